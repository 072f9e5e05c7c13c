//! The block allocator of the paged KV cache, with automatic prefix caching. Pure over block
//! ids (no tensors), so its invariants are tested directly.
//!
//! Every block is in exactly one of three states: free, in use (referenced by one or more
//! block tables), or cached (unreferenced, but its contents are still a known prefix and it
//! can be reused). A full block whose positions are all committed is *registered* under a
//! content key: a hash chained over the keys of the blocks before it and its own token ids
//! (salted with what else changes its contents: the model and the cache dtype). A new
//! sequence whose prompt starts with registered blocks shares them read-only (reference
//! counts) and prefills only the rest. A released registered block stays cached until the
//! allocator needs room: then the least recently used cached block is evicted. Positions a
//! sequence writes are always past its shared blocks (they are full), so sharing never
//! changes another sequence's keys and values; rejected draft tokens never reach a registered
//! block, because only committed positions are registered.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// A registered block's content key. `tokens` is empty for keys given from outside
/// ([`BlockPool::register_hash`]: the drafter's cache, keyed by the target's block keys).
#[derive(Debug, Clone)]
struct BlockKey {
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
}

/// How far a sequence's blocks are registered: blocks `..blocks` and the key of the last.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Chain {
    pub blocks: usize,
    pub hash: u64,
}

