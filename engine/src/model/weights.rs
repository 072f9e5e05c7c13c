//! Loading model weights from a GGUF file or a Hugging Face folder (`*.safetensors`).
//!
//! Quantized GGUF tensors stay quantized ([`Linear`]: the CPU kernels or candle's `QMatMul`);
//! dense checkpoints are converted to f32. Every failure names the file and what is wrong with it.

use super::config::{Arch, ModelConfig};
use super::linear::Linear;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Token embedding table, quantized or dense; shared with the drafter.
#[derive(Clone)]
pub enum Embedding {
    Quant(Arc<QTensor>),
    Dense(Tensor),
}

impl Embedding {
    /// Rows for `ids` as f32 `[n, hidden]`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Embedding::Quant(q) => q.embedding(ids),
            Embedding::Dense(t) => t.index_select(ids, 0),
        }
    }
}

pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    /// Biases of q, k and v (Qwen2), `[q_dim]`, `[kv_dim]`, `[kv_dim]`.
    pub qkv_bias: Option<[Tensor; 3]>,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub post_attn_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub post_ffn_norm: Option<Tensor>,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Weights {
    pub embed: Embedding,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Linear,
    /// Human-readable weight type, e.g. "q4_1" or "f32".
    pub dtype: String,
}

/// Progress callback: (tensors loaded, tensors total).
pub type Progress<'a> = &'a dyn Fn(usize, usize);

pub fn open_gguf(path: &Path) -> Result<(std::fs::File, gguf_file::Content)> {
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open model file {}", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?
        .len();
    // Buffered: the header is ~100k small reads (a vocabulary and its merges as strings),
    // each a system call on the bare file. Tensors are read later at their own offsets.
    let ct = gguf_file::Content::read(&mut std::io::BufReader::new(&mut file)).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a readable GGUF file ({len} bytes): {e}",
            path.display()
        )
    })?;
    let mut needed = ct.tensor_data_offset;
    for info in ct.tensor_infos.values() {
        let elems = info.shape.elem_count();
        let bytes = elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        needed = needed.max(ct.tensor_data_offset + info.offset + bytes as u64);
    }
    if needed > len {
        bail!(
            "{} is truncated: its tensors need {needed} bytes but the file has {len}; fetch it again (scripts/fetch-models.sh)",
            path.display()
        );
    }
    Ok((file, ct))
}

struct GgufReader<'a> {
    path: &'a Path,
    file: std::fs::File,
    ct: &'a gguf_file::Content,
    device: &'a Device,
}

impl GgufReader<'_> {
    fn has(&self, name: &str) -> bool {
        self.ct.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has(name) {
            bail!("{} has no tensor '{name}'", self.path.display());
        }
        self.ct
            .tensor(&mut self.file, name, self.device)
            .with_context(|| format!("{}: cannot read tensor '{name}'", self.path.display()))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        let q = self.qtensor(name)?;
        q.dequantize(self.device)
            .with_context(|| format!("{}: cannot dequantize '{name}'", self.path.display()))
    }

    fn linear(&mut self, name: &str) -> Result<Linear> {
        Linear::from_qtensor(self.qtensor(name)?)
            .with_context(|| format!("{}: bad weight '{name}'", self.path.display()))
    }

    /// Llama GGUF files store q/k rows permuted for interleaved RoPE; undo it so every
    /// family uses the same (half-split) RoPE. Rows of a quantized tensor are whole blocks,
    /// so this is a byte shuffle, not a requantization.
    fn linear_unpermuted(&mut self, name: &str, n_heads: usize) -> Result<Linear> {
        let q = self.qtensor(name)?;
        let (rows, cols) = q.shape().dims2()?;
        let dtype = q.dtype();
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let data = q.data()?;
        let hd = rows / n_heads;
        let mut out = vec![0u8; data.len()];
        for h in 0..n_heads {
            for i in 0..hd / 2 {
                for c in 0..2 {
                    let src = h * hd + 2 * i + c;
                    let dst = h * hd + c * (hd / 2) + i;
                    out[dst * row_bytes..(dst + 1) * row_bytes]
                        .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
                }
            }
        }
        let storage = QStorage::from_data(Cow::Owned(out), self.device, dtype)?;
        Ok(Linear::from_qtensor(QTensor::new(storage, (rows, cols))?)?)
    }
}

