//! Greedy speculative decoding is lossless: with batching (many requests of different
//! lengths at once) and every drafter type and block size, the output is token-for-token
//! the output of plain decoding. Real default model, real prompts.

mod common;

use dspark_engine::engine::{EngineConfig, Event, GenRequest, Usage};
use dspark_engine::runtime::AppOptions;
use dspark_engine::sampling::SamplingParams;
use dspark_engine::speculative::{Speculation, VerifyPolicy};
use dspark_engine::testutil::shipped_drafter;
use std::sync::OnceLock;

const MAX_TOKENS: usize = 16;

fn prompts() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/peer/prompts.jsonl");
    let mut out: Vec<String> = std::fs::read_to_string(&root)
        .expect("tests/peer/prompts.jsonl")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["prompt"].as_str().map(String::from))
        .collect();
    let he = common::cache_dir().join("data/HumanEval.jsonl");
    let he = std::fs::read_to_string(&he).expect("HumanEval.jsonl: run scripts/fetch-models.sh");
    for l in he.lines().skip(100).take(10) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        out.push(v["prompt"].as_str().unwrap().to_string());
    }
    out
}

/// Runs all prompts concurrently through one engine and returns (text, completion tokens,
/// draft tokens, accepted) per prompt.
fn run(
    speculation: Speculation,
    policy: VerifyPolicy,
    prompts: &[String],
    max_tokens: usize,
    drafter: Option<std::path::PathBuf>,
) -> Vec<(String, usize, usize, usize)> {
    let step = dspark_engine::speculative::recalibrate::DEFAULT_STEP;
    run_with(speculation, policy, prompts, max_tokens, drafter, step).0
}

/// [`run`] with online recalibration at step `online` (run: the serving default); also
/// returns the metrics text.
fn run_with(
    speculation: Speculation,
    policy: VerifyPolicy,
    prompts: &[String],
    max_tokens: usize,
    drafter: Option<std::path::PathBuf>,
    online: f32,
) -> (Vec<(String, usize, usize, usize)>, String) {
    let cfg = EngineConfig {
        speculation,
        policy,
        online_calibration: online,
        ..Default::default()
    };
    let (r, m, _) = run_cfg(cfg, prompts, max_tokens, drafter, None, &greedy());
    (r, m)
}

/// A cost table for the served model: `sps(B)` at B = 1, 2, 4, ... 1024 and a draft time of
/// `draft_ms` for every (sequences, length) up to 64 x 16.
fn table_json(model_id: &str, sps: impl Fn(f64) -> f64, draft_ms: f64) -> String {
    let points: Vec<(u32, f64)> = (0..=10)
        .map(|i| (1u32 << i, sps((1u32 << i) as f64)))
        .collect();
    let mut draft = Vec::new();
    for n in [1u32, 2, 4, 8, 16, 32, 64] {
        for l in 1..=16u32 {
            draft.push((n, l, draft_ms * 1e-3));
        }
    }
    serde_json::json!({
        "schema": 2, "model_id": model_id, "engine_version": dspark_engine::VERSION,
        "device": "cpu", "dtype": "q4_1", "measured_at": "2026-12-01T00:00:00Z",
        "points": points, "draft_points": draft,
    })
    .to_string()
}

type Outputs = Vec<(String, usize, usize, usize)>;

/// A run's outputs, its `/metrics` page and its app state.
type Run = (
    Outputs,
    String,
    std::sync::Arc<dspark_engine::server::AppState>,
);

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

/// [`run_with`] with the cost table `table(model_id)` installed before any request, the
/// given engine config (its batch bound raised to 1024) and every request sampled under
/// `params`; also returns the app state.
fn run_cfg(
    cfg: EngineConfig,
    prompts: &[String],
    max_tokens: usize,
    drafter: Option<std::path::PathBuf>,
    table: Option<&dyn Fn(&str) -> String>,
    params: &SamplingParams,
) -> Run {
    let state = start(cfg, drafter, table);
    let results = submit_all(&state, prompts, max_tokens, params)
        .into_iter()
        .map(|(text, u)| {
            (
                text,
                u.completion_tokens,
                u.draft_tokens,
                u.accepted_draft_tokens,
            )
        })
        .collect();
    let m = state.metrics.render();
    (results, m, state)
}

