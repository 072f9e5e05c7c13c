//! Admin API payloads (`PUT /admin/v1/cost-table`, `GET /admin/v1/state`).

use serde::{Deserialize, Serialize};

/// Where the engine's current cost table came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostTableSource {
    /// The built-in conservative default (no table was given).
    Default,
    /// Loaded from a file given with `--cost-table` (hot-reloaded).
    File,
    /// Pushed over the admin API.
    Admin,
    /// Measured by the engine itself at start-up (no table was given; `--startup-profile`).
    StartupProfile,
}

/// Answer of `GET /admin/v1/state`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdminState {
    pub model_id: String,
    pub engine_version: String,
    pub device: String,
    pub speculation: String,
    pub policy: String,
    pub cost_table_source: CostTableSource,
    /// Monotonic counter bumped on every accepted table swap (0 = built-in default).
    pub cost_table_revision: u64,
    /// A stable content hash of the current table, so the operator can tell whether a pod
    /// already holds the table it would push.
    pub cost_table_digest: String,
    pub requests_running: usize,
    pub requests_waiting: usize,
}

/// Answer of a successful `PUT /admin/v1/cost-table`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushResponse {
    pub revision: u64,
    pub digest: String,
}

/// OpenAI-style error body, used by every 4xx/5xx of the engine's HTTP APIs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl ErrorBody {
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                param: None,
                code: None,
            },
        }
    }
}
