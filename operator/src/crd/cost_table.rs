//! `DSparkCostTable`: a measured SPS(B) table per (model, drafter, engine version, node
//! type), its key and its name (a hash of the key), shared by the deployments that match.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A measured SPS(B) cost table for one (model, drafter, engine version, node type). The name
/// is derived from a hash of that key ([`cost_table_name`]); deployments that match share it.
// The repeated `type_ = "string"` of the printer columns is not a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "serving.dspark.dev",
    version = "v1alpha1",
    kind = "DSparkCostTable",
    plural = "dsparkcosttables",
    singular = "dsparkcosttable",
    shortname = "dsct",
    category = "dspark",
    namespaced,
    status = "DSparkCostTableStatus",
    derive = "PartialEq",
    doc = "A measured SPS(B) cost table for one (model, drafter, engine version, node type).",
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.modelId"),
    printcolumn(name = "Drafter", type_ = "string", json_path = ".spec.drafterId"),
    printcolumn(name = "Engine", type_ = "string", json_path = ".spec.engineVersion"),
    printcolumn(name = "NodeType", type_ = "string", json_path = ".spec.nodeType"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Revision", type_ = "integer", json_path = ".status.revision"),
    printcolumn(
        name = "MeasuredAt",
        type_ = "string",
        json_path = ".status.measuredAt"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DSparkCostTableSpec {
    pub model_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_id: Option<String>,
    pub engine_version: String,
    pub node_type: String,
}

/// Lifecycle of a cost table.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CostTablePhase {
    /// Nothing measured yet and no Job running.
    #[default]
    Pending,
    /// A profiling Job is running.
    Profiling,
    /// A valid table is stored.
    Ready,
    /// The last Job failed; the next one waits for `retryAfter`.
    Failed,
}

/// The measured table and how it was obtained.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DSparkCostTableStatus {
    #[serde(default)]
    pub phase: CostTablePhase,
    /// The validated table, exactly as the engine reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "cost_table_schema")]
    pub table: Option<dspark_types::CostTable>,
    /// Bumped every time a new table is stored (0: none yet).
    #[serde(default)]
    pub revision: i64,
    /// The table's content digest (`CostTable::digest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<String>,
    /// The profiling Job that produced (or is producing) the table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Consecutive failed Jobs.
    #[serde(default)]
    pub failures: i32,
    /// RFC 3339 time before which no new Job starts after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// Why the last Job failed, or what was wrong with its table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Structural schema of [`dspark_types::CostTable`] (its `points` are `[B, sps]` pairs, its
/// `draft_points` `[sequences, draft_length, seconds]` triples).
fn cost_table_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let s = |t: &str| serde_json::json!({ "type": t });
    serde_json::from_value(serde_json::json!({
        "type": "object",
        "description": "SPS(B) table: target-forward steps per second at B tokens per forward.",
        "required": ["schema", "model_id", "engine_version", "device", "dtype", "measured_at", "points"],
        "properties": {
            "schema": s("integer"),
            "model_id": s("string"),
            "drafter_id": { "type": "string", "nullable": true },
            "engine_version": s("string"),
            "device": s("string"),
            "node_type": { "type": "string", "nullable": true },
            "dtype": s("string"),
            "measured_at": s("string"),
            "points": {
                "type": "array",
                "description": "[B, steps_per_second] pairs, B strictly increasing.",
                "items": { "type": "array", "items": s("number"), "minItems": 2, "maxItems": 2 },
            },
            "draft_points": {
                "type": "array",
                "description": "[sequences, draft_length, seconds] of one drafter call (schema 2).",
                "items": { "type": "array", "items": s("number"), "minItems": 3, "maxItems": 3 },
            },
        },
    }))
    .expect("static schema is valid")
}

/// Cost-table key: what a measurement depends on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CostTableKey {
    pub model_id: String,
    pub drafter_id: Option<String>,
    pub engine_version: String,
    pub node_type: String,
}

impl CostTableKey {
    pub fn spec(&self) -> DSparkCostTableSpec {
        DSparkCostTableSpec {
            model_id: self.model_id.clone(),
            drafter_id: self.drafter_id.clone(),
            engine_version: self.engine_version.clone(),
            node_type: self.node_type.clone(),
        }
    }
}

/// Deterministic object name of the cost table for `key`: a readable prefix (node type) and a
/// 64-bit FNV-1a hash of the whole key.
pub fn cost_table_name(key: &CostTableKey) -> String {
    let mut text = String::new();
    for part in [
        key.model_id.as_str(),
        key.drafter_id.as_deref().unwrap_or(""),
        key.engine_version.as_str(),
        key.node_type.as_str(),
    ] {
        text.push_str(part);
        text.push('\u{0}');
    }
    let slug = dns_slug(&key.node_type, 24);
    format!("{slug}-{:016x}", fnv1a(text.as_bytes()))
}

/// FNV-1a, 64 bits: stable across builds and platforms.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Lower-case DNS-label fragment of `s`, at most `max` characters, never empty.
pub fn dns_slug(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
        if out.len() >= max {
            break;
        }
    }
    let trimmed = out.trim_matches('-');
    if trimmed.is_empty() {
        "x".into()
    } else {
        trimmed.to_string()
    }
}
