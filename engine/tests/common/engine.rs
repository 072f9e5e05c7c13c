//! An engine started in process (what `serve` starts, without the HTTP listener) and
//! requests submitted to it directly.

use dspark_engine::engine::{EngineConfig, Event, GenRequest, Usage};
use dspark_engine::runtime::{self, AppOptions};
use dspark_engine::sampling::SamplingParams;
use dspark_engine::server::AppState;
use std::path::PathBuf;
use std::sync::Arc;

/// The tests' usual options for `model`: CPU, a 64 MiB f16 KV cache of 16-token blocks,
/// 1024 tokens per sequence, no drafter, no cost table, no start-up profile, quiet.
pub fn options(model: PathBuf) -> AppOptions {
    AppOptions {
        model,
        model_id: None,
        device: "cpu".into(),
        served_model_name: None,
        kv_cache_mb: 64,
        kv_block_size: 16,
        kv_cache_dtype: candle_core::DType::F16,
        max_model_len: Some(1024),
        engine: EngineConfig::default(),
        show_progress: false,
        drafter: None,
        cost_table: None,
        startup_profile: false,
        shipped_drafter: None,
    }
}

/// Starts the engine thread and the state the API serves.
pub fn start(opts: AppOptions) -> Arc<AppState> {
    dspark_engine::loader::init_threads(None);
    runtime::start(&opts).expect("engine starts").0
}

/// Installs a cost table (JSON) as if pushed through the admin API.
pub fn install_table(state: &AppState, table: &str) {
    state
        .costs
        .install(table, dspark_types::CostTableSource::Admin)
        .unwrap();
}

/// Greedy sampling.
pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

/// One request as the API would submit it.
pub struct Submit<'a> {
    pub params: &'a SamplingParams,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub operation: &'static str,
}

/// Submits every prompt at once, then collects (text, usage) per prompt, in order; an
/// engine error fails the test.
pub fn generate_all(state: &AppState, prompts: Vec<Vec<u32>>, s: &Submit) -> Vec<(String, Usage)> {
    let rxs: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            state
                .engine
                .submit(GenRequest {
                    params: s.params.clone(),
                    ignore_eos: s.ignore_eos,
                    operation: s.operation,
                    ..GenRequest::new(prompt, s.max_tokens, tx)
                })
                .unwrap();
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut text = String::new();
            loop {
                match rx.blocking_recv().expect("engine answers") {
                    Event::Delta { text: t, .. } => text.push_str(&t),
                    Event::Finished { usage, .. } => return (text, usage),
                    Event::Error(e) => panic!("engine error: {e}"),
                }
            }
        })
        .collect()
}
