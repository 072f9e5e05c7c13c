//! Greedy speculation on the real-size target is lossless: Qwen2.5-Coder-1.5B-Instruct Q4_K_M
//! (Q4_K / Q6_K weights through the packed kernels, whose verify rows must round exactly as
//! one-row decoding does) with n-gram lookup (drafts the target accepts on code) and with a
//! DSpark Markov drafter of this target's shape gives plain decoding's output token for
//! token, with the prompts batched.

mod common;

use dspark_engine::engine::EngineConfig;
use dspark_engine::runtime::AppOptions;
use dspark_engine::speculative::{Speculation, VerifyPolicy};

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
    common::engine::start(AppOptions {
        kv_cache_mb: 128,
        engine: EngineConfig {
            max_batch_tokens: 1024,
            ..engine
        },
        ..common::engine::options(common::qwen15())
    })
}

/// Chat-templated greedy answers of every prompt, submitted at once: (text, draft tokens,
/// accepted draft tokens).
fn answers(state: &dspark_engine::server::AppState) -> Vec<(String, usize, usize)> {
    let ids = prompts()
        .iter()
        .map(|p| {
            let msgs = [dspark_engine::chat::ChatMessage::text("user", p.clone())];
            let text = state.template.render(&msgs, true).unwrap();
            state.tok.encode(&text, false).unwrap()
        })
        .collect();
    let submit = common::engine::Submit {
        params: &common::engine::greedy(),
        max_tokens: MAX_TOKENS,
        ignore_eos: false,
        operation: "chat.completion",
    };
    common::engine::generate_all(state, ids, &submit)
        .into_iter()
        .map(|(text, u)| (text, u.draft_tokens, u.accepted_draft_tokens))
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
