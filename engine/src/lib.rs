//! `dspark-engine`: the serving engine of DSpark-on-Kubernetes.
//!
//! It owns everything that touches a model: loading real checkpoints (GGUF, Hugging Face
//! folders) for Llama, Qwen3 and Gemma 3 ([`model`]) on the engine's own CPU matmul kernels
//! and thread pool ([`kernels`]), tokenization and chat templates ([`tokenizer`], [`chat`]),
//! the paged KV cache ([`kv`]), sampling ([`sampling`]), the continuous-batching step loop
//! ([`engine`]), speculative decoding ([`speculative`]: drafters, the drafting plan and the
//! verify scheduler, lossless verification, behind one `Speculator` the step loop calls),
//! the online policy experiment ([`experiment`]), the SPS(B) and draft-time cost table in
//! force ([`cost`]) and its measurement
//! ([`profile`]), drafter training and evaluation ([`train`]), process wiring ([`runtime`]),
//! the OpenAI-compatible HTTP API ([`server`]) and its metrics ([`metrics`]). Cost-table
//! types come from `dspark-types`; nothing here knows about Kubernetes.
//!
//! Layering: `kernels` <- `model` <- `speculative` <- `engine` <- `server`; `runtime` wires
//! them; nothing below `engine` imports from it or from `server`.

pub mod chat;
pub mod cost;
pub mod engine;
pub mod experiment;
pub mod kernels;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod profile;
pub mod runtime;
pub mod sampling;
pub mod server;
pub mod speculative;
#[cfg(test)]
pub(crate) mod testutil;
pub mod tokenizer;
pub mod train;

/// Engine version, recorded in cost tables.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
