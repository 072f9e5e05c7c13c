//! Wire types that both the engine and the operator speak, and nothing else.
//!
//! This crate owns the SPS(B) cost table (its JSON form, its compact form for a container
//! termination message, its validation and its interpolation) and the admin API payloads.
//! It must not pull in candle, kube or any I/O: the operator depends on it too.
#![forbid(unsafe_code)]
#![deny(warnings)]

mod admin;
mod cost_table;

pub use admin::{AdminState, CostTableSource, ErrorBody, ErrorDetail, PushResponse};
pub use cost_table::{
    CostTable, CostTableError, COST_TABLE_SCHEMA, MAX_COMPACT_BYTES, MIN_COST_TABLE_SCHEMA,
};
