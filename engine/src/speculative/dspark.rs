//! The DSpark drafter (issue #4): a parallel block drafter with a sequential head and a
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

mod head;
pub mod layout;
#[cfg(test)]
mod tests;

pub use layout::Layout;

use crate::kv::KvCache;
use crate::model::attention::{AttnSeq, PagedAttention};
use crate::model::Linear;
use crate::model::{Model, ModelConfig};
use crate::sampling::{edit_logits, target_probs, Dist, History, SamplingParams};
use crate::speculative::recalibrate::OnlineCalibration;
pub use crate::speculative::Proposal;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::ops::rms_norm;
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

/// The sequential stage on top of the parallel backbone (`markov_head_type` in configs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HeadKind {
    /// No sequential head: the DFlash-style parallel baseline.
    #[serde(rename = "none")]
    Parallel,
    #[serde(rename = "markov")]
    Markov,
    /// DeepSpec's gated Markov head: `B_k = W2 (sigmoid(G [h_k; W1[x_{k-1}]] + g) * W1[x_{k-1}])`.
    #[serde(rename = "gated")]
    Gated,
    #[serde(rename = "rnn")]
    Rnn,
}

/// `config.json` of a DSpark drafter: copies of the target's dimensions plus the drafter's own
/// settings. Unknown fields (the rest of a copied target config) are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DSparkConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Drafter layers.
    #[serde(default = "default_num_layers")]
    pub num_hidden_layers: usize,
    /// gamma: block length, the most draft tokens one block yields.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Token id of the mask inputs; ids `>= vocab_size` use the drafter's own `mask_embedding`.
    pub mask_token_id: u32,
    /// 0-based target layers whose outputs feed `fc`, ascending. Empty in a file means the
    /// default spread ([`default_target_layers`] with L = 3).
    #[serde(default)]
    pub target_layer_ids: Vec<usize>,
    /// Rank r of `W1`/`W2` (Markov and RNN heads).
    #[serde(default = "default_rank")]
    pub markov_rank: usize,
    #[serde(default = "default_head")]
    pub markov_head_type: HeadKind,
    /// Without a confidence head, a draft token's confidence is its probability under the raw
    /// (temperature 1, unfiltered) softmax of the drafter's logits.
    #[serde(default = "default_true")]
    pub enable_confidence_head: bool,
    /// The confidence head also reads `W1[x_{k-1}]` (DeepSpec's `confidence_head_with_markov`);
    /// false: `c_k = sigmoid(w . h_k + b)`. Ignored for the parallel head (it has no `W1`).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub confidence_head_with_markov: bool,
    /// The anchor row's output is not a draft (z-lab DFlash): the block has `block_size + 1`
    /// input rows `[x_0, MASK x block_size]` and draft k comes from row k (k = 1..).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skip_anchor_row: bool,
    /// The backbone always runs the whole block (as the reference implementations do), even
    /// when fewer draft tokens are wanted: drafts do not depend on the requested length.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub full_block: bool,
    /// The checkpoint carries its own `embed_tokens.weight` and `lm_head.weight` (DeepSpec
    /// stores copies of the target's) and the drafter uses them instead of the target's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_embeddings: bool,
    /// Adds the last context feature `c_{a-1}` (the target's state one position before the
    /// anchor, after `fc` and `hidden_norm`) to the input of every block row, EAGLE-style, on
    /// top of the KV injection. Not in the DFlash/DSpark reference (a 1-layer backbone finds
    /// that row by attention only approximately); no extra parameters.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub context_input: bool,
    /// Per-position STS temperatures `T_k`, `block_size` of them, fitted against sampled
    /// (temperature 1) acceptance; used for sampled requests, and for greedy ones when
    /// `sts_temperatures_greedy` is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sts_temperatures: Option<Vec<f32>>,
    /// Per-position logit offsets `b_k` of the sampled calibration:
    /// `c_k = sigmoid(z_k / T_k + b_k)` (absent: 0, the paper's STS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sts_offsets: Option<Vec<f32>>,
    /// Per-position STS temperatures fitted against greedy acceptance (argmax match), used
    /// for greedy requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sts_temperatures_greedy: Option<Vec<f32>>,
    /// Per-position logit offsets `b_k` of the greedy calibration:
    /// `c_k = sigmoid(z_k / T_k + b_k)` (absent: 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sts_offsets_greedy: Option<Vec<f32>>,
    /// Reduced draft vocabulary: target ids the draft LM head (and `W2`) cover, in row order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_vocab: Option<Vec<u32>>,
    /// `W1` holds one row per `draft_vocab` id plus a last row shared by every other target
    /// token, so the head grows with the draft vocabulary, not the target's. Only the
    /// anchor `x_0` can be such a token (later `x_{k-1}` are drafted). Written by
    /// `dspark-engine convert --compact-w1`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compact_w1: bool,
}

fn default_num_layers() -> usize {
    1
}
fn default_block_size() -> usize {
    7
}
fn default_rank() -> usize {
    256
}
fn default_head() -> HeadKind {
    HeadKind::Markov
}
fn default_true() -> bool {
    true
}
fn is_true(b: &bool) -> bool {
    *b
}

