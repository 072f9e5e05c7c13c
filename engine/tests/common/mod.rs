//! Shared helpers for the engine's integration tests: the real model files fetched by
//! `scripts/fetch-models.sh` (tests fail, not skip, when they are missing).
#![allow(dead_code)]

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

/// An axum router served on a loopback port by its own runtime (kept alive by the value).
pub struct Server {
    pub base: String,
    _rt: tokio::runtime::Runtime,
}

pub fn serve(app: axum::Router) -> Server {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    Server {
        base: format!("http://{addr}"),
        _rt: rt,
    }
}

/// Value of the first sample of metric `name` in Prometheus text (NaN when absent).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| {
            l.starts_with(name)
                && (l.as_bytes().get(name.len()) == Some(&b' ')
                    || l.as_bytes().get(name.len()) == Some(&b'{'))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}
