//! Speculative decoding: drafters propose blocks of tokens, the target verifies them in the
//! same batched forward as everything else, and rejection sampling keeps the output
//! distribution exactly the target's.
//!
//! - [`verify`]: the acceptance rule (lossless for any draft distribution).
//! - [`acceptance`]: what a sequence commits from its logits (`judge`: sampling or the
//!   verdict on its block, under its penalties and grammar).
//! - [`proposer`]: who proposes drafts ([`proposer::Proposer`]): [`ngram`] prompt lookup
//!   (training-free) or a model drafter ([`proposer::ModelProposer`]).
//! - [`context`]: a model drafter's context bookkeeping (its KV cache per sequence, the
//!   hidden-state backlog, prefix-key mirroring).
//! - [`gate`]: the pure drafting gate (draft, skip, probe, early stop).
//! - [`clock`]: drafting and verifying time measured against the cost table, so plans are
//!   priced at what this machine does now.
//! - [`scheduler`]: the hardware-aware prefix scheduler (`--policy dspark`).
//! - [`recalibrate`]: online per-position scales and offsets on top of STS, learned from verify
//!   outcomes (`serve --online-calibration`).
//! - [`speculator`]: the component the step loop talks to (drafter, per-sequence drafting
//!   state, the drafting plan, acceptance statistics, recalibration).
//! - [`dspark`]: the DSpark drafter (parallel backbone on target features + sequential head
//!   + confidence head); with no sequential head it is the DFlash-style parallel baseline.

pub mod acceptance;
pub mod clock;
pub mod context;
pub mod dspark;
pub mod gate;
pub mod lookup;
pub mod memory;
pub mod ngram;
pub mod proposer;
pub mod recalibrate;
pub mod scheduler;
pub mod speculator;
pub mod verify;

use crate::sampling::Dist;
pub use dspark_types::PolicyKind;

/// Which drafter an engine runs (`--speculation`); the names are the operator contract's.
pub use dspark_types::Speculation;

/// A proposed block after the anchor (the last committed token).
#[derive(Debug, Clone)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The drafter's distribution at each position (a point mass for deterministic drafters).
    pub q: Vec<Dist>,
    /// Calibrated probability that token k passes given all earlier ones passed.
    pub confidence: Vec<f32>,
}

/// Whether a block was drafted for a greedy request (point-mass drafts), which selects the
/// greedy calibration of the confidences.
pub fn is_greedy(q: &[Dist]) -> bool {
    matches!(q.first(), Some(Dist::Greedy(_)))
}

impl Proposal {
    /// The first `n` draft tokens (all of them when shorter).
    pub fn truncated(mut self, n: usize) -> Self {
        self.tokens.truncate(n);
        self.q.truncate(n);
        self.confidence.truncate(n);
        self
    }
}

/// How many draft tokens each request sends to verification (`--policy`).
#[derive(Debug, Clone, PartialEq)]
pub enum VerifyPolicy {
    /// Always verify the whole block of `gamma` tokens.
    Fixed { gamma: usize },
    /// Verify the prefix whose survival (product of confidences) stays above `threshold`.
    Threshold { gamma: usize, threshold: f32 },
    /// The load-aware prefix scheduler: all requests' verify lengths chosen together each
    /// step to maximise `tau * SPS(B)` under the current cost table ([`scheduler`]).
    Dspark { gamma: usize },
}

/// One step's verify lengths and, for the scheduler, what it expected.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyPlan {
    pub lens: Vec<usize>,
    /// Expected committed tokens over the scheduled requests (`tau`).
    pub expected_tau: f64,
    /// `tau * SPS(B)` when the scheduler ran.
    pub theta: Option<f64>,
}

impl VerifyPolicy {
    /// Block size the drafter should produce.
    pub fn gamma(&self) -> usize {
        match self {
            VerifyPolicy::Fixed { gamma }
            | VerifyPolicy::Threshold { gamma, .. }
            | VerifyPolicy::Dspark { gamma } => *gamma,
        }
    }

    /// The same policy with another block size.
    pub fn with_gamma(&self, g: usize) -> Self {
        match self.clone() {
            VerifyPolicy::Fixed { .. } => VerifyPolicy::Fixed { gamma: g },
            VerifyPolicy::Threshold { threshold, .. } => VerifyPolicy::Threshold {
                gamma: g,
                threshold,
            },
            VerifyPolicy::Dspark { .. } => VerifyPolicy::Dspark { gamma: g },
        }
    }

    /// The policy's kind (its `--policy` name is the contract's [`PolicyKind::flag`]).
    pub fn kind(&self) -> PolicyKind {
        match self {
            VerifyPolicy::Fixed { .. } => PolicyKind::Fixed,
            VerifyPolicy::Threshold { .. } => PolicyKind::Threshold,
            VerifyPolicy::Dspark { .. } => PolicyKind::Dspark,
        }
    }

