//! A model drafter's context bookkeeping: the drafter and its own paged KV cache, and per
//! sequence the blocks it holds there, how far the target's hidden states are written into
//! them, the committed rows still waiting (the backlog), and the target's prefix-cache keys
//! its full blocks are registered under (so a prefix hit shares the drafter's context too).
//!
//! Committed hidden-state rows wait per sequence and are written into the drafter cache by
//! the next drafting call ([`DrafterContext::feed`]). A backlog that grows past
//! [`DETACH_ROWS`] (the drafter stayed off for that long) is dropped and that sequence
//! decodes plainly to its end (detached), so memory stays bounded.

use super::dspark::{ContextFeed, DSparkDrafter};
use crate::kv::KvCache;
use anyhow::Result;
use candle_core::Tensor;
use std::collections::HashMap;

/// A model drafter with its own context KV cache (fed with the target's hidden states).
pub struct Drafter {
    pub model: DSparkDrafter,
    pub kv: KvCache,
}

/// A sequence whose backlog reaches this many rows loses its drafter context and decodes
/// plainly until it ends.
pub const DETACH_ROWS: usize = 1024;

/// One sequence's drafter context.
#[derive(Default)]
struct SeqContext {
    /// Block table in the drafter's context cache.
    draft_blocks: Vec<u32>,
    /// The drafter's context feature of the last position fed (context-input drafters).
    draft_ctx: Option<Tensor>,
    /// Committed positions whose features are in the drafter cache
    /// (`draft_fed + pending.rows` = the target's cached positions).
    draft_fed: usize,
    pending: PendingFeatures,
    /// Lost its drafter context (backlog over [`DETACH_ROWS`]): never drafts again.
    detached: bool,
    /// The target's prefix-cache keys of this sequence's full blocks, and how many of its
    /// drafter blocks are registered under them (a block is once all its positions are fed).
    prefix_keys: Vec<u64>,
    draft_registered: usize,
}

/// The drafter and every sequence's context in it.
pub struct DrafterContext {
    pub drafter: Drafter,
    seqs: HashMap<u64, SeqContext>,
}

impl DrafterContext {
    pub fn new(drafter: Drafter) -> Self {
        Self {
            drafter,
            seqs: HashMap::new(),
        }
    }

    /// Draft block size of the drafter.
    pub fn block_size(&self) -> usize {
        self.drafter.model.config().block_size
    }

