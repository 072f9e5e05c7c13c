//! Attention over the paged KV cache for many sequences of different lengths in one call.
//!
//! On CPU a custom kernel reads keys and values straight from the cache slots (no gather
//! copies); on other devices the same semantics are built from tensor ops. Tests check the two
//! against each other.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// One sequence's part of a batched attention call.
#[derive(Debug, Clone)]
pub struct AttnSeq {
    /// First row of this sequence's queries in the flat batch.
    pub q_start: usize,
    pub q_len: usize,
    /// Absolute position of the first query.
    pub q_pos0: usize,
    /// Number of cached positions visible (0..kv_len), including the ones written this step.
    pub kv_len: usize,
    pub block_table: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct PagedAttention {
    pub seqs: std::sync::Arc<Vec<AttnSeq>>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// Sliding window: a query at position p sees positions > p - window.
    pub window: Option<usize>,
    /// Causal: a query at position p sees positions <= p. Non-causal: all `kv_len` positions.
    pub causal: bool,
}

impl PagedAttention {
    fn visible(&self, s: &AttnSeq, qi: usize) -> (usize, usize) {
        let p = s.q_pos0 + qi;
        let hi = if self.causal {
            (p + 1).min(s.kv_len)
        } else {
            s.kv_len
        };
        let lo = match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        (lo.min(hi), hi)
    }

    /// `q`: `[T, num_heads, head_dim]`; caches: `[slots, num_kv_heads * head_dim]`.
    /// Returns `[T, num_heads * head_dim]`.
    pub fn forward(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        if q.device().is_cpu() {
            q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, self)
        } else {
            self.forward_generic(q, k_cache, v_cache)
        }
    }

