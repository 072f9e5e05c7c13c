//! Acceptance evaluation: single-stream greedy speculative decoding with the engine's own
//! pieces (the target's batched forward and paged KV cache, `DSparkDrafter::propose` fed with
//! the target's hidden states like the step loop does, n-gram prompt lookup, and the
//! lossless `verify` rule), one prompt at a time, every block verified in full.
//!
//! Per drafter and domain it reports `tau` (committed tokens per target forward while
//! decoding), the conditional acceptance rate at each block position (accepted / reached),
//! the reliability of the confidences (conditional `c_k` against acceptance, and ECE of the
//! survival estimate `prod c` against observed survival) and wall-clock tokens/s.

use crate::calibrate::{ece, reliability};
use anyhow::{ensure, Result};
use dspark_engine::kv::KvCache;
use dspark_engine::model::{Model, SeqBatch};
use dspark_engine::sampling::{target_probs, Dist, SamplingParams};
use dspark_engine::speculative::dspark::{DSparkDrafter, DraftRequest};
use dspark_engine::speculative::is_greedy;
use dspark_engine::speculative::ngram;
use dspark_engine::speculative::recalibrate::OnlineCalibration;
use dspark_engine::speculative::verify::verify;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::cell::RefCell;
use std::time::Instant;

/// A drafter under evaluation.
pub enum EvalDrafter {
    /// Plain decoding (the speed baseline).
    Plain,
    Ngram,
    Model(Box<DSparkDrafter>),
}

/// One draft-and-verify cycle.
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    pub drafted: usize,
    pub accepted: usize,
    pub confidence: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub cycles: Vec<Cycle>,
    /// Target forwards after the prefill.
    pub forwards: usize,
    /// Wall-clock seconds of the decoding phase (after the prefill and its first token).
    pub seconds: f64,
    /// Of which in the model drafter (`propose` and `append_context`).
    pub draft_seconds: f64,
}

/// Generation of up to `max_new` tokens after `prompt` (greedy or sampled), drafting blocks
/// of `gamma` and verifying each in full.
/// How [`generate`] decodes.
pub struct Decoding<'a> {
    pub max_new: usize,
    pub gamma: usize,
    pub stop: &'a [u32],
    /// 0: greedy; above 0: target and drafter sample at this temperature and drafts are
    /// verified by rejection sampling.
    pub temperature: f32,
    pub seed: u64,
    /// Online recalibration of a model drafter's confidences, as `serve
    /// --online-calibration` does (shared across the generations that pass it).
    pub recal: Option<&'a RefCell<OnlineCalibration>>,
}

