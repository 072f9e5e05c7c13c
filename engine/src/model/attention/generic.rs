//! The device-independent attention path, built from tensor ops.

use super::plan::Group;
use super::PagedAttention;
use candle_core::{Result, Tensor};

impl PagedAttention {
    /// Device-independent path built from tensor ops (gather, batched matmul, mask, softmax):
    /// what runs on CUDA, and the CPU kernel's reference in tests. Sequences are padded into
    /// groups of similar lengths (bounded in query rows x keys), so a
    /// layer costs a fixed number of kernel launches per group, not per sequence; the gather
    /// indices and masks go to the device once per forward ([`AttnBatch`](super::AttnBatch) keeps them for all
    /// layers), never once per sequence and layer.
    pub fn forward_generic(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Tensor> {
        let (t, nh, hd) = q.dims3()?;
        let plan = self.seqs.plan(self, q.device())?;
        let (nkv, group) = (self.num_kv_heads, self.num_heads / self.num_kv_heads);
        let gather = |cache: &Tensor, g: &Group| -> Result<Tensor> {
            cache
                .index_select(&g.slots, 0)?
                .to_dtype(candle_core::DType::F32)?
                .reshape((g.n, g.lmax, nkv, hd))?
                .transpose(1, 2)?
                .contiguous() // [n, nkv, L, hd]
        };
        let mut outs = Vec::with_capacity(plan.groups.len());
        for g in &plan.groups {
            let (n, qm, lm) = (g.n, g.qmax, g.lmax);
            // [n * qmax, nh, hd] -> [n, nkv, group * qmax, hd]: the query heads sharing a kv
            // head attend to its keys in one product.
            let qs = q
                .index_select(&g.rows, 0)?
                .reshape((n, qm, nkv, group, hd))?
                .permute((0, 2, 3, 1, 4))?
                .contiguous()?
                .reshape((n, nkv, group * qm, hd))?;
            let k = gather(k_cache, g)?;
            let v = gather(v_cache, g)?;
            let scores = (qs.matmul(&k.t()?)? * self.scale as f64)?
                .reshape((n, nkv, group, qm, lm))?
                .broadcast_add(&g.mask)?;
            let probs =
                candle_nn::ops::softmax_last_dim(&scores)?.reshape((n, nkv, group * qm, lm))?;
            let o = probs
                .matmul(&v)? // [n, nkv, group * qmax, hd]
                .reshape((n, nkv, group, qm, hd))?
                .permute((0, 3, 1, 2, 4))?
                .contiguous()?
                .reshape((n * qm, nh * hd))?;
            outs.push(o);
        }
        let out = Tensor::cat(&outs, 0)?.index_select(&plan.unpad, 0)?;
        debug_assert_eq!(out.dim(0)?, t);
        Ok(out)
    }
}
