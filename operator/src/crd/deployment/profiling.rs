//! `spec.profiling`: how cost tables are measured by profiling Jobs.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::default_true;

/// How cost tables are measured.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.timeoutSeconds > 0").message("profiling.timeoutSeconds must be positive"),
    validation = Rule::new("self.retryBaseSeconds > 0 && self.retryMaxSeconds >= self.retryBaseSeconds").message("profiling retry backoff needs 0 < retryBaseSeconds <= retryMaxSeconds"),
)]
#[serde(rename_all = "camelCase")]
pub struct ProfilingSpec {
    /// Run a profiling Job for pools without a valid table.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Extra arguments appended to `dspark-engine profile`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = crate::crd::admission::args)]
    pub args: Vec<String>,
    /// Deadline of one profiling Job.
    #[serde(default = "default_profile_timeout")]
    #[schemars(range(max = 86400))]
    pub timeout_seconds: i64,
    /// Wait after the first failed Job; doubles per failure up to `retryMaxSeconds`.
    #[serde(default = "default_retry_base")]
    #[schemars(range(max = 86400))]
    pub retry_base_seconds: i64,
    #[serde(default = "default_retry_max")]
    #[schemars(range(max = 604800))]
    pub retry_max_seconds: i64,
}

impl Default for ProfilingSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            args: Vec::new(),
            timeout_seconds: default_profile_timeout(),
            retry_base_seconds: default_retry_base(),
            retry_max_seconds: default_retry_max(),
        }
    }
}

fn default_profile_timeout() -> i64 {
    900
}
fn default_retry_base() -> i64 {
    60
}
fn default_retry_max() -> i64 {
    3600
}
