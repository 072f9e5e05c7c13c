//! The speculator's clocks: what drafting and verifying cost on this machine now, against
//! what the cost table predicted when it was profiled.
//!
//! - [`DraftClock`]: drafter calls, measured against the table's `draft_points`.
//! - [`StepClock`]: target forwards that verify drafts against plain ones, each measured
//!   against `1 / SPS(B)`. A table is profiled on synthetic batches (one context length, the
//!   fastest repetitions, a lower convex hull); serving adds what it does not see (the
//!   acceptance sampling of every verified row, longer and uneven contexts). When verifying
//!   forwards run slower against the table than plain ones, the planner prices every drafting
//!   plan's forward by that factor, so a mis-measured table cannot make speculation lose.

use crate::cost::ActiveTable;

/// Measured drafting time against the cost table's prediction.
#[derive(Debug, Clone)]
pub(super) struct DraftClock {
    /// Moving average of measured / predicted seconds (table present), so a machine that
    /// got slower or faster since profiling is priced as it is now.
    scale: f64,
    /// Without table draft points: moving average of seconds per unit of
    /// [`DraftClock::shape`], 0 until the first measurement.
    per_unit: f64,
}

impl Default for DraftClock {
    fn default() -> Self {
        Self {
            scale: 1.0,
            per_unit: 0.0,
        }
    }
}

impl DraftClock {
    /// Relative cost of a call without measured points: a fixed part plus one per token.
    fn shape(n: usize, l: usize) -> f64 {
        l as f64 * (1.0 + n as f64 / 4.0)
    }

    pub(super) fn predict(&self, table: &ActiveTable, n: usize, l: usize) -> f64 {
        if n == 0 || l == 0 {
            return 0.0;
        }
        match table.table.draft_seconds(n as u32, l as u32) {
            Some(t) => t * self.scale,
            None => self.per_unit * Self::shape(n, l),
        }
    }

    pub(super) fn record(&mut self, table: &ActiveTable, n: usize, l: usize, secs: f64) {
        if n == 0 || l == 0 || !secs.is_finite() {
            return;
        }
        match table.table.draft_seconds(n as u32, l as u32) {
            Some(t) if t > 0.0 => {
                let r = (secs / t).clamp(0.25, 8.0);
                self.scale = 0.9 * self.scale + 0.1 * r;
            }
            _ => {
                let u = secs / Self::shape(n, l);
                self.per_unit = if self.per_unit == 0.0 {
                    u
                } else {
                    0.9 * self.per_unit + 0.1 * u
                };
            }
        }
    }
}

/// Weight of one step in the [`StepClock`]'s moving averages.
const STEP_ALPHA: f64 = 0.05;
/// Steps of each kind before the [`StepClock`] prices anything.
const STEP_MIN_SAMPLES: u64 = 8;
/// Per plain step, how far the verify average relaxes toward the plain one: evidence ages, so
/// one slow stretch while verifying cannot keep drafting off for good (half-life ~350 steps).
const STEP_RELAX: f64 = 0.002;
/// Largest factor a verifying forward is priced up by.
pub const MAX_VERIFY_FACTOR: f64 = 2.0;

/// Target forwards (forward plus commit, decode-only steps) against the cost table.
#[derive(Debug, Clone, Default)]
pub struct StepClock {
    /// Moving averages of measured / predicted seconds: plain steps, steps that verify drafts.
    plain: f64,
    verify: f64,
    plain_n: u64,
    verify_n: u64,
}

impl StepClock {
    /// One step of `secs` whose forward the table priced at `predicted` seconds.
    pub fn record(&mut self, predicted: f64, secs: f64, verified: bool) {
        if !(predicted > 0.0 && secs.is_finite() && secs > 0.0) {
            return;
        }
        let r = (secs / predicted).clamp(0.25, 8.0);
        let (avg, n) = if verified {
            (&mut self.verify, &mut self.verify_n)
        } else {
            (&mut self.plain, &mut self.plain_n)
        };
        *avg = if *n == 0 {
            r
        } else {
            (1.0 - STEP_ALPHA) * *avg + STEP_ALPHA * r
        };
        *n += 1;
        if !verified && self.verify_n > 0 {
            self.verify += STEP_RELAX * (self.plain - self.verify);
        }
    }

