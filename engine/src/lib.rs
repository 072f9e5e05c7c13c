//! `dspark-engine`: the serving engine of DSpark-on-Kubernetes.
//!
//! It owns everything that touches a model: loading real checkpoints (GGUF, Hugging Face
//! folders) for Llama, Qwen3 and Gemma 3 ([`model`]), tokenization and chat templates
//! ([`tokenizer`], [`chat`]), the paged KV cache ([`kv`]), sampling ([`sampling`]), the
//! continuous-batching step loop ([`engine`]), the OpenAI-compatible HTTP API ([`server`])
//! and its metrics ([`metrics`]). Cost-table types come from `dspark-types`; nothing here
//! knows about Kubernetes.

pub mod chat;
pub mod cost;
pub mod engine;
pub mod kernels;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod profile;
pub mod runtime;
pub mod sampling;
pub mod server;
pub mod spec;
#[cfg(test)]
pub(crate) mod testutil;
pub mod tokenizer;
pub mod train;

/// Engine version, recorded in cost tables.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
