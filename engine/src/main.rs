//! `dspark-engine` command line: `serve` (and more subcommands as they land).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use dspark_engine::engine::EngineConfig;
use dspark_engine::runtime::{self, AppOptions};
use dspark_engine::server::router;
use dspark_engine::VERSION;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "dspark-engine", version = VERSION, about = "DSpark serving engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A GGUF file or a Hugging Face model folder.
    #[arg(long, env = "DSPARK_MODEL")]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Name clients use in the `model` field (the alias `default` always works).
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Worker threads for the compute kernels (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Memory budget of the paged KV cache.
    #[arg(long, default_value_t = 512)]
    kv_cache_mb: usize,
    #[arg(long, default_value_t = 16)]
    kv_block_size: usize,
    /// Longest prompt + completion (default: the model's context, capped by the KV budget).
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Admission queue bound: past it, requests get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// On SIGTERM, how long in-flight requests may finish before the process exits.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve(a) => serve(a),
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    runtime::init_threads(a.threads);
    let (state, summary) = runtime::start(&AppOptions {
        model: a.model.clone(),
        device: a.device.clone(),
        served_model_name: a.served_model_name.clone(),
        kv_cache_mb: a.kv_cache_mb,
        kv_block_size: a.kv_block_size,
        max_model_len: a.max_model_len,
        engine: EngineConfig {
            max_batch_tokens: a.max_batch_tokens,
            prefill_chunk: a.prefill_chunk,
            max_running: a.max_running,
            max_waiting: a.max_waiting,
        },
        show_progress: true,
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        println!("{summary} | http://{addr}");
        let app = router(state.clone());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        shutdown_signal().await;
        state.draining.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(a.drain_timeout_secs);
        tracing::info!(
            inflight = state.inflight.load(Ordering::SeqCst),
            "draining before exit (up to {}s)",
            a.drain_timeout_secs
        );
        while state.inflight.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = state.inflight.load(Ordering::SeqCst);
        if left > 0 {
            tracing::warn!(left, "drain deadline passed; exiting with requests in flight");
        } else {
            tracing::info!("drained; exiting");
        }
        server.abort();
        Ok::<(), anyhow::Error>(())
    })
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}
