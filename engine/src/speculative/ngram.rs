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
    lookup(tokens, k, min_n, max_n).map_or_else(Vec::new, |(_, t)| t)
}

/// The longest suffix of `tokens` (`max_n` down to `min_n`) that occurred earlier, and up to
/// `k` tokens that followed its most recent occurrence: `(suffix length, continuation)`.
/// One backward scan: every earlier occurrence of the last token is extended backwards.
pub fn lookup(tokens: &[u32], k: usize, min_n: usize, max_n: usize) -> Option<(usize, Vec<u32>)> {
    let len = tokens.len();
    let (&last, _) = tokens.split_last()?;
    let mut best: Option<(usize, usize)> = None;
    // `end`: the last position of an earlier occurrence (never the suffix itself).
    for end in (0..len - 1).rev() {
        if tokens[end] != last {
            continue;
        }
        let n = (1..max_n.min(end + 1))
            .take_while(|&d| tokens[end - d] == tokens[len - 1 - d])
            .count()
            + 1;
        if best.is_none_or(|(m, _)| n > m) {
            best = Some((n, end));
            if n >= max_n {
                break;
            }
        }
    }
    let (n, end) = best.filter(|&(n, _)| n >= min_n.max(1))?;
    let to = (end + 1 + k).min(len);
    Some((n, tokens[end + 1..to].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(tokens: &[u32], k: usize, min_n: usize, max_n: usize) -> Option<(usize, Vec<u32>)> {
        let len = tokens.len();
        for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] == suffix {
                    return Some((n, tokens[start + n..(start + n + k).min(len)].to_vec()));
                }
            }
        }
        None
    }

    #[test]
    fn finds_the_latest_longest_match() {
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(propose(&t, 2, 1, 3), vec![5, 6]);
        assert_eq!(propose(&t, 5, 1, 3), vec![5, 6, 1, 2, 3]);
        assert!(propose(&[1, 2, 3], 4, 1, 3).is_empty());
        assert_eq!(propose(&[7, 8, 7], 3, 1, 2), vec![8, 7]);
        assert_eq!(lookup(&t, 2, 1, 3), Some((3, vec![5, 6])));
        assert_eq!(lookup(&t, 2, 4, 6), None);
        // Against the definition: for each suffix length, longest first, the most recent
        // earlier occurrence.
        let mut x = 12345u32;
        for _ in 0..2000 {
            let t: Vec<u32> = (0..40)
                .map(|_| {
                    x = x.wrapping_mul(1103515245).wrapping_add(12345);
                    (x >> 16) % 3
                })
                .collect();
            for len in 1..=t.len() {
                assert_eq!(
                    lookup(&t[..len], 4, 2, 5),
                    naive(&t[..len], 4, 2, 5),
                    "{:?}",
                    &t[..len]
                );
            }
        }
    }
}
