//! Sequential Temperature Scaling (`shared/method.md`): on held-out blocks, left to right
//! over block positions, choose `T_k` from a log grid to minimise the expected calibration
//! error of the prefix survival estimate `a_k = prod_{i<=k} sigmoid(z_i / T_i)` against the
//! observed survival `s_k`, keeping the earlier `T_i` fixed. Dividing a logit by a positive
//! `T` is monotone, so the ranking of confidences at each position never changes.
//!
//! Each position also gets a logit offset (see [`fit_sts`]). Survival depends on the
//! decoding mode, so there is one fit per [`Mode`]:
//! - greedy: `s_k = prod_{i<=k} [argmax q_i == argmax p_i]` (the data is the target's greedy
//!   continuation, so the data token is `argmax p_i`);
//! - sampled (temperature 1, rejection sampling): `s_k = prod_{i<=k} c*_i` with
//!   `c*_i = sum_x min(p_i(x), q_i(x))`, the expected survival of a block drafted from `q` (the
//!   confidence head's training target). Blocks are teacher-forced on the data tokens.
//!
//! The same pass measures teacher-forced acceptance: per-position conditional acceptance and
//! `tau = 1 + sum_k s_k` per mode, a cheap held-out proxy for the decoding-time `eval`.

use crate::data::Dataset;
use crate::loss::acceptance_rate;
use crate::model::TrainDrafter;
use crate::{pick_anchors, targets, VocabMap};
use anyhow::{ensure, Result};
use candle_core::{DType, D};
use dspark_engine::model::Model;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Per held-out block: confidence logits `z[k]`, greedy acceptance `ok[k]` and the
/// temperature-1 acceptance probability `soft[k] = c*_k`.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    pub z: Vec<Vec<f32>>,
    pub ok: Vec<Vec<bool>>,
    pub soft: Vec<Vec<f32>>,
}

/// The decoding mode a calibration is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Greedy,
    Sampled,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Greedy => "greedy",
            Mode::Sampled => "sampled (T = 1)",
        }
    }
}

pub fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// Expected calibration error with `bins` equal-width bins.
pub fn ece(conf: &[f64], obs: &[f64], bins: usize) -> f64 {
    if conf.is_empty() {
        return 0.0;
    }
    let mut sc = vec![0f64; bins];
    let mut so = vec![0f64; bins];
    let mut n = vec![0usize; bins];
    for (&c, &o) in conf.iter().zip(obs) {
        let b = ((c * bins as f64) as usize).min(bins - 1);
        sc[b] += c;
        so[b] += o;
        n[b] += 1;
    }
    (0..bins).map(|b| (sc[b] - so[b]).abs()).sum::<f64>() / conf.len() as f64
}

/// Reliability bins: `(mean confidence, observed rate, count)` of the non-empty bins.
pub fn reliability(conf: &[f64], obs: &[f64], bins: usize) -> Vec<(f64, f64, usize)> {
    let mut acc = vec![(0f64, 0f64, 0usize); bins];
    for (&c, &o) in conf.iter().zip(obs) {
        let b = ((c * bins as f64) as usize).min(bins - 1);
        acc[b].0 += c;
        acc[b].1 += o;
        acc[b].2 += 1;
    }
    acc.into_iter()
        .filter(|a| a.2 > 0)
        .map(|(c, o, n)| (c / n as f64, o / n as f64, n))
        .collect()
}

/// Cumulative survival estimates `a_k` of every sample under temperatures `t` and logit
/// offsets `b`.
pub fn survival_estimates(s: &Samples, t: &[f64], b: &[f64]) -> Vec<Vec<f64>> {
    s.z.iter()
        .map(|z| {
            let mut a = 1.0;
            z.iter()
                .zip(t.iter().zip(b))
                .map(|(&z, (&tk, &bk))| {
                    a *= sigmoid(z as f64 / tk + bk);
                    a
                })
                .collect()
        })
        .collect()
}