pub fn load_gguf(
    path: &Path,
    cfg: &ModelConfig,
    file: std::fs::File,
    ct: &gguf_file::Content,
    device: &Device,
    progress: Progress,
) -> Result<Weights> {
    let mut r = GgufReader {
        path,
        file,
        ct,
        device,
    };
    let total = cfg.num_layers + 2;
    let embed = Arc::new(r.qtensor("token_embd.weight")?);
    let (rows, cols) = embed.shape().dims2()?;
    if rows != cfg.vocab_size || cols != cfg.hidden_size {
        bail!(
            "{}: token_embd.weight is {rows}x{cols}, expected {}x{}",
            path.display(),
            cfg.vocab_size,
            cfg.hidden_size
        );
    }
    let dtype =
        r.ct.tensor_infos
            .get("blk.0.ffn_up.weight")
            .map(|i| format!("{:?}", i.ggml_dtype).to_lowercase())
            .unwrap_or_else(|| "unknown".into());
    progress(1, total);
    let permuted = cfg.arch == Arch::Llama;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let (wq, wk) = if permuted {
            (
                r.linear_unpermuted(&n("attn_q"), cfg.num_heads)?,
                r.linear_unpermuted(&n("attn_k"), cfg.num_kv_heads)?,
            )
        } else {
            (r.linear(&n("attn_q"))?, r.linear(&n("attn_k"))?)
        };
        let opt = |r: &mut GgufReader, s: &str| -> Result<Option<Tensor>> {
            if r.has(&n(s)) {
                Ok(Some(r.dense(&n(s))?))
            } else {
                Ok(None)
            }
        };
        let b = |s: &str| format!("blk.{i}.{s}.bias");
        let qkv_bias = if r.has(&b("attn_q")) {
            Some([
                r.dense(&b("attn_q"))?,
                r.dense(&b("attn_k"))?,
                r.dense(&b("attn_v"))?,
            ])
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: r.dense(&n("attn_norm"))?,
            wq,
            wk,
            wv: r.linear(&n("attn_v"))?,
            wo: r.linear(&n("attn_output"))?,
            qkv_bias,
            q_norm: opt(&mut r, "attn_q_norm")?,
            k_norm: opt(&mut r, "attn_k_norm")?,
            post_attn_norm: opt(&mut r, "post_attention_norm")?,
            ffn_norm: r.dense(&n("ffn_norm"))?,
            post_ffn_norm: opt(&mut r, "post_ffw_norm")?,
            gate: r.linear(&n("ffn_gate"))?,
            up: r.linear(&n("ffn_up"))?,
            down: r.linear(&n("ffn_down"))?,
        });
        progress(i + 2, total);
    }
    check_layer_flags(path, cfg, &layers)?;
    let final_norm = r.dense("output_norm.weight")?;
    let lm_head = if r.has("output.weight") {
        r.linear("output.weight")?
    } else {
        Linear::from_arc(embed.clone())?
    };
    progress(total, total);
    let embed = if embed.dtype() == GgmlDType::F32 {
        Embedding::Dense(embed.dequantize(device)?)
    } else {
        Embedding::Quant(embed)
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
        dtype,
    })
}

fn check_layer_flags(path: &Path, cfg: &ModelConfig, layers: &[LayerWeights]) -> Result<()> {
    let l = &layers[0];
    if cfg.qk_norm && (l.q_norm.is_none() || l.k_norm.is_none()) {
        bail!(
            "{}: {} expects q/k norm weights but the file has none",
            path.display(),
            cfg.arch.name()
        );
    }
    if cfg.qkv_bias && l.qkv_bias.is_none() {
        bail!(
            "{}: {} expects q/k/v biases but the file has none",
            path.display(),
            cfg.arch.name()
        );
    }
    if let Some(b) = &l.qkv_bias {
        let want = [cfg.q_dim(), cfg.kv_dim(), cfg.kv_dim()];
        for (t, (n, w)) in b.iter().zip(["q", "k", "v"].iter().zip(want)) {
            if t.dims() != [w] {
                bail!(
                    "{}: the {n} bias has shape {:?}, expected [{w}]",
                    path.display(),
                    t.dims()
                );
            }
        }
    }
    if cfg.sandwich_norms && (l.post_attn_norm.is_none() || l.post_ffn_norm.is_none()) {
        bail!(
            "{}: {} expects post-attention/post-MLP norms but the file has none",
            path.display(),
            cfg.arch.name()
        );
    }
    Ok(())
}

