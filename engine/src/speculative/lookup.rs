//! Prompt lookup beside a model drafter: each step, a decoding sequence whose recent tokens
//! occur earlier in its own context (code that restates its prompt, a loop the model is
//! repeating, an identifier list) may verify the continuation found there instead of the
//! model drafter's block, when that is worth more tokens per second under the cost table.
//!
//! - The lookup is [`super::ngram::lookup`]: the longest earlier occurrence of the last
//!   `n` tokens (`MIN_N..=MAX_N`), most recent first.
//! - Its per-position acceptance is learnt live, separately per match length bucket
//!   ([`bucket`]): a continuation found after 8 matching tokens is accepted far more often
//!   than one after 2, and both differ from the model drafter's rates.
//! - The choice ([`LookupAssist::prefer`]) compares the best expected rate of each source
//!   for the sequence alone (committed tokens per second over its verify lengths, the
//!   model's drafting time included). It reads only the context and past outcomes, never
//!   the model drafter's sampled tokens, so each block's draft law is the one declared in
//!   its `q` (a point mass for lookup) and rejection sampling stays lossless.
//! - A lookup block the plan does not verify is scored as a shadow against the tokens the
//!   target commits (exactly its acceptance chance for a point-mass draft), so the rates
//!   keep learning while the model drafter is chosen.

use super::{AcceptanceStats, Proposal};
use crate::sampling::Dist;

/// Shortest suffix the lookup matches (one token matches too often to be worth a verify).
pub const MIN_N: usize = 2;
/// Longest suffix tried; matches this long fall in the top bucket.
pub const MAX_N: usize = 8;
/// Match-length buckets: `[MIN_N, 4)`, `[4, 8)`, `[8, ..)`.
pub const BUCKETS: usize = 3;
/// Half-life, in verified lookup blocks, of a bucket's rates.
const HALF_LIFE: f64 = 100.0;
/// Longest lookup block tracked.
const POSITIONS: usize = 64;

/// The bucket of a match of `n` tokens.
pub fn bucket(n: usize) -> usize {
    match n {
        0..=3 => 0,
        4..=7 => 1,
        _ => 2,
    }
}

/// A lookup block for one sequence, before the choice.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupBlock {
    pub tokens: Vec<u32>,
    /// Its match-length bucket.
    pub bucket: usize,
}

/// The live rates of lookup blocks and the choice against the model drafter.
#[derive(Debug, Clone)]
pub struct LookupAssist {
    stats: Vec<AcceptanceStats>,
}

impl Default for LookupAssist {
    fn default() -> Self {
        Self {
            stats: (0..BUCKETS)
                .map(|_| AcceptanceStats::new(POSITIONS, HALF_LIFE))
                .collect(),
        }
    }
}

impl LookupAssist {
    /// The continuation of `tokens` (prompt + output so far) found by lookup, at most `cap`
    /// tokens (`None`: no match of [`MIN_N`] tokens or more, or `cap` is 0).
    pub fn find(&self, tokens: &[u32], cap: usize) -> Option<LookupBlock> {
        if cap == 0 {
            return None;
        }
        let (n, tokens) = super::ngram::lookup(tokens, cap, MIN_N, MAX_N)?;
        Some(LookupBlock {
            tokens,
            bucket: bucket(n),
        })
    }

    /// Conditional acceptance rates of positions `0..len` in `bucket`'s blocks (the rule of
    /// [`super::memory::predicted_rates`], no per-sequence memory).
    pub fn rates(&self, bucket: usize, len: usize) -> Vec<f32> {
        super::memory::predicted_rates(&self.stats[bucket.min(BUCKETS - 1)], None, len)
    }

    /// The block as a proposal: point-mass drafts, its bucket's rates as confidences.
    pub fn proposal(&self, b: LookupBlock) -> Proposal {
        Proposal {
            q: b.tokens.iter().map(|&t| Dist::Greedy(t)).collect(),
            confidence: self.rates(b.bucket, b.tokens.len()),
            tokens: b.tokens,
        }
    }

    /// Records a verified (or shadow-scored) lookup block of `bucket`.
    pub fn record(&mut self, bucket: usize, verified: usize, accepted: usize) {
        self.stats[bucket.min(BUCKETS - 1)].record(verified, accepted);
    }

