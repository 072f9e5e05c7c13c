//! The DSpark sequential head (Markov, RNN or none) and confidence head. Both run left to
//! right at sampling time, batched over all requests at one block position per step.

use super::HeadKind;
use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::Linear;
use std::collections::BTreeMap;

pub const W1: &str = "markov_head.markov_w1.weight";
pub const W2: &str = "markov_head.markov_w2.weight";
pub const RNN_W: &str = "rnn_head.proj.weight";
pub const RNN_B: &str = "rnn_head.proj.bias";
pub const GATE_W: &str = "markov_head.gate_proj.weight";
pub const GATE_B: &str = "markov_head.gate_proj.bias";
pub const CONF_W: &str = "confidence_head.proj.weight";
pub const CONF_B: &str = "confidence_head.proj.bias";

/// `W1: [V, r]` (or `[V_draft + 1, r]`, `compact_w1`) embeds the previous token, `W2: [V_draft, r]` maps rank r to draft logits.
pub(super) enum SeqHead {
    Parallel,
    Markov {
        w1: Tensor,
        w2: crate::model::Linear,
        /// `W2 · W1[row]` by W1 row, once `W2` runs on the CPU kernels.
        memo: Option<BiasMemo>,
    },
    Gated {
        w1: Tensor,
        w2: crate::model::Linear,
        gate: Linear,
    },
    Rnn {
        w1: Tensor,
        w2: crate::model::Linear,
        proj: Linear,
    },
}

/// One left-to-right step for all requests.
pub(super) struct Step {
    /// `W1[x_{k-1}]`, `[B, r]` (None for the parallel head).
    pub prev_embedding: Option<Tensor>,
    /// `B_k`, flat `[B * V_draft]` (None for the parallel head).
    pub bias: Option<Vec<f32>>,
}

impl SeqHead {
    /// The head of `kind` from checked parameters.
    pub fn new(kind: HeadKind, params: &BTreeMap<String, Tensor>) -> Self {
        let p = |name: &str| params[name].clone();
        match kind {
            HeadKind::Parallel => SeqHead::Parallel,
            HeadKind::Markov => SeqHead::Markov {
                w1: p(W1),
                w2: crate::model::Linear::dense(p(W2)),
                memo: None,
            },
            HeadKind::Gated => SeqHead::Gated {
                w1: p(W1),
                w2: crate::model::Linear::dense(p(W2)),
                gate: Linear::new(p(GATE_W), Some(p(GATE_B))),
            },
            HeadKind::Rnn => SeqHead::Rnn {
                w1: p(W1),
                w2: crate::model::Linear::dense(p(W2)),
                proj: Linear::new(p(RNN_W), Some(p(RNN_B))),
            },
        }
    }

    /// `W2` on the CPU kernels (see `DSparkDrafter::use_cpu_kernels`).
    pub fn use_cpu_kernels(
        &mut self,
        params: &BTreeMap<String, Tensor>,
        format: super::DrafterWeights,
    ) -> Result<()> {
        match self {
            SeqHead::Parallel => {}
            SeqHead::Markov { w2, .. } | SeqHead::Gated { w2, .. } | SeqHead::Rnn { w2, .. } => {
                *w2 = super::kernel_linear(&params[W2], format)?;
            }
        }
        if let SeqHead::Markov { w2, memo, .. } = self {
            // The kernels give a row the same values in any batch, so a remembered row is
            // exactly what recomputing it would give (candle's dense matmul promises not).
            if w2.uses_kernel() {
                *memo = Some(BiasMemo::new(params[W2].dim(0)?));
            }
        }
        Ok(())
    }

