//! `DSparkDeployment`: a served model on one or more GPU node pools, its status, and what
//! its spec derives (scaling mode, drain deadline, model identity, cost-table keys). One
//! file per part of the spec; this one holds the resource's root.

mod engine;
mod keys;
mod pod_template;
mod pool;
mod profiling;
mod scaling;
mod scheduler;
mod source;
mod speculation;
mod status;
mod version;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

pub use engine::*;
pub use pod_template::*;
pub use pool::*;
pub use profiling::*;
pub use scaling::*;
pub use scheduler::*;
pub use source::*;
pub use speculation::*;
pub use status::*;

/// A model served by DSpark engine pods on one or more node pools, sized by SLO.
///
/// The `/scale` subresource reads and writes the TOTAL number of engine replicas over all
/// pools (`spec.replicas`); `status.selector` selects every engine pod of the deployment.
/// Who owns that total is `spec.scaling.mode`: `SLO` (the operator's SLO autoscaler chooses
/// it and writes it to `spec.replicas`) or `External` (an HPA, KEDA or `kubectl scale` sets it
/// and the operator spreads it over the pools, cheapest pool that meets the SLO first, within
/// each pool's min/max).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.dspark.dev",
    version = "v1alpha1",
    kind = "DSparkDeployment",
    plural = "dsparkdeployments",
    singular = "dsparkdeployment",
    shortname = "dsd",
    category = "dspark",
    namespaced,
    status = "DSparkDeploymentStatus",
    derive = "PartialEq",
    doc = "A model served by DSpark engine pods on one or more GPU node pools, sized by SLO.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas", description = "Ready engine replicas over all pools"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredReplicas", description = "Desired engine replicas over all pools"),
    printcolumn(name = "SLO", type_ = "string", json_path = ".status.sloStatus", description = "Met, Breached or Unknown"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 40").message("metadata.name must be at most 40 characters (owned objects append the pool name)"),
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, ending with a letter or digit): it names the deployment's Service"),
)]
#[x_kube(
    validation = Rule::new("self.pools.all(p, self.pools.exists_one(q, q.name == p.name))").message("spec.pools: pool names must be unique"),
    validation = Rule::new("!has(self.replicas) || (has(self.scaling) && has(self.scaling.mode) && self.scaling.mode == 'SLO') || self.replicas >= self.pools.map(p, p.minReplicas).sum()").message("spec.replicas is below the sum of the pools' minReplicas"),
    validation = Rule::new("!has(self.replicas) || (has(self.scaling) && has(self.scaling.mode) && self.scaling.mode == 'SLO') || self.replicas <= self.pools.map(p, p.maxReplicas).sum()").message("spec.replicas is above the sum of the pools' maxReplicas"),
)]
#[serde(rename_all = "camelCase")]
pub struct DSparkDeploymentSpec {
    /// The target model.
    pub model: ModelSource,
    /// The drafter for speculative decoding; without one the engine uses the drafter it ships
    /// for the model, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<ModelSource>,
    /// Where remote model sources are fetched to (default: an emptyDir per pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<ModelCacheSpec>,
    /// Start-up budgets (download and load of large models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<StartupSpec>,
    /// The engine container (all defaults: the operator's own engine image).
    #[serde(default)]
    pub engine: EngineSpec,
    /// Node pools (one engine Deployment per pool).
    #[x_kube(validation = Rule::new("self.size() > 0").message("spec.pools must name at least one node pool"))]
    #[schemars(
        length(max = 8),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub pools: Vec<NodePool>,
    /// Total replicas over all pools: the `/scale` subresource's replica count. In `External`
    /// scaling mode the input (HPA, KEDA, `kubectl scale`; unset: the operator writes the
    /// current total); in `SLO` mode written by the operator (the autoscaler's total).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = crate::crd::admission::MAX_TOTAL_REPLICAS))]
    pub replicas: Option<i32>,
    /// Who owns the replica count (`mode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<ScalingSpec>,
    /// Pod-level platform settings merged into the engine pods and the profiling Jobs' pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodTemplateOverrides>,
    /// Latency objectives the autoscaler keeps.
    pub slo: Slo,
    /// Verify-length scheduler of the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<SchedulerSpec>,
    /// Speculation mode; unset lets the engine pick its default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<Speculation>,
    /// Cost-table profiling.
    #[serde(default)]
    pub profiling: ProfilingSpec,
    /// Autoscaling behaviour.
    #[serde(default)]
    pub autoscaling: AutoscalingSpec,
    /// Stop reconciling (maintenance, an incident, a hand-edited engine Deployment under
    /// investigation): while true the operator leaves every object it owns as it is (no
    /// apply, prune, scaling or cost-table push) and reports `Suspended=True`; setting it back
    /// reconciles at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// Keep a Gateway API Inference Extension `InferencePool` (named after this deployment)
    /// over every engine pod, for gateways that route by load through an endpoint picker;
    /// removing the field deletes the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<crate::crd::InferencePoolSpec>,
}

impl DSparkDeploymentSpec {
    /// Who owns the replica count: `spec.scaling.mode`, or, while unset, `External` when
    /// `spec.replicas` is set and `SLO` otherwise.
    pub fn scaling_mode(&self) -> ScalingMode {
        match self.scaling.as_ref().and_then(|s| s.mode) {
            Some(m) => m,
            None if self.replicas.is_some() => ScalingMode::External,
            None => ScalingMode::Slo,
        }
    }

    /// The engine's drain deadline, seconds.
    pub fn drain_seconds(&self) -> u32 {
        self.engine
            .drain_timeout_seconds
            .unwrap_or(DEFAULT_DRAIN_SECONDS)
    }

    /// The `model` or `drafter` source.
    pub fn source(&self, role: &str) -> Option<&ModelSource> {
        match role {
            "model" => Some(&self.model),
            "drafter" => self.drafter.as_ref(),
            _ => None,
        }
    }
}

fn default_true() -> bool {
    true
}