    /// Whether the lookup block (rates `lookup`) is worth more than the model drafter's
    /// block (prefix survivals `model`, costing `t_draft(l)` seconds to draft `l` tokens)
    /// for a sequence in a forward of `base_b` tokens priced by `sps`, and more than
    /// decoding plainly.
    pub fn prefer(
        lookup: &[f32],
        model: &[f64],
        base_b: usize,
        sps: &dyn Fn(usize) -> f64,
        t_draft: &dyn Fn(usize) -> f64,
    ) -> bool {
        let lookup = super::scheduler::survival(lookup);
        let plain = sps(base_b.max(1));
        let l = best_rate(&lookup, base_b, sps, &|_| 0.0);
        l > plain && l >= best_rate(model, base_b, sps, t_draft)
    }
}

/// Most expected committed tokens per second over verify lengths `0..=survival.len()`.
fn best_rate(
    survival: &[f64],
    base_b: usize,
    sps: &dyn Fn(usize) -> f64,
    t_draft: &dyn Fn(usize) -> f64,
) -> f64 {
    let mut best = sps(base_b.max(1));
    let mut tokens = 1.0;
    for (l, s) in survival.iter().enumerate() {
        let l = l + 1;
        tokens += s;
        let secs = 1.0 / sps(base_b.max(1) + l) + t_draft(l);
        best = best.max(tokens / secs);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward of b tokens runs at 20 steps/s for one token, 6 % slower per extra token.
    fn sps(b: usize) -> f64 {
        20.0 / (1.0 + 0.06 * (b as f64 - 1.0))
    }

    #[test]
    fn finds_matches_by_length_bucket() {
        let a = LookupAssist::default();
        // "1 2 3 4 5 6 7 8 9" then "1 2 3 4 5 6 7 8" again: an 8-token match.
        let mut t: Vec<u32> = (1..=9).chain(1..=8).collect();
        let b = a.find(&t, 4).unwrap();
        assert_eq!((b.tokens.clone(), b.bucket), (vec![9, 1, 2, 3], 2));
        t = vec![5, 6, 7, 1, 2, 9, 1, 2];
        assert_eq!(
            a.find(&t, 3).unwrap(),
            LookupBlock {
                tokens: vec![9, 1, 2],
                bucket: 0
            }
        );
        // A one-token match is not enough, and a zero cap drafts nothing.
        assert!(a.find(&[4, 1, 2, 4], 3).is_none());
        assert!(a.find(&t, 0).is_none());
    }

    #[test]
    fn rates_are_learnt_per_bucket() {
        let mut a = LookupAssist::default();
        assert_eq!(a.rates(2, 2), vec![0.5, 0.5]);
        for _ in 0..50 {
            a.record(2, 4, 4);
            a.record(0, 4, 0);
        }
        let hi = a.rates(2, 4);
        let lo = a.rates(0, 4);
        assert!(hi.iter().all(|&r| r > 0.9), "{hi:?}");
        assert!(lo[0] < 0.1, "{lo:?}");
        // Bucket 1 saw nothing: still the prior.
        assert_eq!(a.rates(1, 1), vec![0.5]);
        let p = a.proposal(LookupBlock {
            tokens: vec![3, 4],
            bucket: 2,
        });
        assert!(matches!(p.q[..], [Dist::Greedy(3), Dist::Greedy(4)]));
        assert_eq!(p.confidence, hi[..2].to_vec());
    }

    #[test]
    fn prefers_the_source_worth_more_tokens_per_second() {
        let model = [0.45, 0.18, 0.07];
        let free = |_l: usize| 0.0;
        let slow = |_l: usize| 0.02;
        // A sure lookup beats a mediocre drafter; a poor lookup does not.
        assert!(LookupAssist::prefer(
            &[0.95, 0.95, 0.95, 0.95],
            &model,
            1,
            &sps,
            &slow
        ));
        assert!(!LookupAssist::prefer(&[0.2, 0.3], &model, 1, &sps, &free));
        // Equal rates: the drafter's time decides.
        let rates = [0.45f32, 0.4, 0.39];
        let surv = crate::speculative::scheduler::survival(&rates);
        assert!(LookupAssist::prefer(&rates, &surv, 1, &sps, &slow));
        // A lookup that does not beat plain decoding is never preferred, even with no model.
        assert!(!LookupAssist::prefer(&[0.01], &[], 1, &sps, &free));
    }
}
