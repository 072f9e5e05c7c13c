//! Prompt-lookup drafting (training-free): find the most recent earlier occurrence of the
//! sequence's last n tokens (longest n first) and propose the tokens that followed it.
//! [`NgramProposer`] is the [`Proposer`] that does it for every decoding sequence (it costs
//! nothing, so it needs no gate); its confidences are the live acceptance rates.

use super::proposer::{DraftInput, DraftRun, Proposer};
use super::speculator::Candidate;
use super::Proposal;
use crate::sampling::Dist;
use anyhow::Result;

/// Shortest and longest suffix the lookup tries.
const MIN_N: usize = 1;
const MAX_N: usize = 3;

/// Prompt-lookup drafting as a [`Proposer`]: point-mass drafts.
pub struct NgramProposer;

impl Proposer for NgramProposer {
    fn propose(
        &mut self,
        cands: &mut [Candidate<'_>],
        gamma: &[usize],
        input: DraftInput<'_>,
    ) -> Result<DraftRun> {
        let mut run = DraftRun::none(cands.len());
        for ((o, c), &g) in run.blocks.iter_mut().zip(cands.iter()).zip(gamma) {
            if g == 0 {
                continue;
            }
            let tokens = propose(c.tokens, g, MIN_N, MAX_N);
            if !tokens.is_empty() {
                *o = Some(Proposal {
                    q: tokens.iter().map(|&t| Dist::Greedy(t)).collect(),
                    confidence: (0..tokens.len()).map(|k| (input.rate)(k)).collect(),
                    tokens,
                });
            }
        }
        Ok(run)
    }
}

/// Proposes up to `k` tokens for `tokens` (prompt + generated so far), trying suffix
/// lengths from `max_n` down to `min_n`.
pub fn propose(tokens: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent match that is not the suffix itself.
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(len);
                if to > from {
                    return tokens[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_latest_longest_match() {
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(propose(&t, 2, 1, 3), vec![5, 6]);
        assert_eq!(propose(&t, 5, 1, 3), vec![5, 6, 1, 2, 3]);
        assert!(propose(&[1, 2, 3], 4, 1, 3).is_empty());
        assert_eq!(propose(&[7, 8, 7], 3, 1, 2), vec![8, 7]);
    }
}
