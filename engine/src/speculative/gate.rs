//! The drafting gate (`--policy dspark`), pure: each step, before any drafter code runs,
//! whether the decoding sequences draft and how long ([`plan_drafts`], the whole cycle
//! priced), skip (a plan that does not beat plain decoding by [`PLAN_MARGIN`]), probe (after
//! [`DRAFT_PROBE`] skips in a row one sequence drafts anyway, so the acceptance estimates
//! keep up, unless even a perfect drafter would not pay: [`probe_pays`]), and the early stop
//! ([`early_stop`]: a draft token whose survival is below the cheapest marginal verify cost
//! of the step can never be taken, so the drafter stops there). No I/O, no state: the
//! [`super::speculator::Speculator`] keeps the counters and acts on the [`Decision`].

use super::scheduler::{drafting_bound, plan_drafts, DraftCost};

/// Steps in a row without drafting after which one sequence drafts anyway (a probe), so the
/// acceptance estimates keep up with the traffic. A probe drafts ONE sequence and is timed
/// and counted like any draft.
pub const DRAFT_PROBE: usize = 16;

/// Relative gain over plain decoding a drafting plan must promise to run.
pub const PLAN_MARGIN: f64 = 0.03;

/// What the gate sees of one step.
pub struct GateInput<'a> {
    /// Most draft tokens per candidate (0: it may not draft).
    pub caps: &'a [usize],
    /// Predicted prefix survivals per candidate, cut to its cap.
    pub predicted: &'a [Vec<f64>],
    /// Tokens the forward holds anyway, and its bound.
    pub base_b: usize,
    pub max_b: usize,
    /// The cost table as this step prices it.
    pub sps: &'a dyn Fn(usize) -> f64,
    /// Predicted drafter call time.
    pub t_draft: DraftCost<'a>,
    /// Steps in a row that drafted nobody, before this one.
    pub skips_in_row: usize,
    /// Per candidate, its probe order key (smallest first: the one whose context is
    /// cheapest to bring up to date, then the one that drafted longest ago, then its id).
    pub probe_key: &'a [(usize, u64, u64)],
}

/// How the step's drafting went through the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The plan drafts.
    Draft,
    /// Nobody drafts; a probe is not due yet.
    Skip,
    /// A probe was due, but not even a perfect drafter would pay at this load.
    SkipUnpaidProbe,
    /// A probe was due and nobody could draft.
    SkipNoCandidate,
    /// One sequence drafts its whole cap (a probe).
    Probe,
}

impl Verdict {
    /// Nobody drafts this step.
    pub fn skipped(self) -> bool {
        !matches!(self, Verdict::Draft | Verdict::Probe)
    }
}

/// The gate's decision for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Draft length per candidate (0: it decodes plainly this step).
    pub gamma: Vec<usize>,
    pub verdict: Verdict,
    /// The drafter's early stop (0 when nobody drafts).
    pub min_survival: f32,
}

/// Decides who drafts this step and how long (see the module docs).
pub fn decide(g: &GateInput<'_>) -> Decision {
    let plan = plan_drafts(g.predicted, g.base_b, g.max_b, g.sps, g.t_draft);
    let mut gamma = plan.gamma;
    // Predictions are estimates: a plan must beat plain decoding by a margin, or the step
    // decodes plainly (a near-tie is not worth the drafter's risk).
    if plan.rate < plan.plain_rate * (1.0 + PLAN_MARGIN) {
        gamma.iter_mut().for_each(|x| *x = 0);
    }
    let skip = |gamma: Vec<usize>, verdict| Decision {
        gamma,
        verdict,
        min_survival: 0.0,
    };
    let mut verdict = Verdict::Draft;
    if gamma.iter().all(|&x| x == 0) {
        if g.skips_in_row + 1 < DRAFT_PROBE {
            return skip(gamma, Verdict::Skip);
        }
        // A probe is priced like any draft: where even a drafter that is never wrong would
        // not pay at this load, it cannot change the decision.
        if !probe_pays(g.caps, g.base_b, g.max_b, g.sps, g.t_draft, PLAN_MARGIN) {
            return skip(gamma, Verdict::SkipUnpaidProbe);
        }
        let pick = (0..g.caps.len())
            .filter(|&i| g.caps[i] > 0)
            .min_by_key(|&i| g.probe_key[i]);
        let Some(p) = pick else {
            return skip(gamma, Verdict::SkipNoCandidate);
        };
        gamma[p] = g.caps[p];
        verdict = Verdict::Probe;
    }
    Decision {
        gamma,
        verdict,
        min_survival: early_stop(g.caps.len(), g.base_b, g.max_b, g.sps),
    }
}