    /// Device-independent reference built from tensor ops (gather, matmul, mask, softmax).
    pub fn forward_generic(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Tensor> {
        let dev = q.device();
        let (t, nh, hd) = q.dims3()?;
        let group = self.num_heads / self.num_kv_heads;
        let mut outs = Vec::new();
        for s in self.seqs.iter() {
            if s.q_len == 0 {
                continue;
            }
            let slots: Vec<u32> = (0..s.kv_len)
                .map(|p| {
                    (s.block_table[p / self.block_size] as usize * self.block_size
                        + p % self.block_size) as u32
                })
                .collect();
            let idx = Tensor::new(slots.as_slice(), dev)?;
            let k = k_cache
                .index_select(&idx, 0)?
                .reshape((s.kv_len, self.num_kv_heads, 1, hd))?
                .broadcast_as((s.kv_len, self.num_kv_heads, group, hd))?
                .reshape((s.kv_len, nh, hd))?
                .transpose(0, 1)?
                .contiguous()?; // [nh, L, hd]
            let v = v_cache
                .index_select(&idx, 0)?
                .reshape((s.kv_len, self.num_kv_heads, 1, hd))?
                .broadcast_as((s.kv_len, self.num_kv_heads, group, hd))?
                .reshape((s.kv_len, nh, hd))?
                .transpose(0, 1)?
                .contiguous()?;
            let qs = q
                .narrow(0, s.q_start, s.q_len)?
                .transpose(0, 1)?
                .contiguous()?; // [nh, q, hd]
            let scores = (qs.matmul(&k.t()?)? * self.scale as f64)?; // [nh, q, L]
            let mut mask = vec![f32::NEG_INFINITY; s.q_len * s.kv_len];
            for qi in 0..s.q_len {
                let (lo, hi) = self.visible(s, qi);
                for p in lo..hi {
                    mask[qi * s.kv_len + p] = 0.0;
                }
            }
            let mask = Tensor::from_vec(mask, (1, s.q_len, s.kv_len), dev)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
            let o = probs.matmul(&v)?; // [nh, q, hd]
            outs.push(o.transpose(0, 1)?.reshape((s.q_len, nh * hd))?);
        }
        let out = Tensor::cat(&outs, 0)?;
        debug_assert_eq!(out.dim(0)?, t);
        Ok(out)
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline]
fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(q), CpuStorage::F32(kc), CpuStorage::F32(vc)) = (qs, ks, vs) else {
            candle_core::bail!("paged attention expects f32 tensors");
        };
        let (Some((q0, _)), Some((k0, _)), Some((v0, _))) = (
            ql.contiguous_offsets(),
            kl.contiguous_offsets(),
            vl.contiguous_offsets(),
        ) else {
            candle_core::bail!("paged attention expects contiguous tensors");
        };
        let (q, kc, vc) = (&q[q0..], &kc[k0..], &vc[v0..]);
        let (t, nh, hd) = ql.shape().dims3()?;
        let kv_dim = self.num_kv_heads * hd;
        let group = nh / self.num_kv_heads;
        let mut out = vec![0f32; t * nh * hd];
        // Map each flat row to its sequence.
        let mut row_seq = vec![usize::MAX; t];
        for (si, s) in self.seqs.iter().enumerate() {
            row_seq[s.q_start..s.q_start + s.q_len].fill(si);
        }
        out.par_chunks_mut(hd).enumerate().for_each(|(task, o)| {
            let (row, h) = (task / nh, task % nh);
            let si = row_seq[row];
            if si == usize::MAX {
                return;
            }
            let s = &self.seqs[si];
            let qi = row - s.q_start;
            let (lo, hi) = self.visible(s, qi);
            if lo >= hi {
                return;
            }
            let qv = &q[(row * nh + h) * hd..(row * nh + h + 1) * hd];
            let kvh = h / group;
            let mut scores = Vec::with_capacity(hi - lo);
            let mut m = f32::NEG_INFINITY;
            for p in lo..hi {
                let slot = s.block_table[p / self.block_size] as usize * self.block_size
                    + p % self.block_size;
                let off = slot * kv_dim + kvh * hd;
                let sc = dot(qv, &kc[off..off + hd]) * self.scale;
                m = m.max(sc);
                scores.push(sc);
            }
            let mut l = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - m).exp();
                l += *sc;
            }
            let inv = 1.0 / l;
            for (i, p) in (lo..hi).enumerate() {
                let slot = s.block_table[p / self.block_size] as usize * self.block_size
                    + p % self.block_size;
                let off = slot * kv_dim + kvh * hd;
                axpy(o, scores[i] * inv, &vc[off..off + hd]);
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((t, nh * hd))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn check(causal: bool, window: Option<usize>) {
        let dev = Device::Cpu;
        let (nh, nkv, hd, bs) = (4, 2, 16, 4);
        let slots = 64;
        let kc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let seqs = vec![
            AttnSeq {
                q_start: 0,
                q_len: 3,
                q_pos0: 5,
                kv_len: 8,
                block_table: vec![7, 2],
            },
            AttnSeq {
                q_start: 3,
                q_len: 1,
                q_pos0: 0,
                kv_len: 1,
                block_table: vec![4],
            },
            AttnSeq {
                q_start: 4,
                q_len: 5,
                q_pos0: 6,
                kv_len: 11,
                block_table: vec![9, 1, 15],
            },
        ];
        let q = Tensor::randn(0f32, 1.0, (9, nh, hd), &dev).unwrap();
        let op = PagedAttention {
            seqs: std::sync::Arc::new(seqs),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            scale: 0.25,
            window,
            causal,
        };
        let a = op.forward(&q, &kc, &vc).unwrap();
        let b = op.forward_generic(&q, &kc, &vc).unwrap();
        let d = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-4, "kernel and reference differ by {d}");
    }

    #[test]
    fn kernel_matches_reference_causal() {
        check(true, None);
    }
    #[test]
    fn kernel_matches_reference_bidirectional() {
        check(false, None);
    }
    #[test]
    fn kernel_matches_reference_sliding_window() {
        check(true, Some(3));
    }
}
