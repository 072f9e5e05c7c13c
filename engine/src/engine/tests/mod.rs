//! Step-loop fault tolerance on the real default model (SmolLM2-135M-Instruct, its shipped
//! DSpark Markov drafter): injected faults ([`super::Faults`]) fail one sequence at each site
//! of its step, panic the step, or stall the loop. The engine is stepped here, on the test
//! thread, so its state can be read after.

mod faults;

use super::*;
use crate::constraint::{GrammarSpec, Grammars, JsonStyle};
use crate::speculative::{Speculation, VerifyPolicy};
use crate::testutil::shipped_drafter;
use std::path::PathBuf;
use tokio::sync::mpsc::UnboundedReceiver;

/// The model cache (`DSPARK_CACHE`, else `~/.cache/dspark`).
fn cache_dir() -> PathBuf {
    std::env::var_os("DSPARK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/dspark"))
}

/// The default model (fails, not skips, when `scripts/fetch-models.sh` has not run).
fn smollm2() -> PathBuf {
    let p = cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

/// An engine on the default model with `cfg`, its shipped drafter when `cfg` speculates with
/// a model drafter; also the tokenizer and the structured-output compiler.
fn engine(cfg: EngineConfig) -> (Engine, EngineHandle, Arc<TextTokenizer>, Grammars) {
    crate::loader::init_threads(None);
    let dev = candle_core::Device::Cpu;
    let (model, tok) = crate::loader::load(&smollm2(), &dev, false).unwrap();
    let kv = KvCache::new_as(
        model.cfg.num_layers,
        model.cfg.kv_dim(),
        32 << 20,
        16,
        &dev,
        candle_core::DType::F16,
    )
    .unwrap();
    let drafter = crate::loader::build_drafter(
        cfg.speculation,
        Some(&shipped_drafter()),
        cfg.policy.gamma(),
        &model,
        kv.capacity_tokens(),
        16,
        kv.dtype(),
    )
    .unwrap();
    let metrics = Arc::new(Metrics::new("test"));
    let costs = Arc::new(CostTables::new(&model.id, "cpu", None));
    let tok = Arc::new(tok);
    let grammars = Grammars::new(tok.clone(), model.cfg.vocab_size).unwrap();
    let (mut e, h) = Engine::new(Arc::new(model), tok.clone(), kv, cfg, metrics, costs);
    if let Some(d) = drafter {
        e = e.with_drafter(d);
    }
    (e, h, tok, grammars)
}

/// A config speculating with the shipped drafter (greedy outputs are plain decoding's).
fn speculating(faults: &Faults) -> EngineConfig {
    EngineConfig {
        speculation: Speculation::DSparkMarkov,
        policy: VerifyPolicy::Fixed { gamma: 4 },
        faults: faults.clone(),
        ..Default::default()
    }
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "List three colors:",
];

/// Submits `prompt` (greedy, `max_tokens`), constrained to a JSON object with `json`.
fn submit(
    h: &EngineHandle,
    tok: &TextTokenizer,
    grammars: &Grammars,
    prompt: &str,
    max_tokens: usize,
    json: bool,
) -> UnboundedReceiver<Event> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let constraint = json.then(|| {
        grammars
            .compile(&GrammarSpec::JsonObject(JsonStyle::Compact))
            .unwrap()
    });
    h.submit(GenRequest {
        params: crate::sampling::SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ignore_eos: true,
        constraint,
        ..GenRequest::new(tok.encode(prompt, tok.add_bos).unwrap(), max_tokens, tx)
    })
    .unwrap();
    rx
}

/// How a request ended: its text and completion tokens, or its error.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Done(String, usize),
    Failed(String),
}

/// Steps the engine until every request has ended; their outcomes in order.
fn drive(e: &mut Engine, rxs: &mut [UnboundedReceiver<Event>]) -> Vec<Outcome> {
    let mut text = vec![String::new(); rxs.len()];
    let mut out: Vec<Option<Outcome>> = vec![None; rxs.len()];
    for _ in 0..10_000 {
        e.step().unwrap();
        for (k, rx) in rxs.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Delta { text: t, .. } => text[k].push_str(&t),
                    Event::Finished { usage, .. } => {
                        out[k] = Some(Outcome::Done(text[k].clone(), usage.completion_tokens))
                    }
                    Event::Error(m) => out[k] = Some(Outcome::Failed(m)),
                }
            }
        }
        if out.iter().all(Option::is_some) {
            return out.into_iter().map(Option::unwrap).collect();
        }
    }
    panic!("requests never ended: {out:?}");
}

/// Every KV block of the target and of the drafter's context cache is free (prefix-cached
/// blocks count: they are evictable), and the speculator holds no sequence.
fn assert_all_free(e: &Engine) {
    assert!(e.running.is_empty() && e.waiting.is_empty());
    assert_eq!(
        e.kv.free_blocks(),
        e.kv.total_blocks(),
        "target blocks leaked"
    );
    if let Some(c) = e.spec.context() {
        let kv = &c.drafter.kv;
        assert_eq!(kv.free_blocks(), kv.total_blocks(), "drafter blocks leaked");
        assert_eq!(c.sequences(), 0, "drafter contexts left");
    }
}