/// `count` target layers spread evenly over `num_target_layers`:
/// `id_i = round(1 + i (N - 4) / (count - 1))`, clamped to the model and deduplicated (targets
/// under 4 layers get fewer ids).
pub fn default_target_layers(num_target_layers: usize, count: usize) -> Vec<usize> {
    let n = num_target_layers as f64;
    let span = count.saturating_sub(1).max(1) as f64;
    let mut ids: Vec<usize> = (0..count)
        .map(|i| {
            (1.0 + i as f64 * (n - 4.0) / span)
                .round()
                .clamp(0.0, n - 1.0) as usize
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

impl DSparkConfig {
    /// This config with every STS calibration field cleared (the architecture alone).
    pub fn without_sts(&self) -> Self {
        Self {
            sts_temperatures: None,
            sts_offsets: None,
            sts_temperatures_greedy: None,
            sts_offsets_greedy: None,
            ..self.clone()
        }
    }

    fn seq_rank(&self) -> usize {
        match self.markov_head_type {
            HeadKind::Parallel => 0,
            HeadKind::Markov | HeadKind::Gated | HeadKind::Rnn => self.markov_rank,
        }
    }

    /// Width of the confidence head's input: `h_k`, plus `W1[x_{k-1}]` when it reads it.
    fn confidence_fan_in(&self) -> usize {
        self.hidden_size
            + if self.confidence_head_with_markov {
                self.seq_rank()
            } else {
                0
            }
    }

    /// Input rows of one block that yields `gamma` drafts ([`Self::full_block`],
    /// [`Self::skip_anchor_row`]); the drafter cache must cover `anchor_pos` plus these.
    pub fn block_rows(&self, gamma: usize) -> usize {
        let drafts = if self.full_block {
            self.block_size
        } else {
            gamma
        };
        drafts + usize::from(self.skip_anchor_row)
    }

    /// Rows of the draft LM head.
    pub fn draft_vocab_size(&self) -> usize {
        self.draft_vocab.as_ref().map_or(self.vocab_size, Vec::len)
    }

    /// Rows of `W1`.
    pub fn w1_rows(&self) -> usize {
        if self.compact_w1 {
            self.draft_vocab_size() + 1
        } else {
            self.vocab_size
        }
    }

    /// With `compact_w1`: the `W1` row of every target id (its draft-vocabulary index, or
    /// the shared last row); `None` when `W1` is indexed by target id.
    pub fn w1_index(&self) -> Option<Vec<u32>> {
        let vocab = self.draft_vocab.as_ref().filter(|_| self.compact_w1)?;
        let mut index = vec![vocab.len() as u32; self.vocab_size];
        for (row, &id) in vocab.iter().enumerate() {
            index[id as usize] = row as u32;
        }
        Some(index)
    }

    /// Whether this config fits `target`, as an error naming what does not.
    pub fn validate(&self, target: &ModelConfig) -> Result<()> {
        self.check(target)
            .map_err(|e| anyhow::anyhow!("drafter config does not fit the target: {e}"))
    }

    /// Whether this config fits `target`; the message says what does not.
    fn check(&self, target: &ModelConfig) -> std::result::Result<(), String> {
        if self.hidden_size != target.hidden_size {
            return Err(format!(
                "hidden_size {} does not match the target's {}",
                self.hidden_size, target.hidden_size
            ));
        }
        if self.vocab_size != target.vocab_size {
            return Err(format!(
                "vocab_size {} does not match the target's {}",
                self.vocab_size, target.vocab_size
            ));
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "invalid head counts: {} query heads, {} key/value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(format!("invalid head_dim {}", self.head_dim));
        }
        if self.num_hidden_layers == 0 || self.block_size == 0 || self.intermediate_size == 0 {
            return Err(
                "num_hidden_layers, block_size and intermediate_size must be positive".into(),
            );
        }
        if self.markov_head_type != HeadKind::Parallel && self.markov_rank == 0 {
            return Err("markov_rank must be positive for a markov or rnn head".into());
        }
        if self.target_layer_ids.is_empty() {
            return Err("target_layer_ids is empty".into());
        }
        if !self.target_layer_ids.windows(2).all(|w| w[0] < w[1]) {
            return Err(format!(
                "target_layer_ids {:?} must be strictly ascending",
                self.target_layer_ids
            ));
        }
        if let Some(&id) = self
            .target_layer_ids
            .iter()
            .find(|&&id| id >= target.num_layers)
        {
            return Err(format!(
                "target layer id {id} is out of range: the target has {} layers (ids 0..{})",
                target.num_layers,
                target.num_layers - 1
            ));
        }
        check_sts(self.block_size, self.sts_temperatures.as_deref())?;
        check_sts(self.block_size, self.sts_temperatures_greedy.as_deref())?;
        check_offsets(self.block_size, self.sts_offsets_greedy.as_deref())?;
        check_offsets(self.block_size, self.sts_offsets.as_deref())?;
        if let Some(vocab) = &self.draft_vocab {
            if vocab.is_empty() {
                return Err("draft_vocab is empty".into());
            }
            if let Some(&id) = vocab.iter().find(|&&id| id as usize >= self.vocab_size) {
                return Err(format!(
                    "draft_vocab id {id} is outside the target vocabulary of {}",
                    self.vocab_size
                ));
            }
            if vocab.iter().collect::<HashSet<_>>().len() != vocab.len() {
                return Err("draft_vocab has duplicate ids".into());
            }
        }
        if self.own_embeddings && self.draft_vocab.is_some() {
            return Err(
                "own_embeddings (a stored LM head) cannot be combined with draft_vocab".into(),
            );
        }
        if self.compact_w1 && self.draft_vocab.is_none() {
            return Err("compact_w1 needs a draft_vocab".into());
        }
        if self.compact_w1 && self.markov_head_type == HeadKind::Parallel {
            return Err(
                "compact_w1 needs a Markov or RNN head (the parallel head has no W1)".into(),
            );
        }
        Ok(())
    }
}

fn check_sts(block_size: usize, temps: Option<&[f32]>) -> std::result::Result<(), String> {
    match temps {
        Some(t) if t.len() != block_size => Err(format!(
            "sts_temperatures has {} entries, expected block_size = {block_size}",
            t.len()
        )),
        Some(t) if t.iter().any(|x| !x.is_finite() || *x <= 0.0) => Err(format!(
            "sts_temperatures {t:?} must be positive and finite"
        )),
        _ => Ok(()),
    }
}

fn check_offsets(block_size: usize, offsets: Option<&[f32]>) -> std::result::Result<(), String> {
    match offsets {
        Some(b) if b.len() != block_size => Err(format!(
            "sts offsets have {} entries, expected block_size = {block_size}",
            b.len()
        )),
        Some(b) if b.iter().any(|x| !x.is_finite()) => {
            Err(format!("sts offsets {b:?} must be finite"))
        }
        _ => Ok(()),
    }
}

/// One sequence's committed positions `start..start + n` for
/// [`DSparkDrafter::append_contexts`].
pub struct ContextFeed<'a> {
    /// The sequence's block table in the drafter cache, covering `start + n`.
    pub table: &'a [u32],
    pub start: usize,
    /// The target's outputs of `target_layers()` for those positions, `[n, hidden]` each.
    pub hidden: &'a [Tensor],
}

/// One request's drafting input.
pub struct DraftRequest<'a> {
    /// Last committed token `x_0`.
    pub anchor: u32,
    /// Its absolute position; the drafter context holds positions `< anchor_pos`.
    pub anchor_pos: usize,
    /// The request's block table in the DRAFTER cache, covering `anchor_pos + gamma`.
    pub block_table: &'a [u32],
    /// Draft tokens wanted, `1..=block_size`.
    pub gamma: usize,
    pub params: &'a SamplingParams,
    /// The tokens the request's penalties read (its generated tokens); `None`: the drafter
    /// ignores penalties (the verification stays lossless either way; this only helps the
    /// drafts get accepted).
    pub history: Option<&'a History>,
    pub rng: &'a mut ChaCha8Rng,
    /// The context feature of position `anchor_pos - 1` as returned by the last
    /// [`DSparkDrafter::append_context`]; required when the config has `context_input`.
    pub last_context: Option<&'a Tensor>,
}

/// Options of [`DSparkDrafter::propose_with`].
#[derive(Default, Clone, Copy)]
pub struct ProposeOptions<'a> {
    /// Stop a request's block once the running product of its confidences (its prefix
    /// survival) falls below this: later positions cannot be worth verifying. 0: draft
    /// every requested position.
    pub min_survival: f32,
    /// Online recalibration applied to each confidence as it is produced (so the early stop
    /// and the returned block see the calibrated values).
    pub calibration: Option<&'a OnlineCalibration>,
}