    /// Sequence `id` lost its drafter context for good.
    pub fn detached(&self, id: u64) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.detached)
    }

    /// Committed rows of `id` not yet written into the drafter cache.
    pub fn backlog(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.pending.rows)
    }

    /// Sequence `id` loses its drafter context for good (it decodes plainly).
    pub fn detach(&mut self, id: u64) {
        let st = self.seqs.entry(id).or_default();
        st.detached = true;
        st.pending = PendingFeatures::default();
        st.draft_ctx = None;
        self.drafter.kv.truncate(&mut st.draft_blocks, 0);
    }

    /// Every known sequence loses its drafter context (speculation switched off).
    pub fn detach_all(&mut self) {
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.detach(id);
        }
    }

    /// Turns prefix caching on in the drafter's context cache (keyed by the target's keys).
    pub fn enable_prefix_cache(&mut self) {
        self.drafter.kv.enable_prefix_cache("drafter");
    }

    /// How many of the leading target prefix-cache `keys` the drafter's cache holds too.
    pub fn shared_prefix(&self, keys: &[u64]) -> usize {
        self.drafter.kv.lookup_keys(keys).len()
    }

    /// A sequence starts on the first `keys.len()` cached blocks: its context shares the
    /// drafter blocks registered under the same keys.
    pub fn attach_prefix(&mut self, id: u64, keys: &[u64]) {
        if keys.is_empty() {
            return;
        }
        let kv = &mut self.drafter.kv;
        let blocks = kv.lookup_keys(keys);
        debug_assert_eq!(blocks.len(), keys.len(), "shared_prefix bounds the hit");
        let st = self.seqs.entry(id).or_default();
        st.draft_blocks = kv.share(&blocks);
        st.draft_fed = blocks.len() * kv.block_size;
        st.prefix_keys = keys[..blocks.len()].to_vec();
        st.draft_registered = blocks.len();
    }

    /// The target registered more of sequence `id`'s blocks under `keys`.
    pub fn note_prefix_keys(&mut self, id: u64, keys: &[u64]) {
        let st = self.seqs.entry(id).or_default();
        st.prefix_keys.extend_from_slice(keys);
        self.register(id);
    }

    /// Registers sequence `id`'s drafter blocks whose positions are all fed under the
    /// target's keys.
    fn register(&mut self, id: u64) {
        let Some(st) = self.seqs.get_mut(&id) else {
            return;
        };
        if st.detached {
            return;
        }
        let kv = &mut self.drafter.kv;
        let bs = kv.block_size;
        while st.draft_registered < st.prefix_keys.len()
            && (st.draft_registered + 1) * bs <= st.draft_fed
            && st.draft_registered < st.draft_blocks.len()
        {
            let i = st.draft_registered;
            kv.register_key(&st.draft_blocks, i, st.prefix_keys[i]);
            st.draft_registered += 1;
        }
    }

    /// One sequence's share of the forward: rows `first_row..first_row + valid` of `hidden`
    /// stay in the target cache (now `cached` positions). With no hidden states (speculation
    /// was off this step) the context cannot follow any more: the sequence is detached.
    pub fn commit(
        &mut self,
        id: u64,
        hidden: &[Tensor],
        first_row: usize,
        valid: usize,
        cached: usize,
    ) -> Result<()> {
        if hidden.is_empty() && valid > 0 {
            if !self.detached(id) {
                self.detach(id);
            }
            return Ok(());
        }
        let st = self.seqs.entry(id).or_default();
        if st.detached {
            return Ok(());
        }
        let kv = &mut self.drafter.kv;
        st.pending.push(hidden, first_row, valid)?;
        kv.truncate(&mut st.draft_blocks, cached);
        if st.pending.rows >= DETACH_ROWS {
            st.detached = true;
            st.pending = PendingFeatures::default();
            st.draft_ctx = None;
            kv.truncate(&mut st.draft_blocks, 0);
        }
        Ok(())
    }

    /// Blocks for `id`'s context up to `upto` positions; false when the cache cannot hold
    /// them.
    pub fn reserve(&mut self, id: u64, upto: usize) -> bool {
        let st = self.seqs.entry(id).or_default();
        self.drafter.kv.ensure(&mut st.draft_blocks, upto)
    }

    /// Attached sequences not in `except` whose backlog is at least `min_rows`, as
    /// `(rows, id)`, longest first.
    pub fn backlogs(&self, min_rows: usize, except: &[u64]) -> Vec<(usize, u64)> {
        let mut b: Vec<(usize, u64)> = self
            .seqs
            .iter()
            .filter(|(id, s)| !s.detached && s.pending.rows >= min_rows && !except.contains(id))
            .map(|(&id, s)| (s.pending.rows, id))
            .collect();
        b.sort_unstable_by(|a, b| b.cmp(a));
        b
    }

    /// Whether `id` can draft at anchor position `cached`: everything before it fed, and
    /// (context-input drafters) the feature of the position before the anchor known.
    pub fn ready(&self, id: u64, cached: usize) -> bool {
        let needs_ctx = self.drafter.model.config().context_input;
        self.seqs.get(&id).is_some_and(|s| {
            s.pending.rows == 0 && s.draft_fed == cached && (s.draft_ctx.is_some() || !needs_ctx)
        })
    }

    /// The drafter and a read-only view of the sequences' contexts, borrowed together (a
    /// draft reads the block tables while it writes the cache).
    pub fn split(&mut self) -> (&mut Drafter, Tables<'_>) {
        (&mut self.drafter, Tables(&self.seqs))
    }

    /// Writes the held rows of sequences `ids` into the drafter's context cache in one
    /// batched call. A sequence the drafter cache cannot hold keeps its backlog. A failed
    /// write detaches the sequences it carried (their contexts can no longer follow) and is
    /// returned.
    pub fn feed(&mut self, ids: &[u64]) -> Result<()> {
        let (mut fed, mut hidden) = (Vec::new(), Vec::new());
        for id in ids {
            let Some(s) = self.seqs.get_mut(id) else {
                continue;
            };
            let upto = s.draft_fed + s.pending.rows;
            if s.pending.rows == 0 || !self.drafter.kv.ensure(&mut s.draft_blocks, upto) {
                continue;
            }
            match s.pending.take() {
                Ok(h) => {
                    hidden.push(h);
                    fed.push(*id);
                }
                Err(e) => {
                    self.detach(*id);
                    return Err(e);
                }
            }
        }
        if fed.is_empty() {
            return Ok(());
        }
        let feeds: Vec<ContextFeed> = fed
            .iter()
            .zip(&hidden)
            .map(|(id, h)| {
                let s = &self.seqs[id];
                ContextFeed {
                    table: &s.draft_blocks,
                    start: s.draft_fed,
                    hidden: h,
                }
            })
            .collect();
        let d = &mut self.drafter;
        let last = match d.model.append_contexts(&mut d.kv, &feeds) {
            Ok(l) => l,
            Err(e) => {
                drop(feeds);
                for id in &fed {
                    self.detach(*id);
                }
                return Err(e);
            }
        };
        drop(feeds);
        for ((id, h), c) in fed.iter().zip(&hidden).zip(last) {
            let s = self.seqs.get_mut(id).expect("fed sequences exist");
            s.draft_fed += h.first().map_or(0, |t| t.dim(0).unwrap_or(0));
            if c.is_some() {
                s.draft_ctx = c;
            }
        }
        for id in &fed {
            self.register(*id);
        }
        Ok(())
    }

    /// Sequence `id` left (or starts over): frees its drafter blocks, forgets its context.
    pub fn release(&mut self, id: u64) {
        if let Some(mut st) = self.seqs.remove(&id) {
            self.drafter.kv.truncate(&mut st.draft_blocks, 0);
        }
    }

    /// Sequences with a context (for tests: none is left once all have ended).
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }
}

