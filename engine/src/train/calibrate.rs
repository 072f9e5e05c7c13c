//! Sequential Temperature Scaling (`shared/method.md`): on held-out blocks, left to right
//! over block positions, choose `T_k` from a log grid to minimise the expected calibration
//! error of the prefix survival estimate `a_k = prod_{i<=k} sigmoid(z_i / T_i)` against the
//! observed survival `s_k = prod_{i<=k} accepted_i`, keeping the earlier `T_i` fixed.
//! Dividing a logit by a positive `T` is monotone, so the ranking of confidences at each
//! position never changes.
//!
//! Acceptance here is the greedy verification rule (the draft's argmax equals the target's
//! greedy token), matching greedily regenerated data.

use super::data::Dataset;
use super::model::{Blocks, TrainDrafter};
use super::{pick_anchors, VocabMap};
use crate::model::Model;
use anyhow::{ensure, Result};
use candle_core::{DType, D};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Per held-out block: confidence logits `z[k]` and greedy acceptance `ok[k]`.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    pub z: Vec<Vec<f32>>,
    pub ok: Vec<Vec<bool>>,
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

/// Cumulative survival estimates `a_k` of every sample under temperatures `t`.
pub fn survival_estimates(s: &Samples, t: &[f64]) -> Vec<Vec<f64>> {
    s.z.iter()
        .map(|z| {
            let mut a = 1.0;
            z.iter()
                .zip(t)
                .map(|(&z, &tk)| {
                    a *= sigmoid(z as f64 / tk);
                    a
                })
                .collect()
        })
        .collect()
}

/// Observed survival `s_k` of every sample.
pub fn observed_survival(s: &Samples) -> Vec<Vec<f64>> {
    s.ok.iter()
        .map(|ok| {
            let mut alive = 1.0;
            ok.iter()
                .map(|&o| {
                    if !o {
                        alive = 0.0;
                    }
                    alive
                })
                .collect()
        })
        .collect()
}

#[derive(Debug, Clone, Serialize)]
pub struct StsReport {
    pub temperatures: Vec<f64>,
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
/// Least observed survivals at a position to fit its temperature.
const MIN_SURVIVORS: usize = 20;

fn column(v: &[Vec<f64>], k: usize) -> Vec<f64> {
    v.iter().map(|r| r[k]).collect()
}

fn pooled_ece(a: &[Vec<f64>], s: &[Vec<f64>]) -> f64 {
    let a: Vec<f64> = a.iter().flatten().copied().collect();
    let s: Vec<f64> = s.iter().flatten().copied().collect();
    ece(&a, &s, BINS)
}

/// Fits the per-position temperatures, left to right.
pub fn fit_sts(s: &Samples) -> Result<StsReport> {
    ensure!(!s.z.is_empty(), "no calibration samples");
    let gamma = s.z[0].len();
    let grid: Vec<f64> = (0..=160)
        .map(|i| (0.05f64.ln() + i as f64 * (20f64.ln() - 0.05f64.ln()) / 160.0).exp())
        .chain([1.0])
        .collect();
    let obs = observed_survival(s);
    let mut t = vec![1.0; gamma];
    let before = survival_estimates(s, &t);
    // Survival estimate up to k - 1 under the temperatures fixed so far.
    let mut prefix = vec![1.0f64; s.z.len()];
    for k in 0..gamma {
        let o = column(&obs, k);
        let mut best = (f64::INFINITY, 1.0f64);
        for &tk in &grid {
            let a: Vec<f64> =
                s.z.iter()
                    .zip(&prefix)
                    .map(|(z, &p)| p * sigmoid(z[k] as f64 / tk))
                    .collect();
            let e = ece(&a, &o, BINS);
            // Ties prefer T closest to 1.
            if e < best.0 - 1e-12 || (e <= best.0 + 1e-12 && tk.ln().abs() < best.1.ln().abs()) {
                best = (e, tk);
            }
        }
        // Keep T = 1 unless the grid clearly helps (positions almost nobody reaches have
        // too few survivals to fit a temperature on).
        let e1 = {
            let a: Vec<f64> =
                s.z.iter()
                    .zip(&prefix)
                    .map(|(z, &p)| p * sigmoid(z[k] as f64))
                    .collect();
            ece(&a, &o, BINS)
        };
        let survivors = o.iter().filter(|&&x| x > 0.0).count();
        t[k] = if best.0 < e1 - MIN_GAIN && survivors >= MIN_SURVIVORS {
            best.1
        } else {
            1.0
        };
        for (p, z) in prefix.iter_mut().zip(&s.z) {
            *p *= sigmoid(z[k] as f64 / t[k]);
        }
    }
    let after = survival_estimates(s, &t);
    Ok(StsReport {
        ece_before: (0..gamma)
            .map(|k| ece(&column(&before, k), &column(&obs, k), BINS))
            .collect(),
        ece_after: (0..gamma)
            .map(|k| ece(&column(&after, k), &column(&obs, k), BINS))
            .collect(),
        ece_all_before: pooled_ece(&before, &obs),
        ece_all_after: pooled_ece(&after, &obs),
        temperatures: t,
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
        let feats = s
            .feats
            .narrow(0, 0, *a.last().expect("non-empty"))?
            .to_dtype(DType::F32)?;
        let o = td.forward(
            target,
            &Blocks {
                feats: &feats,
                tokens: &s.tokens,
                anchors: &a,
            },
        )?;
        let am: Vec<u32> = o
            .logits
            .argmax(D::Minus1)?
            .to_dtype(DType::U32)?
            .to_vec1()?;
        let z: Vec<f32> = o.conf_logit.expect("checked").to_vec1()?;
        for (bi, &anc) in a.iter().enumerate() {
            let mut zs = Vec::with_capacity(gamma);
            let mut ok = Vec::with_capacity(gamma);
            for j in 0..gamma {
                let r = bi * gamma + j;
                zs.push(z[r]);
                ok.push(vm.rows.get(&s.tokens[anc + j + 1]) == Some(&am[r]));
            }
            out.z.push(zs);
            out.ok.push(ok);
        }
    }
    Ok(out)
}