    /// Forgets the remembered Markov bias rows.
    pub fn forget_memos(&self) {
        if let SeqHead::Markov {
            memo: Some(memo), ..
        } = self
        {
            memo.rows.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// Step k: `prev[i]` is the `W1` row of request i's `x_{k-1}` (its target id, or its
    /// [`super::DSparkConfig::w1_index`] row), `rows[i]` its row of `h`
    /// (`[rows, hidden]`, the normed backbone outputs). `state` carries the RNN state `s`
    /// between steps (start with None: `s_0 = 0`).
    pub fn step(
        &self,
        prev: &[u32],
        h: &Tensor,
        rows: &[u32],
        state: &mut Option<Tensor>,
    ) -> Result<Step> {
        let (w1, w2) = match self {
            SeqHead::Parallel => {
                return Ok(Step {
                    prev_embedding: None,
                    bias: None,
                });
            }
            SeqHead::Markov { w1, w2, .. }
            | SeqHead::Gated { w1, w2, .. }
            | SeqHead::Rnn { w1, w2, .. } => (w1, w2),
        };
        let dev = h.device();
        let e = w1.index_select(&Tensor::new(prev, dev)?, 0)?;
        if let SeqHead::Markov {
            memo: Some(memo), ..
        } = self
        {
            let bias = memo.rows(prev, |miss| {
                let pre = w1.index_select(&Tensor::new(miss, dev)?, 0)?;
                Ok(w2.forward(&pre)?.flatten_all()?.to_vec1()?)
            })?;
            return Ok(Step {
                prev_embedding: Some(e),
                bias: Some(bias),
            });
        }
        let pre = match self {
            SeqHead::Rnn { proj, .. } => {
                let r = e.dim(1)?;
                let s = match state.take() {
                    Some(s) => s,
                    None => e.zeros_like()?,
                };
                let h_k = h.index_select(&Tensor::new(rows, dev)?, 0)?;
                let gco = proj.forward(&Tensor::cat(&[&s, &e, &h_k], 1)?)?;
                let g = candle_nn::ops::sigmoid(&gco.narrow(1, 0, r)?)?;
                let c = gco.narrow(1, r, r)?.tanh()?;
                *state = Some(((&g * &s)? + (g.affine(-1.0, 1.0)? * c)?)?);
                gco.narrow(1, 2 * r, r)?.tanh()?
            }
            SeqHead::Gated { gate, .. } => {
                let h_k = h.index_select(&Tensor::new(rows, dev)?, 0)?;
                let g = candle_nn::ops::sigmoid(&gate.forward(&Tensor::cat(&[&h_k, &e], 1)?)?)?;
                (g * &e)?
            }
            _ => e.clone(),
        };
        let bias = w2.forward(&pre)?.flatten_all()?.to_vec1()?;
        Ok(Step {
            prev_embedding: Some(e),
            bias: Some(bias),
        })
    }
}

/// The Markov head's bias `B_k = W2 · W1[x_{k-1}]` depends on the previous token alone, so
/// each W1 row's is computed once and remembered (up to [`BiasMemo::BYTES`]; then the memo
/// starts over): a drafted token then costs a lookup instead of a `[V_draft, r]` matmul
/// (frequent tokens recur within a block and across requests).
pub(super) struct BiasMemo {
    width: usize,
    rows: std::sync::Mutex<std::collections::HashMap<u32, Vec<f32>>>,
}

impl BiasMemo {
    /// Bytes of remembered rows at most.
    pub const BYTES: usize = 32 << 20;

    fn new(width: usize) -> Self {
        Self {
            width,
            rows: Default::default(),
        }
    }

    /// Rows `W2 · W1[r]` for every `r` of `prev`, back to back; `compute(misses)` gives the
    /// rows not yet remembered (each once, in order of first appearance).
    fn rows(
        &self,
        prev: &[u32],
        compute: impl FnOnce(&[u32]) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let misses = |rows: &std::collections::HashMap<u32, Vec<f32>>| {
            let mut miss: Vec<u32> = Vec::new();
            for &r in prev {
                if !rows.contains_key(&r) && !miss.contains(&r) {
                    miss.push(r);
                }
            }
            miss
        };
        let mut miss = misses(&rows);
        let cap = (Self::BYTES / (4 * self.width.max(1))).max(prev.len());
        if !miss.is_empty() && rows.len() + miss.len() > cap {
            rows.clear();
            miss = misses(&rows);
        }
        if !miss.is_empty() {
            let fresh = compute(&miss)?;
            anyhow::ensure!(
                fresh.len() == miss.len() * self.width,
                "Markov bias: {} values for {} rows of {}",
                fresh.len(),
                miss.len(),
                self.width
            );
            for (&r, v) in miss.iter().zip(fresh.chunks_exact(self.width)) {
                rows.insert(r, v.to_vec());
            }
        }
        let mut out = Vec::with_capacity(prev.len() * self.width);
        for r in prev {
            out.extend_from_slice(&rows[r]);
        }
        Ok(out)
    }
}

/// `c_k = sigmoid(w_h . h_k + w_e . W1[x_{k-1}] + b)`; `w_e` is absent for the parallel head.
pub(super) struct ConfidenceHead {
    /// `[hidden, 1]`.
    w_h: Tensor,
    /// `[r, 1]`.
    w_e: Option<Tensor>,
    pub bias: f32,
}

impl ConfidenceHead {
    pub fn new(params: &BTreeMap<String, Tensor>, hidden: usize) -> Result<Self> {
        let w = &params[CONF_W];
        let rest = w.dim(1)? - hidden;
        Ok(Self {
            w_h: w.narrow(1, 0, hidden)?.t()?.contiguous()?,
            w_e: (rest > 0)
                .then(|| w.narrow(1, hidden, rest)?.t()?.contiguous())
                .transpose()?,
            bias: params[CONF_B].to_vec1::<f32>()?[0],
        })
    }

    /// `w_h . h` for every row of `h` `[rows, hidden]`.
    pub fn hidden_part(&self, h: &Tensor) -> Result<Vec<f32>> {
        Ok(h.matmul(&self.w_h)?.flatten_all()?.to_vec1()?)
    }

    /// `w_e . e` for every row of `e = W1[x_{k-1}]` `[B, r]` (None without `w_e`).
    pub fn prev_part(&self, e: &Tensor) -> Result<Option<Vec<f32>>> {
        self.w_e
            .as_ref()
            .map(|w| Ok(e.matmul(w)?.flatten_all()?.to_vec1()?))
            .transpose()
    }
}

/// Confidence without a trained head: the logit of token `x`'s probability under the raw
/// (temperature 1, unfiltered) softmax of `logits`.
pub(super) fn raw_logit(logits: &[f32], x: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let lp = logits[x as usize] - lse;
    lp - (-lp.exp()).ln_1p()
}

#[cfg(test)]
mod tests {
    use super::BiasMemo;
    use std::cell::RefCell;

    /// A row's values: its id, then its id + 1, ...
    fn row(r: u32, width: usize) -> Vec<f32> {
        (0..width).map(|i| (r as usize + i) as f32).collect()
    }

    #[test]
    fn bias_memo_computes_each_row_once_and_returns_rows_in_order() {
        let width = 4;
        let memo = BiasMemo::new(width);
        let asked = RefCell::new(Vec::new());
        let compute = |miss: &[u32]| {
            asked.borrow_mut().push(miss.to_vec());
            Ok(miss.iter().flat_map(|&r| row(r, width)).collect())
        };
        let want =
            |prev: &[u32]| -> Vec<f32> { prev.iter().flat_map(|&r| row(r, width)).collect() };
        assert_eq!(memo.rows(&[5, 7, 5], compute).unwrap(), want(&[5, 7, 5]));
        assert_eq!(memo.rows(&[7, 9], compute).unwrap(), want(&[7, 9]));
        assert_eq!(memo.rows(&[9, 5, 7], compute).unwrap(), want(&[9, 5, 7]));
        // Each row once, in order of first appearance; nothing asked when all are known.
        assert_eq!(*asked.borrow(), vec![vec![5, 7], vec![9]]);
        // A compute that returns the wrong amount is an error, not a misread.
        assert!(memo.rows(&[11], |_| Ok(vec![0.0; 3])).is_err());
    }

    #[test]
    fn a_full_bias_memo_starts_over_and_still_returns_every_row() {
        // Room for 2 rows: a third clears it; rows asked together are all returned.
        let width = BiasMemo::BYTES / 4 / 2;
        let memo = BiasMemo::new(width);
        let n = RefCell::new(0);
        let compute = |miss: &[u32]| {
            *n.borrow_mut() += miss.len();
            Ok(miss.iter().flat_map(|&r| row(r, width)).collect())
        };
        for prev in [vec![1u32, 2], vec![2, 3], vec![1, 2, 3], vec![3]] {
            let got = memo.rows(&prev, compute).unwrap();
            let want: Vec<f32> = prev.iter().flat_map(|&r| row(r, width)).collect();
            assert_eq!(got, want, "{prev:?}");
        }
        // 1 and 2; then 3 does not fit (cleared: 2 and 3 again); then 1 (three rows asked
        // together may all stay); then 3 is known.
        assert_eq!(*n.borrow(), 2 + 2 + 1);
    }
}
