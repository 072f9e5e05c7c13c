//! `spec.podTemplate`: platform settings merged into the engine and profiling pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, Toleration, TopologySpreadConstraint,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::crd::admission;

/// Extra labels and annotations of the engine and profiling pods (the operator's own labels
/// win on a clash).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateMetadata {
    /// Label values are label values (at most 32 labels).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(transform = admission::node_selector)]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub annotations: BTreeMap<String, String>,
}

/// Pod settings of the platform the engines run on.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateSpecOverrides {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = admission::name_refs)]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The pods' ServiceAccount (its token is still not mounted: the engine needs no API
    /// access).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub service_account_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = admission::DNS1123_SUBDOMAIN))]
    pub runtime_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Added to the pool's tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = admission::tolerations)]
    pub tolerations: Vec<Toleration>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Added to the node selector (the pool's terms and its node-type label win).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(transform = admission::node_selector)]
    pub node_selector: BTreeMap<String, String>,
    /// Default: the engine's drain deadline plus a margin (`engine.drainTimeoutSeconds` + 15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// `spec.podTemplate`: merged into every engine pod and profiling pod.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<PodTemplateMetadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodTemplateSpecOverrides>,
}