/// An engine on the default model with `cfg` (batch bound raised to 1024) and the cost
/// table `table(model_id)` installed before any request.
fn start(
    cfg: EngineConfig,
    drafter: Option<std::path::PathBuf>,
    table: Option<&dyn Fn(&str) -> String>,
) -> std::sync::Arc<dspark_engine::server::AppState> {
    start_with(cfg, drafter, table, 256)
}

/// [`start`] with a KV cache of `kv_mb` MiB.
fn start_with(
    cfg: EngineConfig,
    drafter: Option<std::path::PathBuf>,
    table: Option<&dyn Fn(&str) -> String>,
    kv_mb: usize,
) -> std::sync::Arc<dspark_engine::server::AppState> {
    let state = common::engine::start(AppOptions {
        kv_cache_mb: kv_mb,
        engine: EngineConfig {
            max_batch_tokens: 1024,
            ..cfg
        },
        drafter,
        ..common::engine::options(common::smollm2())
    });
    if let Some(t) = table {
        common::engine::install_table(&state, &t(&state.target_model_id));
    }
    state
}

/// Submits every prompt at once and collects (text, usage) per prompt.
fn submit_all(
    state: &dspark_engine::server::AppState,
    prompts: &[String],
    max_tokens: usize,
    params: &SamplingParams,
) -> Vec<(String, Usage)> {
    let ids = prompts
        .iter()
        .map(|p| state.tok.encode(p, state.tok.add_bos).unwrap())
        .collect();
    let submit = common::engine::Submit {
        params,
        max_tokens,
        ignore_eos: false,
        operation: "text_completion",
    };
    common::engine::generate_all(state, ids, &submit)
}

/// Plain decoding of the test prompts (computed once per test binary).
fn plain(prompts: &[String]) -> &'static [(String, usize, usize, usize)] {
    static PLAIN: OnceLock<Vec<(String, usize, usize, usize)>> = OnceLock::new();
    PLAIN.get_or_init(|| {
        run(
            Speculation::None,
            VerifyPolicy::Fixed { gamma: 1 },
            prompts,
            MAX_TOKENS,
            None,
        )
    })
}

/// Every prompt's output under `speculation` equals plain decoding; returns the accepted
/// draft tokens per gamma.
fn check(
    speculation: Speculation,
    gammas: &[usize],
    drafter: Option<std::path::PathBuf>,
) -> Vec<usize> {
    let prompts = prompts();
    assert!(prompts.len() >= 50, "only {} prompts", prompts.len());
    let max_tokens = MAX_TOKENS;
    let plain = plain(&prompts);
    let mut out = Vec::new();
    for &gamma in gammas {
        let spec = run(
            speculation,
            VerifyPolicy::Fixed { gamma },
            &prompts,
            max_tokens,
            drafter.clone(),
        );
        let (mut drafted, mut accepted) = (0, 0);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{speculation:?} gamma={gamma}: prompt {i} differs from plain decoding"
            );
            assert_eq!(
                a.1, b.1,
                "{speculation:?} gamma={gamma}: prompt {i} token count differs"
            );
            drafted += b.2;
            accepted += b.3;
        }
        println!("{speculation:?} gamma={gamma}: identical on {} prompts; {accepted}/{drafted} draft tokens accepted", prompts.len());
        assert!(
            drafted > 0,
            "{speculation:?} gamma={gamma} never drafted: the test would not test anything"
        );
        out.push(accepted);
    }
    out
}

/// One test per untrained drafter kind: greedy decoding through it, at gamma 1, 4, 7 and
/// 16, is plain decoding.
macro_rules! greedy_is_lossless {
    ($($name:ident: $speculation:expr,)*) => {$(
        #[test]
        fn $name() {
            check($speculation, &[1, 4, 7, 16], None);
        }
    )*};
}

greedy_is_lossless! {
    ngram_greedy_is_lossless: Speculation::Ngram,
    parallel_drafter_greedy_is_lossless: Speculation::Parallel,
    dspark_markov_greedy_is_lossless: Speculation::DSparkMarkov,
    dspark_rnn_greedy_is_lossless: Speculation::DSparkRnn,
}

/// The shipped trained DSpark Markov drafter (context input) drafts tokens the
/// target accepts, so this run exercises acceptance, the bonus token and the drafter's
/// context bookkeeping after partial acceptance, with many requests batched.
#[test]
fn shipped_markov_drafter_greedy_is_lossless() {
    let dir = shipped_drafter();
    let accepted = check(Speculation::DSparkMarkov, &[3, 7], Some(dir));
    for a in accepted {
        assert!(
            a > 50,
            "the trained drafter got only {a} draft tokens accepted"
        );
    }
}

