//! Fetching remote sources: the model cache volume (a shared PVC or an emptyDir per pod) and
//! the `dspark-engine fetch` init container that downloads one source into it before the
//! engine starts (a failure lands in its termination message).

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PersistentVolumeClaimVolumeSource, Volume, VolumeMount,
};

use super::model_mount::Mounted;
use super::pins::{pins_mount, pins_var};
use super::pod::container_security;
use super::{MODEL_CACHE_DIR, MODEL_CACHE_VOLUME};
use crate::crd::{DSparkDeployment, NodePool};
use dspark_types::contract::flags::{self, arg};

/// Where a fetch writes the text the operator reads back (resolved revision or failure).
const TERMINATION_LOG: &str = "/dev/termination-log";

/// The read-write mount of the model cache volume.
pub(super) fn cache_mount() -> VolumeMount {
    VolumeMount {
        name: MODEL_CACHE_VOLUME.into(),
        mount_path: MODEL_CACHE_DIR.into(),
        ..Default::default()
    }
}

/// The model cache volume: `spec.modelCache.claimName`, else an emptyDir (with its size
/// limit).
pub(super) fn cache_volume(dsd: &DSparkDeployment) -> Volume {
    let cache = dsd.spec.model_cache.clone().unwrap_or_default();
    Volume {
        name: MODEL_CACHE_VOLUME.into(),
        persistent_volume_claim: cache.claim_name.as_ref().map(|c| {
            PersistentVolumeClaimVolumeSource {
                claim_name: c.clone(),
                read_only: None,
            }
        }),
        empty_dir: cache.claim_name.is_none().then(|| EmptyDirVolumeSource {
            size_limit: cache.size_limit.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The init container `name` that fetches the remote source `m` into the cache, with the
/// source's credentials, the pins and the engine's environment.
pub(super) fn fetch_container(
    dsd: &DSparkDeployment,
    pool: &NodePool,
    m: &Mounted,
    name: &str,
) -> Option<Container> {
    let r = m.remote.as_ref()?;
    let mut env = r.env.clone();
    env.push(pins_var());
    env.extend(dsd.spec.engine.env.iter().cloned());
    Some(Container {
        name: name.into(),
        image: Some(dsd.spec.engine.image_for(pool)),
        image_pull_policy: dsd.spec.engine.image_pull_policy.clone(),
        command: Some(vec!["dspark-engine".into()]),
        args: Some(vec![
            "fetch".into(),
            m.path.clone(),
            arg(flags::CACHE),
            MODEL_CACHE_DIR.into(),
            arg(flags::TERMINATION_LOG),
            TERMINATION_LOG.into(),
        ]),
        env: Some(env),
        env_from: (!r.env_from.is_empty()).then(|| r.env_from.clone()),
        termination_message_path: Some(TERMINATION_LOG.into()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        security_context: Some(container_security()),
        volume_mounts: Some(vec![cache_mount(), pins_mount()]),
        ..Default::default()
    })
}