/// Everything one greedy block computed ([`DSparkDrafter::trace_greedy`]), per draft position
/// k: base logits `U_k` and sequential-head bias `B_k` (over the draft vocabulary; zeros for
/// the parallel head), the raw confidence logit (before sigmoid and STS; None without a
/// confidence head) and the greedy token (target id).
#[derive(Debug, Clone)]
pub struct BlockTrace {
    pub base_logits: Vec<Vec<f32>>,
    pub bias: Vec<Vec<f32>>,
    pub confidence_logits: Option<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// How a parameter is initialised by [`DSparkDrafter::random`].
enum Init {
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform(f32),
}

struct ParamSpec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

/// Every tensor a drafter with `cfg` has: checkpoint name and shape (the training code
/// builds its variables from this list, so trained weights load here unchanged).
pub fn param_shapes(cfg: &DSparkConfig) -> Vec<(String, Vec<usize>)> {
    param_specs(cfg)
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect()
}

/// Every tensor a drafter with `cfg` has, with its shape.
fn param_specs(cfg: &DSparkConfig) -> Vec<ParamSpec> {
    let (h, v, r) = (cfg.hidden_size, cfg.vocab_size, cfg.markov_rank);
    let (q_dim, kv_dim) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    );
    let mut specs = Vec::new();
    let mut add =
        |name: String, shape: Vec<usize>, init: Init| specs.push(ParamSpec { name, shape, init });
    let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f32).sqrt());
    let ctx = cfg.target_layer_ids.len() * h;
    add("fc.weight".into(), vec![h, ctx], lin(ctx));
    add("hidden_norm.weight".into(), vec![h], Init::Ones);
    add("norm.weight".into(), vec![h], Init::Ones);
    for i in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("layers.{i}.{s}.weight");
        add(p("input_layernorm"), vec![h], Init::Ones);
        add(p("post_attention_layernorm"), vec![h], Init::Ones);
        add(p("self_attn.q_proj"), vec![q_dim, h], lin(h));
        add(p("self_attn.k_proj"), vec![kv_dim, h], lin(h));
        add(p("self_attn.v_proj"), vec![kv_dim, h], lin(h));
        add(p("self_attn.o_proj"), vec![h, q_dim], lin(q_dim));
        add(p("self_attn.q_norm"), vec![cfg.head_dim], Init::Ones);
        add(p("self_attn.k_norm"), vec![cfg.head_dim], Init::Ones);
        add(p("mlp.gate_proj"), vec![cfg.intermediate_size, h], lin(h));
        add(p("mlp.up_proj"), vec![cfg.intermediate_size, h], lin(h));
        add(
            p("mlp.down_proj"),
            vec![h, cfg.intermediate_size],
            lin(cfg.intermediate_size),
        );
    }
    if cfg.markov_head_type != HeadKind::Parallel {
        add(head::W1.into(), vec![cfg.w1_rows(), r], Init::Uniform(1.0));
        add(head::W2.into(), vec![cfg.draft_vocab_size(), r], lin(r));
    }
    if cfg.markov_head_type == HeadKind::Rnn {
        add(head::RNN_W.into(), vec![3 * r, 2 * r + h], lin(2 * r + h));
        add(head::RNN_B.into(), vec![3 * r], lin(2 * r + h));
    }
    if cfg.markov_head_type == HeadKind::Gated {
        add(head::GATE_W.into(), vec![r, h + r], lin(h + r));
        add(head::GATE_B.into(), vec![r], lin(h + r));
    }
    if cfg.own_embeddings {
        add(EMBED.into(), vec![v, h], Init::Uniform(1.0));
        add(LM_HEAD.into(), vec![v, h], lin(h));
    }
    if cfg.enable_confidence_head {
        let fan_in = cfg.confidence_fan_in();
        add(head::CONF_W.into(), vec![1, fan_in], lin(fan_in));
        add(head::CONF_B.into(), vec![1], lin(fan_in));
    }
    if cfg.mask_token_id as usize >= v {
        add("mask_embedding".into(), vec![h], lin(h));
    }
    specs
}

/// One Qwen3-style drafter layer (q/k norms, SiLU MLP): dense f32, or Q8_0 on the CPU
/// kernels after [`DSparkDrafter::use_cpu_kernels`].
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

/// `w` `[n, k]` re-quantised to Q8_0 for the CPU kernels (dense when `k` is not a whole
/// number of 32-blocks).
fn q8_linear(w: &Tensor) -> Result<Linear> {
    let (_, k) = w.dims2()?;
    if !k.is_multiple_of(32) {
        return Ok(Linear::dense(w.clone()));
    }
    Ok(Linear::from_qtensor(QTensor::quantize(
        w,
        candle_core::quantized::GgmlDType::Q8_0,
    )?)?)
}

/// Scatter index writing row i into cache slot `slots[i]`.
fn slot_index(slots: &[u32], kv_dim: usize, dev: &Device) -> Result<Tensor> {
    let t = slots.len();
    Ok(Tensor::new(slots, dev)?
        .reshape((t, 1))?
        .broadcast_as((t, kv_dim))?
        .contiguous()?)
}

fn sigmoid(z: f32) -> f32 {
    // Kept strictly inside (0, 1) so that logit(c) and log(c) stay finite downstream.
    (1.0 / (1.0 + (-z).exp())).clamp(f32::MIN_POSITIVE, 1.0 - f32::EPSILON / 2.0)
}

impl DSparkDrafter {
    /// A drafter config for `target`: its dimensions, one layer, the default target layers,
    /// rank 256, a confidence head and a dedicated mask row (`mask_token_id = vocab_size`).
    pub fn default_config(target: &Model, head: HeadKind, gamma: usize) -> DSparkConfig {
        let t = &target.cfg;
        DSparkConfig {
            hidden_size: t.hidden_size,
            vocab_size: t.vocab_size,
            num_attention_heads: t.num_heads,
            num_key_value_heads: t.num_kv_heads,
            head_dim: t.head_dim,
            intermediate_size: t.intermediate_size,
            rms_norm_eps: t.rms_eps,
            rope_theta: t.rope_theta,
            num_hidden_layers: default_num_layers(),
            block_size: gamma,
            mask_token_id: t.vocab_size as u32,
            target_layer_ids: default_target_layers(t.num_layers, 3),
            markov_rank: default_rank(),
            markov_head_type: head,
            enable_confidence_head: true,
            confidence_head_with_markov: true,
            skip_anchor_row: false,
            full_block: false,
            own_embeddings: false,
            context_input: false,
            sts_temperatures: None,
            sts_offsets: None,
            sts_temperatures_greedy: None,
            sts_offsets_greedy: None,
            draft_vocab: None,
            compact_w1: false,
        }
    }

