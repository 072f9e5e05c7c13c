//! The DSpark drafter: a parallel block drafter with a sequential head and a
//! calibrated confidence head, as a model of its own next to the target.
//!
//! Equations implemented (numbering of `shared/method.md`, "Drafter: semi-autoregressive
//! generation" and "Sequential Temperature Scaling"):
//! - target features: `c_t = RMSNorm(fc([f_{id_1}(t); ..; f_{id_L}(t)]))`, where `f_id` is the
//!   OUTPUT of target layer `id` (`hidden_states[id + 1]` in Hugging Face terms) and by default
//!   `id_i = round(1 + i (N - 4) / (L - 1))`, L = 3 ([`default_target_layers`]);
//! - KV injection: in every drafter layer the block `[x_0, MASK x (gamma - 1)]` at absolute
//!   positions `anchor_pos..anchor_pos + gamma` is the only query; keys/values are
//!   `[k_proj(c_{<anchor}); k_proj(block)]` (same projections, q/k norms, RoPE), attended
//!   bidirectionally. The context part lives in the drafter's own paged [`KvCache`]
//!   ([`DSparkDrafter::append_context`]);
//! - parallel logits `U_k = lm_head(h_k)`, `h_k = RMSNorm(drafter output at block position k)`,
//!   with the TARGET's embedding and LM head (frozen, not stored; a DeepSpec checkpoint's
//!   stored copies are used when it has them, [`DSparkConfig::own_embeddings`]);
//! - sequential head, left to right from `x_0 = anchor`:
//!   Markov `B_k = W2 W1[x_{k-1}]`; gated Markov (DeepSpec)
//!   `B_k = W2 (sigmoid(G [h_k; W1[x_{k-1}]] + g) * W1[x_{k-1}])`; RNN `[g, c, o] = Linear([s_{k-1}; W1[x_{k-1}]; h_k])`,
//!   `s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)`, `B_k = W2 tanh(o)`, `s_0 = 0`;
//!   parallel (DFlash baseline) `B_k = 0`; `q_k = softmax(U_k + B_k)` as processed by the
//!   request's sampling parameters ([`target_probs`]), `x_k ~ q_k`;
//! - confidence `c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b)` (`w . h_k` alone for the parallel
//!   head, which has no `W1`), then STS `c_k <- sigmoid(logit(c_k) / T_k)`.
//!
//! A reduced draft vocabulary (EAGLE-3 style) restricts `U_k`, `W2` and sampling to a list of
//! target ids; `q_k` is still returned over the full target vocabulary (zero outside), so
//! verification stays exact.
//!
//! Checkpoints are folders with `config.json` ([`DSparkConfig`]) and `model.safetensors`
//! (tensor names of the reference implementations, stored in bf16/f16/f32, computed in f32);
//! DeepSpec DSpark and z-lab DFlash folders load unchanged too ([`layout`]).
//!
//! Files by role: `config` (the checkpoint's config and its checks), `params` (every
//! tensor's name, shape and initialisation), `weights` (building, loading, saving,
//! converting), `forward` (the context cache and the parallel backbone), `head` (the
//! sequential and confidence heads), `propose` (draft blocks: the sequential head left to
//! right, request parameters, grammars, STS), `layout` (the downloaded layouts); this file
//! holds the drafter itself and the small numeric helpers they share.

mod config;
mod forward;
mod head;
pub mod layout;
mod params;
mod propose;
#[cfg(test)]
mod tests;
mod weights;

pub use layout::Layout;

use crate::kv::KvCache;
use crate::model::attention::{AttnBatch, AttnSeq, PagedAttention};
use crate::model::ops::rms_norm;
use crate::model::Linear;
use crate::model::{Model, ModelConfig};
use crate::sampling::{edit_logits, target_probs, Dist, History, SamplingParams};
use crate::speculative::recalibrate::OnlineCalibration;
pub use crate::speculative::Proposal;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use head::{ConfidenceHead, SeqHead};
/// Checkpoint names of the sequential and confidence heads' tensors.
pub use head::{CONF_B, CONF_W, RNN_B, RNN_W, W1, W2};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

const CONFIG_FILE: &str = "config.json";
const WEIGHTS_FILE: &str = "model.safetensors";
/// The drafter's own copies of the target's embedding and LM head ([`DSparkConfig::own_embeddings`]).
pub const EMBED: &str = "embed_tokens.weight";
pub const LM_HEAD: &str = "lm_head.weight";

