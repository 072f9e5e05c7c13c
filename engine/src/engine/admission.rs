//! Admission: which queued sequences join the running batch, and on which cached prefix
//! blocks each starts (automatic prefix caching, as far as the drafter's context cache
//! holds them too); committed full blocks are registered for later requests.

use super::planner::{self, Limits};
use super::seq::Seq;
use super::Engine;

impl Engine {
    /// Starts an admitted sequence on the cached blocks its tokens begin with (automatic
    /// prefix caching), as far as the drafter's context cache holds them too, so that
    /// speculation after a hit is the same as without one.
    pub(super) fn attach_prefix(&mut self, s: &mut Seq) {
        if s.cached > 0 || !self.kv.prefix_cache() {
            return;
        }
        let hits = self.kv.lookup_prefix(&s.tokens);
        let keys: Vec<u64> = hits.iter().map(|h| h.0).collect();
        let n = self.spec.shared_prefix(&keys);
        let blocks: Vec<u32> = hits[..n].iter().map(|h| h.1).collect();
        s.blocks = self.kv.share(&blocks);
        s.cached = n * self.kv.block_size;
        s.chain = crate::kv::Chain {
            blocks: n,
            hash: keys[..n].last().copied().unwrap_or(0),
        };
        self.spec.attach_prefix(s.id, &keys[..n]);
        let st = self.kv.prefix_stats_mut();
        st.queried_tokens += s.tokens.len() as u64;
        st.hit_tokens += s.cached as u64;
        self.metrics.prefix_queries.inc_by(s.tokens.len() as u64);
        self.metrics.prefix_hits.inc_by(s.cached as u64);
        if s.cached_prompt.is_none() {
            s.cached_prompt = Some(s.cached.min(s.prompt_len));
        }
    }

    /// Whether `s` should wait because a running sequence is still prefilling full blocks
    /// that `s` starts with too: once they are computed, `s` starts on them from the prefix
    /// cache instead of computing them again (the `n` choices of one prompt, requests with
    /// one system prompt arriving together).
    fn waits_for_shared_prefill<'a>(
        &'a self,
        s: &Seq,
        ahead: impl Iterator<Item = &'a Seq>,
    ) -> bool {
        let bs = self.kv.block_size;
        if !self.kv.prefix_cache() || s.cached > 0 || s.tokens.len() <= bs {
            return false;
        }
        self.running.iter().chain(ahead).any(|r| {
            if r.cached >= r.prompt_len || r.tokens.len() <= bs || r.tokens[..bs] != s.tokens[..bs]
            {
                return false;
            }
            let common = r
                .tokens
                .iter()
                .zip(&s.tokens[..s.tokens.len() - 1])
                .take_while(|(a, b)| a == b)
                .count();
            r.cached < common / bs * bs
        })
    }

    /// Registers the sequence's newly committed full blocks in the prefix cache (the
    /// drafter's cache follows with the same keys).
    pub(super) fn register_blocks(&mut self, i: usize) {
        let s = &mut self.running[i];
        // A sequence that stopped inside an accepted block has fewer tokens than positions.
        let committed = s.cached.min(s.tokens.len());
        let keys = self
            .kv
            .register(&s.blocks, &s.tokens, committed, &mut s.chain);
        if !keys.is_empty() {
            self.spec.note_prefix_keys(s.id, &keys);
        }
    }

    pub(super) fn limits(&self) -> Limits {
        Limits {
            max_batch_tokens: self.cfg.max_batch_tokens,
            prefill_chunk: self.cfg.prefill_chunk,
            block_size: self.kv.block_size,
            free_blocks: self.kv.free_blocks(),
        }
    }

    /// Moves the sequences the planner admits from the queue to the running list.
    pub(super) fn admit(&mut self) {
        // Sequences waiting for another's prefill of their shared prefix stay queued (the
        // other running, or admitted before them now).
        let mut eligible: Vec<usize> = Vec::new();
        for i in 0..self.waiting.len() {
            let s = &self.waiting[i];
            let ahead = eligible.iter().map(|&j| &self.waiting[j]);
            if !self.waits_for_shared_prefill(s, ahead) {
                eligible.push(i);
            }
        }
        let n = planner::admit(
            eligible.iter().map(|&i| self.waiting[i].tokens.len()),
            self.running.len(),
            self.cfg.max_running,
            &self.limits(),
        );
        let mut admitted: Vec<Seq> = Vec::with_capacity(n);
        for &i in eligible[..n].iter().rev() {
            admitted.push(self.waiting.remove(i).expect("eligible index"));
        }
        admitted.reverse();
        for mut s in admitted {
            self.attach_prefix(&mut s);
            if !s.queued_metric_done {
                self.metrics
                    .queue_time
                    .observe(s.req.arrived.elapsed().as_secs_f64());
                s.queued_metric_done = true;
            }
            s.enter_phase(if s.first_token.is_none() {
                "prefill"
            } else {
                "recompute"
            });
            self.running.push(s);
        }
    }
}