/// The sequences' drafter block tables and last context features, read while drafting.
pub struct Tables<'a>(&'a HashMap<u64, SeqContext>);

impl<'a> Tables<'a> {
    /// `id`'s block table and last context feature (`id` has a context).
    pub fn get(&self, id: u64) -> (&'a [u32], Option<&'a Tensor>) {
        let all: &'a HashMap<u64, SeqContext> = self.0;
        let s = &all[&id];
        (&s.draft_blocks, s.draft_ctx.as_ref())
    }
}

/// Target hidden-state rows of committed positions not yet written into the drafter's
/// context cache. Feeding waits for the next drafting call (one batched pass over every
/// drafting sequence), so while the plan keeps the drafter off it costs these copies only.
#[derive(Default)]
struct PendingFeatures {
    /// Per target layer, chunks of `[rows, hidden]` in position order.
    layers: Vec<Vec<Tensor>>,
    rows: usize,
}

impl PendingFeatures {
    /// Keeps rows `first_row..first_row + n` of this step's hidden states (copied, so the
    /// step's whole batch is not held).
    fn push(&mut self, hidden: &[Tensor], first_row: usize, n: usize) -> Result<()> {
        if n == 0 || hidden.is_empty() {
            return Ok(());
        }
        if self.layers.is_empty() {
            self.layers = vec![Vec::new(); hidden.len()];
        }
        for (chunks, h) in self.layers.iter_mut().zip(hidden) {
            chunks.push(h.narrow(0, first_row, n)?.force_contiguous()?);
        }
        self.rows += n;
        Ok(())
    }

    /// All held rows, one `[rows, hidden]` tensor per target layer; empties the backlog.
    fn take(&mut self) -> Result<Vec<Tensor>> {
        let out = self
            .layers
            .iter()
            .map(|c| Tensor::cat(c, 0))
            .collect::<candle_core::Result<_>>()?;
        *self = Self::default();
        Ok(out)
    }
}
