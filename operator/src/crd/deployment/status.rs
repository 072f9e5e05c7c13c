//! `DSparkDeployment.status`: the observed state, per pool and per resolved source.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Observed state. Deterministic: it changes only when the world does.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DSparkDeploymentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, Available, Progressing, Profiled, Scaling, MetricsAvailable, Stalled (a map by
    /// type: other controllers may add their own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Current replicas over all pools (the `/scale` status).
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    #[serde(default)]
    pub desired_replicas: i32,
    /// Label selector of every engine pod of this deployment (the `/scale` selector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Met, Breached or Unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_status: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scaling_decision: Option<ScalingDecisionStatus>,
    /// What the first successful fetch of each remote source (as the spec names it now)
    /// resolved: a Hub branch's commit, an S3 / HTTP ETag. Later fetches of a Hub source use
    /// that commit (the pool ConfigMap's `revision-pins`), and the revision is part of the
    /// cost-table key. Read back from the fetch init containers' termination messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["role"]))]
    pub resolved_sources: Vec<ResolvedSource>,
    /// The `InferencePool` the operator keeps for `spec.inferencePool` (its name), absent when
    /// there is none (the field is unset, or the cluster has no InferencePool CRD).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<String>,
}

/// A remote source's resolved revision.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedSource {
    /// `model` or `drafter`.
    pub role: String,
    /// The source as fetched (`dspark-engine fetch SOURCE`), from the spec.
    pub source: String,
    /// The Hub commit sha, or the S3 / HTTP ETag.
    pub revision: String,
    /// The engine's model id for it (file or folder name, `@`, 12 characters of revision).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_id: String,
    /// The pod whose fetch reported it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod: String,
}

/// The two sources a deployment may fetch.
pub const SOURCE_ROLES: [&str; 2] = ["model", "drafter"];

/// One pool's observed state.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    pub name: String,
    pub desired_replicas: i32,
    pub ready_replicas: i32,
    /// Name of the DSparkCostTable this pool uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_table: Option<String>,
    /// Revision of that table held in the pool's ConfigMap (absent: engine default table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_table_revision: Option<i64>,
    /// p95 time to first token over the SLO window, milliseconds (3 significant digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p95_ms: Option<f64>,
    /// p95 inter-token latency over the SLO window, milliseconds (3 significant digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p95_ms: Option<f64>,
    /// Mean tokens committed per verification (tau), 3 significant digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance_length: Option<f64>,
}

/// The autoscaler's latest decision that changed (or, in advisory mode, would change) a pool.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ScalingDecisionStatus {
    pub pool: String,
    pub from_replicas: i32,
    pub to_replicas: i32,
    pub reason: String,
    pub applied: bool,
    /// RFC 3339 time the decision was made (set once per decision).
    pub time: String,
}
