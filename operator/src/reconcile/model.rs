//! `ModelAvailable`: whether the engine pods have their weights. Remote sources are fetched
//! by the pods' `fetch-model` / `fetch-drafter` init containers; their state (and, when one
//! failed, its termination message: the engine's error) is what this reads. So are the
//! revisions a successful fetch resolved (its termination message is the fetch's JSON
//! report), which the deployment pins and keys cost tables by. Pure: pods in, condition and
//! status fields out.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::pool::{FETCH_DRAFTER_CONTAINER, FETCH_MODEL_CONTAINER};
use crate::crd::{DSparkDeployment, ResolvedSource, SOURCE_ROLES};

/// The `ModelAvailable` condition's status, reason and message.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelAvailability {
    pub ok: Option<bool>,
    pub reason: String,
    pub message: String,
}

fn is_fetch(c: &ContainerStatus) -> bool {
    c.name == FETCH_MODEL_CONTAINER || c.name == FETCH_DRAFTER_CONTAINER
}

/// A CamelCase reason from the fetch's error message.
pub fn failure_reason(message: &str) -> &'static str {
    let m = message.to_ascii_lowercase();
    if m.contains("refused the token") || m.contains("gated or private") || m.contains("denied") {
        "Unauthorized"
    } else if m.contains("checksum mismatch") {
        "ChecksumMismatch"
    } else if m.contains("no space left") {
        "CacheVolumeFull"
    } else if m.contains("not found") || m.contains("has no file") {
        "NotFound"
    } else if m.contains("cannot reach") || m.contains("unreachable") {
        "SourceUnreachable"
    } else {
        "FetchFailed"
    }
}

/// Reads the deployment's engine pods.
pub fn availability(dsd: &DSparkDeployment, pods: &[&Pod]) -> ModelAvailability {
    let remote: Vec<String> = std::iter::once(&dsd.spec.model)
        .chain(dsd.spec.drafter.as_ref())
        .filter_map(|s| s.fetch_uri())
        .collect();
    if remote.is_empty() {
        return ModelAvailability {
            ok: Some(true),
            reason: "VolumeSource".into(),
            message: "the weights come from a volume".into(),
        };
    }
    let what = remote.join(", ");
    let mut fetched = None;
    for pod in pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(status) = &pod.status else { continue };
        for c in status
            .init_container_statuses
            .iter()
            .flatten()
            .filter(|c| is_fetch(c))
        {
            let failed = [c.state.as_ref(), c.last_state.as_ref()]
                .into_iter()
                .flatten()
                .filter_map(|s| s.terminated.as_ref())
                .find(|t| t.exit_code != 0);
            let done = c
                .state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some_and(|t| t.exit_code == 0);
            if done {
                fetched.get_or_insert(name.clone());
                continue;
            }
            if let Some(t) = failed {
                let msg = t
                    .message
                    .as_deref()
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .unwrap_or("exited without a message");
                let msg: String = msg.chars().take(1024).collect();
                return ModelAvailability {
                    ok: Some(false),
                    reason: failure_reason(&msg).into(),
                    message: format!("pod {name}: {} failed: {msg}", c.name),
                };
            }
        }
    }
    match fetched {
        Some(pod) => ModelAvailability {
            ok: Some(true),
            reason: "Fetched".into(),
            message: format!("{what} fetched into the model cache (pod {pod})"),
        },
        None if pods.is_empty() => ModelAvailability {
            ok: None,
            reason: "NoPods".into(),
            message: format!("no engine pod has fetched {what} yet"),
        },
        None => ModelAvailability {
            ok: None,
            reason: "Fetching".into(),
            message: format!("fetching {what}"),
        },
    }
}

/// The fetch init container of `role`.
fn fetch_container(role: &str) -> &'static str {
    if role == "drafter" {
        FETCH_DRAFTER_CONTAINER
    } else {
        FETCH_MODEL_CONTAINER
    }
}

/// The resolved revision of each remote source as the spec names it: the one already in the
/// status, else the first (oldest pod first) successful fetch of exactly that source that
/// reported a revision. A later fetch that resolved another revision (an S3 object
/// overwritten) does not move it.
pub fn resolutions(dsd: &DSparkDeployment, pods: &[&Pod]) -> Vec<ResolvedSource> {
    let mut pods = pods.to_vec();
    pods.sort_by(|a, b| {
        (&a.metadata.creation_timestamp, &a.metadata.name)
            .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
    });
    SOURCE_ROLES
        .iter()
        .filter_map(|&role| {
            if let Some(r) = dsd.resolved(role) {
                return Some(r.clone());
            }
            let uri = dsd.spec.source(role)?.fetch_uri()?;
            pods.iter().find_map(|pod| {
                let c = pod
                    .status
                    .as_ref()?
                    .init_container_statuses
                    .iter()
                    .flatten()
                    .find(|c| c.name == fetch_container(role))?;
                let t = c.state.as_ref()?.terminated.as_ref()?;
                if t.exit_code != 0 {
                    return None;
                }
                let report: serde_json::Value = serde_json::from_str(t.message.as_deref()?).ok()?;
                (report["source"].as_str()? == uri).then_some(())?;
                Some(ResolvedSource {
                    role: role.into(),
                    source: uri.clone(),
                    revision: report["revision"].as_str()?.to_string(),
                    model_id: report["model_id"].as_str().unwrap_or_default().to_string(),
                    pod: pod.metadata.name.clone().unwrap_or_default(),
                })
            })
        })
        .collect()
}

