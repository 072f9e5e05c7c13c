//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde::Deserialize;
use std::path::Path;

/// The decoder families this engine serves. They share one forward; the flags in
/// [`ModelConfig`] select the per-family differences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections, NEOX RoPE.
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Some(Arch::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "gemma3" | "gemma3_text" | "Gemma3ForCausalLM" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    /// Per-head RMSNorm on queries and keys.
    pub fn has_qk_norm(&self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Gemma3)
    }

    /// The MLP's activation: tanh-approximated GELU for Gemma, SiLU for the others.
    pub fn activation(&self) -> Activation {
        if *self == Arch::Gemma3 {
            Activation::GeluTanh
        } else {
            Activation::Silu
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    /// RoPE base of the sliding-window layers (Gemma 3 uses 10k locally, 1M globally).
    pub rope_local_theta: f64,
    pub max_position: usize,
    /// Per-head RMSNorm on queries and keys (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Biases on the q/k/v projections (Qwen2).
    pub qkv_bias: bool,
    /// Extra norms after attention and after the MLP (Gemma 3).
    pub sandwich_norms: bool,
    /// Multiply embeddings by sqrt(hidden) (Gemma).
    pub scale_embeddings: bool,
    pub activation: Activation,
    pub attn_scale: f64,
    /// Sliding-window size and the layers that use it (`None` = all layers global).
    pub sliding_window: Option<usize>,
    pub sliding_layers: Vec<bool>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn finish(mut self) -> Result<Self> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            bail!(
                "invalid head counts: {} query heads, {} key/value heads",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!("invalid head dimension {}", self.head_dim);
        }
        if self.sliding_layers.len() != self.num_layers {
            self.sliding_layers = vec![false; self.num_layers];
        }
        Ok(self)
    }

    /// Gemma 3: five sliding-window layers, then one global layer.
    fn gemma3_pattern(num_layers: usize) -> Vec<bool> {
        (0..num_layers).map(|i| (i + 1) % 6 != 0).collect()
    }

    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let arch_name = md_str(ct, "general.architecture")?;
        let arch = Arch::parse(&arch_name).with_context(|| {
            format!(
                "unsupported architecture '{arch_name}' (supported: llama, qwen2, qwen3, gemma3)"
            )
        })?;
        let p = |k: &str| format!("{arch_name}.{k}");
        let hidden_size = md_usize(ct, &p("embedding_length"))?;
        let num_heads = md_usize(ct, &p("attention.head_count"))?;
        let num_kv_heads = md_usize(ct, &p("attention.head_count_kv")).unwrap_or(num_heads);
        let head_dim = md_usize(ct, &p("attention.key_length"))
            .or_else(|_| md_usize(ct, &p("rope.dimension_count")))
            .unwrap_or(hidden_size / num_heads);
        let num_layers = md_usize(ct, &p("block_count"))?;
        let vocab_size = match md_usize(ct, &p("vocab_size")) {
            Ok(v) => v,
            Err(_) => ct
                .metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .context("GGUF has neither a vocab_size nor tokenizer.ggml.tokens")?,
        };
        let rope_theta = md_f64(ct, &p("rope.freq_base")).unwrap_or(10_000.0);
        let gemma = arch == Arch::Gemma3;
        let sliding_window = if gemma {
            md_usize(ct, &p("attention.sliding_window")).ok()
        } else {
            None
        };
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: md_usize(ct, &p("feed_forward_length"))?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_eps: md_f64(ct, &p("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            rope_theta,
            rope_local_theta: if gemma { 10_000.0 } else { rope_theta },
            max_position: md_usize(ct, &p("context_length")).unwrap_or(4096),
            qk_norm: arch.has_qk_norm(),
            qkv_bias: arch == Arch::Qwen2,
            sandwich_norms: gemma,
            scale_embeddings: gemma,
            activation: arch.activation(),
            attn_scale: 1.0 / (head_dim as f64).sqrt(),
            sliding_layers: if sliding_window.is_some() {
                Self::gemma3_pattern(num_layers)
            } else {
                vec![]
            },
            sliding_window,
        };
        cfg.finish()
    }

    pub fn from_hf_config(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let c: HfConfig = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid model config.json", path.display()))?;
        let arch_name = c
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or(c.model_type.clone())
            .unwrap_or_default();
        let arch = Arch::parse(&arch_name)
            .or_else(|| c.model_type.as_deref().and_then(Arch::parse))
            .with_context(|| {
                format!(
                    "{}: unsupported architecture '{arch_name}' (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)",
                    path.display()
                )
            })?;
        let num_heads = c.num_attention_heads;
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / num_heads);
        let gemma = arch == Arch::Gemma3;
        let sliding_window = if gemma { c.sliding_window } else { None };
        // transformers >= 5 writes `rope_parameters: {rope_type, rope_theta}` instead of a
        // top-level `rope_theta`; only the default (unscaled) RoPE is implemented.
        if let Some(rp) = &c.rope_parameters {
            if let Some(kind) = rp.rope_type.as_deref().filter(|k| *k != "default") {
                anyhow::bail!(
                    "{}: rope_parameters.rope_type '{kind}' is not supported (expected 'default')",
                    path.display()
                );
            }
        }
        let rope_theta = c
            .rope_theta
            .or(c.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10_000.0);
        let sliding_layers = match (&c.layer_types, sliding_window) {
            (Some(t), Some(_)) => t.iter().map(|s| s == "sliding_attention").collect(),
            (None, Some(_)) => Self::gemma3_pattern(c.num_hidden_layers),
            _ => vec![],
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(num_heads),
            head_dim,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_local_theta: c.rope_local_base_freq.unwrap_or(if gemma {
                10_000.0
            } else {
                rope_theta
            }),
            max_position: c.max_position_embeddings.unwrap_or(4096),
            qk_norm: arch.has_qk_norm(),
            qkv_bias: arch == Arch::Qwen2,
            sandwich_norms: gemma,
            scale_embeddings: gemma,
            activation: arch.activation(),
            attn_scale: 1.0 / (c.query_pre_attn_scalar.unwrap_or(head_dim as f64)).sqrt(),
            sliding_window,
            sliding_layers,
        };
        cfg.finish()
    }
}

#[derive(Debug, Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_local_base_freq: Option<f64>,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
}

/// `rope_parameters` of a transformers >= 5 config.json.
#[derive(Debug, Deserialize)]
pub(crate) struct RopeParameters {
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
}

pub(crate) fn md_str(ct: &gguf_file::Content, key: &str) -> Result<String> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("missing GGUF metadata key '{key}'"))?;
    Ok(v.to_string()
        .with_context(|| format!("GGUF metadata '{key}' is not a string"))?
        .clone())
}

pub(crate) fn md_usize(ct: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("missing GGUF metadata key '{key}'"))?;
    let n = v
        .to_u64()
        .or_else(|_| v.to_u32().map(u64::from))
        .or_else(|_| v.to_i32().map(|x| x as u64))
        .or_else(|_| v.to_i64().map(|x| x as u64))
        .with_context(|| format!("GGUF metadata '{key}' is not an integer"))?;
    Ok(n as usize)
}

pub(crate) fn md_f64(ct: &gguf_file::Content, key: &str) -> Result<f64> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("missing GGUF metadata key '{key}'"))?;
    v.to_f32()
        .map(f64::from)
        .or_else(|_| v.to_f64())
        .with_context(|| format!("GGUF metadata '{key}' is not a float"))
}