/// Online recalibration moves the confidences the threshold policy cuts blocks with (the
/// dspark policy too, but at 50 concurrent requests on a CPU it rarely verifies at all);
/// the output stays the target's and the offsets are exported per mode and position.
#[test]
fn online_recalibration_with_a_confidence_policy_is_lossless() {
    let dir = shipped_drafter();
    let prompts = prompts();
    let plain = plain(&prompts);
    let (spec, metrics) = run_with(
        Speculation::DSparkMarkov,
        VerifyPolicy::Threshold {
            gamma: 7,
            threshold: 0.2,
        },
        &prompts,
        MAX_TOKENS,
        Some(dir),
        0.05,
    );
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a.0, b.0, "prompt {i} differs from plain decoding");
    }
    let accepted: usize = spec.iter().map(|r| r.3).sum();
    assert!(accepted > 20, "only {accepted} draft tokens accepted");
    let offsets: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with("dspark_spec_decode_calibration_offset{"))
        .map(|l| {
            assert!(l.contains("mode=\"greedy\""), "{l}");
            l.rsplit(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    assert!(!offsets.is_empty(), "no calibration offsets exported");
    assert!(
        offsets.iter().any(|&o| o != 0.0),
        "offsets never moved: {offsets:?}"
    );
}

fn first_prompts(n: usize) -> Vec<String> {
    prompts().into_iter().take(n).collect()
}

/// [`run_cfg`] with the shipped drafter and the cost table `table`, whose output must be
/// `plain`'s prompt by prompt (`note` ends the failure message): the outputs, the metrics
/// page and the app state.
fn shipped_equals_plain(
    cfg: EngineConfig,
    prompts: &[String],
    max_tokens: usize,
    table: &dyn Fn(&str) -> String,
    plain: &Outputs,
    note: &str,
) -> Run {
    let drafter = Some(shipped_drafter());
    let (spec, m, state) = run_cfg(cfg, prompts, max_tokens, drafter, Some(table), &greedy());
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a.0, b.0, "prompt {i} differs from plain decoding{note}");
    }
    (spec, m, state)
}

/// Plain decoding of `prompts` (no drafter).
fn plain_run(prompts: &[String], max_tokens: usize) -> Outputs {
    let plain = VerifyPolicy::Fixed { gamma: 1 };
    run(Speculation::None, plain, prompts, max_tokens, None)
}

/// The dspark policy prices the whole cycle. Where verification never pays (every extra
/// token in the forward costs a whole step), the plan drafts nobody, and the due probes
/// (every 16th skipped step) do not run either: even a drafter that is never wrong could
/// not pay there. Only a step that also carries another prompt's prefill chunk can make
/// drafting pay (its tokens share that step's time); every other step runs no drafter
/// code, as the drafter itself counts its calls. Where verification and drafting are
/// nearly free, most steps draft. The output is the target's either way.
#[test]
fn a_step_that_drafts_nothing_runs_no_drafter_code() {
    let (prompts, max_tokens) = (first_prompts(8), 48);
    let plain = plain_run(&prompts, max_tokens);
    let policy = VerifyPolicy::Dspark { gamma: 4 };
    let steep = |id: &str| table_json(id, |b| 100.0 / b, 1.0);
    // The metrics of a run under the cost table `table`, lossless.
    let run_under = |table: &dyn Fn(&str) -> String, note: &str| {
        let cfg = EngineConfig {
            speculation: Speculation::DSparkMarkov,
            policy: policy.clone(),
            ..Default::default()
        };
        shipped_equals_plain(cfg, &prompts, max_tokens, table, &plain, note).1
    };
    let m = run_under(&steep, "");
    let steps = common::metric(&m, "dspark_engine_steps_total");
    let skipped = common::metric(&m, "dspark_spec_decode_draft_skipped_steps_total");
    let drafting = common::metric(&m, "dspark_spec_decode_draft_steps_total");
    let calls = common::metric(&m, "dspark_spec_decode_drafter_calls_total");
    println!(
        "steep table: {steps} steps, {skipped} skipped, {drafting} drafting, {calls} drafter calls"
    );
    let unprobed = common::metric(&m, "dspark_spec_decode_skipped_probes_total");
    println!("steep table: {unprobed} probes skipped");
    assert!(skipped >= 32.0, "only {skipped} steps were planned");
    // Probes fell due and were priced out (unpriced, one ran every 16th skipped step).
    assert!(
        unprobed >= skipped - 2.0 * 16.0,
        "{unprobed} probes skipped for {skipped} skipped steps"
    );
    assert!(
        drafting <= 1.0,
        "{drafting} drafting steps under the steep table"
    );
    // A drafting step makes at most two calls (one context feed, one draft); the others none.
    assert!(
        calls <= 2.0 * drafting,
        "{calls} drafter calls in {drafting} drafting steps"
    );

    let flat = |id: &str| table_json(id, |_| 100.0, 0.01);
    let m = run_under(&flat, " (flat table)");
    let skipped = common::metric(&m, "dspark_spec_decode_draft_skipped_steps_total");
    let drafting = common::metric(&m, "dspark_spec_decode_draft_steps_total");
    println!("flat table: {skipped} skipped, {drafting} drafting");
    assert!(
        drafting > 4.0 * skipped.max(1.0),
        "{drafting} drafting vs {skipped} skipped steps"
    );
}

