//! Attention over the paged KV cache for many sequences of different lengths in one call.
//!
//! On CPU a custom kernel reads keys and values straight from the cache slots (no gather
//! copies); on other devices the same semantics are built from tensor ops. Tests check the two
//! against each other.
//!
//! Files: the batch's device-side gather plans ([`plan`]), the device-independent path built
//! from tensor ops ([`generic`]), how a CPU call is cut into pool tasks ([`work`]), the CPU
//! kernel ([`cpu`]) and its x86 inner loops ([`simd`]).

mod cpu;
mod generic;
mod plan;
mod simd;
#[cfg(test)]
mod tests;
mod work;

use candle_core::{Result, Tensor};

pub use plan::AttnBatch;

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
    pub seqs: std::sync::Arc<AttnBatch>,
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

    /// Calls `f(p, slot)` for positions `lo..hi` in order, walking the block table.
    #[inline(always)]
    fn for_slots(&self, s: &AttnSeq, lo: usize, hi: usize, mut f: impl FnMut(usize, usize)) {
        let bs = self.block_size;
        let mut p = lo;
        while p < hi {
            let base = s.block_table[p / bs] as usize * bs;
            let end = ((p / bs + 1) * bs).min(hi);
            for pp in p..end {
                f(pp, base + pp % bs);
            }
            p = end;
        }
    }
}