/// Loads a Hugging Face folder: every `*.safetensors` in it (sharded or not).
pub fn load_hf(
    dir: &Path,
    cfg: &ModelConfig,
    device: &Device,
    progress: Progress,
) -> Result<Weights> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{} has no *.safetensors files", dir.display());
    }
    // SAFETY: the files are mapped read-only and not modified while the engine runs.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
        .with_context(|| format!("cannot read safetensors in {}", dir.display()))?;
    let gemma = cfg.arch == Arch::Gemma3;
    let load = |name: &str| -> Result<Tensor> {
        st.load(name, device)
            .with_context(|| format!("{}: missing or unreadable tensor '{name}'", dir.display()))
    };
    let get = |name: &str| -> Result<Tensor> { Ok(load(name)?.to_dtype(DType::F32)?) };
    // Layer matrices: f32 on the CPU (its kernels and candle's CPU matmul want f32); on a GPU
    // a bf16/f16 checkpoint stays in its type (half the bytes per step, tensor cores), like
    // vLLM's `--dtype auto`. Embeddings, norms and the LM head are f32 everywhere.
    let matrix = |name: &str| -> Result<Tensor> {
        let t = load(name)?;
        Ok(match t.dtype() {
            DType::BF16 | DType::F16 if !device.is_cpu() => t,
            _ => t.to_dtype(DType::F32)?,
        })
    };
    let has = |name: &str| st.get(name).is_ok();
    // Gemma stores norm weights as offsets from 1.
    let norm = |name: &str| -> Result<Tensor> {
        let t = get(name)?;
        Ok(if gemma { (t + 1.0)? } else { t })
    };
    let lin = |name: &str| -> Result<Linear> { Ok(Linear::dense(matrix(name)?)) };
    let total = cfg.num_layers + 2;
    let embed = get("model.embed_tokens.weight")?;
    progress(1, total);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let opt_norm = |s: &str| -> Result<Option<Tensor>> {
            let name = format!("{p}.{s}.weight");
            if has(&name) {
                Ok(Some(norm(&name)?))
            } else {
                Ok(None)
            }
        };
        let (post_attn_norm, ffn_norm, post_ffn_norm) = if gemma {
            (
                opt_norm("post_attention_layernorm")?,
                norm(&format!("{p}.pre_feedforward_layernorm.weight"))?,
                opt_norm("post_feedforward_layernorm")?,
            )
        } else {
            (
                None,
                norm(&format!("{p}.post_attention_layernorm.weight"))?,
                None,
            )
        };
        let qkv_bias = if has(&format!("{p}.self_attn.q_proj.bias")) {
            let b = |s: &str| get(&format!("{p}.self_attn.{s}_proj.bias"));
            Some([b("q")?, b("k")?, b("v")?])
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: norm(&format!("{p}.input_layernorm.weight"))?,
            wq: lin(&format!("{p}.self_attn.q_proj.weight"))?,
            wk: lin(&format!("{p}.self_attn.k_proj.weight"))?,
            wv: lin(&format!("{p}.self_attn.v_proj.weight"))?,
            wo: lin(&format!("{p}.self_attn.o_proj.weight"))?,
            qkv_bias,
            q_norm: opt_norm("self_attn.q_norm")?,
            k_norm: opt_norm("self_attn.k_norm")?,
            post_attn_norm,
            ffn_norm,
            post_ffn_norm,
            gate: lin(&format!("{p}.mlp.gate_proj.weight"))?,
            up: lin(&format!("{p}.mlp.up_proj.weight"))?,
            down: lin(&format!("{p}.mlp.down_proj.weight"))?,
        });
        progress(i + 2, total);
    }
    check_layer_flags(dir, cfg, &layers)?;
    let final_norm = norm("model.norm.weight")?;
    // The LM head stays f32 on every device: logits (and the logprobs users get) at full
    // precision, and greedy ties not decided by bf16 rounding (6 % of an 8B model's bytes).
    let lm_head = if has("lm_head.weight") {
        Linear::dense(get("lm_head.weight")?)
    } else {
        Linear::dense(embed.clone())
    };
    let dtype = match layers.first().map(|l| l.wq.dense_dtype()) {
        Some(Some(DType::BF16)) => "bf16",
        Some(Some(DType::F16)) => "f16",
        _ => "f32",
    };
    progress(total, total);
    Ok(Weights {
        embed: Embedding::Dense(embed),
        layers,
        final_norm,
        lm_head,
        dtype: dtype.into(),
    })
}
