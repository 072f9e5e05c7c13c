//! The DSpark training loss (`shared/method.md`, "Training"):
//! per block position k (1-based), weight `w_k = exp(-(k - 1) / g)`, and
//! `loss = sum w_k (a_ce CE_k + a_l1 L1(q_k, p_k) + a_bce BCE(c_k, c*_k)) / sum w_k` with
//! - `CE_k = -log q_k(y_k)`, `y_k` the data token (rows whose token lies outside the draft
//!   vocabulary get no CE term);
//! - `L1(q, p) = sum_x |q(x) - p(x)|` with `p` the target's stored top-k distribution
//!   (probabilities outside the top-k taken as 0; mass outside the draft vocabulary, where
//!   `q = 0`, adds a constant);
//! - `c*_k = sum_x min(p_k(x), q_k(x))` (detached: a target, not a path for gradients) and
//!   `BCE(c, c*) = -(c* log c + (1 - c*) log(1 - c)) = softplus(z) - c* z` for `c = sigmoid(z)`.
//!
//! Defaults: `a_ce = 0.1`, `a_l1 = 0.9`, `a_bce = 1.0`, `g = 4`.

use crate::model::BlockOut;
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, D};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossConfig {
    pub ce: f64,
    pub l1: f64,
    pub bce: f64,
    /// Decay constant g of the position weights (`<= 0`: all positions weigh 1).
    pub decay: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            ce: 0.1,
            l1: 0.9,
            bce: 1.0,
            decay: 4.0,
        }
    }
}

impl LossConfig {
    /// `w_k` for 0-based block position `k`.
    pub fn weight(&self, k: usize) -> f64 {
        if self.decay > 0.0 {
            (-(k as f64) / self.decay).exp()
        } else {
            1.0
        }
    }
}

/// What the blocks should predict, one row per block position (anchor-major).
pub struct Targets {
    /// Data token of each row as a draft-vocabulary index (None: outside the draft vocab).
    pub y: Vec<Option<u32>>,
    /// Target distribution restricted to the draft vocabulary, `[rows, V_draft]`.
    pub p: Tensor,
    /// Target probability mass outside the draft vocabulary, per row.
    pub p_out: Vec<f32>,
}

/// The scalar loss (with gradients) and its parts (weighted means, for logs).
pub struct LossParts {
    pub total: Tensor,
    pub ce: f32,
    pub l1: f32,
    pub bce: f32,
    /// Weighted mean of `c*`.
    pub c_star: f32,
    /// Rows whose argmax equals the data token, per block position (count, rows).
    pub hits: Vec<(usize, usize)>,
}

