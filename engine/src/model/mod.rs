//! The target model: one decoder forward for Llama, Qwen2, Qwen3 and Gemma 3, on any candle
//! device.
//!
//! The model is a pure function of its weights, the new tokens, their positions and a view of
//! the paged KV cache (each sequence's block table). Many sequences of different lengths run
//! in ONE batched forward: matmuls see all their tokens as one matrix, attention reads each
//! sequence's own cache slots. The forward can also return the hidden states of chosen
//! layers, which the drafter consumes.

pub mod attention;
pub mod config;
pub mod linear;
pub mod ops;
pub mod weights;

use crate::kv::KvCache;
use anyhow::{Context, Result};
use attention::{AttnBatch, AttnSeq, PagedAttention};
use candle_core::{DType, Device, Tensor};
pub use config::{Activation, Arch, ModelConfig};
pub use linear::Linear;
use std::path::{Path, PathBuf};
use std::sync::Arc;
pub use weights::{Embedding, Weights};

/// Where a model came from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

impl ModelSource {
    pub fn detect(path: &Path) -> Result<Self> {
        if !path.exists() {
            anyhow::bail!("model path {} does not exist", path.display());
        }
        if path.is_dir() {
            if !path.join("config.json").exists() {
                anyhow::bail!(
                    "{} is a folder without config.json; give a GGUF file or a Hugging Face model folder",
                    path.display()
                );
            }
            return Ok(ModelSource::HfDir(path.to_path_buf()));
        }
        Ok(ModelSource::Gguf(path.to_path_buf()))
    }
}

/// One sequence's slice of a batched forward.
#[derive(Debug, Clone)]
pub struct SeqBatch {
    /// New tokens, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    /// Block table covering at least `start_pos + tokens.len()` positions.
    pub block_table: Vec<u32>,
    /// How many of the LAST new tokens need logits (0 for a mid-prompt chunk, 1 for decode,
    /// 1 + k to verify k draft tokens).
    pub num_logits: usize,
}

pub struct ForwardOutput {
    /// `[sum(num_logits), vocab]`, rows in sequence order.
    pub logits: Tensor,
    /// Hidden states after each requested layer, `[T, hidden]` over all new tokens.
    pub hidden: Vec<Tensor>,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub weights: Weights,
    pub device: Device,
    /// Short id, e.g. "SmolLM2-135M-Instruct.Q4_1".
    pub id: String,
    rope_global: (Tensor, Tensor),
    rope_local: (Tensor, Tensor),
    max_rope: usize,
}

/// RoPE cos/sin tables `[max_pos, hd / 2]` (half-split layout), shared with the drafter.
pub fn rope_table(theta: f64, hd: usize, max_pos: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd as f64) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, (1, hd / 2), dev)?;
    let pos = Tensor::arange(0u32, max_pos as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((max_pos, 1))?;
    let f = pos.broadcast_mul(&inv)?;
    Ok((f.cos()?, f.sin()?))
}

impl Model {
    /// Loads a GGUF file or a Hugging Face folder. `progress(done, total)` is called as
    /// tensors load.
    pub fn load(path: &Path, device: &Device, progress: weights::Progress) -> Result<Self> {
        let source = ModelSource::detect(path)?;
        let (cfg, weights) = match &source {
            ModelSource::Gguf(p) => {
                let (file, ct) = weights::open_gguf(p)?;
                let cfg = ModelConfig::from_gguf(&ct)
                    .with_context(|| format!("{}: unusable model metadata", p.display()))?;
                let w = weights::load_gguf(p, &cfg, file, &ct, device, progress)?;
                (cfg, w)
            }
            ModelSource::HfDir(d) => {
                let cfg = ModelConfig::from_hf_config(&d.join("config.json"))?;
                let w = weights::load_hf(d, &cfg, device, progress)?;
                (cfg, w)
            }
        };
        let id = path
            .file_name()
            .map(|s| s.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "model".into());
        let max_rope = cfg.max_position.clamp(1, 32_768);
        let rope_global = rope_table(cfg.rope_theta, cfg.head_dim, max_rope, device)?;
        let rope_local = if cfg.rope_local_theta != cfg.rope_theta {
            rope_table(cfg.rope_local_theta, cfg.head_dim, max_rope, device)?
        } else {
            rope_global.clone()
        };
        Ok(Self {
            cfg,
            weights,
            device: device.clone(),
            id,
            rope_global,
            rope_local,
            max_rope,
        })
    }

    /// Longest sequence (prompt + output) this model instance supports.
    pub fn max_context(&self) -> usize {
        self.max_rope
    }