/// Prompt lookup beside the model drafter: where a continuation found in the context is
/// worth more than the drafter's block (here verification is free and drafting slow, so
/// wherever a match exists), the lookup block is verified instead. Greedy output stays
/// plain decoding's, lookup blocks are verified and accepted, and `prompt_lookup: false`
/// verifies none.
#[test]
fn prompt_lookup_beside_the_drafter_is_lossless() {
    let (prompts, max_tokens) = (first_prompts(12), 64);
    let plain = plain_run(&prompts, max_tokens);
    let slow_drafter = |id: &str| table_json(id, |_| 100.0, 20.0);
    let run = |prompt_lookup: bool| {
        let cfg = EngineConfig {
            speculation: Speculation::DSparkMarkov,
            policy: VerifyPolicy::Dspark { gamma: 7 },
            prompt_lookup,
            ..Default::default()
        };
        let note = format!(" (prompt_lookup {prompt_lookup})");
        let m = shipped_equals_plain(cfg, &prompts, max_tokens, &slow_drafter, &plain, &note).1;
        let blocks = common::metric(&m, "dspark_spec_decode_lookup_drafts_total");
        let accepted = common::metric(&m, "dspark_spec_decode_lookup_accepted_tokens_total");
        let all = common::metric(&m, "dspark_spec_decode_num_accepted_tokens_total");
        println!("prompt_lookup {prompt_lookup}: {blocks} lookup blocks, {accepted} of {all} accepted tokens");
        (blocks, accepted, all)
    };
    let (blocks, accepted, all) = run(true);
    assert!(blocks >= 20.0, "only {blocks} lookup blocks verified");
    assert!(
        accepted > 0.0 && accepted < all,
        "lookup accepted {accepted} of {all}"
    );
    let (blocks, _, all) = run(false);
    assert_eq!(blocks, 0.0, "lookup blocks verified with prompt_lookup off");
    assert!(all > 0.0, "the drafter alone accepted nothing");
}

