//! `spec.engine` and `spec.startup`: the engine container, its drain deadline and the
//! start-up budgets.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::admission;

/// How long start-up may take: large models spend minutes downloading (the init container)
/// and loading (before the startup probe passes).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StartupSpec {
    /// Seconds the engine may take to load the model before its startup probe fails
    /// (default 1800).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 30, max = 86400))]
    pub startup_probe_seconds: Option<i32>,
    /// The engine Deployments' `progressDeadlineSeconds`: a rollout (download included) that
    /// makes no progress this long is reported as stalled (default 3600 for remote sources;
    /// unset, the Kubernetes default, for volumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 60, max = 86400))]
    pub progress_deadline_seconds: Option<i32>,
}

/// Defaults of [`StartupSpec`].
pub const DEFAULT_STARTUP_PROBE_SECONDS: i32 = 1800;
pub const DEFAULT_PROGRESS_DEADLINE_SECONDS: i32 = 3600;

/// The engine container.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Image holding `dspark-engine`. Default: the engine image of the operator's own
    /// version, the CUDA one (`dspark/engine-cuda:VERSION`) on pools that request GPUs and the
    /// CPU one (`dspark/engine:VERSION`) on the others; the operator's `--engine-image` and
    /// `--engine-cuda-image` (the chart's `engineImages`) say where they live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512), regex(pattern = admission::IMAGE_REFERENCE))]
    pub image: Option<String>,
    /// Engine version used to key cost tables; defaults to the image tag (the operator's
    /// version with the default images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), regex(pattern = admission::IMAGE_REFERENCE))]
    pub version: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = admission::pull_policy)]
    pub image_pull_policy: Option<String>,
    /// Extra arguments appended to `dspark-engine serve`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = admission::args)]
    pub args: Vec<String>,
    /// Environment of the engine and its fetch init containers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = admission::env)]
    pub env: Vec<EnvVar>,
    /// CPU and memory; the GPU request comes from the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// On SIGTERM, how long in-flight requests may finish (`serve --drain-timeout-secs`;
    /// default 30). The pods' `terminationGracePeriodSeconds` defaults to this plus
    /// [`GRACE_MARGIN_SECONDS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub drain_timeout_seconds: Option<u32>,
}

/// The engine's drain deadline when `engine.drainTimeoutSeconds` is unset (its own default).
pub const DEFAULT_DRAIN_SECONDS: u32 = 30;
/// Seconds of `terminationGracePeriodSeconds` beyond the drain deadline: the engine's exit and
/// the endpoints' removal after it.
pub const GRACE_MARGIN_SECONDS: i64 = 15;
