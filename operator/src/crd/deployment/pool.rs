//! `spec.pools[]`: a group of identical nodes, its accelerators, replica bounds and rollout.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::admission::{self, matches, MAX_POOL_REPLICAS};

/// How a pool's engine Deployment replaces its pods (`RollingUpdate`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Pods above the desired count during a rollout (default 0: a pool that fills its nodes'
    /// accelerators has no room for an extra pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrString>,
    /// Pods below the desired count during a rollout (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
}

/// A group of identical nodes (one GPU type) and how many engine replicas may run there.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.minReplicas <= self.maxReplicas").message("pool minReplicas must not exceed maxReplicas"),
)]
#[serde(rename_all = "camelCase")]
pub struct NodePool {
    /// Pool name (a DNS-1035 label), part of the owned objects' names (`{deployment}-{pool}`
    /// names the pool's Service, at most 61 characters).
    #[schemars(
        length(min = 1, max = 20),
        regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("spec.pools[].name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter, ending with a letter or digit): it is part of the pool's Service name"))]
    pub name: String,
    /// Value of the `dspark.dev/node-type` node label (a label value); keys the pool's cost
    /// table.
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')").message("spec.pools[].nodeType must be a label value (letters, digits, '-', '_' and '.', starting and ending with a letter or digit): it is the value of the engine pods' dspark.dev/node-type node selector"))]
    pub node_type: String,
    /// Extra node selector terms (the node-type label is always added).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(transform = admission::node_selector)]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the pool's taints (operator `Exists` or `Equal`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = admission::tolerations)]
    pub tolerations: Vec<Toleration>,
    /// Accelerator resource per replica.
    #[serde(default)]
    pub gpu: GpuSpec,
    #[serde(default = "default_min_replicas")]
    #[x_kube(
        validation = Rule::new("self >= 0").message("pool minReplicas must be non-negative"),
        validation = Rule::new(format!("self <= {MAX_POOL_REPLICAS}")).message(format!("spec.pools[].minReplicas must be at most {MAX_POOL_REPLICAS}").as_str()),
    )]
    pub min_replicas: i32,
    /// At most 1000.
    #[x_kube(
        validation = Rule::new("self >= 1").message("pool maxReplicas must be at least 1"),
        validation = Rule::new(format!("self <= {MAX_POOL_REPLICAS}")).message(format!("spec.pools[].maxReplicas must be at most {MAX_POOL_REPLICAS}").as_str()),
    )]
    pub max_replicas: i32,
    /// Relative cost of one replica (any unit, compared across pools).
    #[serde(default = "default_cost")]
    #[schemars(range(min = 0.0, max = 1e9))]
    pub cost: f64,
    /// Rollout of the pool's engine Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
}

fn default_min_replicas() -> i32 {
    1
}
fn default_cost() -> f64 {
    1.0
}

/// The accelerator each replica requests (and limits).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// An extended resource name, `DOMAIN/NAME` (default `nvidia.com/gpu`).
    #[serde(default = "default_gpu_resource")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(matches(admission::EXTENDED_RESOURCE)).message("spec.pools[].gpu.resourceName must be an extended resource name DOMAIN/NAME, such as nvidia.com/gpu or amd.com/gpu"))]
    pub resource_name: String,
    /// Devices per replica; 0 runs without an accelerator.
    #[serde(default = "default_gpu_count")]
    #[schemars(range(min = 0, max = 64))]
    pub count: u32,
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            resource_name: default_gpu_resource(),
            count: default_gpu_count(),
        }
    }
}

fn default_gpu_resource() -> String {
    "nvidia.com/gpu".into()
}
fn default_gpu_count() -> u32 {
    1
}