    /// The `--policy` name.
    pub fn name(&self) -> &'static str {
        self.kind().flag()
    }

    /// Verify length for one proposal on its own, at most `cap` tokens (the scheduler, which
    /// needs every request at once, verifies the whole capped block here).
    pub fn verify_len(&self, p: &Proposal, cap: usize) -> usize {
        let n = p.tokens.len().min(cap);
        match self {
            VerifyPolicy::Fixed { .. } | VerifyPolicy::Dspark { .. } => n,
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

    /// Verify lengths for all decoding requests of one step. `props[r]` is request r's
    /// proposal (None: it decodes plainly), `caps[r]` its most draft tokens, `base_b` the
    /// tokens the forward holds anyway (pending tokens + prefill), `max_b` the batch bound,
    /// `sps` the cost table.
    pub fn plan(
        &self,
        props: &[Option<&Proposal>],
        caps: &[usize],
        base_b: usize,
        max_b: usize,
        sps: &dyn Fn(usize) -> f64,
    ) -> VerifyPlan {
        let capped = |p: &Proposal, cap: usize| p.confidence.len().min(p.tokens.len()).min(cap);
        let expected = |lens: &[usize]| -> f64 {
            props
                .iter()
                .zip(lens)
                .map(|(p, &l)| {
                    1.0 + p.map_or(0.0, |p| {
                        scheduler::survival(&p.confidence[..l]).iter().sum::<f64>()
                    })
                })
                .sum()
        };
        match self {
            VerifyPolicy::Dspark { .. } => {
                let surv: Vec<Vec<f64>> = props
                    .iter()
                    .zip(caps)
                    .map(|(p, &cap)| {
                        p.map_or_else(Vec::new, |p| {
                            scheduler::survival(&p.confidence[..capped(p, cap)])
                        })
                    })
                    .collect();
                let s = scheduler::schedule(&surv, base_b, max_b, sps);
                VerifyPlan {
                    expected_tau: s.tau,
                    theta: Some(s.theta),
                    lens: s.lens,
                }
            }
            _ => {
                let lens: Vec<usize> = props
                    .iter()
                    .zip(caps)
                    .map(|(p, &cap)| p.map_or(0, |p| self.verify_len(p, capped(p, cap))))
                    .collect();
                VerifyPlan {
                    expected_tau: expected(&lens),
                    theta: None,
                    lens,
                }
            }
        }
    }
}

/// Live per-position conditional acceptance rates (exponentially decayed counts), used as
/// the confidences of drafters that have no confidence head (n-gram lookup), and as the
/// realised side of the calibration check.
#[derive(Debug, Clone)]
pub struct AcceptanceStats {
    offered: Vec<f64>,
    accepted: Vec<f64>,
    decay: f64,
}

impl AcceptanceStats {
    /// `positions`: longest block tracked; `half_life`: drafts after which old evidence
    /// weighs half.
    pub fn new(positions: usize, half_life: f64) -> Self {
        Self {
            offered: vec![0.0; positions],
            accepted: vec![0.0; positions],
            decay: 0.5f64.powf(1.0 / half_life.max(1.0)),
        }
    }

    /// Records one verified block: `verified` draft tokens were checked, the first
    /// `accepted` passed.
    pub fn record(&mut self, verified: usize, accepted: usize) {
        for k in 0..verified.min(self.offered.len()) {
            self.offered[k] = self.offered[k] * self.decay + 1.0;
            self.accepted[k] = self.accepted[k] * self.decay + if k < accepted { 1.0 } else { 0.0 };
            if k >= accepted {
                // Positions after the first rejection were not tried.
                break;
            }
        }
    }

    /// Decayed `(accepted, offered)` counts of position k.
    pub fn counts(&self, k: usize) -> (f64, f64) {
        match (self.accepted.get(k), self.offered.get(k)) {
            (Some(&a), Some(&o)) => (a, o),
            _ => (0.0, 0.0),
        }
    }

    /// Estimated probability that position k passes given the earlier ones did, with a
    /// weak prior of 1/2 (two pseudo-observations).
    pub fn rate(&self, k: usize) -> f32 {
        let k = k.min(self.offered.len().saturating_sub(1));
        match (self.accepted.get(k), self.offered.get(k)) {
            (Some(a), Some(o)) => ((a + 1.0) / (o + 2.0)) as f32,
            _ => 0.5,
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

    #[test]
    fn plan_applies_caps_and_reports_expected_tau() {
        let p = Proposal {
            tokens: vec![1, 2, 3],
            q: vec![Dist::Greedy(1); 3],
            confidence: vec![0.9, 0.9, 0.9],
        };
        let flat = |_: usize| 100.0;
        let fixed = VerifyPolicy::Fixed { gamma: 3 }.plan(&[Some(&p), None], &[2, 0], 2, 64, &flat);
        assert_eq!(fixed.lens, vec![2, 0]);
        assert!((fixed.expected_tau - (2.0 + 0.9 + 0.81)).abs() < 1e-6);
        assert_eq!(fixed.theta, None);
        let d = VerifyPolicy::Dspark { gamma: 3 };
        let plan = d.plan(&[Some(&p), None], &[3, 0], 2, 64, &flat);
        assert_eq!(plan.lens, vec![3, 0]);
        assert!(plan.theta.unwrap() > 200.0);
        // Linear cost: nothing is worth verifying.
        let plan = d.plan(&[Some(&p)], &[3], 1, 64, &|b| 100.0 / b as f64);
        assert_eq!(plan.lens, vec![0]);
    }

    #[test]
    fn acceptance_stats_track_conditional_rates() {
        let mut s = AcceptanceStats::new(4, 1000.0);
        assert_eq!(s.rate(0), 0.5);
        for _ in 0..100 {
            s.record(3, 1); // first passes, second fails, third never tried
        }
        assert!(s.rate(0) > 0.95);
        assert!(s.rate(1) < 0.05);
        assert_eq!(s.rate(2), 0.5);
        assert_eq!(s.rate(10), s.rate(3));
    }
}
