//! Builders of the objects one node pool owns: the engine Deployment ([`engine`]: its pod
//! spec from [`pod`], its model volumes from [`model_mount`], fetch init containers from
//! [`fetch`] and revision pins from [`pins`], put together by [`plan`]), its Service, its
//! PodDisruptionBudget and its cost-table ConfigMap ([`objects`]); plus the deployment-wide
//! Service and admin-token Secret. Names and labels come from `names.rs`, the engine's flags,
//! variables, ports and paths from `dspark_types::contract`. Pure: object in, objects out
//! (applied with server-side apply).

mod engine;
mod fetch;
mod model_mount;
mod objects;
mod pins;
mod plan;
mod pod;
#[cfg(test)]
pub(crate) mod tests;

use dspark_types::contract::ports;
use k8s_openapi::api::core::v1::EnvVar;

pub use engine::{engine_deployment, rolling_update, serve_args};
pub use model_mount::{mount_model, Mounted, Remote};
pub use objects::{
    admin_secret, cost_table_config_map, deployment_service, pool_pdb, pool_service,
};
pub use pins::{revision_pins, PINS_DIR};
pub use plan::{model_plan, ModelPlan};
pub use pod::{container_security, drain_seconds, pod_spec_base, pod_template_meta, resources};

/// Engine ports (the contract's).
pub const HTTP_PORT: i32 = ports::HTTP as i32;
pub const ADMIN_PORT: i32 = ports::ADMIN as i32;
/// Where the pool's cost table is mounted.
pub const COST_TABLE_DIR: &str = "/etc/dspark/cost-table";
pub const COST_TABLE_KEY: &str = "cost-table.json";
/// Where the admin token is mounted.
pub const ADMIN_TOKEN_DIR: &str = "/etc/dspark/admin";
pub const ADMIN_TOKEN_KEY: &str = "token";
/// UID the engine runs as (non-root).
pub const ENGINE_UID: i64 = 65532;

/// Where the model cache volume is mounted (fetch init containers and engine).
pub const MODEL_CACHE_DIR: &str = "/models/cache";
pub const MODEL_CACHE_VOLUME: &str = "model-cache";
/// Init containers that fetch remote sources; a failure is in their termination message.
pub const FETCH_MODEL_CONTAINER: &str = "fetch-model";
pub const FETCH_DRAFTER_CONTAINER: &str = "fetch-drafter";

fn var(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }
}