    /// Token embeddings `[n, hidden]` (scaled for Gemma).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.weights.embed.forward(ids)?;
        Ok(if self.cfg.scale_embeddings {
            (x * (self.cfg.hidden_size as f64).sqrt())?
        } else {
            x
        })
    }

    /// Final norm + LM head on `[n, hidden]` hidden states.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let h = ops::rms_norm(h, &self.weights.final_norm, self.cfg.rms_eps as f32)?;
        Ok(self.weights.lm_head.forward(&h)?)
    }

    /// One batched forward over all sequences' new tokens. Writes their keys/values into
    /// the cache slots of their block tables.
    pub fn forward(
        &self,
        batch: &[SeqBatch],
        kv: &mut KvCache,
        hidden_layers: &[usize],
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        let dev = &self.device;
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut logit_rows = Vec::new();
        let mut seqs = Vec::with_capacity(batch.len());
        for s in batch {
            let q_start = tokens.len();
            let end = s.start_pos + s.tokens.len();
            if end > self.max_rope {
                anyhow::bail!(
                    "sequence of {end} tokens exceeds the model's context of {}",
                    self.max_rope
                );
            }
            tokens.extend_from_slice(&s.tokens);
            for p in s.start_pos..end {
                positions.push(p as u32);
                slots.push(kv.slot(&s.block_table, p) as u32);
            }
            let n = s.tokens.len();
            for i in n - s.num_logits.min(n)..n {
                logit_rows.push((q_start + i) as u32);
            }
            seqs.push(AttnSeq {
                q_start,
                q_len: n,
                q_pos0: s.start_pos,
                kv_len: end,
                block_table: s.block_table.clone(),
            });
        }
        let t = tokens.len();
        let seqs = Arc::new(AttnBatch::new(seqs));
        let ids = Tensor::new(tokens.as_slice(), dev)?;
        let pos = Tensor::new(positions.as_slice(), dev)?;
        let kv_dim = cfg.kv_dim();
        let slot_idx = kv.slot_index(slots)?;
        let cos_g = self.rope_global.0.index_select(&pos, 0)?;
        let sin_g = self.rope_global.1.index_select(&pos, 0)?;
        let (cos_l, sin_l) = if cfg.rope_local_theta != cfg.rope_theta {
            (
                self.rope_local.0.index_select(&pos, 0)?,
                self.rope_local.1.index_select(&pos, 0)?,
            )
        } else {
            (cos_g.clone(), sin_g.clone())
        };
        let eps = cfg.rms_eps as f32;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let mut x = self.embed(&ids)?;
        let mut hidden = Vec::with_capacity(hidden_layers.len());
        // The last layer's MLP output, added to `x` by the norm that reads the sum.
        let mut pending: Option<Tensor> = None;
        for (li, w) in self.weights.layers.iter().enumerate() {
            let sliding = cfg.sliding_layers[li];
            let (cos, sin) = if sliding {
                (&cos_l, &sin_l)
            } else {
                (&cos_g, &sin_g)
            };
            let h = match pending.take() {
                Some(m) => {
                    let (sum, h) = ops::add_rms_norm(&x, &m, &w.attn_norm, eps)?;
                    x = sum;
                    h
                }
                None => ops::rms_norm(&x, &w.attn_norm, eps)?,
            };
            let mut qkv = linear::forward_many(&[&w.wq, &w.wk, &w.wv], &h)?;
            if let Some(b) = &w.qkv_bias {
                for (y, b) in qkv.iter_mut().zip(b) {
                    *y = y.broadcast_add(b)?;
                }
            }
            let mut q = qkv[0].reshape((t, nh, hd))?;
            let mut k = qkv[1].reshape((t, nkv, hd))?;
            let v = &qkv[2];
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                q = ops::rms_norm(&q, qn, eps)?;
                k = ops::rms_norm(&k, kn, eps)?;
            }
            let q = ops::rope_thd(&q, cos, sin)?;
            let k = ops::rope_thd(&k, cos, sin)?.reshape((t, kv_dim))?;
            kv.write(li, &slot_idx, &k, v)?;
            let attn = PagedAttention {
                seqs: seqs.clone(),
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: kv.block_size,
                scale: cfg.attn_scale as f32,
                window: if sliding { cfg.sliding_window } else { None },
                causal: true,
            };
            let a = attn.forward(&q, &kv.k[li], &kv.v[li])?;
            let mut o = w.wo.forward(&a)?;
            if let Some(n) = &w.post_attn_norm {
                o = ops::rms_norm(&o, n, eps)?;
            }
            let (sum, h) = ops::add_rms_norm(&x, &o, &w.ffn_norm, eps)?;
            x = sum;
            let g = linear::forward_glu(&w.gate, &w.up, &h, cfg.activation)?;
            let mut m = w.down.forward(&g)?;
            if let Some(n) = &w.post_ffn_norm {
                m = ops::rms_norm(&m, n, eps)?;
            }
            if hidden_layers.contains(&li) {
                x = (x + m)?;
                hidden.push(x.clone());
            } else {
                pending = Some(m);
            }
        }
        if let Some(m) = pending {
            x = (x + m)?;
        }
        let logits = if logit_rows.is_empty() {
            Tensor::zeros((0, cfg.vocab_size), DType::F32, dev)?
        } else {
            let rows = Tensor::new(logit_rows.as_slice(), dev)?;
            self.logits(&x.index_select(&rows, 0)?)?
        };
        Ok(ForwardOutput { logits, hidden })
    }

    /// An f32 KV cache for this model (its layers and key/value width, on its device) of
    /// `budget_bytes`, in blocks of `block_size` tokens.
    pub fn kv_cache(&self, budget_bytes: usize, block_size: usize) -> Result<KvCache> {
        KvCache::new(
            self.cfg.num_layers,
            self.cfg.kv_dim(),
            budget_bytes,
            block_size,
            &self.device,
        )
    }

    /// One sequence forwarded from scratch in `kv` (its blocks are free again after): the
    /// logits of its last `num_logits` tokens and the hidden states after `layers` (tests,
    /// evaluation).
    pub fn forward_fresh(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        num_logits: usize,
        layers: &[usize],
    ) -> Result<ForwardOutput> {
        let mut table = Vec::new();
        anyhow::ensure!(kv.ensure(&mut table, tokens.len()), "KV cache too small");
        let out = self.forward(
            &[SeqBatch {
                tokens: tokens.to_vec(),
                start_pos: 0,
                block_table: table.clone(),
                num_logits,
            }],
            kv,
            layers,
        );
        kv.truncate(&mut table, 0);
        out
    }

    /// Teacher-forced logits for one sequence from scratch (tests, evaluation).
    pub fn logits_for(&self, tokens: &[u32], kv: &mut KvCache) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .forward_fresh(tokens, kv, tokens.len(), &[])?
            .logits
            .to_vec2::<f32>()?)
    }
}