/// The early stop of a step with `r` decoding sequences: the survival below which a draft
/// token can never be taken, `r` times the cheapest marginal verify cost
/// `SPS(b) / SPS(b + 1) - 1` over the step's batch sizes, at most 1.
pub fn early_stop(r: usize, base_b: usize, max_b: usize, sps: &dyn Fn(usize) -> f64) -> f32 {
    let mut cheapest = f64::INFINITY;
    for b in base_b.max(1)..max_b.max(base_b.max(1) + 1) {
        cheapest = cheapest.min(sps(b) / sps(b + 1) - 1.0);
        if cheapest <= 0.0 {
            break;
        }
    }
    (r as f64 * cheapest.max(0.0)).min(1.0) as f32
}

/// Whether a probe can pay at this load: a drafter that is never wrong (every survival 1,
/// up to each candidate's cap) would beat plain decoding by `margin` under the same prices
/// ([`plan_drafts`]). When even it would not (the batch is past the point where extra
/// tokens are cheap, or drafting costs more than any block can return), a probe's fresher
/// estimates could not change the decision, so the probe is skipped and the step stays
/// plain. Pure.
pub fn probe_pays(
    caps: &[usize],
    base_b: usize,
    max_b: usize,
    sps: &dyn Fn(usize) -> f64,
    t_draft: DraftCost<'_>,
    margin: f64,
) -> bool {
    let perfect: Vec<Vec<f64>> = caps.iter().map(|&c| vec![1.0; c]).collect();
    let plain_rate = caps.len() as f64 * sps(base_b.max(1));
    if drafting_bound(&perfect, base_b, max_b, sps) < plain_rate * (1.0 + margin) {
        return false;
    }
    let plan = plan_drafts(&perfect, base_b, max_b, sps, t_draft);
    plan.drafting() > 0 && plan.rate >= plan.plain_rate * (1.0 + margin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::scheduler::survival;
    use crate::speculative::scheduler::tests::instance_of;
    use proptest::prelude::*;

    /// A probe runs only where a perfect drafter would pay: cheap extra tokens (flat table)
    /// yes; a table where each extra token costs a whole step, a saturated one (token
    /// throughput flat from B = 4), or a draft dearer than any block returns, no.
    #[test]
    fn probes_only_where_a_perfect_drafter_pays() {
        let free = |_: usize, _: usize| 0.0;
        let flat = |_: usize| 100.0;
        assert!(probe_pays(&[4], 1, 64, &flat, &free, 0.03));
        assert!(probe_pays(&[4, 4, 4], 3, 64, &flat, &free, 0.03));
        let steep = |b: usize| 100.0 / b as f64;
        assert!(!probe_pays(&[4], 1, 64, &steep, &free, 0.03));
        assert!(!probe_pays(&[4; 8], 8, 64, &steep, &free, 0.03));
        // Saturated: 400 tokens/s from B = 4 on. One stream still gains (B = 1..4 cheap),
        // 16 streams cannot, whatever the acceptance.
        let sat = |b: usize| if b <= 4 { 100.0 } else { 400.0 / b as f64 };
        assert!(probe_pays(&[4], 1, 64, &sat, &free, 0.03));
        assert!(!probe_pays(&[4; 16], 16, 64, &sat, &free, 0.03));
        // Drafting that costs 10 steps per call never pays back.
        let dear = |n: usize, _: usize| if n > 0 { 0.1 } else { 0.0 };
        assert!(!probe_pays(&[4], 1, 64, &flat, &dear, 0.03));
        // Nothing to draft (every cap 0): no probe.
        assert!(!probe_pays(&[0, 0], 2, 64, &flat, &free, 0.03));
    }

    /// A random step: candidates with caps and survivals, a decreasing table, a draft cost.
    fn step() -> impl Strategy<Value = (Vec<Vec<f64>>, usize, Vec<f64>, f64, usize)> {
        (
            prop::collection::vec(prop::collection::vec(0.05f32..1.0, 0..6), 1..5),
            0usize..4,
            prop::collection::vec(1.0f64..1.6, 40),
            0.0f64..3.0,
            0usize..(2 * DRAFT_PROBE),
        )
            .prop_map(|(conf, prefill, ratios, ms, skips)| {
                let (surv, base, sps) = instance_of(&conf, prefill, &ratios);
                (surv, base, sps, ms, skips)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Whatever the step: no candidate drafts past its cap; a skip drafts nobody and has
        /// no early stop; a probe drafts exactly one sequence, its whole cap, the first in
        /// probe order, and only once [`DRAFT_PROBE`] steps in a row skipped and a perfect
        /// drafter would pay; a drafting plan beats plain decoding by the margin; the early
        /// stop is a probability and the same whoever drafts.
        #[test]
        fn the_gate_keeps_its_rules((surv, base, table, ms, skips) in step(), max_extra in 0usize..10) {
            let sps = |b: usize| table[b.min(table.len() - 1)];
            let t = move |n: usize, l: usize| if n == 0 { 0.0 } else { ms * 1e-3 * (1.0 + 0.1 * l as f64) };
            let caps: Vec<usize> = surv.iter().map(Vec::len).collect();
            let keys: Vec<(usize, u64, u64)> = (0..caps.len()).map(|i| ((i * 7) % 3, 0, i as u64)).collect();
            let max_b = base + max_extra;
            let input = GateInput {
                caps: &caps, predicted: &surv, base_b: base, max_b, sps: &sps, t_draft: &t,
                skips_in_row: skips, probe_key: &keys,
            };
            let d = decide(&input);
            prop_assert_eq!(d.gamma.len(), caps.len());
            for (g, c) in d.gamma.iter().zip(&caps) {
                prop_assert!(g <= c);
            }
            let drafting = d.gamma.iter().filter(|&&g| g > 0).count();
            let plan = plan_drafts(&surv, base, max_b, &sps, &t);
            match d.verdict {
                Verdict::Draft => {
                    prop_assert!(drafting > 0);
                    prop_assert!(plan.rate >= plan.plain_rate * (1.0 + PLAN_MARGIN));
                    prop_assert_eq!(&d.gamma, &plan.gamma);
                }
                Verdict::Probe => {
                    prop_assert_eq!(drafting, 1);
                    prop_assert!(skips + 1 >= DRAFT_PROBE);
                    prop_assert!(probe_pays(&caps, base, max_b, &sps, &t, PLAN_MARGIN));
                    let p = d.gamma.iter().position(|&g| g > 0).unwrap();
                    prop_assert_eq!(d.gamma[p], caps[p]);
                    let first = (0..caps.len()).filter(|&i| caps[i] > 0).min_by_key(|&i| keys[i]);
                    prop_assert_eq!(Some(p), first);
                }
                v => {
                    prop_assert!(v.skipped());
                    prop_assert_eq!(drafting, 0);
                    prop_assert_eq!(d.min_survival, 0.0);
                    if v == Verdict::Skip {
                        prop_assert!(skips + 1 < DRAFT_PROBE);
                    }
                }
            }
            if !d.verdict.skipped() {
                prop_assert!((0.0..=1.0).contains(&d.min_survival));
                prop_assert_eq!(d.min_survival, early_stop(caps.len(), base, max_b, &sps));
            }
        }

        /// The early stop grows with the number of decoding sequences (each extra token is
        /// shared by more of them) and is 0 on a flat table (extra tokens are free).
        #[test]
        fn the_early_stop_grows_with_the_batch((_, base, table, _, _) in step(), r in 1usize..16, max_extra in 1usize..10) {
            let sps = |b: usize| table[b.min(table.len() - 1)];
            let a = early_stop(r, base, base + max_extra, &sps);
            let b = early_stop(r + 1, base, base + max_extra, &sps);
            prop_assert!(b >= a);
            prop_assert_eq!(early_stop(r, base, base + max_extra, &|_: usize| 100.0), 0.0);
        }
    }

    /// A skip streak turns into a probe exactly at [`DRAFT_PROBE`] skips, on a step where
    /// the plan itself would not draft (a drafter that is rarely right) and a perfect one
    /// would pay (flat table).
    #[test]
    fn a_skip_streak_ends_in_a_probe() {
        let surv = vec![survival(&[0.01, 0.01]), survival(&[0.02])];
        let caps = [2, 1];
        let flat = |_: usize| 100.0;
        let t = |n: usize, _: usize| if n > 0 { 0.002 } else { 0.0 };
        let keys = [(5, 0, 1), (0, 0, 2)];
        let at = |skips| {
            decide(&GateInput {
                caps: &caps,
                predicted: &surv,
                base_b: 2,
                max_b: 64,
                sps: &flat,
                t_draft: &t,
                skips_in_row: skips,
                probe_key: &keys,
            })
        };
        for s in 0..DRAFT_PROBE - 1 {
            assert_eq!(at(s).verdict, Verdict::Skip, "{s}");
        }
        let d = at(DRAFT_PROBE - 1);
        assert_eq!(d.verdict, Verdict::Probe);
        assert_eq!(d.gamma, vec![0, 1]);
    }
}
