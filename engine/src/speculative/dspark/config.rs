//! A drafter's `config.json`: the head kind, dimensions, target layers, STS parameters,
//! and the checks against the target it drafts for.

use super::*;

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
    /// Every drafter trained on whole blocks needs it (`dspark-train` sets it): the block's
    /// rows attend to each other both ways, so a shorter block changes every draft. Off, the
    /// backbone runs only the `gamma` rows wanted (cheaper; exact for block-causal drafters).
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

pub(super) fn default_num_layers() -> usize {
    1
}
pub(super) fn default_block_size() -> usize {
    7
}
pub(super) fn default_rank() -> usize {
    256
}
pub(super) fn default_head() -> HeadKind {
    HeadKind::Markov
}
pub(super) fn default_true() -> bool {
    true
}
pub(super) fn is_true(b: &bool) -> bool {
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

    pub(super) fn seq_rank(&self) -> usize {
        match self.markov_head_type {
            HeadKind::Parallel => 0,
            HeadKind::Markov | HeadKind::Gated | HeadKind::Rnn => self.markov_rank,
        }
    }

    /// Width of the confidence head's input: `h_k`, plus `W1[x_{k-1}]` when it reads it.
    pub(super) fn confidence_fan_in(&self) -> usize {
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
    pub(super) fn check(&self, target: &ModelConfig) -> std::result::Result<(), String> {
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

pub(super) fn check_sts(
    block_size: usize,
    temps: Option<&[f32]>,
) -> std::result::Result<(), String> {
    let valid = |x: f32| x.is_finite() && x > 0.0;
    check_per_position(
        block_size,
        temps,
        ("sts_temperatures", "has"),
        valid,
        "positive and finite",
    )
}

pub(super) fn check_offsets(
    block_size: usize,
    offsets: Option<&[f32]>,
) -> std::result::Result<(), String> {
    check_per_position(
        block_size,
        offsets,
        ("sts offsets", "have"),
        f32::is_finite,
        "finite",
    )
}

/// Per-position values (if any): one per block position, each `valid`. `(what, has)` say what
/// they are and its verb ("sts offsets", "have"), `must` what `valid` wants.
fn check_per_position(
    block_size: usize,
    values: Option<&[f32]>,
    (what, has): (&str, &str),
    valid: impl Fn(f32) -> bool,
    must: &str,
) -> std::result::Result<(), String> {
    match values {
        Some(v) if v.len() != block_size => Err(format!(
            "{what} {has} {} entries, expected block_size = {block_size}",
            v.len()
        )),
        Some(v) if !v.iter().all(|&x| valid(x)) => Err(format!("{what} {v:?} must be {must}")),
        _ => Ok(()),
    }
}
