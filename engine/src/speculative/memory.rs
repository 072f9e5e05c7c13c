//! Every sequence's acceptance memory, as the [`super::speculator::Speculator`] keeps it: its
//! own recent outcomes ([`SeqState`]), a deterministic draft left unverified and scored
//! later ([`Shadow`]), and the one rule that turns decayed counts into predicted
//! per-position rates ([`predicted_rates`]), used for the model drafter's plan and for the
//! prompt-lookup buckets alike.

use super::AcceptanceStats;

/// Half-life, in verified blocks, of a sequence's own acceptance memory.
const OWN_HALF_LIFE: f64 = 8.0;
/// Weight (pseudo-blocks) of the global rates in a sequence's predicted acceptance.
const PRIOR_WEIGHT: f64 = 4.0;

/// A deterministic draft that was not verified (n-gram or lookup, verify length 0), kept to
/// be checked against the tokens the target commits next. For a point-mass draft the chance
/// that the target's own token matches is exactly the chance verification would have
/// accepted it, so the live acceptance rates stay honest while the scheduler is not
/// verifying.
pub struct Shadow {
    /// Position of its first token.
    pub start: usize,
    pub tokens: Vec<u32>,
    /// A lookup block beside a model drafter (its match-length bucket), else the n-gram
    /// drafter's.
    pub bucket: Option<usize>,
}

impl Shadow {
    /// `(verified, accepted)` once the sequence's `tokens` decide the draft (its first
    /// mismatch, or all of it matched); `None` while they do not yet.
    pub fn score(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        let known = tokens.len().saturating_sub(self.start);
        let matched = self
            .tokens
            .iter()
            .zip(&tokens[self.start.min(tokens.len())..])
            .take_while(|(a, b)| a == b)
            .count();
        if matched < known.min(self.tokens.len()) {
            // First mismatch at `matched`: positions 0..=matched were decided.
            Some((matched + 1, matched))
        } else if matched == self.tokens.len() {
            Some((matched, matched))
        } else {
            None
        }
    }
}

/// One sequence's speculation state besides its drafter context.
pub struct SeqState {
    pub shadow: Option<Shadow>,
    /// This step's block came from prompt lookup beside the model drafter (its bucket).
    pub lookup: Option<usize>,
    /// This sequence's own recent acceptance.
    pub own: AcceptanceStats,
    /// Step counter value when it last drafted (probe order).
    pub last_drafted: u64,
}

impl SeqState {
    pub fn new(positions: usize) -> Self {
        Self {
            shadow: None,
            lookup: None,
            own: AcceptanceStats::new(positions, OWN_HALF_LIFE),
            last_drafted: 0,
        }
    }
}

/// Predicted conditional acceptance of positions `0..len`: `own` recent outcomes when
/// given, with the `global` rates as a prior of [`PRIOR_WEIGHT`] blocks. A position with
/// little evidence borrows the estimate of the position before it (acceptance rarely rises
/// along a block), starting from 1/2, not an uninformed 1/2 everywhere: deep positions are
/// verified rarely, and an optimistic guess there would make the plan draft long blocks that
/// do not pay.
pub fn predicted_rates(
    global: &AcceptanceStats,
    own: Option<&AcceptanceStats>,
    len: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    let mut prev = 0.5f64;
    for k in 0..len {
        let (a, n) = global.counts(k);
        let g = (a + 2.0 * prev) / (n + 2.0);
        let r = match own {
            Some(o) => {
                let (a, n) = o.counts(k);
                (a + PRIOR_WEIGHT * g) / (n + PRIOR_WEIGHT)
            }
            None => g,
        };
        out.push(r as f32);
        prev = g;
    }
    out
}