/// Observed survival `s_k` of every sample under `mode`.
pub fn observed_survival(s: &Samples, mode: Mode) -> Vec<Vec<f64>> {
    let prod = |x: &mut dyn Iterator<Item = f64>| -> Vec<f64> {
        let mut alive = 1.0;
        x.map(|v| {
            alive *= v;
            alive
        })
        .collect()
    };
    match mode {
        Mode::Greedy => {
            s.ok.iter()
                .map(|ok| prod(&mut ok.iter().map(|&o| if o { 1.0 } else { 0.0 })))
                .collect()
        }
        Mode::Sampled => s
            .soft
            .iter()
            .map(|c| prod(&mut c.iter().map(|&v| v as f64)))
            .collect(),
    }
}

/// Teacher-forced acceptance under one mode.
#[derive(Debug, Clone, Serialize)]
pub struct Acceptance {
    /// `E[s_k] / E[s_{k-1}]`: acceptance at position k given all earlier ones passed.
    pub conditional: Vec<f64>,
    /// `1 + sum_k E[s_k]`: committed tokens per cycle with every block verified in full.
    pub tau: f64,
}

pub fn acceptance(s: &Samples, mode: Mode) -> Acceptance {
    let obs = observed_survival(s, mode);
    let n = obs.len().max(1) as f64;
    let gamma = obs.first().map_or(0, Vec::len);
    let mean: Vec<f64> = (0..gamma)
        .map(|k| obs.iter().map(|r| r[k]).sum::<f64>() / n)
        .collect();
    let conditional = (0..gamma)
        .map(|k| {
            let before = if k == 0 { 1.0 } else { mean[k - 1] };
            if before > 0.0 {
                mean[k] / before
            } else {
                0.0
            }
        })
        .collect();
    Acceptance {
        conditional,
        tau: 1.0 + mean.iter().sum::<f64>(),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StsReport {
    pub mode: Mode,
    pub temperatures: Vec<f64>,
    /// Logit offsets `b_k`.
    pub offsets: Vec<f64>,
    /// ECE of `a_k` per position, before (T = 1) and after.
    pub ece_before: Vec<f64>,
    pub ece_after: Vec<f64>,
    /// Over all (block, position) pairs.
    pub ece_all_before: f64,
    pub ece_all_after: f64,
    pub blocks: usize,
}

const BINS: usize = 15;
/// Least ECE improvement for a temperature other than 1.
const MIN_GAIN: f64 = 1e-4;
/// Least observed survival mass at a position to fit its temperature.
const MIN_SURVIVORS: f64 = 20.0;

fn column(v: &[Vec<f64>], k: usize) -> Vec<f64> {
    v.iter().map(|r| r[k]).collect()
}

fn pooled_ece(a: &[Vec<f64>], s: &[Vec<f64>]) -> f64 {
    let a: Vec<f64> = a.iter().flatten().copied().collect();
    let s: Vec<f64> = s.iter().flatten().copied().collect();
    ece(&a, &s, BINS)
}

/// Fits the per-position temperatures for `mode`, left to right, each with a logit offset
/// `b_k` (`c_k <- sigmoid(z_k / T_k + b_k)`, a 2-D grid; `b = 0` is the paper's STS). A
/// temperature alone cannot remove a bias: greedy acceptance exceeds the head's training
/// target `c*` by a roughly constant margin, and a head can be biased against `c*` too
/// (then the best temperature-only fit flattens a position towards 0.5 and every later
/// position inherits the error). The map is increasing in `z`, so rankings at a position
/// never change; the identity is kept unless the grid gains.
pub fn fit_sts(s: &Samples, mode: Mode) -> Result<StsReport> {
    ensure!(!s.z.is_empty(), "no calibration samples");
    let gamma = s.z[0].len();
    let grid: Vec<f64> = (0..=160)
        .map(|i| (0.05f64.ln() + i as f64 * (20f64.ln() - 0.05f64.ln()) / 160.0).exp())
        .chain([1.0])
        .collect();
    let offsets: Vec<f64> = (-30..=30).map(|i| i as f64 * 0.05).collect();
    let obs = observed_survival(s, mode);
    let (mut t, mut b) = (vec![1.0; gamma], vec![0.0; gamma]);
    let before = survival_estimates(s, &t, &b);
    // Survival estimate up to k - 1 under the maps fixed so far.
    let mut prefix = vec![1.0f64; s.z.len()];
    for k in 0..gamma {
        let o = column(&obs, k);
        let ece_at = |tk: f64, bk: f64| {
            let a: Vec<f64> =
                s.z.iter()
                    .zip(&prefix)
                    .map(|(z, &p)| p * sigmoid(z[k] as f64 / tk + bk))
                    .collect();
            ece(&a, &o, BINS)
        };
        // Ties prefer the map closest to the identity.
        let dist = |tk: f64, bk: f64| tk.ln().abs() + bk.abs();
        let mut best = (f64::INFINITY, 1.0f64, 0.0f64);
        for &bk in &offsets {
            for &tk in &grid {
                let e = ece_at(tk, bk);
                if e < best.0 - 1e-12
                    || (e <= best.0 + 1e-12 && dist(tk, bk) < dist(best.1, best.2))
                {
                    best = (e, tk, bk);
                }
            }
        }
        // Keep the identity unless the grid clearly helps (positions almost nobody reaches
        // have too little survival to fit on).
        let survivors: f64 = o.iter().sum();
        if best.0 < ece_at(1.0, 0.0) - MIN_GAIN && survivors >= MIN_SURVIVORS {
            (t[k], b[k]) = (best.1, best.2);
        }
        for (p, z) in prefix.iter_mut().zip(&s.z) {
            *p *= sigmoid(z[k] as f64 / t[k] + b[k]);
        }
    }
    let after = survival_estimates(s, &t, &b);
    Ok(StsReport {
        mode,
        ece_before: (0..gamma)
            .map(|k| ece(&column(&before, k), &column(&obs, k), BINS))
            .collect(),
        ece_after: (0..gamma)
            .map(|k| ece(&column(&after, k), &column(&obs, k), BINS))
            .collect(),
        ece_all_before: pooled_ece(&before, &obs),
        ece_all_after: pooled_ece(&after, &obs),
        temperatures: t,
        offsets: b,
        blocks: s.z.len(),
    })
}

/// Held-out samples: up to `anchors` random blocks per held-out sequence.
pub fn collect(
    target: &Model,
    td: &TrainDrafter,
    ds: &Dataset,
    held: &[usize],
    anchors: usize,
    seed: u64,
) -> Result<Samples> {
    ensure!(
        td.cfg.enable_confidence_head,
        "the drafter has no confidence head to calibrate"
    );
    let gamma = td.cfg.block_size;
    let vm = VocabMap::new(&td.cfg);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Samples::default();
    for &i in held {
        let s = &ds.seqs[i];
        let a = pick_anchors(s, gamma, anchors, &mut rng);
        if a.is_empty() {
            continue;
        }
        let o = td.forward_seq(target, s, &a)?;
        let am: Vec<u32> = o
            .logits
            .argmax(D::Minus1)?
            .to_dtype(DType::U32)?
            .to_vec1()?;
        let t = targets(s, &a, gamma, ds.meta.topk, &vm, &target.device)?;
        let c_star: Vec<f32> = acceptance_rate(&o.logits, &t.p)?.to_vec1()?;
        let z: Vec<f32> = o.conf_logit.expect("checked").to_vec1()?;
        for (bi, &anc) in a.iter().enumerate() {
            let rows = bi * gamma..(bi + 1) * gamma;
            out.z.push(z[rows.clone()].to_vec());
            out.soft.push(c_star[rows].to_vec());
            out.ok.push(
                (0..gamma)
                    .map(|j| vm.rows.get(&s.tokens[anc + j + 1]) == Some(&am[bi * gamma + j]))
                    .collect(),
            );
        }
    }
    Ok(out)
}