    /// A randomly initialised drafter (PyTorch-style uniform fan-in init, norms at 1),
    /// deterministic per seed. Values are bf16-exact, so `save` + `load` reproduce it bit
    /// for bit.
    pub fn random(target: &Model, cfg: DSparkConfig, seed: u64) -> Result<Self> {
        cfg.check(&target.cfg)
            .map_err(|e| anyhow::anyhow!("invalid drafter config: {e}"))?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        for spec in param_specs(&cfg) {
            let n: usize = spec.shape.iter().product();
            let data: Vec<f32> = match spec.init {
                Init::Ones => vec![1.0; n],
                Init::Uniform(b) => (0..n).map(|_| rng.random_range(-b..=b)).collect(),
            };
            let t = Tensor::from_vec(data, spec.shape, &target.device)?
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?;
            tensors.insert(spec.name, t);
        }
        Self::build(
            target,
            cfg,
            tensors,
            DType::BF16,
            Path::new("<random init>"),
        )
    }

    /// A drafter from named tensors (e.g. trained variables), checked against `cfg` and
    /// `target`; `save` writes them in `store_dtype`.
    pub fn from_tensors(
        target: &Model,
        cfg: DSparkConfig,
        tensors: HashMap<String, Tensor>,
        store_dtype: DType,
    ) -> Result<Self> {
        cfg.validate(&target.cfg)?;
        Self::build(target, cfg, tensors, store_dtype, Path::new("<tensors>"))
    }

