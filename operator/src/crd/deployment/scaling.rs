//! Who owns the replica count (`spec.scaling`), the latency objectives (`spec.slo`) and the
//! SLO autoscaler's behaviour (`spec.autoscaling`).

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::default_true;
use crate::crd::admission::{self, matches, MAX_POOL_REPLICAS};

/// Who owns the total replica count (`spec.scaling.mode`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalingMode {
    /// The SLO autoscaler (`spec.autoscaling`) chooses the total; the operator writes it to
    /// `spec.replicas`, so `/scale` reads it (a write there is overwritten).
    #[serde(rename = "SLO")]
    Slo,
    /// `spec.replicas` (through `/scale`: HPA, KEDA, `kubectl scale`) sets the total; the
    /// operator spreads it over the pools. The SLO autoscaler does not act.
    External,
}

/// `spec.scaling`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ScalingSpec {
    /// Unset: the operator sets it on its first reconcile, to `External` when `spec.replicas`
    /// is set and `SLO` otherwise (the behaviour of manifests written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ScalingMode>,
}

/// p95 latency objectives, evaluated over a sliding window.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.ttftP95Ms > 0").message("slo.ttftP95Ms must be positive"),
    validation = Rule::new("self.itlP95Ms > 0").message("slo.itlP95Ms must be positive"),
    validation = Rule::new("self.windowSeconds > 0").message("slo.windowSeconds must be positive"),
)]
#[serde(rename_all = "camelCase")]
pub struct Slo {
    /// p95 time to first token, milliseconds.
    #[schemars(range(max = 3_600_000))]
    pub ttft_p95_ms: i32,
    /// p95 inter-token latency, milliseconds.
    #[schemars(range(max = 3_600_000))]
    pub itl_p95_ms: i32,
    /// Evaluation window, seconds.
    #[serde(default = "default_window")]
    #[schemars(range(max = 86400))]
    pub window_seconds: i32,
}

fn default_window() -> i32 {
    60
}

/// Whether scaling decisions are applied.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutoscalingMode {
    /// Decisions change the pools' replicas.
    #[default]
    Active,
    /// Decisions are recorded (status, events) but not applied.
    Advisory,
}

/// Where latency metrics come from.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MetricsSource {
    /// Scrape every ready engine pod's `/metrics` by pod IP.
    #[default]
    Scrape,
    /// Query a Prometheus server (`prometheusUrl`).
    Prometheus,
}

/// Autoscaling behaviour: a predictive loop (load and the SPS(B) table) and a reactive loop
/// (+-1 toward the p95 SLOs).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.metricsSource != 'Prometheus' || has(self.prometheusUrl)").message("autoscaling.prometheusUrl is required when metricsSource is Prometheus"),
    validation = Rule::new("self.periodSeconds > 0").message("autoscaling.periodSeconds must be positive"),
    validation = Rule::new("self.maxScaleUpStep >= 1 && self.maxScaleDownStep >= 1").message("autoscaling step limits must be at least 1"),
    validation = Rule::new("self.scaleUpStabilizationSeconds >= 0 && self.scaleDownStabilizationSeconds >= 0").message("autoscaling stabilization windows must be non-negative"),
)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Period of the reactive loop (at most an hour).
    #[serde(default = "default_period")]
    #[schemars(range(max = 3600))]
    pub period_seconds: i32,
    /// A higher recommendation must hold this long before it is applied (at most a day).
    #[serde(default)]
    #[schemars(range(max = 86400))]
    pub scale_up_stabilization_seconds: i32,
    /// A lower recommendation must hold this long before it is applied (at most a day).
    #[serde(default = "default_down_window")]
    #[schemars(range(max = 86400))]
    pub scale_down_stabilization_seconds: i32,
    #[serde(default = "default_up_step")]
    #[schemars(range(max = MAX_POOL_REPLICAS))]
    pub max_scale_up_step: i32,
    #[serde(default = "default_down_step")]
    #[schemars(range(max = MAX_POOL_REPLICAS))]
    pub max_scale_down_step: i32,
    /// Fraction of a replica's capacity at the ITL target the predictive loop plans for.
    #[serde(default = "default_utilization")]
    #[schemars(range(min = 0.05, max = 1.0))]
    pub target_utilization: f64,
    #[serde(default)]
    pub metrics_source: MetricsSource,
    /// The Prometheus server's `http://` or `https://` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new(matches(admission::HTTP_URL)).message("autoscaling.prometheusUrl must be an http:// or https:// URL with a host, such as http://prometheus.monitoring:9090"))]
    pub prometheus_url: Option<String>,
}

impl Default for AutoscalingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: AutoscalingMode::Active,
            period_seconds: default_period(),
            scale_up_stabilization_seconds: 0,
            scale_down_stabilization_seconds: default_down_window(),
            max_scale_up_step: default_up_step(),
            max_scale_down_step: default_down_step(),
            target_utilization: default_utilization(),
            metrics_source: MetricsSource::Scrape,
            prometheus_url: None,
        }
    }
}

fn default_period() -> i32 {
    15
}
fn default_down_window() -> i32 {
    300
}
fn default_up_step() -> i32 {
    4
}
fn default_down_step() -> i32 {
    1
}
fn default_utilization() -> f64 {
    0.8
}
