//! Wire types that both the engine and the operator speak, and nothing else.
//!
//! This crate owns the SPS(B) cost table (its JSON form, its compact form for a container
//! termination message, its validation and its interpolation), the admin API payloads, and
//! the engine's contract with the operator and the dashboards ([`contract`]: ports, paths,
//! flags, environment variables, speculation and policy names, metric families).
//! It must not pull in candle, kube or any I/O: the operator depends on it too.
#![forbid(unsafe_code)]
#![deny(warnings)]

mod admin;
pub mod contract;
mod cost_table;

pub use admin::{AdminState, CostTableSource, ErrorBody, ErrorDetail, PushResponse};
pub use contract::{PolicyKind, Speculation};
pub use cost_table::{
    CostTable, CostTableError, COST_TABLE_SCHEMA, MAX_COMPACT_BYTES, MIN_COST_TABLE_SCHEMA,
};
