//! `spec.inferencePool`: the Gateway API Inference Extension (GIE) side of a
//! DSparkDeployment. When set, the operator keeps an `InferencePool`
//! (`inference.networking.k8s.io/v1`) named after the deployment that selects every engine
//! pod of every node-type pool on the serving port, and points it at the endpoint picker the
//! user runs (GIE's reference picker or the llm-d router, as a Service). A gateway (Istio,
//! agentgateway, NGINX Gateway Fabric, ...) routes an `HTTPRoute` to that pool and asks the
//! picker which pod takes each request; the picker reads the engines' model-server metrics
//! (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Default gRPC (ext_proc) port of GIE's endpoint picker.
pub const DEFAULT_PICKER_PORT: i32 = 9002;

/// Expose the deployment's engines to GIE gateways through an `InferencePool`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The endpoint picker Service the pool names (`spec.endpointPickerRef`).
    pub endpoint_picker: EndpointPicker,
}

/// The endpoint picker (ext_proc server) a gateway consults for this pool.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPicker {
    /// Name of the picker's Service in the deployment's namespace.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// The picker's ext_proc port (GIE's default: 9002).
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// What the gateway does when the picker is unreachable: `FailClose` (reject, GIE's
    /// default) or `FailOpen` (route without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

fn default_port() -> i32 {
    DEFAULT_PICKER_PORT
}

/// `spec.endpointPickerRef.failureMode` of an InferencePool.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureMode {
    FailOpen,
    FailClose,
}
