//! The paged KV cache: fixed-size blocks of key/value slots for every layer, shared by all
//! sequences, handed out from a free list under a memory budget. Slots are f32 or f16
//! ([`KvCache::new_as`]); f16 halves the memory and the bytes attention reads per step (the
//! attention kernel widens rows to f32 as it reads them), as llama.cpp's default cache does.
//!
//! The model never owns the cache: a forward gets each sequence's block table (a view) and
//! writes the new keys/values into the slots it names. Sequences of any length therefore run
//! in one batched forward, and a finished or cancelled sequence returns its blocks at once.
//! Blocks are handed out by [`blocks::BlockPool`], which also caches full prefix blocks by
//! content (automatic prefix caching) when [`KvCache::enable_prefix_cache`] turned it on.

pub mod blocks;

use anyhow::{bail, Result};
use blocks::BlockPool;
pub use blocks::{Chain, PrefixStats};
use candle_core::{DType, Device, Tensor};

pub struct KvCache {
    pub block_size: usize,
    num_blocks: usize,
    kv_dim: usize,
    /// Per layer `[num_blocks * block_size, kv_dim]` of `dtype`.
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    pool: BlockPool,
    dtype: DType,
}

/// Where the rows of one forward go in the cache (see [`KvCache::slot_index`]).
pub struct SlotIndex {
    slots: Vec<u32>,
    /// `[T, kv_dim]` u32 (row i all `slots[i]`) for devices that scatter with tensors.
    tensor: Option<Tensor>,
}

impl KvCache {
    /// Bytes one token's keys and values take over all layers in an f32 cache.
    pub fn bytes_per_token(num_layers: usize, kv_dim: usize) -> usize {
        Self::bytes_per_token_as(num_layers, kv_dim, DType::F32)
    }

    /// Bytes one token's keys and values take over all layers in a cache of `dtype`.
    pub fn bytes_per_token_as(num_layers: usize, kv_dim: usize, dtype: DType) -> usize {
        num_layers * 2 * kv_dim * dtype.size_in_bytes()
    }

    /// An f32 cache.
    pub fn new(
        num_layers: usize,
        kv_dim: usize,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<Self> {
        Self::new_as(
            num_layers,
            kv_dim,
            budget_bytes,
            block_size,
            device,
            DType::F32,
        )
    }

    /// A cache of `dtype` (F32 or F16) with as many blocks as `budget_bytes` holds.
    pub fn new_as(
        num_layers: usize,
        kv_dim: usize,
        budget_bytes: usize,
        block_size: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F16) {
            bail!("KV cache dtype {dtype:?} is not supported (use f16 or f32)");
        }
        let per_block = Self::bytes_per_token_as(num_layers, kv_dim, dtype) * block_size;
        let num_blocks = budget_bytes / per_block;
        if num_blocks == 0 {
            bail!(
                "KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens ({per_block} bytes); raise --kv-cache-mb"
            );
        }
        let slots = num_blocks * block_size;
        let mut k = Vec::with_capacity(num_layers);
        let mut v = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            k.push(Tensor::zeros((slots, kv_dim), dtype, device)?);
            v.push(Tensor::zeros((slots, kv_dim), dtype, device)?);
        }
        Ok(Self {
            block_size,
            num_blocks,
            kv_dim,
            k,
            v,
            pool: BlockPool::new(num_blocks, block_size),
            dtype,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The cache slots rows of a forward go to, ready for [`Self::write`] on this cache's
    /// device.
    pub fn slot_index(&self, slots: Vec<u32>) -> candle_core::Result<SlotIndex> {
        let dev = self.k.first().map(|t| t.device().clone());
        let tensor = match dev {
            Some(dev) if !dev.is_cpu() => {
                let t = slots.len();
                Some(
                    Tensor::new(slots.as_slice(), &dev)?
                        .reshape((t, 1))?
                        .broadcast_as((t, self.kv_dim))?
                        .contiguous()?,
                )
            }
            _ => None,
        };
        Ok(SlotIndex { slots, tensor })
    }

    /// Writes rows of `k` and `v` (`[T, kv_dim]`, any float dtype) of `layer` into the slots
    /// of `idx` (row i into `idx.slots[i]`), converting to the cache dtype. On CPU the rows
    /// are copied (or narrowed to f16) straight into the cache.
    pub fn write(
        &mut self,
        layer: usize,
        idx: &SlotIndex,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<()> {
        match &idx.tensor {
            Some(slot_idx) => {
                let (k, v) = (k.to_dtype(self.dtype)?, v.to_dtype(self.dtype)?);
                self.k[layer].scatter_set(slot_idx, &k.contiguous()?, 0)?;
                self.v[layer].scatter_set(slot_idx, &v.contiguous()?, 0)
            }
            None => {
                let op = crate::kernels::write_rows::WriteRows { slots: &idx.slots };
                let f32_rows = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
                self.k[layer].inplace_op2(&f32_rows(k)?, &op)?;
                self.v[layer].inplace_op2(&f32_rows(v)?, &op)
            }
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }
    pub fn total_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Blocks an allocation can take (free, or cached prefix blocks it may evict).
    pub fn free_blocks(&self) -> usize {
        self.pool.available()
    }
    pub fn capacity_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so it can hold `tokens` positions. False (and no change) if the cache
    /// has too few free blocks.
    pub fn ensure(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let need = self.blocks_for(tokens);
        self.pool.ensure(table, need)
    }

    /// Shrinks `table` to the blocks needed for `tokens` positions (rollback of rejected
    /// draft tokens, or release with `tokens = 0`).
    pub fn truncate(&mut self, table: &mut Vec<u32>, tokens: usize) {
        let keep = self.blocks_for(tokens);
        self.pool.truncate(table, keep);
    }

    /// Turns automatic prefix caching on; `salt` names the model and anything else that
    /// changes a block's contents for the same tokens (the cache dtype is added here).
    pub fn enable_prefix_cache(&mut self, salt: &str) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(salt, format!("{:?}", self.dtype)), &mut h);
        self.pool.enable_prefix_cache(std::hash::Hasher::finish(&h));
    }

    pub fn prefix_cache(&self) -> bool {
        self.pool.prefix_cache()
    }

    /// The cached blocks `tokens` starts with (key, block), at least one token left over.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> Vec<(u64, u32)> {
        self.pool.lookup(tokens)
    }

    /// The leading run of `keys` this cache holds (a drafter cache keyed by the target's).
    pub fn lookup_keys(&self, keys: &[u64]) -> Vec<u32> {
        self.pool.lookup_hashes(keys)
    }

    /// A new block table starting with the shared `blocks` (references taken).
    pub fn share(&mut self, blocks: &[u32]) -> Vec<u32> {
        self.pool.acquire(blocks)
    }

    /// Registers the full blocks of `table` below `committed` positions; the new keys.
    pub fn register(
        &mut self,
        table: &[u32],
        tokens: &[u32],
        committed: usize,
        chain: &mut Chain,
    ) -> Vec<u64> {
        self.pool.register(table, tokens, committed, chain)
    }

    /// Registers `table[index]` under the key `key` computed by another cache.
    pub fn register_key(&mut self, table: &[u32], index: usize, key: u64) {
        self.pool.register_hash(table, index, key)
    }

    /// Prefix-cache counters.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.pool.stats
    }
    pub fn prefix_stats_mut(&mut self) -> &mut PrefixStats {
        &mut self.pool.stats
    }
    /// Cached (unreferenced, reusable) blocks.
    pub fn cached_blocks(&self) -> usize {
        self.pool.cached()
    }
    /// Registered blocks (in use or cached).
    pub fn registered_blocks(&self) -> usize {
        self.pool.registered()
    }