    /// Every parameter by checkpoint name (f32).
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.params
    }

    /// Loads a drafter folder for `target`: this engine's own layout, or a DeepSpec DSpark /
    /// z-lab DFlash checkpoint as those projects save it ([`layout`]).
    pub fn load(path: &Path, target: &Model) -> Result<Self> {
        Ok(Self::load_layout(path, target)?.0)
    }

    /// The drafter config of a folder, in whichever layout, with that layout.
    pub fn read_config(path: &Path) -> Result<(Layout, DSparkConfig)> {
        let imported = Self::import_config(&path.join(CONFIG_FILE))?;
        Ok((imported.layout, imported.cfg))
    }

    fn import_config(cfg_path: &Path) -> Result<layout::Imported> {
        let text = std::fs::read_to_string(cfg_path)
            .with_context(|| format!("cannot read drafter config {}", cfg_path.display()))?;
        layout::import_config(&text)
            .with_context(|| format!("{} is not a valid drafter config", cfg_path.display()))
    }

    /// [`Self::load`], also returning the layout the folder was in.
    pub fn load_layout(path: &Path, target: &Model) -> Result<(Self, Layout)> {
        let cfg_path = path.join(CONFIG_FILE);
        let imported = Self::import_config(&cfg_path)?;
        let (kind, mut cfg) = (imported.layout, imported.cfg);
        if let Some(n) = imported.num_target_layers {
            if n != target.cfg.num_layers {
                bail!(
                    "{}: key 'num_target_layers' is {n}, expected the target's {} ({} has {} layers)",
                    cfg_path.display(),
                    target.cfg.num_layers,
                    target.id,
                    target.cfg.num_layers
                );
            }
        }
        if cfg.target_layer_ids.is_empty() {
            cfg.target_layer_ids = default_target_layers(target.cfg.num_layers, 3);
        }
        cfg.check(&target.cfg).map_err(|e| {
            anyhow::anyhow!(
                "{}: drafter does not fit target {}: {e}",
                cfg_path.display(),
                target.id
            )
        })?;
        let tensors = layout::read_weights(path, &target.device)?;
        let store_dtype = tensors.get("fc.weight").map_or(DType::BF16, |t| t.dtype());
        let tensors = layout::import_tensors(kind, &cfg, tensors)
            .with_context(|| format!("{}", path.display()))?;
        let d = Self::build(target, cfg, tensors, store_dtype, &path.join(WEIGHTS_FILE))?;
        Ok((d, kind))
    }

    /// Writes the drafter into `dir` in `layout`. The DeepSpec layout stores the embedding
    /// and LM head: the drafter's own copies, or the target's.
    pub fn save_as(&self, dir: &Path, layout: Layout, target: &Model) -> Result<()> {
        if layout == Layout::Native {
            return self.save(dir);
        }
        let embeddings = match (&self.own_embed, layout) {
            (Some(e), _) => Some((e.clone(), self.params[LM_HEAD].clone())),
            (None, Layout::DeepSpec) => Some(target_embeddings(target)?),
            _ => None,
        };
        let (cfg, tensors) = layout::export(
            layout,
            &self.cfg,
            &self.params,
            target.cfg.num_layers,
            embeddings,
        )?;
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cfg_path = dir.join(CONFIG_FILE);
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg)?)
            .with_context(|| format!("cannot write {}", cfg_path.display()))?;
        let mut out = HashMap::new();
        for (name, t) in tensors {
            out.insert(name, t.to_dtype(self.store_dtype)?);
        }
        let w_path = dir.join(WEIGHTS_FILE);
        candle_core::safetensors::save(&out, &w_path)
            .with_context(|| format!("cannot write {}", w_path.display()))
    }

    /// This drafter using the target's embedding and LM head instead of its own copies,
    /// with the largest |difference| between the copies and the target's (0 when it had none).
    pub fn without_own_embeddings(&self, target: &Model) -> Result<(Self, f32)> {
        let Some(own) = &self.own_embed else {
            return Ok((
                Self::from_tensors(
                    target,
                    self.cfg.clone(),
                    self.params
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                    self.store_dtype,
                )?,
                0.0,
            ));
        };
        let (embed, lm_head) = target_embeddings(target)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        let d = diff(own, &embed)?.max(diff(&self.params[LM_HEAD], &lm_head)?);
        let tensors = self
            .params
            .iter()
            .filter(|(k, _)| k.as_str() != EMBED && k.as_str() != LM_HEAD)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let cfg = DSparkConfig {
            own_embeddings: false,
            ..self.cfg.clone()
        };
        Ok((
            Self::from_tensors(target, cfg, tensors, self.store_dtype)?,
            d,
        ))
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if missing).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let cfg_path = dir.join(CONFIG_FILE);
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&self.cfg)?)
            .with_context(|| format!("cannot write {}", cfg_path.display()))?;
        let mut out = HashMap::new();
        for (name, t) in &self.params {
            out.insert(name.clone(), t.to_dtype(self.store_dtype)?);
        }
        let w_path = dir.join(WEIGHTS_FILE);
        candle_core::safetensors::save(&out, &w_path)
            .with_context(|| format!("cannot write {}", w_path.display()))
    }

    /// Checks every tensor against `cfg` (errors name `origin`) and assembles the drafter.
    fn build(
        target: &Model,
        cfg: DSparkConfig,
        mut tensors: HashMap<String, Tensor>,
        store_dtype: DType,
        origin: &Path,
    ) -> Result<Self> {
        let dev = target.device.clone();
        let mut params = BTreeMap::new();
        for spec in param_specs(&cfg) {
            let t = tensors
                .remove(&spec.name)
                .with_context(|| format!("{}: missing tensor '{}'", origin.display(), spec.name))?;
            if t.dims() != spec.shape.as_slice() {
                bail!(
                    "{}: tensor '{}' has shape {:?}, expected {:?} for this config and target",
                    origin.display(),
                    spec.name,
                    t.dims(),
                    spec.shape
                );
            }
            params.insert(spec.name, t.to_dtype(DType::F32)?.to_device(&dev)?);
        }
        let p = |name: &str| params[name].clone();
        let lin = |name: &str| Linear::dense(p(name));
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let n = |s: &str| format!("layers.{i}.{s}.weight");
                Layer {
                    input_norm: p(&n("input_layernorm")),
                    post_norm: p(&n("post_attention_layernorm")),
                    q: lin(&n("self_attn.q_proj")),
                    k: lin(&n("self_attn.k_proj")),
                    v: lin(&n("self_attn.v_proj")),
                    o: lin(&n("self_attn.o_proj")),
                    q_norm: p(&n("self_attn.q_norm")),
                    k_norm: p(&n("self_attn.k_norm")),
                    gate: lin(&n("mlp.gate_proj")),
                    up: lin(&n("mlp.up_proj")),
                    down: lin(&n("mlp.down_proj")),
                }
            })
            .collect();
        let seq_head = SeqHead::new(cfg.markov_head_type, &params);
        let confidence = cfg
            .enable_confidence_head
            .then(|| ConfidenceHead::new(&params, cfg.hidden_size))
            .transpose()?;
        let own_embed = cfg.own_embeddings.then(|| p(EMBED));
        let own_lm_head = cfg.own_embeddings.then(|| lin(LM_HEAD));
        let mask_row =
            if let (Some(e), true) = (&own_embed, (cfg.mask_token_id as usize) < cfg.vocab_size) {
                e.get(cfg.mask_token_id as usize)?.unsqueeze(0)?
            } else if (cfg.mask_token_id as usize) < cfg.vocab_size {
                target.embed(&Tensor::new(&[cfg.mask_token_id], &dev)?)?
            } else {
                p("mask_embedding").unsqueeze(0)?
            };
        let draft_lm_head = cfg
            .draft_vocab
            .as_ref()
            .map(|v| {
                select_rows(&target.weights.lm_head, v).map(crate::model::Linear::from_qmatmul)
            })
            .transpose()?;
        let (rope_cos, rope_sin) =
            crate::model::rope_table(cfg.rope_theta, cfg.head_dim, target.max_context(), &dev)?;
        let w1_index = cfg.w1_index();
        let sub_vocab = cfg
            .draft_vocab
            .clone()
            .map(|ids| Arc::new(crate::sampling::SubVocab::new(ids, cfg.vocab_size)));
        Ok(Self {
            sub_vocab,
            fc: lin("fc.weight"),
            hidden_norm: p("hidden_norm.weight"),
            norm: p("norm.weight"),
            eps: cfg.rms_norm_eps as f32,
            cfg,
            params,
            store_dtype,
            layers,
            seq_head,
            confidence,
            mask_row,
            draft_lm_head,
            own_embed,
            own_lm_head,
            w1_index,
            rope_cos,
            rope_sin,
            device: dev,
            calls: Default::default(),
        })
    }

    pub fn config(&self) -> &DSparkConfig {
        &self.cfg
    }

    /// Context feeds and drafts run so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count_call(&self) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Serving speed on CPU: re-quantises the backbone's matrices (fc and every layer) to
    /// Q8_0 for the engine's matmul kernels. candle's f32 matmul repacks the whole weight on
    /// every call, which made a 1-layer draft cost ~75 % of a target decode step. Drafts may
    /// change by the rounding (verification keeps the output exact); `save` still writes
    /// the original weights. No-op on other devices.
    pub fn use_cpu_kernels(&mut self) -> Result<()> {
        if !self.device.is_cpu() {
            return Ok(());
        }
        let q8 = |name: &str| q8_linear(&self.params[name]);
        self.fc = q8("fc.weight")?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let n = |s: &str| format!("layers.{i}.{s}.weight");
            l.q = q8(&n("self_attn.q_proj"))?;
            l.k = q8(&n("self_attn.k_proj"))?;
            l.v = q8(&n("self_attn.v_proj"))?;
            l.o = q8(&n("self_attn.o_proj"))?;
            l.gate = q8(&n("mlp.gate_proj"))?;
            l.up = q8(&n("mlp.up_proj"))?;
            l.down = q8(&n("mlp.down_proj"))?;
        }
        if self.own_lm_head.is_some() {
            self.own_lm_head = Some(q8(LM_HEAD)?);
        }
        self.seq_head.use_cpu_kernels(&self.params)?;
        Ok(())
    }

    /// Target layers whose outputs the drafter consumes, ascending (pass them as the target
    /// forward's `hidden_layers`).
    pub fn target_layers(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    /// This drafter with `compact_w1` ([`DSparkConfig::compact_w1`]): `W1`'s rows of the
    /// draft vocabulary, then one shared row for every other target token, set to the mean
    /// of their rows. Drafts only change when the anchor is outside the draft vocabulary.
    pub fn compact_w1(&self, target: &Model) -> Result<Self> {
        let Some(vocab) = self.cfg.draft_vocab.as_ref() else {
            bail!("compact W1 needs a drafter with a reduced draft vocabulary (draft_vocab)");
        };
        if self.cfg.markov_head_type == HeadKind::Parallel {
            bail!("compact W1 needs a Markov or RNN head; the parallel head has no W1");
        }
        if self.cfg.compact_w1 {
            bail!("this drafter's W1 is already compact");
        }
        let w1 = &self.params[head::W1];
        let dev = w1.device();
        let in_vocab: HashSet<u32> = vocab.iter().copied().collect();
        let others: Vec<u32> = (0..self.cfg.vocab_size as u32)
            .filter(|t| !in_vocab.contains(t))
            .collect();
        let kept = w1.index_select(&Tensor::new(vocab.as_slice(), dev)?, 0)?;
        let shared = if others.is_empty() {
            kept.mean_keepdim(0)?
        } else {
            w1.index_select(&Tensor::new(others.as_slice(), dev)?, 0)?
                .mean_keepdim(0)?
        };
        let mut tensors: HashMap<String, Tensor> = self
            .params
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        tensors.insert(head::W1.into(), Tensor::cat(&[&kept, &shared], 0)?);
        let cfg = DSparkConfig {
            compact_w1: true,
            ..self.cfg.clone()
        };
        Self::from_tensors(target, cfg, tensors, self.store_dtype)
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

    /// Position `k`'s calibration `(T_k, b_k)` for a request in this decoding mode.
    fn sts_for(&self, greedy: bool, k: usize) -> (f32, f32) {
        let c = &self.cfg;
        match (greedy, &c.sts_temperatures_greedy) {
            (true, Some(t)) => (t[k], c.sts_offsets_greedy.as_ref().map_or(0.0, |b| b[k])),
            _ => (
                c.sts_temperatures.as_ref().map_or(1.0, |t| t[k]),
                c.sts_offsets.as_ref().map_or(0.0, |b| b[k]),
            ),
        }
    }

    fn kv_dim(&self) -> usize {
        self.cfg.num_key_value_heads * self.cfg.head_dim
    }

    /// The drafter's own context KV cache (one layer per drafter layer).
    pub fn new_cache(
        &self,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<KvCache> {
        KvCache::new(
            self.layers.len(),
            self.kv_dim(),
            budget_bytes,
            block_size,
            device,
        )
    }

    fn check_cache(&self, kv: &KvCache) -> Result<()> {
        if kv.k.len() != self.layers.len() || kv.kv_dim() != self.kv_dim() {
            bail!(
                "KV cache has {} layers of width {}, the drafter needs {} of width {} (use DSparkDrafter::new_cache)",
                kv.k.len(),
                kv.kv_dim(),
                self.layers.len(),
                self.kv_dim()
            );
        }
        Ok(())
    }

    /// RoPE rows for absolute positions.
    fn rope_at(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let max = self.rope_cos.dim(0)?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= max) {
            bail!("position {p} exceeds the drafter's context of {max}");
        }
        let pos = Tensor::new(positions, &self.device)?;
        Ok((
            self.rope_cos.index_select(&pos, 0)?,
            self.rope_sin.index_select(&pos, 0)?,
        ))
    }

    /// Keys (k_norm, RoPE) and values of `x` `[T, hidden]` for layer `l`, each `[T, kv_dim]`.
    fn key_values(
        &self,
        l: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let t = x.dim(0)?;
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim);
        let k = rms_norm(&l.k.forward(x)?.reshape((t, nkv, hd))?, &l.k_norm, self.eps)?;
        let k = rope(&k, cos, sin)?.reshape((t, nkv * hd))?;
        Ok((k, l.v.forward(x)?.contiguous()?))
    }

    /// Context features of committed tokens at positions `[start, start + n)`: `hidden[i]` is
    /// the target's output of `target_layers()[i]` for those tokens (`[n, hidden]` each).
    /// Computes `hidden_norm(fc(concat))` and writes every drafter layer's keys/values into
    /// the slots of `table` (which must cover `start + n`). With `context_input`, returns the
    /// feature of the last position (`[hidden]`) for the next [`DraftRequest::last_context`].
    pub fn append_context(
        &self,
        kv: &mut KvCache,
        table: &[u32],
        start: usize,
        hidden: &[Tensor],
    ) -> Result<Option<Tensor>> {
        let feed = ContextFeed {
            table,
            start,
            hidden,
        };
        Ok(self.append_contexts(kv, &[feed])?.pop().flatten())
    }

    /// [`Self::append_context`] for several sequences in one batched pass (one `fc`, one
    /// projection per layer and one cache write for all their rows): the engine feeds every
    /// sequence that is about to draft this way. Returns each feed's last context feature
    /// (`None` for an empty feed or without `context_input`), in input order.
    pub fn append_contexts(
        &self,
        kv: &mut KvCache,
        feeds: &[ContextFeed<'_>],
    ) -> Result<Vec<Option<Tensor>>> {
        self.count_call();
        self.check_cache(kv)?;
        let layers = self.cfg.target_layer_ids.len();
        let mut positions: Vec<u32> = Vec::new();
        let mut slots: Vec<u32> = Vec::new();
        let mut rows: Vec<Vec<&Tensor>> = vec![Vec::new(); layers];
        let mut last_row: Vec<Option<usize>> = Vec::with_capacity(feeds.len());
        for f in feeds {
            if f.hidden.len() != layers {
                bail!(
                    "append_context got {} hidden-state tensors, the drafter uses {layers} target layers",
                    f.hidden.len()
                );
            }
            let n = f.hidden[0].dim(0)?;
            for h in f.hidden {
                if h.dims() != [n, self.cfg.hidden_size] {
                    bail!(
                        "append_context: hidden states of shape {:?}, expected [{n}, {}]",
                        h.dims(),
                        self.cfg.hidden_size
                    );
                }
            }
            if n == 0 {
                last_row.push(None);
                continue;
            }
            if f.table.len() * kv.block_size < f.start + n {
                bail!(
                    "append_context: block table of {} blocks does not cover position {}",
                    f.table.len(),
                    f.start + n - 1
                );
            }
            positions.extend((f.start..f.start + n).map(|p| p as u32));
            slots.extend((f.start..f.start + n).map(|p| kv.slot(f.table, p) as u32));
            for (li, h) in f.hidden.iter().enumerate() {
                rows[li].push(h);
            }
            last_row.push(Some(positions.len() - 1));
        }
        if positions.is_empty() {
            return Ok(vec![None; feeds.len()]);
        }
        let (cos, sin) = self.rope_at(&positions)?;
        let idx = slot_index(&slots, self.kv_dim(), &self.device)?;
        let per_layer: Vec<Tensor> = rows
            .iter()
            .map(|r| Tensor::cat(r, 0))
            .collect::<candle_core::Result<_>>()?;
        let ctx = self.fc.forward(&Tensor::cat(&per_layer, 1)?)?;
        let ctx = rms_norm(&ctx, &self.hidden_norm, self.eps)?;
        for (li, l) in self.layers.iter().enumerate() {
            let (k, v) = self.key_values(l, &ctx, &cos, &sin)?;
            kv.write(li, &idx, &k, &v)?;
        }
        last_row
            .into_iter()
            .map(|r| match r {
                Some(r) if self.cfg.context_input => Ok(Some(ctx.get(r)?)),
                _ => Ok(None),
            })
            .collect()
    }

    /// Embeddings of `ids`: the checkpoint's own table when it has one, else the target's.
    fn embed(&self, target: &Model, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, &self.device)?;
        Ok(match &self.own_embed {
            Some(e) => e.index_select(&ids, 0)?,
            None => target.embed(&ids)?,
        })
    }

    /// The LM head of the drafts: the checkpoint's own, the draft-vocabulary rows of the
    /// target's, or the target's.
    fn lm_logits(&self, target: &Model, h: &Tensor) -> Result<Tensor> {
        Ok(match (&self.own_lm_head, &self.draft_lm_head) {
            (Some(l), _) => l.forward(h)?,
            (None, Some(l)) => l.forward(h)?,
            (None, None) => target.weights.lm_head.forward(h)?,
        })
    }

    /// The parallel backbone over all requests' blocks in one batched forward: returns the
    /// normed block outputs `h` `[rows, hidden]` (each request's `block_rows(gamma)` rows,
    /// in request order) and the row of each request's first draft. Writes the blocks'
    /// keys/values into the cache at `anchor_pos..anchor_pos + block_rows(gamma)`.
    fn backbone(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &[DraftRequest<'_>],
    ) -> Result<(Tensor, Vec<usize>)> {
        let cfg = &self.cfg;
        let b = reqs.len();
        let mut embed_idx = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut seqs = Vec::with_capacity(b);
        let mut first_draft = Vec::with_capacity(b);
        for (i, r) in reqs.iter().enumerate() {
            let rows = cfg.block_rows(r.gamma);
            let end = r.anchor_pos + rows;
            first_draft.push(positions.len() + usize::from(cfg.skip_anchor_row));
            seqs.push(AttnSeq {
                q_start: positions.len(),
                q_len: rows,
                q_pos0: r.anchor_pos,
                kv_len: end,
                block_table: r.block_table.to_vec(),
            });
            embed_idx.push(i as u32);
            embed_idx.extend(std::iter::repeat_n(b as u32, rows - 1));
            for p in r.anchor_pos..end {
                positions.push(p as u32);
                slots.push(kv.slot(r.block_table, p) as u32);
            }
        }
        let t = positions.len();
        let dev = &self.device;
        let anchors: Vec<u32> = reqs.iter().map(|r| r.anchor).collect();
        // Rows 0..b: the anchors' embeddings; row b: the mask input.
        let inputs = Tensor::cat(&[self.embed(target, &anchors)?, self.mask_row.clone()], 0)?;
        let mut x = inputs.index_select(&Tensor::new(embed_idx.as_slice(), dev)?, 0)?;
        if cfg.context_input {
            let rows = reqs
                .iter()
                .map(|r| {
                    let c = r.last_context.context(
                        "this drafter (context_input) needs each request's last context feature",
                    )?;
                    let n = cfg.block_rows(r.gamma);
                    Ok(c.reshape((1, cfg.hidden_size))?
                        .broadcast_as((n, cfg.hidden_size))?)
                })
                .collect::<Result<Vec<_>>>()?;
            x = (x + Tensor::cat(&rows, 0)?)?;
        }
        let (cos, sin) = self.rope_at(&positions)?;
        let idx = slot_index(&slots, self.kv_dim(), dev)?;
        let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let attn = PagedAttention {
            seqs: Arc::new(seqs),
            num_heads: nh,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            block_size: kv.block_size,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            causal: false,
        };
        for (li, l) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &l.input_norm, self.eps)?;
            let (k, v) = self.key_values(l, &h, &cos, &sin)?;
            kv.write(li, &idx, &k, &v)?;
            let q = rms_norm(&l.q.forward(&h)?.reshape((t, nh, hd))?, &l.q_norm, self.eps)?;
            let a = attn.forward(&rope(&q, &cos, &sin)?, &kv.k[li], &kv.v[li])?;
            x = (x + l.o.forward(&a)?)?;
            let h = rms_norm(&x, &l.post_norm, self.eps)?;
            let gu = crate::model::linear::forward_glu(
                &l.gate,
                &l.up,
                &h,
                crate::model::config::Activation::Silu,
            )?;
            x = (&x + l.down.forward(&gu)?)?;
        }
        Ok((rms_norm(&x, &self.norm, self.eps)?, first_draft))
    }

    /// Drafts one block per request in ONE batched drafter forward (see the module docs for
    /// the equations). The blocks' keys/values are written into the drafter cache at
    /// `anchor_pos..anchor_pos + gamma`; `append_context` overwrites them when tokens commit.
    pub fn propose(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
    ) -> Result<Vec<Proposal>> {
        self.propose_with(kv, target, reqs, &ProposeOptions::default())
    }

    /// [`DSparkDrafter::propose`] with an early stop and online calibration: a request whose
    /// prefix survival falls below `opts.min_survival` gets a shorter block (its remaining
    /// positions are not drafted, and the sequential loop ends when every request stopped).
    pub fn propose_with(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
    ) -> Result<Vec<Proposal>> {
        self.propose_under(kv, target, reqs, opts, &mut [])
    }

    /// [`DSparkDrafter::propose_with`] under grammars: `grammars[i]` (when given; the
    /// slice is empty or one per request) masks request `i`'s proposals position by
    /// position, walked along its draft and rolled back after, so no draft token is one
    /// the grammar forbids (a block ends early where it allows no draft-vocabulary token).
    pub fn propose_under(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
        grammars: &mut [Option<&mut crate::constraint::Constraint>],
    ) -> Result<Vec<Proposal>> {
        if !grammars.is_empty() && grammars.len() != reqs.len() {
            bail!(
                "{} grammars for {} draft requests",
                grammars.len(),
                reqs.len()
            );
        }
        // The grammars come back as they were, whatever happens.
        let mut consumed = vec![0usize; grammars.len()];
        let r = self.propose_inner(kv, target, reqs, opts, grammars, &mut consumed);
        for (g, &n) in grammars.iter_mut().zip(&consumed) {
            if let Some(g) = g {
                g.rollback(n)?;
            }
        }
        r
    }

    fn propose_inner(
        &self,
        kv: &mut KvCache,
        target: &Model,
        reqs: &mut [DraftRequest<'_>],
        opts: &ProposeOptions<'_>,
        grammars: &mut [Option<&mut crate::constraint::Constraint>],
        consumed: &mut [usize],
    ) -> Result<Vec<Proposal>> {
        self.count_call();
        self.check_cache(kv)?;
        for r in reqs.iter() {
            if r.gamma == 0 || r.gamma > self.cfg.block_size {
                bail!(
                    "gamma {} is outside 1..={} (the drafter's block_size)",
                    r.gamma,
                    self.cfg.block_size
                );
            }
            if r.anchor as usize >= self.cfg.vocab_size {
                bail!(
                    "anchor token {} is outside the vocabulary of {}",
                    r.anchor,
                    self.cfg.vocab_size
                );
            }
            let end = r.anchor_pos + self.cfg.block_rows(r.gamma);
            if r.block_table.len() * kv.block_size < end {
                bail!(
                    "drafter block table of {} blocks does not cover the block at {}..{end}",
                    r.block_table.len(),
                    r.anchor_pos,
                );
            }
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let (h, row0) = self.backbone(kv, target, reqs)?;
        let vd = self.cfg.draft_vocab_size();
        let base: Vec<f32> = self.lm_logits(target, &h)?.flatten_all()?.to_vec1()?;
        let conf_h = self
            .confidence
            .as_ref()
            .map(|c| c.hidden_part(&h))
            .transpose()?;
        let max_gamma = reqs.iter().map(|r| r.gamma).max().unwrap_or(0);
        let mut blocks: Vec<Proposal> = reqs
            .iter()
            .map(|r| Proposal {
                tokens: Vec::with_capacity(r.gamma),
                q: Vec::with_capacity(r.gamma),
                confidence: Vec::with_capacity(r.gamma),
            })
            .collect();
        let mut prev: Vec<u32> = reqs.iter().map(|r| r.anchor).collect();
        let mut state = None;
        // Per request: its block length so far may still grow, and its prefix survival.
        let mut open: Vec<bool> = vec![true; reqs.len()];
        let mut surv: Vec<f32> = vec![1.0; reqs.len()];
        for k in 0..max_gamma {
            if !open.iter().zip(reqs.iter()).any(|(&o, r)| o && k < r.gamma) {
                break;
            }
            // Requests whose block is shorter repeat their last row; their results are unused.
            let rows: Vec<u32> = reqs
                .iter()
                .zip(&row0)
                .map(|(r, &s)| (s + k.min(r.gamma - 1)) as u32)
                .collect();
            let w1_rows: Vec<u32> = match &self.w1_index {
                Some(index) => prev.iter().map(|&t| index[t as usize]).collect(),
                None => prev.clone(),
            };
            let step = self.seq_head.step(&w1_rows, &h, &rows, &mut state)?;
            let conf_e = match (&self.confidence, &step.prev_embedding) {
                (Some(c), Some(e)) => c.prev_part(e)?,
                _ => None,
            };
            for (i, r) in reqs.iter_mut().enumerate() {
                if k >= r.gamma || !open[i] {
                    continue;
                }
                let row = rows[i] as usize;
                let mut logits = base[row * vd..(row + 1) * vd].to_vec();
                if let Some(bias) = &step.bias {
                    for (l, b) in logits.iter_mut().zip(&bias[i * vd..(i + 1) * vd]) {
                        *l += b;
                    }
                }
                if r.params.edits_logits() {
                    // The request's bias and penalties, after this block's drafts so far.
                    let mut h = r.history.cloned().unwrap_or_default();
                    for &t in &blocks[i].tokens {
                        h.push(t);
                    }
                    match &self.sub_vocab {
                        Some(v) => edit_logits(&mut logits, r.params, &h, |t| v.position(t)),
                        None => edit_logits(&mut logits, r.params, &h, |t| Some(t as usize)),
                    }
                }
                if let Some(Some(g)) = grammars.get_mut(i) {
                    if !self.mask_draft(g, &mut logits)? {
                        open[i] = false;
                        continue;
                    }
                }
                let q = target_probs(&logits, r.params);
                let x = q.sample(r.rng);
                let z = match (&self.confidence, &conf_h) {
                    (Some(c), Some(zh)) => zh[row] + conf_e.as_ref().map_or(0.0, |e| e[i]) + c.bias,
                    _ => head::raw_logit(&logits, x),
                };
                let greedy = matches!(q, Dist::Greedy(_));
                let (t_k, b_k) = self.sts_for(greedy, k);
                let (tok, q) = self.to_target_vocab(x, q);
                let mut conf = sigmoid(z / t_k + b_k);
                if let Some(oc) = opts.calibration {
                    conf = oc.adjust_one(greedy, k, conf);
                }
                if let Some(Some(g)) = grammars.get_mut(i) {
                    g.consume(tok)?;
                    consumed[i] += 1;
                }
                let blk = &mut blocks[i];
                blk.tokens.push(tok);
                blk.q.push(q);
                blk.confidence.push(conf);
                prev[i] = tok;
                surv[i] *= if conf.is_nan() {
                    0.0
                } else {
                    conf.clamp(0.0, 1.0)
                };
                if surv[i] < opts.min_survival {
                    open[i] = false;
                }
            }
        }
        Ok(blocks)
    }

    /// Masks draft-vocabulary `logits` to what grammar `g` allows next; false when it
    /// allows none of them (or only the end).
    fn mask_draft(
        &self,
        g: &mut crate::constraint::Constraint,
        logits: &mut [f32],
    ) -> Result<bool> {
        if g.is_stopped() {
            return Ok(false);
        }
        let m = g.mask()?;
        let mut any = false;
        for (d, l) in logits.iter_mut().enumerate() {
            let t = match &self.sub_vocab {
                Some(v) => v.ids[d],
                None => d as u32,
            };
            if m.is_allowed(t) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(any)
    }

    /// One full block drafted greedily (argmax of `U_k + B_k`, no request parameters, no
    /// STS) with every intermediate value, for checks against reference implementations:
    /// the same backbone and heads as [`Self::propose`].
    pub fn trace_greedy(
        &self,
        kv: &mut KvCache,
        target: &Model,
        anchor: u32,
        anchor_pos: usize,
        block_table: &[u32],
    ) -> Result<BlockTrace> {
        self.check_cache(kv)?;
        let params = SamplingParams::default();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let gamma = self.cfg.block_size;
        let reqs = [DraftRequest {
            anchor,
            anchor_pos,
            block_table,
            gamma,
            params: &params,
            history: None,
            rng: &mut rng,
            last_context: None,
        }];
        let (h, row0) = self.backbone(kv, target, &reqs)?;
        let rows = h.narrow(0, row0[0], gamma)?;
        let base: Vec<Vec<f32>> = self.lm_logits(target, &rows)?.to_vec2()?;
        let conf_h = self
            .confidence
            .as_ref()
            .map(|c| c.hidden_part(&rows))
            .transpose()?;
        let mut out = BlockTrace {
            base_logits: base.clone(),
            bias: Vec::with_capacity(gamma),
            confidence_logits: conf_h.as_ref().map(|_| Vec::with_capacity(gamma)),
            tokens: Vec::with_capacity(gamma),
        };
        let mut prev = anchor;
        let mut state = None;
        for (k, base_k) in base.iter().enumerate() {
            let w1_row = match &self.w1_index {
                Some(index) => index[prev as usize],
                None => prev,
            };
            let step = self
                .seq_head
                .step(&[w1_row], &rows, &[k as u32], &mut state)?;
            let bias = step.bias.unwrap_or_else(|| vec![0.0; base_k.len()]);
            let logits: Vec<f32> = base_k.iter().zip(&bias).map(|(u, b)| u + b).collect();
            let x = crate::model::argmax(&logits);
            if let (Some(c), Some(zh), Some(z)) =
                (&self.confidence, &conf_h, out.confidence_logits.as_mut())
            {
                let e = match &step.prev_embedding {
                    Some(e) => c.prev_part(e)?.map_or(0.0, |v| v[0]),
                    None => 0.0,
                };
                z.push(zh[k] + e + c.bias);
            }
            let tok = self.sub_vocab.as_ref().map_or(x, |v| v.ids[x as usize]);
            out.bias.push(bias);
            out.tokens.push(tok);
            prev = tok;
        }
        Ok(out)
    }

    /// Maps a draft-vocabulary token and distribution to target ids (identity without a
    /// reduced vocabulary).
    fn to_target_vocab(&self, x: u32, q: Dist) -> (u32, Dist) {
        let Some(vocab) = &self.sub_vocab else {
            return (x, q);
        };
        let q = match q {
            Dist::Greedy(t) => Dist::Greedy(vocab.ids[t as usize]),
            Dist::Probs(probs) => Dist::Sparse {
                vocab: vocab.clone(),
                probs,
            },
            sparse @ Dist::Sparse { .. } => sparse,
        };
        (vocab.ids[x as usize], q)
    }
}
