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
    pub fn use_cpu_kernels(&mut self, params: &BTreeMap<String, Tensor>) -> Result<()> {
        match self {
            SeqHead::Parallel => {}
            SeqHead::Markov { w2, .. } | SeqHead::Gated { w2, .. } | SeqHead::Rnn { w2, .. } => {
                *w2 = super::q8_linear(&params[W2])?;
            }
        }
        Ok(())
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
            SeqHead::Markov { w1, w2 }
            | SeqHead::Gated { w1, w2, .. }
            | SeqHead::Rnn { w1, w2, .. } => (w1, w2),
        };
        let dev = h.device();
        let e = w1.index_select(&Tensor::new(prev, dev)?, 0)?;
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