use config::{check_offsets, check_sts, default_num_layers, default_rank};
pub use config::{default_target_layers, DSparkConfig, HeadKind};
pub use forward::ContextFeed;
pub use params::param_shapes;
use params::{param_specs, Init};
pub use propose::{BlockTrace, DraftRequest, ProposeOptions};

/// One Qwen3-style drafter layer (q/k norms, SiLU MLP): dense f32, or quantised
/// ([`DrafterWeights`]) on the CPU kernels after [`DSparkDrafter::use_cpu_kernels`].
struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Tensor,
    k_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A DSpark drafter bound to one target: it borrows the target's embedding and LM head at
/// every call and keeps its own paged context cache ([`DSparkDrafter::new_cache`]).
pub struct DSparkDrafter {
    cfg: DSparkConfig,
    /// Every parameter by checkpoint name (f32), for `save`.
    params: BTreeMap<String, Tensor>,
    /// dtype `save` writes (the dtype the weights came in).
    store_dtype: DType,
    fc: Linear,
    hidden_norm: Tensor,
    norm: Tensor,
    layers: Vec<Layer>,
    seq_head: SeqHead,
    confidence: Option<ConfidenceHead>,
    /// `[1, hidden]` input of the mask positions.
    mask_row: Tensor,
    /// Rows of the target's LM head for `draft_vocab` (None: the full head).
    draft_lm_head: Option<crate::model::Linear>,
    /// The checkpoint's own embedding `[V, hidden]` and LM head ([`DSparkConfig::own_embeddings`]).
    own_embed: Option<Tensor>,
    own_lm_head: Option<Linear>,
    /// `W1` row per target id with `compact_w1` ([`DSparkConfig::w1_index`]).
    w1_index: Option<Vec<u32>>,
    rope_cos: Tensor,
    rope_sin: Tensor,
    eps: f32,
    device: Device,
    /// `draft_vocab` with its reverse index: draft distributions stay on it ([`Dist::Sparse`]).
    sub_vocab: Option<Arc<crate::sampling::SubVocab>>,
    /// Calls of [`DSparkDrafter::append_contexts`] and [`DSparkDrafter::propose_with`]
    /// (the step loop's promise: a step that drafts nothing makes none).
    calls: std::sync::atomic::AtomicU64,
}

/// The target's embedding table and LM head as dense f32 `[V, hidden]` matrices.
fn target_embeddings(target: &Model) -> Result<(Tensor, Tensor)> {
    let dev = &target.device;
    let v = target.cfg.vocab_size as u32;
    let ids: Vec<u32> = (0..v).collect();
    let embed = target.embed(&Tensor::new(ids.as_slice(), dev)?)?;
    let eye = Tensor::eye(target.cfg.hidden_size, DType::F32, dev)?;
    // lm_head(I) = W^T.
    let lm_head = target.weights.lm_head.forward(&eye)?.t()?.contiguous()?;
    Ok((embed.to_dtype(DType::F32)?, lm_head))
}

/// Rows `rows` of a (possibly quantized) matrix; quantized rows are whole blocks, so this is a
/// byte copy.
fn select_rows(m: &QMatMul, rows: &[u32]) -> Result<QMatMul> {
    Ok(match m {
        QMatMul::QTensor(q) => {
            let (_, cols) = q.shape().dims2()?;
            let dt = q.dtype();
            let row_bytes = cols / dt.block_size() * dt.type_size();
            let data = q.data()?;
            let mut out = Vec::with_capacity(rows.len() * row_bytes);
            for &r in rows {
                let r = r as usize;
                out.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
            }
            let storage = QStorage::from_data(Cow::Owned(out), &q.device(), dt)?;
            QMatMul::from_qtensor(QTensor::new(storage, (rows.len(), cols))?)?
        }
        QMatMul::Tensor(t) => QMatMul::Tensor(t.index_select(&Tensor::new(rows, t.device())?, 0)?),
        QMatMul::TensorF16(t) => {
            QMatMul::TensorF16(t.index_select(&Tensor::new(rows, t.device())?, 0)?)
        }
    })
}

/// Half-split RoPE on `[T, heads, head_dim]` with per-row `cos`/`sin` `[T, head_dim / 2]`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(crate::model::ops::rope_thd(x, cos, sin)?)
}

