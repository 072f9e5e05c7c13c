//! `ModelAvailable`: whether the engine pods have their weights. Remote sources are fetched
//! by the pods' `fetch-model` / `fetch-drafter` init containers; their state (and, when one
//! failed, its termination message: the engine's error) is what this reads. Pure: pods in,
//! condition fields out.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::pool::{FETCH_DRAFTER_CONTAINER, FETCH_MODEL_CONTAINER};
use crate::crd::DSparkDeployment;

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