    /// Slot index of logical position `pos` in a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_and_returned() {
        let mut kv = KvCache::new(2, 8, 2 * 2 * 8 * 4 * 4 * 10, 4, &Device::Cpu).unwrap();
        assert_eq!(kv.total_blocks(), 10);
        let mut a = vec![];
        assert!(kv.ensure(&mut a, 9));
        assert_eq!(a.len(), 3);
        let mut b = vec![];
        assert!(!kv.ensure(&mut b, 40), "8 tokens over budget must fail");
        assert!(b.is_empty());
        assert!(kv.ensure(&mut b, 28));
        assert_eq!(kv.free_blocks(), 0);
        kv.truncate(&mut a, 5);
        assert_eq!(a.len(), 2);
        assert_eq!(kv.free_blocks(), 1);
        kv.truncate(&mut b, 0);
        assert_eq!(kv.free_blocks(), 8);
        assert_eq!(kv.slot(&a, 5), a[1] as usize * 4 + 1);
    }

    #[test]
    fn an_f16_cache_holds_twice_the_tokens_and_converts_writes() {
        let budget = 2 * 2 * 8 * 4 * 4 * 10;
        let kv32 = KvCache::new(2, 8, budget, 4, &Device::Cpu).unwrap();
        let mut kv16 = KvCache::new_as(2, 8, budget, 4, &Device::Cpu, DType::F16).unwrap();
        assert_eq!(kv16.total_blocks(), 2 * kv32.total_blocks());
        let k = Tensor::new(&[[0.5f32; 8], [1.25; 8]], &Device::Cpu).unwrap();
        let v = (&k * -2.0).unwrap();
        let idx = kv16.slot_index(vec![3, 9]).unwrap();
        kv16.write(1, &idx, &k, &v).unwrap();
        let rows =
            |t: &Tensor| -> Vec<Vec<f32>> { t.to_dtype(DType::F32).unwrap().to_vec2().unwrap() };
        assert_eq!(kv16.k[1].dtype(), DType::F16);
        assert_eq!(rows(&kv16.k[1])[9], vec![1.25; 8]);
        assert_eq!(rows(&kv16.v[1])[3], vec![-1.0; 8]);
        assert_eq!(rows(&kv16.k[0])[9], vec![0.0; 8]);
        let e = KvCache::new_as(2, 8, budget, 4, &Device::Cpu, DType::BF16)
            .err()
            .unwrap();
        assert!(e.to_string().contains("not supported"));
    }

    #[test]
    fn zero_budget_is_a_clear_error() {
        let e = KvCache::new(2, 8, 10, 16, &Device::Cpu).err().unwrap();
        assert!(e.to_string().contains("--kv-cache-mb"));
    }
}