/// Counters of the prefix cache (monotonic; the metrics export them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens looked up / found in cached blocks.
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    pub evictions: u64,
}

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
    key: Vec<Option<BlockKey>>,
    by_hash: HashMap<u64, u32>,
    /// Cached blocks by last use (stamp -> block).
    lru: BTreeMap<u64, u32>,
    stamp: Vec<u64>,
    clock: u64,
    /// Prefix caching on: blocks are registered and kept after release.
    salt: Option<u64>,
    pub stats: PrefixStats,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            key: vec![None; num_blocks],
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            stamp: vec![0; num_blocks],
            clock: 0,
            salt: None,
            stats: PrefixStats::default(),
        }
    }

    /// Turns prefix caching on; `salt` names what else determines a block's contents.
    pub fn enable_prefix_cache(&mut self, salt: u64) {
        self.salt = Some(salt);
    }

    pub fn prefix_cache(&self) -> bool {
        self.salt.is_some()
    }

    /// Blocks an allocation can take: free plus cached (evictable) ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Registered blocks (in use or cached).
    pub fn registered(&self) -> usize {
        self.by_hash.len()
    }

    /// Cached blocks (registered, unreferenced).
    pub fn cached(&self) -> usize {
        self.lru.len()
    }

    fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&stamp, &b) = self.lru.iter().next()?;
                self.lru.remove(&stamp);
                if let Some(k) = self.key[b as usize].take() {
                    self.by_hash.remove(&k.hash);
                }
                self.stats.evictions += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released twice");
        *r -= 1;
        if *r > 0 {
            return;
        }
        if self.key[b as usize].is_some() && self.salt.is_some() {
            self.clock += 1;
            self.stamp[b as usize] = self.clock;
            self.lru.insert(self.clock, b);
        } else {
            self.key[b as usize] = None;
            self.free.push(b);
        }
    }

    /// Grows `table` to `blocks` blocks. False (and no change) if too few are available.
    pub fn ensure(&mut self, table: &mut Vec<u32>, blocks: usize) -> bool {
        if blocks <= table.len() {
            return true;
        }
        let extra = blocks - table.len();
        if extra > self.available() {
            return false;
        }
        for _ in 0..extra {
            let b = self.allocate().expect("checked available blocks");
            table.push(b);
        }
        true
    }

    /// Shrinks `table` to `blocks` blocks, releasing the rest.
    pub fn truncate(&mut self, table: &mut Vec<u32>, blocks: usize) {
        while table.len() > blocks {
            let b = table.pop().expect("len checked");
            self.release(b);
        }
    }

    /// The content key of a full block of `tokens` after the block keyed `parent`.
    pub fn hash_block(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.salt.unwrap_or(0).hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// The longest run of registered blocks `tokens` starts with, as (key, block), leaving
    /// at least one token of `tokens` to compute (its logits are needed). Takes nothing.
    pub fn lookup(&self, tokens: &[u32]) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        if self.salt.is_none() || tokens.is_empty() {
            return out;
        }
        let bs = self.block_size;
        let mut parent = 0u64;
        for i in 0..(tokens.len() - 1) / bs {
            let t = &tokens[i * bs..(i + 1) * bs];
            let h = self.hash_block(parent, t);
            let Some(&b) = self.by_hash.get(&h) else {
                break;
            };
            match &self.key[b as usize] {
                Some(k) if k.parent == parent && k.tokens == t => {}
                _ => break, // a hash collision: treat as a miss
            }
            out.push((h, b));
            parent = h;
        }
        out
    }

    /// The leading run of `hashes` registered here (blocks keyed from outside).
    pub fn lookup_hashes(&self, hashes: &[u64]) -> Vec<u32> {
        if self.salt.is_none() {
            return Vec::new();
        }
        hashes
            .iter()
            .map_while(|h| self.by_hash.get(h).copied())
            .collect()
    }

    /// Takes a reference on each of `blocks` (from [`Self::lookup`]), which become the start
    /// of a new block table.
    pub fn acquire(&mut self, blocks: &[u32]) -> Vec<u32> {
        for &b in blocks {
            if self.refs[b as usize] == 0 {
                self.lru.remove(&self.stamp[b as usize]);
            }
            self.refs[b as usize] += 1;
        }
        blocks.to_vec()
    }

    /// Registers the full blocks of `table` whose positions are all below `committed` (the
    /// sequence's `tokens` there are final), continuing `chain`. Returns the new keys, in
    /// block order. A block whose contents are already registered elsewhere stays private.
    pub fn register(
        &mut self,
        table: &[u32],
        tokens: &[u32],
        committed: usize,
        chain: &mut Chain,
    ) -> Vec<u64> {
        let mut keys = Vec::new();
        if self.salt.is_none() {
            return keys;
        }
        let bs = self.block_size;
        let full = (committed.min(tokens.len()) / bs).min(table.len());
        for i in chain.blocks..full {
            let t = &tokens[i * bs..(i + 1) * bs];
            let h = self.hash_block(chain.hash, t);
            let b = table[i] as usize;
            if self.key[b].is_none() && !self.by_hash.contains_key(&h) {
                self.key[b] = Some(BlockKey {
                    hash: h,
                    parent: chain.hash,
                    tokens: t.to_vec(),
                });
                self.by_hash.insert(h, b as u32);
            }
            keys.push(h);
            chain.hash = h;
            chain.blocks = i + 1;
        }
        keys
    }

    /// Registers block `table[index]` under a key computed elsewhere (the drafter cache
    /// follows the target's keys).
    pub fn register_hash(&mut self, table: &[u32], index: usize, hash: u64) {
        if self.salt.is_none() {
            return;
        }
        let b = table[index] as usize;
        if self.key[b].is_none() && !self.by_hash.contains_key(&hash) {
            self.key[b] = Some(BlockKey {
                hash,
                parent: 0,
                tokens: Vec::new(),
            });
            self.by_hash.insert(hash, b as u32);
        }
    }

    /// Checks the allocator's invariants against the block tables in use (tests).
    #[cfg(test)]
    pub fn check(&self, tables: &[&Vec<u32>]) {
        let n = self.refs.len();
        let mut held = vec![0u32; n];
        for t in tables {
            for &b in t.iter() {
                held[b as usize] += 1;
            }
        }
        let mut seen = vec![0u8; n];
        for &b in &self.free {
            seen[b as usize] += 1;
            assert!(self.key[b as usize].is_none(), "free block {b} keeps a key");
        }
        for &b in self.lru.values() {
            seen[b as usize] += 1;
            assert!(
                self.key[b as usize].is_some(),
                "cached block {b} has no key"
            );
        }
        for b in 0..n {
            assert_eq!(self.refs[b], held[b], "block {b}: refs vs tables");
            if held[b] > 0 {
                seen[b] += 1;
            }
            assert_eq!(seen[b], 1, "block {b} is in {} states", seen[b]);
        }
        for (h, &b) in &self.by_hash {
            assert_eq!(self.key[b as usize].as_ref().map(|k| k.hash), Some(*h));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn filled(pool: &mut BlockPool, tokens: &[u32]) -> (Vec<u32>, Chain, usize) {
        let hits = pool.lookup(tokens);
        pool.stats.queried_tokens += tokens.len() as u64;
        let blocks: Vec<u32> = hits.iter().map(|h| h.1).collect();
        let mut table = pool.acquire(&blocks);
        let cached = blocks.len() * 4;
        let mut chain = Chain {
            blocks: blocks.len(),
            hash: hits.last().map_or(0, |h| h.0),
        };
        assert!(pool.ensure(&mut table, tokens.len().div_ceil(4)));
        pool.register(&table, tokens, tokens.len(), &mut chain);
        (table, chain, cached)
    }

    #[test]
    fn a_shared_prefix_is_found_shared_and_kept_after_release() {
        let mut pool = BlockPool::new(8, 4);
        pool.enable_prefix_cache(1);
        let a: Vec<u32> = (0..10).collect();
        let (mut ta, _, hit) = filled(&mut pool, &a);
        assert_eq!(hit, 0);
        // Same first 8 tokens, then different: two blocks shared.
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([50, 51, 52]);
        let (mut tb, _, hit) = filled(&mut pool, &b);
        assert_eq!(hit, 8);
        assert_eq!(ta[..2], tb[..2]);
        assert_ne!(ta[2], tb[2]);
        pool.check(&[&ta, &tb]);
        // A prompt of exactly two blocks reuses only the first (its last token is computed).
        let c: Vec<u32> = (0..8).collect();
        assert_eq!(pool.lookup(&c).len(), 1);
        pool.truncate(&mut ta, 0);
        pool.truncate(&mut tb, 0);
        pool.check(&[]);
        assert_eq!(pool.available(), 8);
        assert_eq!(pool.cached(), 2, "the registered (full) blocks stay cached");
        assert_eq!(pool.lookup(&b).len(), 2);
        // A different first block shares nothing, even with the same second block.
        let mut d = vec![9, 9, 9, 9];
        d.extend(4..8);
        d.push(1);
        assert!(pool.lookup(&d).is_empty());
    }

    #[test]
    fn the_least_recently_used_cached_block_is_evicted_first() {
        let mut pool = BlockPool::new(4, 4);
        pool.enable_prefix_cache(1);
        let (mut t1, _, _) = filled(&mut pool, &[1, 1, 1, 1, 0]);
        let (mut t2, _, _) = filled(&mut pool, &[2, 2, 2, 2, 0]);
        assert_eq!(pool.available(), 0);
        pool.truncate(&mut t1, 0); // block [1,1,1,1] cached first, the tail freed
        pool.truncate(&mut t2, 0);
        // Three blocks: the two free ones go first, then the oldest cached one.
        let mut t = Vec::new();
        assert!(pool.ensure(&mut t, 3));
        assert_eq!(pool.stats.evictions, 1);
        assert!(pool.lookup(&[1, 1, 1, 1, 0]).is_empty(), "oldest evicted");
        assert_eq!(pool.lookup(&[2, 2, 2, 2, 0]).len(), 1, "newer kept");
        pool.check(&[&t]);
    }

    #[test]
    fn rollback_never_registers_uncommitted_positions() {
        let mut pool = BlockPool::new(4, 4);
        pool.enable_prefix_cache(1);
        let mut table = Vec::new();
        let mut chain = Chain::default();
        let tokens: Vec<u32> = (0..12).collect();
        assert!(pool.ensure(&mut table, 3));
        // Positions 0..6 committed; 6..12 were drafts.
        pool.register(&table, &tokens, 6, &mut chain);
        assert_eq!(chain.blocks, 1);
        pool.truncate(&mut table, 2);
        assert_eq!(pool.registered(), 1);
        pool.check(&[&table]);
    }

    #[test]
    fn without_prefix_caching_released_blocks_are_free() {
        let mut pool = BlockPool::new(4, 4);
        let (mut t, _, _) = filled(&mut pool, &(0..9).collect::<Vec<u32>>());
        assert_eq!(pool.registered(), 0);
        pool.truncate(&mut t, 0);
        assert_eq!(pool.cached(), 0);
        assert!(pool.lookup(&(0..9).collect::<Vec<u32>>()).is_empty());
        pool.check(&[]);
    }

    proptest! {
        /// Random admissions (prompts over a tiny alphabet, so prefixes repeat), partial
        /// rollbacks and releases keep every block in exactly one state, reference counts
        /// equal to the tables holding each block, and every hit exact: a shared block holds
        /// the tokens the new prompt has at those positions.
        #[test]
        fn the_pool_keeps_its_invariants(
            ops in proptest::collection::vec((0usize..3, proptest::collection::vec(0u32..2, 1..14), 0usize..4), 1..40),
        ) {
            let mut pool = BlockPool::new(12, 4);
            pool.enable_prefix_cache(7);
            let mut live: Vec<(Vec<u32>, Vec<u32>)> = Vec::new(); // (table, tokens)
            let mut content: HashMap<u32, Vec<u32>> = HashMap::new();
            for (op, tokens, k) in ops {
                match op {
                    0 => {
                        let hits = pool.lookup(&tokens);
                        for (i, &(_, b)) in hits.iter().enumerate() {
                            prop_assert_eq!(&content[&b][..], &tokens[i * 4..(i + 1) * 4]);
                        }
                        let blocks: Vec<u32> = hits.iter().map(|h| h.1).collect();
                        let mut table = pool.acquire(&blocks);
                        let mut chain = Chain { blocks: blocks.len(), hash: hits.last().map_or(0, |h| h.0) };
                        if pool.ensure(&mut table, tokens.len().div_ceil(4)) {
                            for (i, &b) in table.iter().enumerate().skip(blocks.len()) {
                                let end = ((i + 1) * 4).min(tokens.len());
                                content.insert(b, tokens[i * 4..end].to_vec());
                            }
                            pool.register(&table, &tokens, tokens.len(), &mut chain);
                            live.push((table, tokens));
                        } else {
                            pool.truncate(&mut table, 0);
                        }
                    }
                    1 if !live.is_empty() => {
                        let (mut t, _) = live.swap_remove(k % live.len());
                        pool.truncate(&mut t, 0);
                    }
                    _ if !live.is_empty() => {
                        let i = k % live.len();
                        let (t, toks) = &mut live[i];
                        let keep = t.len().saturating_sub(1).max(toks.len().min(4) / 4);
                        pool.truncate(t, keep);
                        toks.truncate(keep * 4);
                        if t.is_empty() {
                            live.swap_remove(i);
                        }
                    }
                    _ => {}
                }
                let tables: Vec<&Vec<u32>> = live.iter().map(|l| &l.0).collect();
                pool.check(&tables);
            }
        }
    }
}
