//! `dspark-engine`: the serving engine of DSpark-on-Kubernetes.
//!
//! It owns everything that touches a model: loading real checkpoints (GGUF, Hugging Face
//! folders) for Llama, Qwen3 and Gemma 3 ([`model`]) on the engine's own CPU matmul kernels
//! and thread pool ([`kernels`]), tokenization, chat templates and tool calls ([`tokenizer`], [`chat`], [`tools`]),
//! the paged KV cache with automatic prefix caching ([`kv`]), sampling with penalties and
//! bias ([`sampling`]), the continuous-batching step loop ([`engine`]: request contract,
//! pure batch planner, output, observability), speculative decoding ([`speculative`]: drafters, the drafting plan and the
//! verify scheduler, lossless verification, behind one `Speculator` the step loop calls),
//! the online policy experiment ([`experiment`]), the SPS(B) and draft-time cost table in
//! force ([`cost`]) and its measurement
//! ([`profile`]), the loaders every subcommand shares
//! ([`loader`]: device, threads, model + tokenizer, drafter; drafter training in the
//! `dspark-train` crate loads through them too), the `serve` wiring ([`runtime`]), model sources fetched into a shared cache ([`source`]:
//! `hf://`, `s3://`, `https://`),
//! the OpenAI-compatible HTTP API ([`server`]) and its metrics ([`metrics`]). Cost-table
//! types come from `dspark-types`; nothing here knows about Kubernetes.
//!
//! Layers, lowest first: a module imports from its own layer and the ones below, never from
//! a higher one (`tests/layers.rs` reads this list and checks every `crate::` path outside
//! test code; the binary's subcommands, `src/cli/`, sit above them all):
//! 1. `kernels`, `metrics`, `source`: CPU kernels and their thread pool, metric handles,
//!    model sources; nothing of the engine.
//! 2. `kv`: the paged KV cache.
//! 3. `model`: the models' forward.
//! 4. `tokenizer`, `chat`, `tools`, `constraint`: text in and out, chat templates, tool
//!    calls, grammars.
//! 5. `sampling`, `cost`: token choice; the cost table in force.
//! 6. `speculative`: drafters, the verify scheduler, lossless verification.
//! 7. `experiment`, `loader`, `profile`: the policy experiment; loading (profiling and
//!    `dspark-train` load through it, never through `runtime` or `server`); SPS(B)
//!    measurement.
//! 8. `engine`: the step loop.
//! 9. `server`: the HTTP API.
//! 10. `runtime`: the `serve` wiring.
//! 11. `testutil`: fixtures, for tests only.
//!
//! `unsafe` lives only in
//! `kernels` (SIMD, the thread pool) and `model` (memory-mapped weights, SIMD attention),
//! each block with its SAFETY note; every other module forbids it. Even inside an
//! `unsafe fn`, an unsafe operation needs its own `unsafe` block and note
//! (`unsafe_op_in_unsafe_fn`), which states the bounds the function relies on.

#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_op_in_unsafe_fn)]

#[forbid(unsafe_code)]
pub mod chat;
#[forbid(unsafe_code)]
pub mod constraint;
#[forbid(unsafe_code)]
pub mod cost;
#[forbid(unsafe_code)]
pub mod engine;
#[forbid(unsafe_code)]
pub mod experiment;
pub mod kernels;
#[forbid(unsafe_code)]
pub mod kv;
#[forbid(unsafe_code)]
pub mod loader;
#[forbid(unsafe_code)]
pub mod metrics;
pub mod model;
#[forbid(unsafe_code)]
pub mod profile;
#[forbid(unsafe_code)]
pub mod runtime;
#[forbid(unsafe_code)]
pub mod sampling;
#[forbid(unsafe_code)]
pub mod server;
#[forbid(unsafe_code)]
pub mod source;
#[forbid(unsafe_code)]
pub mod speculative;
/// Test fixtures for this crate's and other crates' tests (`dspark-train`). Always compiled
/// (nothing in the binaries calls them, so nothing of them is linked): behind a feature, the
/// test build of this crate differed from the release build and `make test` compiled the
/// engine twice.
#[doc(hidden)]
#[forbid(unsafe_code)]
pub mod testutil;
#[forbid(unsafe_code)]
pub mod tokenizer;
#[forbid(unsafe_code)]
pub mod tools;

/// Engine version, recorded in cost tables.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