pub fn generate(
    target: &Model,
    drafter: &EvalDrafter,
    prompt: &[u32],
    dec: &Decoding<'_>,
) -> Result<Generation> {
    let (max_new, gamma, stop) = (dec.max_new, dec.gamma, dec.stop);
    ensure!(
        !prompt.is_empty() && max_new > 0,
        "empty prompt or no new tokens"
    );
    let dev = &target.device;
    // Room for the last block: a full-block drafter writes `block_size` rows whatever `gamma`.
    let block = match drafter {
        EvalDrafter::Model(d) => d.config().block_rows(gamma),
        _ => gamma,
    };
    let cap = prompt.len() + max_new + block.max(gamma) + 16;
    // The target cache as `serve` keeps it by default (f16).
    let f16 = candle_core::DType::F16;
    let tbytes = cap * KvCache::bytes_per_token_as(target.cfg.num_layers, target.cfg.kv_dim(), f16);
    let mut kv = KvCache::new_as(
        target.cfg.num_layers,
        target.cfg.kv_dim(),
        tbytes,
        16,
        dev,
        f16,
    )?;
    let model = match drafter {
        EvalDrafter::Model(d) => Some(d.as_ref()),
        _ => None,
    };
    let mut dkv = match model {
        Some(d) => {
            let c = d.config();
            let per =
                KvCache::bytes_per_token(c.num_hidden_layers, c.num_key_value_heads * c.head_dim);
            Some(d.new_cache(cap * per, 16, dev)?)
        }
        None => None,
    };
    let layers: Vec<usize> = model
        .map(|d| d.target_layers().to_vec())
        .unwrap_or_default();
    let params = SamplingParams {
        temperature: dec.temperature,
        ..Default::default()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(dec.seed);
    let (mut table, mut dtable) = (Vec::new(), Vec::new());
    let mut t0 = Instant::now();
    let mut tokens = prompt.to_vec();
    let mut cached = 0usize;
    let mut last_ctx = None;
    let mut cycles = Vec::new();
    let mut forwards = 0;
    let mut first = true;
    let mut draft_seconds = 0.0;
    loop {
        let generated = tokens.len() - prompt.len();
        if generated >= max_new || (!first && stop.contains(tokens.last().expect("non-empty"))) {
            break;
        }
        let g = gamma.min(max_new - generated - 1);
        let draft: Option<(Vec<u32>, Vec<Dist>, Vec<f32>)> = if first || g == 0 {
            None
        } else {
            match drafter {
                EvalDrafter::Plain => None,
                EvalDrafter::Ngram => {
                    let t = ngram::propose(&tokens, g, 1, 3);
                    (!t.is_empty()).then(|| {
                        let q = t.iter().map(|&x| Dist::Greedy(x)).collect();
                        (t, q, Vec::new())
                    })
                }
                EvalDrafter::Model(d) => {
                    let dk = dkv.as_mut().expect("model drafter cache");
                    let rows = d.config().block_rows(g);
                    ensure!(dk.ensure(&mut dtable, cached + rows), "drafter cache full");
                    let mut reqs = [DraftRequest {
                        anchor: *tokens.last().expect("non-empty"),
                        anchor_pos: cached,
                        block_table: &dtable,
                        gamma: g,
                        params: &params,
                        history: None,
                        rng: &mut rng,
                        last_context: last_ctx.as_ref(),
                    }];
                    let t = Instant::now();
                    let mut b = d.propose(dk, target, &mut reqs)?.pop().expect("one block");
                    draft_seconds += t.elapsed().as_secs_f64();
                    if let Some(oc) = dec.recal {
                        oc.borrow().adjust(is_greedy(&b.q), &mut b.confidence);
                    }
                    Some((b.tokens, b.q, b.confidence))
                }
            }
        };
        let fed: Vec<u32> = match &draft {
            Some((t, _, _)) => std::iter::once(tokens[cached])
                .chain(t.iter().copied())
                .collect(),
            None => tokens[cached..].to_vec(),
        };
        ensure!(
            kv.ensure(&mut table, cached + fed.len()),
            "target cache full"
        );
        let nd = draft.as_ref().map_or(0, |d| d.0.len());
        let out = target.forward(
            &[SeqBatch {
                tokens: fed.clone(),
                start_pos: cached,
                block_table: table.clone(),
                num_logits: 1 + nd,
            }],
            &mut kv,
            &layers,
        )?;
        if !first {
            forwards += 1;
        }
        let rows = out.logits.to_vec2::<f32>()?;
        let (commit, valid) = match &draft {
            None => (
                vec![target_probs(&rows[0], &params).sample(&mut rng)],
                fed.len(),
            ),
            Some((t, q, conf)) => {
                let p: Vec<Dist> = rows.iter().map(|r| target_probs(r, &params)).collect();
                let v = verify(t, q, &p, &mut rng);
                if let (Some(oc), EvalDrafter::Model(_)) = (dec.recal, drafter) {
                    oc.borrow_mut().record(is_greedy(q), conf, v.accepted);
                }
                cycles.push(Cycle {
                    drafted: t.len(),
                    accepted: v.accepted,
                    confidence: conf.clone(),
                });
                (v.tokens, fed.len() - t.len() + v.accepted)
            }
        };
        if let (Some(d), Some(dk)) = (model, dkv.as_mut()) {
            ensure!(dk.ensure(&mut dtable, cached + valid), "drafter cache full");
            let h: Vec<candle_core::Tensor> = out
                .hidden
                .iter()
                .map(|h| h.narrow(0, 0, valid))
                .collect::<candle_core::Result<_>>()?;
            let t = Instant::now();
            if let Some(c) = d.append_context(dk, &dtable, cached, &h)? {
                last_ctx = Some(c);
            }
            if !first {
                draft_seconds += t.elapsed().as_secs_f64();
            }
        }
        cached += valid;
        kv.truncate(&mut table, cached);
        if let Some(dk) = dkv.as_mut() {
            dk.truncate(&mut dtable, cached);
        }
        for t in commit {
            tokens.push(t);
            if tokens.len() - prompt.len() >= max_new || stop.contains(&t) {
                break;
            }
        }
        if first {
            t0 = Instant::now();
            draft_seconds = 0.0;
        }
        first = false;
    }
    Ok(Generation {
        tokens: tokens[prompt.len()..].to_vec(),
        cycles,
        forwards,
        seconds: t0.elapsed().as_secs_f64(),
        draft_seconds,
    })
}

/// Aggregated results of one drafter on one domain.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DomainStats {
    pub drafter: String,
    pub domain: String,
    pub prompts: usize,
    pub new_tokens: usize,
    pub forwards: usize,
    /// Committed tokens per decoding target forward.
    pub tau: f64,
    /// Mean committed tokens per verified block (accepted + 1), over cycles that drafted.
    pub tau_block: f64,
    pub cycles: usize,
    /// `accepted[k] / reached[k]`.
    pub acceptance: Vec<f64>,
    pub reached: Vec<usize>,
    /// Decoding tokens/s (the prefill excluded).
    pub tokens_per_s: f64,
    pub seconds: f64,
    /// Milliseconds in the model drafter per draft-and-verify cycle.
    pub draft_ms_per_cycle: f64,
    /// Milliseconds per target forward outside the drafter (verify or decode).
    pub target_ms_per_forward: f64,
    /// Conditional reliability bins `(mean c_k, acceptance, count)` (model drafters).
    pub reliability: Vec<(f64, f64, usize)>,
    /// ECE of conditional `c_k` vs acceptance, and of `prod c` vs survival.
    pub ece_conditional: Option<f64>,
    pub ece_survival: Option<f64>,
    /// Whether every output equals the plain-decoding output (when that was run).
    pub matches_plain: Option<bool>,
    /// The online offsets and scales per position after the domain
    /// (`--online-calibration`).
    pub online_offsets: Option<Vec<f32>>,
    pub online_scales: Option<Vec<f32>>,
}

