//! The operator keeps its own CRDs current. Helm installs a chart's `crds/` once and never
//! upgrades them, so after a `helm upgrade` the cluster would still serve the old schema and
//! the apiserver would prune every new field from the objects users apply. With
//! `--apply-crds` (the chart's default) the leader applies, before it starts reconciling, the
//! CRDs of the Rust types it was built with (server-side apply, then it waits until they are
//! `Established`).
//!
//! Every CRD carries the schema revision it was rendered at ([`REVISION_ANNOTATION`]). The
//! operator never replaces a CRD of a newer revision: a rollback to an older operator keeps
//! the newer schema (a superset) instead of pruning fields that stored objects may use. A
//! unit test fails when the schema changes without a new [`SCHEMA_REVISION`].

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, CustomResourceExt, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DSparkCostTable, DSparkDeployment};
use crate::reconcile::names::MANAGER;
use crate::{Error, Result};

/// The schema revision of the CRDs this operator renders. Bump it (and [`SCHEMA_DIGEST`])
/// with every change to the types' schema; the test below says when.
pub const SCHEMA_REVISION: u32 = 6;
/// FNV-1a of the CRDs' specs at [`SCHEMA_REVISION`] (see [`schema_digest`]).
pub const SCHEMA_DIGEST: &str = "fe6e175972a9dad1";
/// The annotation holding a CRD's schema revision.
pub const REVISION_ANNOTATION: &str = "serving.dspark.dev/schema-revision";

/// Every CRD of the operator, annotated with [`SCHEMA_REVISION`], in a fixed order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    [DSparkDeployment::crd(), DSparkCostTable::crd()]
        .into_iter()
        .map(|mut crd| {
            crd.annotations_mut()
                .insert(REVISION_ANNOTATION.into(), SCHEMA_REVISION.to_string());
            crd
        })
        .collect()
}

/// JSON with object keys sorted: the same bytes whether or not another crate in the build
/// turns on serde_json's `preserve_order` (llguidance does, in the workspace build).
pub fn sorted(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut entries: Vec<_> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(sorted).collect())
        }
        other => other,
    }
}

/// A digest of the CRDs' specs (names, versions, schemas, columns), not their metadata.
pub fn schema_digest() -> String {
    let specs: Vec<serde_json::Value> = crds()
        .into_iter()
        .map(|c| sorted(serde_json::to_value(c.spec).expect("a CRD spec serializes")))
        .collect();
    let text = serde_json::to_string(&specs).expect("JSON serializes");
    format!("{:016x}", crate::crd::fnv1a(text.as_bytes()))
}

/// The schema revision a stored CRD was rendered at (`0`: unannotated, i.e. older than the
/// annotation; `None`: not a number, so not ours to judge).
fn stored_revision(crd: &CustomResourceDefinition) -> Option<u32> {
    match crd.annotations().get(REVISION_ANNOTATION) {
        None => Some(0),
        Some(v) => v.parse().ok(),
    }
}

/// What [`ensure`] did with one CRD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied (created, or updated from the revision it had).
    Applied { name: String, from: Option<u32> },
    /// A newer revision (or one this operator cannot read) is installed: left as it is.
    KeptNewer { name: String, found: String },
}

/// Whether a CRD stored at `stored` may be replaced by this operator's.
pub fn may_replace(stored: Option<&CustomResourceDefinition>) -> bool {
    match stored {
        None => true,
        Some(c) => stored_revision(c).is_some_and(|r| r <= SCHEMA_REVISION),
    }
}

/// Applies the operator's CRDs where the cluster has none or an older revision, and waits
/// (up to `timeout`) until each applied one is `Established`.
pub async fn ensure(client: &Client, timeout: Duration) -> Result<Vec<Outcome>> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut out = Vec::new();
    for crd in crds() {
        let name = crd.name_any();
        let stored = api.get_opt(&name).await?;
        if !may_replace(stored.as_ref()) {
            let found = stored
                .as_ref()
                .and_then(|c| c.annotations().get(REVISION_ANNOTATION).cloned())
                .unwrap_or_default();
            warn!(crd = %name, found = %found, ours = SCHEMA_REVISION, "a newer CRD is installed; leaving it");
            out.push(Outcome::KeptNewer { name, found });
            continue;
        }
        api.patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .map_err(Error::applying::<CustomResourceDefinition>(&name))?;
        let from = stored.as_ref().and_then(stored_revision);
        info!(crd = %name, ?from, to = SCHEMA_REVISION, "applied the CRD");
        out.push(Outcome::Applied { name, from });
    }
    let deadline = tokio::time::Instant::now() + timeout;
    for o in &out {
        let Outcome::Applied { name, .. } = o else {
            continue;
        };
        loop {
            let crd = api.get(name).await?;
            let established = crd
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
            if established {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::CrdNotEstablished {
                    name: name.clone(),
                    seconds: timeout.as_secs(),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schema_change_bumps_the_revision() {
        let digest = schema_digest();
        assert!(
            digest == SCHEMA_DIGEST,
            "the CRD schema changed: set SCHEMA_REVISION to {} and SCHEMA_DIGEST to \"{digest}\" \
             in operator/src/crd/install.rs, then regenerate crds/ \
             (`cargo run -p dspark-operator --bin crdgen -- crds/`)",
            SCHEMA_REVISION + 1
        );
    }

    #[test]
    fn newer_or_unreadable_revisions_are_kept() {
        let at = |rev: Option<&str>| {
            let mut c = DSparkDeployment::crd();
            if let Some(r) = rev {
                c.annotations_mut()
                    .insert(REVISION_ANNOTATION.into(), r.into());
            }
            c
        };
        assert!(may_replace(None));
        assert!(may_replace(Some(&at(None))));
        assert!(may_replace(Some(&at(Some("1")))));
        assert!(may_replace(Some(&at(Some(&SCHEMA_REVISION.to_string())))));
        assert!(!may_replace(Some(&at(Some(
            &(SCHEMA_REVISION + 1).to_string()
        )))));
        assert!(!may_replace(Some(&at(Some("v3")))));
        for c in crds() {
            assert_eq!(
                c.annotations().get(REVISION_ANNOTATION),
                Some(&SCHEMA_REVISION.to_string())
            );
        }
    }
}