/// The weight format of a drafter's matrices on the CPU kernels
/// ([`DSparkDrafter::use_cpu_kernels`]): the backbone (`fc` and every layer), the sequential
/// head's `W2` and a checkpoint's own LM head. The draft-vocabulary rows of the target's LM
/// head keep the target's own format.
///
/// Q4_0 is the default: a draft call streams its weights from memory after every target
/// forward has streamed the target's, so halving the bytes is what makes it cheaper (the
/// 1-layer backbone is ~4.6 M weights: 2.6 MB in Q4_0, 4.9 MB in Q8_0). Drafts change by
/// the rounding only; verification keeps the output exact either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DrafterWeights {
    #[default]
    Q4_0,
    Q8_0,
}

impl DrafterWeights {
    /// The environment variable that overrides the default (an A/B switch for benchmarks).
    pub const ENV: &'static str = "DSPARK_DRAFTER_WEIGHTS";

    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q4_0" => Ok(Self::Q4_0),
            "q8_0" => Ok(Self::Q8_0),
            other => bail!("unknown drafter weight format '{other}'; use q4_0 or q8_0"),
        }
    }

    /// [`Self::ENV`] when set (an unknown value is an error, not a silent default), else Q4_0.
    pub fn from_env() -> Result<Self> {
        match std::env::var(Self::ENV) {
            Ok(v) => Self::parse(&v).with_context(|| format!("{}={v}", Self::ENV)),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(e) => bail!("{}: {e}", Self::ENV),
        }
    }

    fn ggml(self) -> candle_core::quantized::GgmlDType {
        match self {
            Self::Q4_0 => candle_core::quantized::GgmlDType::Q4_0,
            Self::Q8_0 => candle_core::quantized::GgmlDType::Q8_0,
        }
    }
}

/// `w` `[n, k]` quantised to `format` for the CPU kernels (dense when `k` is not a whole
/// number of 32-blocks).
fn kernel_linear(w: &Tensor, format: DrafterWeights) -> Result<Linear> {
    let (_, k) = w.dims2()?;
    if !k.is_multiple_of(32) {
        return Ok(Linear::dense(w.clone()));
    }
    Ok(Linear::from_qtensor(QTensor::quantize(w, format.ggml())?)?)
}

fn sigmoid(z: f32) -> f32 {
    // Kept strictly inside (0, 1) so that logit(c) and log(c) stay finite downstream.
    (1.0 / (1.0 + (-z).exp())).clamp(f32::MIN_POSITIVE, 1.0 - f32::EPSILON / 2.0)
}

impl DSparkDrafter {
    pub fn config(&self) -> &DSparkConfig {
        &self.cfg
    }

    /// Context feeds and drafts run so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets what the sequential head remembers between calls (the Markov bias rows), so
    /// the next call costs what a call on unseen tokens costs: `profile` prices drafting
    /// that way (an upper bound; serving repeats frequent tokens and is cheaper).
    pub fn forget_memos(&self) {
        self.seq_head.forget_memos();
    }

    fn count_call(&self) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Target layers whose outputs the drafter consumes, ascending (pass them as the target
    /// forward's `hidden_layers`).
    pub fn target_layers(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    /// Sets (or clears) the per-position STS temperatures for sampled requests (and greedy
    /// ones without their own), e.g. after calibration.
    pub fn set_sts_temperatures(&mut self, temps: Option<Vec<f32>>) -> Result<()> {
        check_sts(self.cfg.block_size, temps.as_deref()).map_err(anyhow::Error::msg)?;
        self.cfg.sts_temperatures = temps;
        Ok(())
    }

    /// Sets (or clears) the per-position logit offsets of sampled requests.
    pub fn set_sts_offsets(&mut self, offsets: Option<Vec<f32>>) -> Result<()> {
        check_offsets(self.cfg.block_size, offsets.as_deref()).map_err(anyhow::Error::msg)?;
        self.cfg.sts_offsets = offsets;
        Ok(())
    }

    /// Sets (or clears) the per-position calibration of greedy requests: temperatures and
    /// logit offsets.
    pub fn set_sts_greedy(
        &mut self,
        temps: Option<Vec<f32>>,
        offsets: Option<Vec<f32>>,
    ) -> Result<()> {
        check_sts(self.cfg.block_size, temps.as_deref()).map_err(anyhow::Error::msg)?;
        check_offsets(self.cfg.block_size, offsets.as_deref()).map_err(anyhow::Error::msg)?;
        self.cfg.sts_temperatures_greedy = temps;
        self.cfg.sts_offsets_greedy = offsets;
        Ok(())
    }
}