/// The online experiment alternates its arms in windows between steps, exports every arm's
/// series and lists the windows, and the output stays the target's (temperature 0) whichever
/// arm was in force at each step.
#[test]
fn policy_experiment_alternates_arms_losslessly() {
    let (prompts, max_tokens) = (first_prompts(32), 64);
    let plain = plain_run(&prompts, max_tokens);
    // fixed:3 first: its window drafts for certain (a sequence running when `none` begins
    // decodes plainly to its end, and these requests all arrive at once). One-second
    // windows: the first must outlast the prefill of every prompt even when the other
    // tests of this binary share the two cores.
    let arms = dspark_engine::experiment::parse_arms("fixed:3,dspark,none", 4).unwrap();
    let cfg = EngineConfig {
        speculation: Speculation::DSparkMarkov,
        policy: VerifyPolicy::Fixed { gamma: 4 },
        experiment: Some((arms, std::time::Duration::from_millis(1000))),
        ..Default::default()
    };
    let flat = |id: &str| table_json(id, |b| 100.0 / (1.0 + (b - 1.0) / 16.0), 0.2);
    let (spec, m, state) = shipped_equals_plain(cfg, &prompts, max_tokens, &flat, &plain, "");
    let windows = state.experiment.as_ref().unwrap().lock().unwrap().clone();
    println!(
        "{} windows: {:?}",
        windows.len(),
        windows
            .iter()
            .map(|w| (w.arm.as_str(), w.tokens))
            .collect::<Vec<_>>()
    );
    assert!(windows.len() >= 3, "only {} windows", windows.len());
    let order = ["fixed:3", "dspark", "none"];
    for (i, w) in windows.iter().enumerate() {
        assert_eq!(w.arm, order[i % 3], "window {i}");
    }
    for arm in order {
        let tokens = m
            .lines()
            .find(|l| {
                l.starts_with("dspark_experiment_tokens_total{")
                    && l.contains(&format!("policy=\"{arm}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(tokens > 0.0, "no tokens under arm {arm}");
        let quoted = format!("policy=\"{arm}\"");
        assert!(
            m.lines()
                .any(|l| l.starts_with("dspark_experiment_active{") && l.contains(&quoted)),
            "no active gauge for {arm}"
        );
    }
    // Drafts were verified under the speculating arms. Sequences running when a `none`
    // window begins decode plainly to their end, and on a loaded machine the first windows
    // can pass in the prefill of the first wave; so later small waves start under whatever
    // arm is in force then, until one drafts (each wave still the target's output).
    let mut drafted: usize = spec.iter().map(|r| r.2).sum();
    let greedy = greedy();
    let wave: Vec<String> = prompts[..4].to_vec();
    let mut waves = 0;
    while drafted == 0 && waves < 12 {
        let out = submit_all(&state, &wave, max_tokens, &greedy);
        for (i, (a, b)) in plain.iter().zip(&out).enumerate() {
            assert_eq!(
                a.0, b.0,
                "wave {waves}: prompt {i} differs from plain decoding"
            );
        }
        drafted += out.iter().map(|o| o.1.draft_tokens).sum::<usize>();
        waves += 1;
    }
    println!("drafted {drafted} tokens ({waves} extra waves)");
    assert!(drafted > 0, "no arm drafted");
}

/// Penalties and a logit bias make each position's target law depend on the tokens before
/// it, the draft tokens verified before it in the same block included. Greedy output under
/// speculation (n-gram and the shipped drafter, fixed blocks) is plain decoding's, token for
/// token, and the penalties visibly changed that output.
#[test]
fn greedy_with_penalties_and_bias_is_lossless() {
    let (prompts, max_tokens) = (first_prompts(20), 32);
    let params = SamplingParams {
        temperature: 0.0,
        presence_penalty: 1.5,
        frequency_penalty: 0.5,
        repetition_penalty: 1.1,
        // Discourage a newline and a space-prefixed "the" (SmolLM2 ids), favour a comma.
        logit_bias: vec![(198, -3.0), (260, -2.0), (28, 1.0)],
        ..Default::default()
    };
    let plain_cfg = EngineConfig::default();
    let (plain, _, _) = run_cfg(plain_cfg, &prompts, max_tokens, None, None, &params);
    let unpenalised = plain_run(&prompts, max_tokens);
    let changed = plain
        .iter()
        .zip(&unpenalised)
        .filter(|(a, b)| a.0 != b.0)
        .count();
    assert!(
        changed >= prompts.len() / 2,
        "penalties changed only {changed} outputs"
    );
    // Penalised text rarely repeats itself, so n-gram drafts are mostly rejected.
    for (speculation, gamma, drafter, min_accepted) in [
        (Speculation::Ngram, 4, None, 1),
        (Speculation::DSparkMarkov, 3, Some(shipped_drafter()), 20),
        (Speculation::DSparkMarkov, 7, Some(shipped_drafter()), 20),
    ] {
        let cfg = EngineConfig {
            speculation,
            policy: VerifyPolicy::Fixed { gamma },
            ..Default::default()
        };
        let (spec, _, _) = run_cfg(cfg, &prompts, max_tokens, drafter, None, &params);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{speculation:?} gamma {gamma}: prompt {i} differs"
            );
        }
        let accepted: usize = spec.iter().map(|r| r.3).sum();
        let drafted: usize = spec.iter().map(|r| r.2).sum();
        println!("{speculation:?} gamma {gamma}: {accepted} of {drafted} draft tokens accepted");
        assert!(
            accepted >= min_accepted,
            "{speculation:?}: only {accepted} drafts accepted"
        );
    }
}

/// Automatic prefix caching: a second round of the same prompts on the same engine starts
/// on the cached blocks (the usage says how many prompt tokens), and its greedy output is
/// the first round's and plain decoding's, with the shipped drafter verifying fixed blocks:
/// the drafter's context blocks are shared under the same keys, so it drafts as well after
/// a hit as without one. Rejected draft tokens never enter the cache (they would change the
/// second round). Without prefix caching nothing is served from the cache.
#[test]
fn prefix_cache_hits_are_lossless_with_the_drafter_context_shared() {
    // A shared system-style preamble makes the prompts share blocks with each other too.
    let preamble = "You are a careful assistant. Answer briefly and precisely, in one sentence, \
                    without any preamble of your own. ";
    let prompts: Vec<String> = first_prompts(12)
        .into_iter()
        .map(|p| format!("{preamble}{p}"))
        .collect();
    let greedy = greedy();
    let max_tokens = 24;
    let plain =
        {
            let cfg = EngineConfig {
                prefix_cache: false,
                ..Default::default()
            };
            let st = start(cfg, None, None);
            let out = submit_all(&st, &prompts, max_tokens, &greedy);
            assert!(
                out.iter().all(|o| o.1.cached_tokens == 0),
                "no cache, no hits"
            );
            assert!(!st.metrics.render().lines().any(|l| {
                l.starts_with("dspark_prefix_cache_hits_total") && !l.ends_with(" 0")
            }));
            out
        };
    let cfg = EngineConfig {
        speculation: Speculation::DSparkMarkov,
        policy: VerifyPolicy::Fixed { gamma: 3 },
        ..Default::default()
    };
    let st = start(cfg, Some(shipped_drafter()), None);
    let first = submit_all(&st, &prompts, max_tokens, &greedy);
    let second = submit_all(&st, &prompts, max_tokens, &greedy);
    for i in 0..prompts.len() {
        assert_eq!(
            first[i].0, plain[i].0,
            "prompt {i}: first round differs from plain"
        );
        assert_eq!(
            second[i].0, plain[i].0,
            "prompt {i}: cache hit differs from plain"
        );
        let (u, len) = (&second[i].1, second[i].1.prompt_tokens);
        assert!(
            u.cached_tokens >= (len - 1) / 16 * 16
                && u.cached_tokens % 16 == 0
                && u.cached_tokens < len,
            "prompt {i}: {} of {len} prompt tokens cached",
            u.cached_tokens
        );
    }
    let acc = |r: &[(String, Usage)]| r.iter().map(|o| o.1.accepted_draft_tokens).sum::<usize>();
    let (a1, a2) = (acc(&first), acc(&second));
    println!("accepted drafts: {a1} without hits, {a2} with");
    assert!(a1 > 20, "the drafter drafted too little to compare: {a1}");
    assert!(
        (a2 as f64) >= 0.9 * a1 as f64,
        "the drafter lost its context after the hits: {a2} vs {a1} accepted"
    );
    let m = st.metrics.render();
    let hits = common::metric(&m, "dspark_prefix_cache_hits_total");
    let cached: usize = second.iter().map(|o| o.1.cached_tokens).sum();
    assert!(
        hits >= cached as f64,
        "{hits} hit tokens vs {cached} reported"
    );
    assert!(common::metric(&m, "dspark_prefix_cache_blocks") > 0.0);
}

/// Eviction under a tiny KV budget never corrupts a running sequence: with room for about
/// twenty blocks, many requests at once preempt each other and the prefix cache evicts its
/// blocks, and every output is still plain decoding's (big cache, no prefix cache).
#[test]
fn eviction_under_a_tiny_kv_budget_keeps_every_output() {
    let prompts = first_prompts(12);
    let greedy = greedy();
    let reference = {
        let cfg = EngineConfig {
            prefix_cache: false,
            ..Default::default()
        };
        submit_all(&start(cfg, None, None), &prompts, 24, &greedy)
    };
    let st = start_with(EngineConfig::default(), None, None, 8);
    // Twice: the second round hits (and evicts) the first round's cached blocks.
    for round in 0..2 {
        let out = submit_all(&st, &prompts, 24, &greedy);
        for (i, (a, b)) in reference.iter().zip(&out).enumerate() {
            assert_eq!(a.0, b.0, "round {round}: prompt {i} differs under eviction");
        }
    }
    let m = st.metrics.render();
    let evictions = common::metric(&m, "dspark_prefix_cache_evictions_total");
    let preemptions = common::metric(&m, "dspark_num_preemptions_total");
    println!("{evictions} evictions, {preemptions} preemptions");
    assert!(evictions > 0.0, "the tiny cache never evicted");
}

/// Generated token ids of requests for `prompt`, one per seed in `seeds`, sampled under `params`
/// with at most `max_tokens` tokens each, on `state`; also the drafted and accepted totals.
fn sampled_tokens(
    state: &dspark_engine::server::AppState,
    prompt: &str,
    seeds: std::ops::Range<u64>,
    max_tokens: usize,
    params: &SamplingParams,
) -> (Vec<Vec<u32>>, usize, usize) {
    let prompt = state.tok.encode(prompt, state.tok.add_bos).unwrap();
    let mut rxs = Vec::new();
    for seed in seeds {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        state
            .engine
            .submit(GenRequest {
                params: SamplingParams {
                    seed: Some(seed),
                    ..params.clone()
                },
                logprobs: Some(0),
                ignore_eos: true,
                ..GenRequest::new(prompt.clone(), max_tokens, tx)
            })
            .unwrap();
        rxs.push(rx);
    }
    let (mut drafted, mut accepted) = (0, 0);
    let seqs = rxs
        .into_iter()
        .map(|mut rx| {
            let mut ids = Vec::new();
            loop {
                match rx.blocking_recv().expect("engine answers") {
                    Event::Delta { logprobs, .. } => ids.extend(logprobs.iter().map(|l| l.id)),
                    Event::Finished { usage, .. } => {
                        drafted += usage.draft_tokens;
                        accepted += usage.accepted_draft_tokens;
                        return ids;
                    }
                    Event::Error(e) => panic!("engine error: {e}"),
                }
            }
        })
        .collect();
    (seqs, drafted, accepted)
}

/// Two-sample chi-square statistic of homogeneity of the token counts at each position of
/// `a` and `b` (equal numbers of samples), tokens seen fewer than 10 times in both pooled
/// into one cell per position: `(statistic, degrees of freedom)`.
fn homogeneity(a: &[Vec<u32>], b: &[Vec<u32>], positions: std::ops::Range<usize>) -> (f64, usize) {
    use std::collections::HashMap;
    let (mut chi, mut dof) = (0.0, 0);
    for k in positions {
        let mut counts: HashMap<u32, (f64, f64)> = HashMap::new();
        for s in a.iter().filter_map(|s| s.get(k)) {
            counts.entry(*s).or_default().0 += 1.0;
        }
        for s in b.iter().filter_map(|s| s.get(k)) {
            counts.entry(*s).or_default().1 += 1.0;
        }
        let (mut cells, mut pooled) = (Vec::new(), (0.0, 0.0));
        for (_, (x, y)) in counts {
            if x + y >= 10.0 {
                cells.push((x, y));
            } else {
                pooled.0 += x;
                pooled.1 += y;
            }
        }
        if pooled.0 + pooled.1 > 0.0 {
            cells.push(pooled);
        }
        for (x, y) in &cells {
            chi += (x - y) * (x - y) / (x + y);
        }
        dof += cells.len().saturating_sub(1);
    }
    (chi, dof)
}

/// Upper tail of the chi-square law with `k` degrees of freedom at `x` (Wilson-Hilferty:
/// the cube root of `x / k` is close to normal; ample for a 1e-4 threshold).
fn chi_square_p(x: f64, k: usize) -> f64 {
    let k = k.max(1) as f64;
    let v = 2.0 / (9.0 * k);
    let z = ((x / k).powf(1.0 / 3.0) - (1.0 - v)) / v.sqrt();
    // Normal upper tail, Abramowitz-Stegun 7.1.26 on erfc(z / sqrt 2).
    let t = z / std::f64::consts::SQRT_2;
    let erfc = |t: f64| {
        let s = 1.0 / (1.0 + 0.327_591_1 * t.abs());
        let poly = s
            * (0.254_829_592
                + s * (-0.284_496_736
                    + s * (1.421_413_741 + s * (-1.453_152_027 + s * 1.061_405_429))));
        let e = poly * (-t * t).exp();
        if t >= 0.0 {
            e
        } else {
            2.0 - e
        }
    };
    0.5 * erfc(t)
}

/// Sampled speculative decoding through the running engine (the shipped drafter, batched,
/// temperature 1) produces the plain engine's token law: at each generated position, the
/// histograms of many seeded requests' tokens agree (two-sample chi-square, p > 1e-4), and
/// the drafter was really verified (tokens drafted and accepted). The statistic does reject
/// different laws: plain decoding at temperature 0.7 against temperature 1. The same holds
/// with prompt-lookup blocks verified beside the drafter.
#[test]
fn sampled_speculation_through_the_engine_follows_the_plain_law() {
    const N: u64 = 600;
    const LEN: usize = 6;
    let prompt = "The capital of France is";
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let cfg = |speculation| EngineConfig {
        speculation,
        policy: VerifyPolicy::Fixed { gamma: 4 },
        max_waiting: 4096,
        ..Default::default()
    };
    let plain = start(cfg(Speculation::None), None, None);
    let (p, _, _) = sampled_tokens(&plain, prompt, 0..N, LEN, &params);
    let colder = SamplingParams {
        temperature: 0.7,
        ..Default::default()
    };
    let (c, _, _) = sampled_tokens(&plain, prompt, 0..N, LEN, &colder);
    drop(plain);
    let spec = start(
        cfg(Speculation::DSparkMarkov),
        Some(shipped_drafter()),
        None,
    );
    let (s, drafted, accepted) = sampled_tokens(&spec, prompt, 0..N, LEN, &params);
    assert!(p.iter().chain(&s).all(|x| x.len() == LEN));
    let (chi, dof) = homogeneity(&p, &s, 0..LEN);
    let pv = chi_square_p(chi, dof);
    println!(
        "sampled speculation vs plain: chi2 {chi:.1} over {dof} dof, p = {pv:.3e}; {accepted}/{drafted} drafts accepted"
    );
    assert!(drafted > N as usize && accepted > 0, "{accepted}/{drafted}");
    assert!(
        pv > 1e-4,
        "speculative tokens do not follow the plain law: p = {pv:.2e}"
    );
    // Prompt lookup blocks (point-mass drafts) beside the drafter, on a prompt that repeats
    // itself (the target follows the repetition with probabilities ~0.3-0.9, so lookup
    // blocks are both accepted and rejected), with verification free and drafting slow so
    // that lookup is verified wherever it finds a match: the same law. Other seeds than the
    // plain run's, so that no two samples share their random draws.
    let prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday, Wednesday, \
                  Thursday, Friday, Monday, Tuesday,";
    let (p2, _, _) = {
        let plain = start(cfg(Speculation::None), None, None);
        sampled_tokens(&plain, prompt, 0..N, LEN, &params)
    };
    let slow_drafter = |id: &str| table_json(id, |_| 100.0, 20.0);
    let lookup = start(
        EngineConfig {
            policy: VerifyPolicy::Dspark { gamma: 4 },
            ..cfg(Speculation::DSparkMarkov)
        },
        Some(shipped_drafter()),
        Some(&slow_drafter),
    );
    let (s2, drafted, accepted) = sampled_tokens(&lookup, prompt, N..2 * N, LEN, &params);
    let m = lookup.metrics.render();
    let blocks = common::metric(&m, "dspark_spec_decode_lookup_drafts_total");
    let (chi, dof) = homogeneity(&p2, &s2, 0..LEN);
    let pv = chi_square_p(chi, dof);
    println!(
        "sampled lookup vs plain: chi2 {chi:.1} over {dof} dof, p = {pv:.3e}; {blocks} lookup blocks, {accepted}/{drafted} drafts accepted"
    );
    assert!(
        blocks > N as f64 && accepted * 5 > drafted && accepted * 5 < 4 * drafted,
        "{blocks} lookup blocks, {accepted}/{drafted} drafts accepted"
    );
    assert!(
        pv > 1e-4,
        "speculative tokens with prompt lookup do not follow the plain law: p = {pv:.2e}"
    );
    let (chi, dof) = homogeneity(&p, &c, 0..LEN);
    let pc = chi_square_p(chi, dof);
    println!("plain at temperature 0.7 vs 1: chi2 {chi:.1} over {dof} dof, p = {pc:.3e}");
    assert!(
        pc < 1e-4,
        "the test cannot tell temperature 0.7 from 1: p = {pc:.2e}"
    );
}