/// `dsd` with `resolved` in its status for the roles the status holds no current
/// resolution of (none, or one of a source the spec no longer names).
pub fn with_resolutions(dsd: &DSparkDeployment, resolved: &[ResolvedSource]) -> DSparkDeployment {
    let mut d = dsd.clone();
    for r in resolved {
        if d.resolved(&r.role).is_none() {
            let status = d.status.get_or_insert_with(Default::default);
            status.resolved_sources.retain(|s| s.role != r.role);
            status.resolved_sources.push(r.clone());
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{HuggingFaceSource, ModelSource};
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, PodStatus,
    };

    fn dsd() -> DSparkDeployment {
        let mut d = super::super::pool::tests::sample();
        d.spec.model = ModelSource {
            hugging_face: Some(HuggingFaceSource {
                repo: "org/gated".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        d.spec.drafter = None;
        d
    }

    fn pod(name: &str, state: ContainerState, last: Option<ContainerState>) -> Pod {
        Pod {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                init_container_statuses: Some(vec![ContainerStatus {
                    name: FETCH_MODEL_CONTAINER.into(),
                    state: Some(state),
                    last_state: last,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn terminated(code: i32, msg: &str) -> ContainerState {
        ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: code,
                message: Some(msg.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_failed_fetch_says_why() {
        let gated = "cannot fetch hf://org/gated: org/gated is gated or private (the Hub answered 401 for hf://org/gated@main): set HF_TOKEN to a token with access to org/gated";
        let crash = ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("CrashLoopBackOff".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = pod("e-0", crash, Some(terminated(1, gated)));
        let a = availability(&dsd(), &[&p]);
        assert_eq!(a.ok, Some(false));
        assert_eq!(a.reason, "Unauthorized");
        assert!(
            a.message.contains("HF_TOKEN") && a.message.contains("e-0"),
            "{}",
            a.message
        );
        assert_eq!(
            failure_reason("checksum mismatch for x"),
            "ChecksumMismatch"
        );
        assert_eq!(
            failure_reason("no space left for hf://o/r"),
            "CacheVolumeFull"
        );
        assert_eq!(failure_reason("hf://o/r@main not found (404)"), "NotFound");
    }

    /// The oldest pod's report of the source the spec names is the resolution; a report of
    /// another source (an older spec) or one without JSON is not; once in the status, a later
    /// report of another revision does not move it.
    #[test]
    fn the_first_fetch_report_of_the_current_source_resolves_it() {
        let d = dsd();
        let uri = d.spec.model.fetch_uri().unwrap();
        let report = |source: &str, rev: &str| {
            serde_json::json!({"source": source, "path": "/m", "revision": rev, "model_id": format!("gated@{rev}")})
                .to_string()
        };
        let mut old = pod("e-0", terminated(0, &report("hf://org/other", "aaa")), None);
        old.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-03T10:00:00Z".parse().unwrap(),
            ));
        let mut second = pod("e-2", terminated(0, &report(&uri, "c2")), None);
        second.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-03T10:02:00Z".parse().unwrap(),
            ));
        let mut first = pod("e-1", terminated(0, &report(&uri, "c1")), None);
        first.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-03T10:01:00Z".parse().unwrap(),
            ));
        let plain = pod("e-3", terminated(0, "fetched"), None);
        assert!(resolutions(&d, &[&old, &plain]).is_empty());
        let r = resolutions(&d, &[&second, &old, &first, &plain]);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (
                r[0].role.as_str(),
                r[0].source.as_str(),
                r[0].revision.as_str(),
                r[0].pod.as_str()
            ),
            ("model", uri.as_str(), "c1", "e-1")
        );
        assert_eq!(r[0].model_id, "gated@c1");
        // Resolved: the key carries the revision, and a later report does not move it.
        let mut d = d;
        assert!(d.cost_table_key(&d.spec.pools[0]).is_none());
        assert_eq!(d.unresolved_sources(), vec![uri.clone()]);
        d.status = Some(crate::crd::DSparkDeploymentStatus {
            resolved_sources: r,
            ..Default::default()
        });
        assert_eq!(resolutions(&d, &[&second])[0].revision, "c1");
        let key = d.cost_table_key(&d.spec.pools[0]).unwrap();
        assert_eq!(key.model_id, format!("{uri}@c1"));
        assert!(d.unresolved_sources().is_empty());
        // Remembered by the operator where the status cannot hold it (an older CRD).
        let bare = dsd();
        let kept = with_resolutions(&bare, &d.status.as_ref().unwrap().resolved_sources);
        assert_eq!(kept.resolved("model").unwrap().revision, "c1");
        assert_eq!(
            kept.cost_table_key(&kept.spec.pools[0]).unwrap().model_id,
            format!("{uri}@c1")
        );
        // A new spec source: the old resolution no longer counts.
        d.spec.model.hugging_face.as_mut().unwrap().revision = Some("v2".into());
        assert!(d.resolved("model").is_none());
        assert!(d.cost_table_key(&d.spec.pools[0]).is_none());
    }

    #[test]
    fn fetched_fetching_and_volume_sources() {
        let ok = pod("e-1", terminated(0, ""), None);
        let a = availability(&dsd(), &[&ok]);
        assert_eq!((a.ok, a.reason.as_str()), (Some(true), "Fetched"));
        let running = pod("e-2", ContainerState::default(), None);
        assert_eq!(availability(&dsd(), &[&running]).reason, "Fetching");
        assert_eq!(availability(&dsd(), &[]).ok, None);
        let local = super::super::pool::tests::sample();
        let a = availability(&local, &[]);
        assert_eq!((a.ok, a.reason.as_str()), (Some(true), "VolumeSource"));
    }
}
