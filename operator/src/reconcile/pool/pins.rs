//! Revision pins in a pod: the pool's ConfigMap mounted for its `revision-pins` file (the
//! fetches, the engine and profiling read it through `DSPARK_REVISION_PINS`), and the file's
//! text from the deployment's resolved sources (see `dspark_types::contract::pins`).

use k8s_openapi::api::core::v1::{ConfigMapVolumeSource, EnvVar, Volume, VolumeMount};

use super::var;
use crate::crd::{DSparkDeployment, NodePool};
use crate::reconcile::names::cost_table_config_map_name;
use dspark_types::contract::{env as cenv, pins};

/// Where the pool's ConfigMap is mounted for its revision pins (fetches, engine, profiling).
pub const PINS_DIR: &str = "/etc/dspark/pins";
pub(super) const PINS_VOLUME: &str = "revision-pins";

/// The read-only mount of the pins volume.
pub(super) fn pins_mount() -> VolumeMount {
    VolumeMount {
        name: PINS_VOLUME.into(),
        mount_path: PINS_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

/// The pool's ConfigMap as the pins volume (optional: there are none until a first fetch
/// resolved a source, and a missing file pins nothing).
pub(super) fn pins_volume(dsd: &DSparkDeployment, pool: &NodePool) -> Volume {
    Volume {
        name: PINS_VOLUME.into(),
        config_map: Some(ConfigMapVolumeSource {
            name: cost_table_config_map_name(dsd, pool),
            optional: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `DSPARK_REVISION_PINS` pointing at the mounted file.
pub(super) fn pins_var() -> EnvVar {
    var(cenv::REVISION_PINS, format!("{PINS_DIR}/{}", pins::KEY))
}

/// The pins file's text: the resolved revision of every remote source as the spec names it
/// (`None` before any is resolved). The fetches, the engine and profiling read it (see
/// `dspark_types::contract::pins`).
pub fn revision_pins(dsd: &DSparkDeployment) -> Option<String> {
    let resolved: Vec<_> = crate::crd::SOURCE_ROLES
        .iter()
        .filter_map(|role| dsd.resolved(role))
        .collect();
    (!resolved.is_empty()).then(|| {
        pins::render(
            resolved
                .iter()
                .map(|r| (r.source.as_str(), r.revision.as_str())),
        )
    })
}