    /// Measured / predicted forward time of plain and of verifying steps (0 before any).
    pub fn ratios(&self) -> (f64, f64) {
        (self.plain, self.verify)
    }

    /// How much dearer, relative to the table, a forward that verifies drafts runs than a
    /// plain one: 1 until both kinds have [`STEP_MIN_SAMPLES`] steps, never below 1 (a
    /// verifying step measured cheaper than the table does not make drafting look better
    /// than profiled) and at most [`MAX_VERIFY_FACTOR`].
    pub fn verify_factor(&self) -> f64 {
        if self.plain_n < STEP_MIN_SAMPLES || self.verify_n < STEP_MIN_SAMPLES {
            return 1.0;
        }
        (self.verify / self.plain).clamp(1.0, MAX_VERIFY_FACTOR)
    }
}

/// The table's SPS as a drafting plan must read it: forwards larger than the step's plain
/// size `base_b` (they verify drafts) at `1 / factor` the profiled speed.
pub fn priced_sps(sps: impl Fn(usize) -> f64, base_b: usize, factor: f64) -> impl Fn(usize) -> f64 {
    move |b| {
        if b > base_b {
            sps(b) / factor
        } else {
            sps(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(c: &mut StepClock, n: usize, ratio: f64, verified: bool) {
        for _ in 0..n {
            c.record(0.010, 0.010 * ratio, verified);
        }
    }

    #[test]
    fn verifying_steps_slower_than_the_table_raise_the_factor() {
        let mut c = StepClock::default();
        run(&mut c, 7, 1.1, false);
        run(&mut c, 100, 1.65, true);
        assert_eq!(
            c.verify_factor(),
            1.0,
            "too few plain steps to price anything"
        );
        run(&mut c, 1, 1.1, false);
        let f = c.verify_factor();
        assert!((f - 1.5).abs() < 0.01, "factor {f}");
        // Measured cheaper than plain: never below 1.
        let mut c = StepClock::default();
        run(&mut c, 50, 1.2, false);
        run(&mut c, 50, 0.9, true);
        assert_eq!(c.verify_factor(), 1.0);
        // Bounded.
        let mut c = StepClock::default();
        run(&mut c, 50, 0.5, false);
        run(&mut c, 50, 4.0, true);
        assert_eq!(c.verify_factor(), MAX_VERIFY_FACTOR);
    }

    #[test]
    fn without_new_verify_evidence_the_factor_relaxes() {
        let mut c = StepClock::default();
        run(&mut c, 50, 1.0, false);
        run(&mut c, 50, 1.5, true);
        let before = c.verify_factor();
        run(&mut c, 1000, 1.0, false);
        let after = c.verify_factor();
        assert!(before > 1.45 && after < 1.1, "{before} -> {after}");
    }

    #[test]
    fn a_measured_verify_factor_turns_a_marginal_plan_off() {
        use crate::speculative::scheduler::plan_drafts;
        let sps = |b: usize| 160.0 / (1.0 + 0.1 * (b as f64 - 1.0));
        let survival = vec![vec![0.5, 0.3, 0.15]];
        let draft = |_: usize, _: usize| 0.0005;
        let at = |factor: f64| {
            let priced = priced_sps(sps, 1, factor);
            plan_drafts(&survival, 1, 64, &priced, &draft)
        };
        let table = at(1.0);
        assert!(
            table.gamma[0] > 0 && table.rate > table.plain_rate * 1.2,
            "{table:?}"
        );
        let measured = at(1.5);
        assert_eq!(measured.gamma, vec![0], "{measured:?}");
        assert_eq!(measured.plain_rate, table.plain_rate);
    }

    #[test]
    fn the_price_applies_to_verifying_forwards_only() {
        let sps = |b: usize| 100.0 / b as f64;
        let p = priced_sps(sps, 4, 1.25);
        assert_eq!(p(4), 25.0);
        assert_eq!(p(3), sps(3));
        assert_eq!(p(5), 16.0);
    }
}
