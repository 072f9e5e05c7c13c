//! The one harness of the engine's integration tests: the real model files fetched by
//! `scripts/fetch-models.sh` (tests fail, not skip, when they are missing) and llama.cpp's
//! references (here), an engine started in process and fed requests directly ([`engine`]),
//! its API served on a loopback port and the HTTP helpers that talk to it ([`http`]), and
//! the engine binary run as a process ([`process`]: `serve` on a free port, ready, killed on
//! drop).
#![allow(dead_code)]

pub mod engine;
pub mod http;
pub mod process;

// Not every test binary uses them.
#[allow(unused_imports)]
pub use http::{metric, serve, Server};

use std::path::PathBuf;

pub fn cache_dir() -> PathBuf {
    std::env::var_os("DSPARK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/dspark"))
}

fn model(name: &str) -> PathBuf {
    let p = cache_dir().join("models").join(name);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh (make test does)",
        p.display()
    );
    p
}

pub fn smollm2() -> PathBuf {
    model("SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn gemma3() -> PathBuf {
    model("gemma-3-270m-Q4_K_M.gguf")
}

/// The real-size target, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB).
pub fn qwen15() -> PathBuf {
    model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
}

/// The integers of a JSON array (token ids, layer indices) in a reference file, as ids.
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

pub fn reference(model_file: &std::path::Path) -> serde_json::Value {
    reference_variant(model_file, "", "")
}

/// A reference of llama.cpp in another configuration: `suffix` ".kv-f32" was made with
/// `reference.py --kv-type f32` (`args`).
pub fn reference_variant(
    model_file: &std::path::Path,
    suffix: &str,
    args: &str,
) -> serde_json::Value {
    let name = model_file
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let p = cache_dir()
        .join("reference")
        .join(format!("{name}{suffix}.json"));
    let alt = cache_dir()
        .join("reference")
        .join(format!("{}{suffix}.json", name.trim_end_matches(".gguf")));
    let p = if p.exists() { p } else { alt };
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "llama.cpp reference {} is missing ({e}): run `python3 tests/peer/reference.py --model {}{args}` (make test does)",
            p.display(),
            model_file.display()
        )
    });
    serde_json::from_str(&text).expect("reference JSON parses")
}