/// Aggregates generations of one drafter on one domain.
pub fn aggregate(drafter: &str, domain: &str, gens: &[Generation], gamma: usize) -> DomainStats {
    let mut s = DomainStats {
        drafter: drafter.into(),
        domain: domain.into(),
        prompts: gens.len(),
        acceptance: vec![0.0; gamma],
        reached: vec![0; gamma],
        ..Default::default()
    };
    let mut acc = vec![0usize; gamma];
    let (mut cc, mut co, mut sa, mut so) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut block_sum = 0usize;
    for g in gens {
        // The prefill's token is not a decoding step.
        s.new_tokens += g.tokens.len().saturating_sub(1);
        s.forwards += g.forwards;
        s.seconds += g.seconds;
        s.draft_ms_per_cycle += g.draft_seconds * 1e3;
        for c in &g.cycles {
            s.cycles += 1;
            block_sum += c.accepted + 1;
            let mut surv = 1.0f64;
            #[allow(clippy::needless_range_loop)]
            for k in 0..c.drafted.min(gamma) {
                let ok = k < c.accepted;
                if k <= c.accepted {
                    s.reached[k] += 1;
                    acc[k] += ok as usize;
                    if let Some(&conf) = c.confidence.get(k) {
                        cc.push(conf as f64);
                        co.push(ok as u8 as f64);
                    }
                }
                if let Some(&conf) = c.confidence.get(k) {
                    surv *= conf as f64;
                    sa.push(surv);
                    so.push((k < c.accepted) as u8 as f64);
                }
            }
        }
    }
    s.acceptance = acc
        .iter()
        .zip(&s.reached)
        .map(|(&a, &r)| a as f64 / r.max(1) as f64)
        .collect();
    s.tau = s.new_tokens as f64 / s.forwards.max(1) as f64;
    s.tau_block = block_sum as f64 / s.cycles.max(1) as f64;
    s.tokens_per_s = s.new_tokens as f64 / s.seconds.max(1e-9);
    s.target_ms_per_forward = (s.seconds * 1e3 - s.draft_ms_per_cycle) / s.forwards.max(1) as f64;
    s.draft_ms_per_cycle /= s.cycles.max(1) as f64;
    if !cc.is_empty() {
        s.reliability = reliability(&cc, &co, 10);
        s.ece_conditional = Some(ece(&cc, &co, 15));
        s.ece_survival = Some(ece(&sa, &so, 15));
    }
    s
}

/// Markdown tables: tau and per-position acceptance per drafter and domain.
pub fn markdown(stats: &[DomainStats], gamma: usize) -> String {
    let mut out = String::new();
    out.push_str("| drafter | domain | tau (tok/fwd) | accepted+1 per block | ");
    for k in 1..=gamma {
        out.push_str(&format!("acc@{k} | "));
    }
    out.push_str("ECE(prod c) | draft ms | target ms | tok/s | = plain |\n|---|---|---|---|");
    for _ in 0..gamma {
        out.push_str("---|");
    }
    out.push_str("---|---|---|---|---|\n");
    for s in stats {
        let block = if s.cycles > 0 {
            format!("{:.2}", s.tau_block)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "| {} | {} | {:.2} | {block} | ",
            s.drafter, s.domain, s.tau
        ));
        for k in 0..gamma {
            if s.reached[k] > 0 {
                out.push_str(&format!("{:.2} | ", s.acceptance[k]));
            } else {
                out.push_str("- | ");
            }
        }
        out.push_str(&format!(
            "{} | {} | {:.2} | {:.1} | {} |\n",
            s.ece_survival.map_or("-".into(), |e| format!("{:.3}", e)),
            if s.cycles > 0 && s.draft_ms_per_cycle > 0.0 {
                format!("{:.2}", s.draft_ms_per_cycle)
            } else {
                "-".into()
            },
            s.target_ms_per_forward,
            s.tokens_per_s,
            s.matches_plain
                .map_or("-", |m| if m { "yes" } else { "NO" })
        ));
    }
    out
}
