//! Greedy speculation on the real-size target is lossless: Qwen2.5-Coder-1.5B-Instruct Q4_K_M
//! (Q4_K / Q6_K weights through the packed kernels, whose verify rows must round exactly as
//! one-row decoding does) with n-gram lookup (drafts the target accepts on code) and with a
//! DSpark Markov drafter of this target's shape gives plain decoding's output token for
//! token, with the prompts batched.

mod common;

use dspark_engine::engine::{EngineConfig, Event, GenRequest};
use dspark_engine::runtime::{self, AppOptions};
use dspark_engine::sampling::SamplingParams;
use dspark_engine::speculative::{Speculation, VerifyPolicy};
use std::time::Instant;

const MAX_TOKENS: usize = 40;

/// Code, math and chat prompts of the held-out sets (never trained on).
fn prompts() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/prompts");
    let mut out = Vec::new();
    for (file, n) in [("code.jsonl", 3), ("math.jsonl", 2), ("chat.jsonl", 1)] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        out.extend(text.lines().take(n).map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"]
                .as_str()
                .unwrap()
                .to_string()
        }));
    }
    out
}

fn start(engine: EngineConfig) -> std::sync::Arc<dspark_engine::server::AppState> {
    dspark_engine::loader::init_threads(None);
    runtime::start(&AppOptions {
        model: common::qwen15(),
        model_id: None,
        device: "cpu".into(),
        served_model_name: None,
        kv_cache_mb: 128,
        kv_block_size: 16,
        kv_cache_dtype: candle_core::DType::F16,
        max_model_len: Some(1024),
        engine: EngineConfig {
            max_batch_tokens: 1024,
            ..engine
        },
        show_progress: false,
        drafter: None,
        cost_table: None,
        startup_profile: false,
        shipped_drafter: None,
    })
    .unwrap()
    .0
}

/// Chat-templated greedy answers of every prompt, submitted at once: (text, draft tokens,
/// accepted draft tokens).
fn answers(state: &dspark_engine::server::AppState) -> Vec<(String, usize, usize)> {
    let rxs: Vec<_> = prompts()
        .iter()
        .map(|p| {
            let msgs = [dspark_engine::chat::ChatMessage::text("user", p.clone())];
            let text = state.template.render(&msgs, true).unwrap();
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            state
                .engine
                .submit(GenRequest {
                    prompt: state.tok.encode(&text, false).unwrap(),
                    params: SamplingParams {
                        temperature: 0.0,
                        ..Default::default()
                    },
                    max_tokens: MAX_TOKENS,
                    stop: vec![],
                    logprobs: None,
                    ignore_eos: false,
                    events: tx,
                    arrived: Instant::now(),
                    span: tracing::Span::none(),
                    operation: "chat.completion",
                    constraint: None,
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
                    Event::Finished { usage, .. } => {
                        return (text, usage.draft_tokens, usage.accepted_draft_tokens)
                    }
                    Event::Error(e) => panic!("engine error: {e}"),
                }
            }
        })
        .collect()
}

#[test]
fn greedy_speculation_on_the_real_size_target_is_lossless() {
    let plain = answers(&start(EngineConfig {
        speculation: Speculation::None,
        policy: VerifyPolicy::Fixed { gamma: 1 },
        ..Default::default()
    }));
    for (speculation, gamma) in [(Speculation::Ngram, 4), (Speculation::DSparkMarkov, 3)] {
        let spec = answers(&start(EngineConfig {
            speculation,
            policy: VerifyPolicy::Fixed { gamma },
            ..Default::default()
        }));
        let (mut drafted, mut accepted) = (0, 0);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{speculation:?}, prompt {i}: speculation changed the answer"
            );
            drafted += b.1;
            accepted += b.2;
        }
        println!(
            "Qwen2.5-Coder-1.5B, {speculation:?} gamma {gamma}: {} prompts identical to plain decoding; {accepted}/{drafted} draft tokens accepted",
            plain.len()
        );
        assert!(drafted > 0, "{speculation:?} proposed nothing");
        if speculation == Speculation::Ngram {
            assert!(
                accepted > 0,
                "no n-gram draft was accepted: the acceptance path is untested"
            );
        }
    }
}
