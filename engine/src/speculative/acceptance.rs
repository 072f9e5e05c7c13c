//! What a sequence commits from its logits: a sampled token, or the verdict on its draft
//! block ([`judge`]), under the request's penalties and, for structured outputs, its grammar.
//!
//! Under a grammar the block is judged up to its first forbidden token, which stays in
//! (target probability 0: rejected for certain, the residual sampled, as lossless rejection
//! sampling needs); each position is judged after the drafts before it, and the grammar
//! advances past what is committed. The statistical losslessness tests call [`judge`]
//! itself (with a toy [`Grammar`]), so they check the code that serves.

use super::verify::verify;
use super::Proposal;
use crate::constraint::{Constraint, Mask};
use crate::sampling::{block_dists_masked, target_dist_masked, History, SamplingParams};
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

/// The grammar state [`judge`] drives: llguidance's [`Constraint`] when serving, a toy
/// grammar in the statistical tests.
pub trait Grammar {
    /// The tokens allowed next.
    fn mask(&mut self) -> Result<Mask>;
    /// Walks a draft block: the masks of positions `0..=k` and `k`, the number of draft
    /// tokens the grammar allows in a row (those are consumed). Verification judges the
    /// block up to the first forbidden token, which it rejects; nothing after is needed.
    fn walk(&mut self, draft: &[u32]) -> Result<(Vec<Mask>, usize)> {
        let mut masks = Vec::with_capacity(draft.len() + 1);
        for (k, &t) in draft.iter().enumerate() {
            let m = self.mask()?;
            let ok = m.is_allowed(t) && !self.is_stopped();
            masks.push(m);
            if !ok {
                return Ok((masks, k));
            }
            self.consume(t)?;
        }
        masks.push(self.mask()?);
        Ok((masks, draft.len()))
    }
    /// Undoes the last `n` consumed tokens.
    fn rollback(&mut self, n: usize) -> Result<()>;
    /// Advances past a committed token.
    fn consume(&mut self, tok: u32) -> Result<()>;
    /// The grammar is complete: only the end may follow.
    fn is_stopped(&self) -> bool;
}

impl Grammar for Constraint {
    fn mask(&mut self) -> Result<Mask> {
        Constraint::mask(self)
    }
    fn rollback(&mut self, n: usize) -> Result<()> {
        Constraint::rollback(self, n)
    }
    fn consume(&mut self, tok: u32) -> Result<()> {
        Constraint::consume(self, tok)
    }
    fn is_stopped(&self) -> bool {
        Constraint::is_stopped(self)
    }
}

/// The grammar masks a constrained sequence's logits need this step (they depend only on
/// its state and draft, not on the logits, so the step computes them beside the forward).
pub enum GrammarWork {
    /// No draft: the mask of the token it samples.
    Sample(Mask),
    /// A draft block, walked (see [`Grammar::walk`]): the masks of its positions and how
    /// many drafts the grammar allows in a row (consumed).
    Block(Vec<Mask>, usize),
}

/// The grammar work of one sequence for `proposal` (none: it samples one token).
pub fn grammar_work<G: Grammar + ?Sized>(
    g: &mut G,
    proposal: Option<&Proposal>,
) -> Result<GrammarWork> {
    Ok(match proposal {
        None => GrammarWork::Sample(g.mask()?),
        Some(p) => {
            let (m, k) = g.walk(&p.tokens)?;
            GrammarWork::Block(m, k)
        }
    })
}

/// One sequence's sampling state, as [`judge`] reads and advances it.
pub struct Judging<'a, G: Grammar + ?Sized> {
    pub params: &'a SamplingParams,
    /// What the penalties read (the caller appends the committed tokens).
    pub history: &'a History,
    pub rng: &'a mut ChaCha8Rng,
    /// The grammar of a structured output.
    pub grammar: Option<&'a mut G>,
}

/// The tokens a sequence commits from its logits `rows` (one per judged position) and how
/// many drafts it accepted: a sampled token without a `proposal`, else the verdict on the
/// block. `work` is the grammar work computed ahead (computed here when absent; its error
/// is this sequence's).
pub fn judge<G: Grammar + ?Sized>(
    s: Judging<'_, G>,
    proposal: Option<&Proposal>,
    rows: &[Vec<f32>],
    work: Option<Result<GrammarWork>>,
) -> Result<(Vec<u32>, usize)> {
    let Judging {
        params,
        history,
        rng,
        mut grammar,
    } = s;
    let work = match (work, grammar.as_deref_mut()) {
        (Some(w), _) => Some(w?),
        (None, Some(g)) => Some(grammar_work(g, proposal)?),
        (None, None) => None,
    };
    let (commit, accepted) = match proposal {
        None => {
            let mask = match work {
                Some(GrammarWork::Sample(m)) => Some(m),
                _ => None,
            };
            let tok = target_dist_masked(&rows[0], params, history, mask.as_ref()).sample(rng);
            (vec![tok], 0)
        }
        Some(p) => {
            let (masks, allowed) = match work {
                Some(GrammarWork::Block(m, k)) => (Some(m), k),
                _ => (None, p.tokens.len()),
            };
            let mut dists = block_dists_masked(
                &rows[..=allowed],
                params,
                history,
                &p.tokens[..allowed],
                masks.as_deref(),
            );
            let judged = if allowed < p.tokens.len() {
                // Never read: the forbidden token before it is rejected.
                dists.push(dists[allowed].clone());
                allowed + 1
            } else {
                allowed
            };
            let v = verify(&p.tokens[..judged], &p.q[..judged], &dists, rng);
            if let Some(g) = grammar.as_deref_mut() {
                g.rollback(allowed - v.accepted)?;
            }
            (v.tokens, v.accepted)
        }
    };
    if let Some(g) = grammar {
        // The final token (sampled or the verify's correction / bonus). A grammar the
        // accepted drafts completed allows only the end token, which it cannot consume;
        // the sequence finishes on it.
        if !g.is_stopped() {
            g.consume(*commit.last().expect("one token at least"))?;
        }
    }
    Ok((commit, accepted))
}