/// `softplus(z) = max(z, 0) + log(1 + exp(-|z|))`, stable for any z.
pub fn softplus(z: &Tensor) -> Result<Tensor> {
    Ok((z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?)
}

/// `c*` per row: `sum_x min(p(x), q(x))` for `q = softmax(logits)` (no gradient).
pub fn acceptance_rate(logits: &Tensor, p: &Tensor) -> Result<Tensor> {
    let q = candle_nn::ops::softmax(&logits.detach(), D::Minus1)?;
    Ok(q.minimum(p)?.sum(D::Minus1)?)
}

/// The loss of one batch of blocks of `gamma` rows each.
pub fn dspark_loss(
    out: &BlockOut,
    t: &Targets,
    gamma: usize,
    cfg: &LossConfig,
) -> Result<LossParts> {
    let logits = &out.logits;
    let (rows, _) = logits.dims2()?;
    ensure!(
        rows == t.y.len() && rows == t.p_out.len() && rows % gamma == 0,
        "loss: {rows} logit rows, {} targets, gamma {gamma}",
        t.y.len()
    );
    let dev = logits.device();
    let w: Vec<f32> = (0..rows).map(|r| cfg.weight(r % gamma) as f32).collect();
    let wsum: f32 = w.iter().sum();
    let w_ce: Vec<f32> = w
        .iter()
        .zip(&t.y)
        .map(|(&w, y)| if y.is_some() { w } else { 0.0 })
        .collect();
    let w_ce_sum: f32 = w_ce.iter().sum::<f32>().max(1e-12);
    let wt = Tensor::from_vec(w.clone(), rows, dev)?;
    let logq = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let yi: Vec<u32> = t.y.iter().map(|y| y.unwrap_or(0)).collect();
    let ce_rows = logq
        .gather(&Tensor::from_vec(yi, (rows, 1), dev)?, 1)?
        .squeeze(1)?
        .neg()?;
    let ce = (ce_rows * Tensor::from_vec(w_ce, rows, dev)?)?.sum_all()? / w_ce_sum as f64;
    let ce = ce?;
    let q = logq.exp()?;
    let p_out = Tensor::from_vec(t.p_out.clone(), rows, dev)?;
    let l1_rows = ((&q - &t.p)?.abs()?.sum(D::Minus1)? + p_out)?;
    let l1 = ((&l1_rows * &wt)?.sum_all()? / wsum as f64)?;
    let c_star = q.detach().minimum(&t.p)?.sum(D::Minus1)?;
    let (bce, bce_val) = match &out.conf_logit {
        Some(z) => {
            let rows_bce = (softplus(z)? - (z * &c_star)?)?;
            let b = ((rows_bce * &wt)?.sum_all()? / wsum as f64)?;
            let v = b.to_scalar::<f32>()?;
            (Some(b), v)
        }
        None => (None, 0.0),
    };
    let mut total = ((ce.clone() * cfg.ce)? + (l1.clone() * cfg.l1)?)?;
    if let Some(b) = bce {
        total = (total + (b * cfg.bce)?)?;
    }
    let am: Vec<u32> = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?;
    let mut hits = vec![(0usize, 0usize); gamma];
    for (r, (a, y)) in am.iter().zip(&t.y).enumerate() {
        let h = &mut hits[r % gamma];
        h.1 += 1;
        if Some(*a) == *y {
            h.0 += 1;
        }
    }
    let cs = ((&c_star * &wt)?.sum_all()?.to_scalar::<f32>()?) / wsum;
    Ok(LossParts {
        ce: ce.to_scalar()?,
        l1: l1.to_scalar()?,
        bce: bce_val,
        c_star: cs,
        hits,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn out(logits: &[[f32; 3]], z: &[f32]) -> BlockOut {
        let rows = logits.len();
        let flat: Vec<f32> = logits.iter().flatten().copied().collect();
        BlockOut {
            logits: Tensor::from_vec(flat, (rows, 3), &Device::Cpu).unwrap(),
            conf_logit: Some(Tensor::new(z, &Device::Cpu).unwrap()),
        }
    }

    #[test]
    fn terms_match_hand_computed_values() {
        // One block of 2 rows, draft vocab of 3.
        // Row 0: logits 0 -> q = 1/3 each; p = (1, 0, 0); y = 0; z = 0.
        // Row 1: logits (ln 2, 0, 0) -> q = (1/2, 1/4, 1/4); p = (0.5, 0.25, 0) + 0.25 outside;
        //        y = 1; z = ln 3.
        let o = out(&[[0.0, 0.0, 0.0], [2f32.ln(), 0.0, 0.0]], &[0.0, 3f32.ln()]);
        let t = Targets {
            y: vec![Some(0), Some(1)],
            p: Tensor::new(&[[1f32, 0.0, 0.0], [0.5, 0.25, 0.0]], &Device::Cpu).unwrap(),
            p_out: vec![0.0, 0.25],
        };
        let cfg = LossConfig {
            decay: 1.0,
            ..Default::default()
        };
        let parts = dspark_loss(&o, &t, 2, &cfg).unwrap();
        let (w0, w1) = (1.0f64, (-1.0f64).exp());
        let ws = w0 + w1;
        // CE: row0 -ln(1/3), row1 -ln(1/4).
        let ce = (w0 * 3f64.ln() + w1 * 4f64.ln()) / ws;
        // L1: row0 |1/3-1| + 1/3 + 1/3 = 4/3; row1 0 + 0 + 1/4 + 0.25 = 0.5.
        let l1 = (w0 * 4.0 / 3.0 + w1 * 0.5) / ws;
        // c*: row0 min(1/3, 1) = 1/3; row1 1/2 + 1/4 + 0 = 3/4.
        // BCE: row0 z=0 -> ln 2; row1 c = 3/4 = c* -> entropy of 3/4.
        let h34 = -(0.75f64 * 0.75f64.ln() + 0.25 * 0.25f64.ln());
        let bce = (w0 * 2f64.ln() + w1 * h34) / ws;
        let total = 0.1 * ce + 0.9 * l1 + bce;
        assert!((parts.ce as f64 - ce).abs() < 1e-5, "{} {ce}", parts.ce);
        assert!((parts.l1 as f64 - l1).abs() < 1e-5, "{} {l1}", parts.l1);
        assert!((parts.bce as f64 - bce).abs() < 1e-5, "{} {bce}", parts.bce);
        let got = parts.total.to_scalar::<f32>().unwrap() as f64;
        assert!((got - total).abs() < 1e-5, "{got} {total}");
        let cs = (w0 / 3.0 + w1 * 0.75) / ws;
        assert!((parts.c_star as f64 - cs).abs() < 1e-5);
        // argmax row0 = 0 (first of ties) = y; row1 argmax 0 != 1.
        assert_eq!(parts.hits, vec![(1, 1), (0, 1)]);
    }

    #[test]
    fn rows_outside_the_draft_vocab_have_no_ce_and_softplus_is_stable() {
        let o = out(&[[5.0, 0.0, 0.0]], &[0.0]);
        let t = Targets {
            y: vec![None],
            p: Tensor::new(&[[0f32, 0.0, 0.0]], &Device::Cpu).unwrap(),
            p_out: vec![1.0],
        };
        let parts = dspark_loss(&o, &t, 1, &LossConfig::default()).unwrap();
        assert_eq!(parts.ce, 0.0);
        assert!((parts.l1 - 2.0).abs() < 1e-6);
        let z = Tensor::new(&[-100f32, 0.0, 100.0], &Device::Cpu).unwrap();
        let sp: Vec<f32> = softplus(&z).unwrap().to_vec1().unwrap();
        assert!(sp[0] < 1e-30 && (sp[1] - 2f32.ln()).abs() < 1e-6 && (sp[2] - 100.0).abs() < 1e-4);
    }
}
