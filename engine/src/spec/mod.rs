//! Speculative decoding: drafters propose blocks of tokens, the target verifies them in the
//! same batched forward as everything else, and rejection sampling keeps the output
//! distribution exactly the target's.
//!
//! - [`verify`]: the acceptance rule (lossless for any draft distribution).
//! - [`ngram`]: prompt-lookup drafting, training-free.
//! - [`dspark`]: the DSpark drafter (parallel backbone on target features + sequential head
//!   + confidence head); with no sequential head it is the DFlash-style parallel baseline.

pub mod dspark;
pub mod ngram;
pub mod verify;

use crate::sampling::Dist;

/// Which drafter an engine runs (`--speculation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    None,
    Ngram,
    Parallel,
    DSparkMarkov,
    DSparkRnn,
}

impl Speculation {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Speculation::None,
            "ngram" => Speculation::Ngram,
            "parallel" => Speculation::Parallel,
            "dspark-markov" => Speculation::DSparkMarkov,
            "dspark-rnn" => Speculation::DSparkRnn,
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Speculation::None => "none",
            Speculation::Ngram => "ngram",
            Speculation::Parallel => "parallel",
            Speculation::DSparkMarkov => "dspark-markov",
            Speculation::DSparkRnn => "dspark-rnn",
        }
    }
}

/// A proposed block after the anchor (the last committed token).
#[derive(Debug, Clone)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The drafter's distribution at each position (a point mass for deterministic drafters).
    pub q: Vec<Dist>,
    /// Calibrated probability that token k passes given all earlier ones passed.
    pub confidence: Vec<f32>,
}

/// How many draft tokens each request sends to verification (`--policy`). The load-aware
/// scheduler plugs in here.
#[derive(Debug, Clone, PartialEq)]
pub enum VerifyPolicy {
    /// Always verify the whole block of `gamma` tokens.
    Fixed { gamma: usize },
    /// Verify the prefix whose survival (product of confidences) stays above `threshold`.
    Threshold { gamma: usize, threshold: f32 },
}

impl VerifyPolicy {
    /// Block size the drafter should produce.
    pub fn gamma(&self) -> usize {
        match self {
            VerifyPolicy::Fixed { gamma } | VerifyPolicy::Threshold { gamma, .. } => *gamma,
        }
    }

    /// Verify length for one proposal, at most `cap` tokens.
    pub fn verify_len(&self, p: &Proposal, cap: usize) -> usize {
        let n = p.tokens.len().min(cap);
        match self {
            VerifyPolicy::Fixed { .. } => n,
            VerifyPolicy::Threshold { threshold, .. } => {
                let mut survival = 1.0f32;
                let mut len = 0;
                for &c in p.confidence.iter().take(n) {
                    survival *= c;
                    if survival < *threshold {
                        break;
                    }
                    len += 1;
                }
                len
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_policy_cuts_where_survival_drops() {
        let p = Proposal {
            tokens: vec![1, 2, 3, 4],
            q: vec![Dist::Greedy(1); 4],
            confidence: vec![0.9, 0.8, 0.5, 0.9],
        };
        let t = VerifyPolicy::Threshold {
            gamma: 4,
            threshold: 0.5,
        };
        assert_eq!(t.verify_len(&p, 4), 2); // 0.9, 0.72, 0.36
        assert_eq!(t.verify_len(&p, 1), 1);
        assert_eq!(VerifyPolicy::Fixed { gamma: 4 }.verify_len(&p, 3), 3);
    }
}
