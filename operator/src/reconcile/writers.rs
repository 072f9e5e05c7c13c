//! The writes every phase shares: server-side apply of owned objects (skipped when nothing
//! changed), the status, `/scale`'s replicas and scaling mode, Events, and the admin token.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use tracing::warn;

use super::cache::Cached;
use super::context::Context;
use super::names::{self, MANAGER};
use super::pool::{self, ADMIN_TOKEN_KEY};
use crate::crd::{DSparkDeployment, ScalingMode};
use crate::{Error, Result};

pub(super) fn object_key(dsd: &DSparkDeployment) -> String {
    format!("{}/{}", dsd.namespace().unwrap_or_default(), dsd.name_any())
}

/// Writes the operator's part of the status (server-side apply of `status`: it owns only
/// the fields and conditions it sets, other writers keep theirs).
pub(super) async fn write_status(
    ctx: &Context,
    dsd: &DSparkDeployment,
    ns: &str,
    status: &crate::crd::DSparkDeploymentStatus,
) -> std::result::Result<(), kube::Error> {
    let api: Api<DSparkDeployment> = Api::namespaced(ctx.client.clone(), ns);
    let mut patch = serde_json::json!({
        "apiVersion": DSparkDeployment::api_version(&()),
        "kind": DSparkDeployment::kind(&()),
        "status": status,
    });
    // A CRD older than this operator (installed by an older chart, not yet re-applied) lacks
    // the newest status fields, and the API server refuses the whole patch for one of them:
    // write the status without those, once each, rather than stop reporting at all.
    loop {
        match api
            .patch_status(
                &dsd.name_any(),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Err(kube::Error::Api(e)) => match undeclared_status_field(&e.message) {
                Some(field) if patch["status"].get(field).is_some() => {
                    static WARNED: std::sync::Mutex<Vec<String>> =
                        std::sync::Mutex::new(Vec::new());
                    let mut warned = WARNED.lock().expect("warned lock");
                    if !warned.iter().any(|f| f == field) {
                        warned.push(field.to_string());
                        warn!(
                            field,
                            "the installed CRD has no status.{field} (older than this \
                             operator): writing statuses without it; apply crds/ to store it"
                        );
                    }
                    patch["status"]
                        .as_object_mut()
                        .expect("status is an object")
                        .remove(field);
                }
                _ => return Err(kube::Error::Api(e)),
            },
            other => return other.map(|_| ()),
        }
    }
}

/// The top-level status field an API server's "field not declared in schema" refusal names
/// (`.status.NAME: field not declared in schema`).
fn undeclared_status_field(message: &str) -> Option<&str> {
    let (before, _) = message.split_once(": field not declared in schema")?;
    let path = &before[before.rfind(".status.")? + ".status.".len()..];
    let field = path.split(['.', '[']).next()?;
    (!field.is_empty()).then_some(field)
}

/// Applies `obj` with server-side apply, unless it is what this process applied last time
/// and nobody wrote it since (see `cache.rs`); returns the object as stored.
pub(super) async fn apply<K: Cached>(ctx: &Context, ns: &str, obj: &K) -> Result<Arc<K>> {
    let name = obj.meta().name.clone().unwrap_or_default();
    apply_body(ctx, ns, &name, obj).await
}

/// [`apply`] of a partial object (`body`: the fields the operator owns) named `name`.
pub(super) async fn apply_body<K: Cached>(
    ctx: &Context,
    ns: &str,
    name: &str,
    body: &(impl Serialize + std::fmt::Debug),
) -> Result<Arc<K>> {
    if let Some(cached) = ctx.caches.unchanged::<K>(ns, name, body) {
        return Ok(cached);
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let stored = api
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(body),
        )
        .await
        .map_err(Error::applying::<K>(name))?;
    ctx.caches.remember(ns, name, body, &stored);
    Ok(Arc::new(stored))
}