/// Argmax of a logits row: the first index of the largest value (NaNs never win; a row
/// whose first value is NaN gives 0, as a plain `>` scan from index 0 would).
///
/// Two vectorisable passes instead of one scan whose every step waits on the last: the
/// maximum over 16 independent lanes, then the first position holding it. A greedy token
/// of the target reads 49,152 logits, a draft token 8,192 (seven per drafter block).
pub fn argmax(row: &[f32]) -> u32 {
    match row.first() {
        None => return 0,
        Some(v) if v.is_nan() => return 0,
        _ => {}
    }
    let max = max_value(row);
    row.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The largest value of a row, NaNs ignored (`-inf` for an empty or all-NaN row): what
/// `fold(-inf, f32::max)` gives, over 16 independent lanes so that it vectorises.
pub fn max_value(row: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(tail) {
        if v > max {
            max = v;
        }
    }
    max
}

#[cfg(test)]
mod tests {
    /// The plain scan [`super::argmax`] replaced.
    fn scan(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_maximum_like_a_plain_scan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut rows: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NEG_INFINITY; 37],
            vec![f32::NAN, 3.0, 5.0],
            vec![1.0, f32::NAN, f32::NAN],
            vec![f32::NEG_INFINITY, f32::NAN, 2.0, 2.0],
        ];
        for len in [1usize, 15, 16, 17, 100, 8192, 49152] {
            for _ in 0..20 {
                // Few distinct values: ties everywhere, also across lanes and the tail.
                let mut r: Vec<f32> = (0..len).map(|_| rng.random_range(0..6) as f32).collect();
                if rng.random_bool(0.3) {
                    let i = rng.random_range(0..len);
                    r[i] = f32::NAN;
                }
                if rng.random_bool(0.3) {
                    let i = rng.random_range(0..len);
                    r[i] = f32::NEG_INFINITY;
                }
                rows.push(r);
            }
        }
        rows.push(vec![f32::NAN; 20]);
        for r in &rows {
            assert_eq!(super::argmax(r), scan(r), "row of {}", r.len());
            let fold = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(super::max_value(r).to_bits(), fold.to_bits());
        }
    }
}