/// Records an Event on the deployment in the background, as client-go's recorder does: an
/// Event is a report, not part of converging, so a slow API server delays it, not the
/// reconcile (the first reconcile of a deployment records about ten).
pub(super) async fn publish(
    ctx: &Context,
    dsd: &DSparkDeployment,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: reason.into(),
        secondary: None,
    };
    let (recorder, reference) = (ctx.recorder.clone(), dsd.object_ref(&()));
    tokio::spawn(async move {
        if let Err(e) = recorder.publish(&ev, &reference).await {
            warn!("could not publish event {}: {e}", ev.reason);
        }
    });
}

/// The admin token: read from the Secret, or a new random one in a new Secret.
pub(super) async fn admin_token(ctx: &Context, dsd: &DSparkDeployment, ns: &str) -> Result<String> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = names::admin_secret_name(dsd);
    if let Some(s) = api.get_opt(&name).await? {
        if let Some(t) = s.data.as_ref().and_then(|d| d.get(ADMIN_TOKEN_KEY)) {
            return Ok(String::from_utf8_lossy(&t.0).into_owned());
        }
    }
    let token = random_token()?;
    match api
        .create(&PostParams::default(), &pool::admin_secret(dsd, &token))
        .await
    {
        Ok(_) => Ok(token),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let s = api.get(&name).await?;
            Ok(s.data
                .and_then(|d| {
                    d.get(ADMIN_TOKEN_KEY)
                        .map(|t| String::from_utf8_lossy(&t.0).into_owned())
                })
                .unwrap_or_default())
        }
        Err(e) => Err(e.into()),
    }
}

/// Keeps `/scale` answering: writes down the scaling mode while `spec.scaling.mode` is unset
/// (`External` when `spec.replicas` is set, else `SLO`: what such manifests did before the
/// field), and `spec.replicas` when the operator owns it (`SLO`: the autoscaler's `total`) or
/// it is missing (`External`: the current `total`). A merge patch conditional on the
/// resource version read, so it never overwrites a concurrent write (that one reconciles).
pub(super) async fn write_replicas(
    client: &kube::Client,
    ns: &str,
    dsd: &DSparkDeployment,
    total: i32,
) -> Result<()> {
    let mode = dsd.spec.scaling_mode();
    let mut spec = serde_json::Map::new();
    if dsd.spec.scaling.as_ref().and_then(|s| s.mode).is_none() {
        spec.insert("scaling".into(), serde_json::json!({ "mode": mode }));
    }
    let replicas = match mode {
        ScalingMode::Slo => Some(total),
        ScalingMode::External => dsd.spec.replicas.or(Some(total)),
    };
    if replicas != dsd.spec.replicas {
        spec.insert("replicas".into(), serde_json::json!(replicas));
    }
    if spec.is_empty() {
        return Ok(());
    }
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": dsd.resource_version() },
        "spec": spec,
    });
    let api: Api<DSparkDeployment> = Api::namespaced(client.clone(), ns);
    api.patch(
        &dsd.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(Error::applying::<DSparkDeployment>(&dsd.name_any()))?;
    Ok(())
}

fn random_token() -> Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(Error::Token)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API server's refusal of a status field an older CRD lacks (its message as the
    /// e2e's previous-chart phase got it) names the field to leave out.
    #[test]
    fn an_undeclared_status_field_is_named() {
        let m = "failed to create typed patch object (/; serving.dspark.dev/v1alpha1, Kind=DSparkDeployment): .status.resolvedSources: field not declared in schema";
        assert_eq!(undeclared_status_field(m), Some("resolvedSources"));
        let nested = "failed to create typed patch object (x): .status.pools[name=\"a\"].newField: field not declared in schema";
        assert_eq!(undeclared_status_field(nested), Some("pools"));
        assert_eq!(
            undeclared_status_field(".spec.x: field not declared in schema"),
            None
        );
        assert_eq!(undeclared_status_field("conflict"), None);
    }
}
