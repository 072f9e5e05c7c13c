//! Online recalibration of a confidence head on the traffic being served.
//!
//! STS (`calibrate`) fits the confidences on held-out data of the training distribution;
//! on a domain the drafter never saw, the head over-states acceptance (docs/benchmarks.md:
//! math, ECE 10-19 %), and the scheduler then verifies blocks that do not pay. Every verify
//! step tells the truth about the positions it reached, so the engine keeps, per decoding
//! mode and block position, a scale `a_k` and an offset `d_k` on top of STS,
//! `c'_k = sigmoid(a_k * logit(c_k) + d_k)` (online Platt scaling; `a = 1, d = 0` is the
//! offline calibration), and moves them by one step of stochastic gradient descent on the
//! binary cross-entropy of `c'_k` against the outcome of every reached position:
//! `d_k -= rate * g`, `a_k -= rate * g * z / E[z^2]` with `g = c'_k - accepted_k` and
//! `z = logit(c_k)` (the scale's step normalised by a running mean of `z^2`). The offset's
//! fixed point is `mean c'_k = mean accepted_k` (calibration in the large), the scale's
//! corrects a head that is too sharp or too flat on this traffic; both follow a drift. It
//! only moves verify lengths: the committed tokens are decided by the lossless
//! verification alone.

/// The default step (`serve --online-calibration`): on a domain the offline calibration
/// data lacks it brings the survival estimate's error down to that of the calibrated
/// domains within a few thousand verify cycles, and leaves those alone (docs/benchmarks.md,
/// online recalibration).
pub const DEFAULT_STEP: f32 = 0.05;

/// Offsets are clipped to this magnitude (a factor of e^4 on the odds).
pub const MAX_OFFSET: f32 = 4.0;
/// Scales stay within this range.
pub const SCALE_RANGE: (f32, f32) = (0.1, 3.0);

/// One decoding mode's parameters per block position.
#[derive(Debug, Clone)]
struct ModeParams {
    scale: Vec<f32>,
    offset: Vec<f32>,
    /// Running mean of `z^2` (the scale step's normaliser).
    z2: Vec<f32>,
    /// Outcomes seen.
    seen: Vec<u64>,
}

/// Per-mode, per-position scales and offsets fitted online.
#[derive(Debug, Clone)]
pub struct OnlineCalibration {
    rate: f32,
    /// `[sampled, greedy]`.
    modes: [ModeParams; 2],
}

fn logit(c: f32) -> f32 {
    let c = c.clamp(1e-6, 1.0 - 1e-6);
    (c / (1.0 - c)).ln()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl OnlineCalibration {
    /// `positions`: longest block; `rate`: SGD step per outcome.
    pub fn new(positions: usize, rate: f32) -> Self {
        let m = ModeParams {
            scale: vec![1.0; positions],
            offset: vec![0.0; positions],
            z2: vec![1.0; positions],
            seen: vec![0; positions],
        };
        Self {
            rate,
            modes: [m.clone(), m],
        }
    }

    /// The offsets of a decoding mode (greedy or sampled).
    pub fn offsets(&self, greedy: bool) -> &[f32] {
        &self.modes[greedy as usize].offset
    }

    /// The scales of a decoding mode.
    pub fn scales(&self, greedy: bool) -> &[f32] {
        &self.modes[greedy as usize].scale
    }

    /// Outcomes recorded per position for a decoding mode.
    pub fn seen(&self, greedy: bool) -> &[u64] {
        &self.modes[greedy as usize].seen
    }

    /// The calibrated confidence of position `k` (unchanged past the tracked positions).
    pub fn adjust_one(&self, greedy: bool, k: usize, c: f32) -> f32 {
        let m = &self.modes[greedy as usize];
        match (m.scale.get(k), m.offset.get(k)) {
            (Some(&s), Some(&o)) if s != 1.0 || o != 0.0 => sigmoid(s * logit(c) + o),
            _ => c,
        }
    }

    /// Applies the scales and offsets to a block's confidences in place.
    pub fn adjust(&self, greedy: bool, confidence: &mut [f32]) {
        let m = &self.modes[greedy as usize];
        for (k, c) in confidence.iter_mut().enumerate().take(m.scale.len()) {
            if m.scale[k] != 1.0 || m.offset[k] != 0.0 {
                *c = sigmoid(m.scale[k] * logit(*c) + m.offset[k]);
            }
        }
    }

    /// Learns from one verified block: `confidence` as adjusted (and used) for the verified
    /// positions, of which the first `accepted` passed; positions after the first rejection
    /// were not decided and teach nothing. The head's own logit is recovered from the
    /// adjusted confidence with the current parameters.
    pub fn record(&mut self, greedy: bool, confidence: &[f32], accepted: usize) {
        let m = &mut self.modes[greedy as usize];
        let n = confidence.len().min(m.scale.len());
        for (k, &c) in confidence.iter().enumerate().take(n.min(accepted + 1)) {
            let y = if k < accepted { 1.0 } else { 0.0 };
            let z = (logit(c) - m.offset[k]) / m.scale[k];
            let g = c - y;
            m.z2[k] = 0.99 * m.z2[k] + 0.01 * z * z;
            m.offset[k] = (m.offset[k] - self.rate * g).clamp(-MAX_OFFSET, MAX_OFFSET);
            m.scale[k] = (m.scale[k] - self.rate * g * z / (m.z2[k] + 1e-3))
                .clamp(SCALE_RANGE.0, SCALE_RANGE.1);
            m.seen[k] += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A head that states 0.8 where the truth is 0.4 at position 0 and 0.6 vs 0.2 at
    /// position 1 (an unfamiliar domain), greedy mode only.
    #[test]
    fn offsets_remove_an_overconfident_bias_per_position_and_mode() {
        let mut oc = OnlineCalibration::new(4, 0.05);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (stated, truth) = ([0.8f32, 0.6], [0.4f64, 0.2]);
        let mut mean_used = [0.0f64; 2];
        let mut n_used = [0usize; 2];
        for step in 0..6000 {
            let mut conf = stated.to_vec();
            oc.adjust(true, &mut conf);
            let accepted = if !rng.random_bool(truth[0]) {
                0
            } else if !rng.random_bool(truth[1]) {
                1
            } else {
                2
            };
            if step >= 3000 {
                mean_used[0] += conf[0] as f64;
                n_used[0] += 1;
                if accepted >= 1 {
                    mean_used[1] += conf[1] as f64;
                    n_used[1] += 1;
                }
            }
            oc.record(true, &conf, accepted);
        }
        for k in 0..2 {
            let m = mean_used[k] / n_used[k] as f64;
            assert!(
                (m - truth[k]).abs() < 0.04,
                "position {k}: confidence {m:.3} after adaptation, truth {}",
                truth[k]
            );
        }
        // Position 1 only learns from blocks that reached it; positions never reached and
        // the other mode stay untouched.
        assert!(oc.seen(true)[1] < oc.seen(true)[0]);
        assert_eq!(oc.seen(true)[2..], [0, 0]);
        assert_eq!(oc.offsets(false), &[0.0; 4]);
        assert_eq!(oc.scales(false), &[1.0; 4]);
        let mut c = vec![0.7f32];
        oc.adjust(false, &mut c);
        assert_eq!(c, vec![0.7]);
    }

    #[test]
    fn calibrated_heads_stay_put_and_ranking_is_kept() {
        let mut oc = OnlineCalibration::new(2, 0.05);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for _ in 0..4000 {
            // Confidence equals the truth: the offset wanders around 0.
            let p = rng.random_range(0.1f32..0.9);
            let mut conf = vec![p];
            oc.adjust(false, &mut conf);
            let accepted = rng.random_bool(p as f64) as usize;
            oc.record(false, &conf, accepted);
        }
        assert!(oc.offsets(false)[0].abs() < 0.3, "{:?}", oc.offsets(false));
        assert!(
            (oc.scales(false)[0] - 1.0).abs() < 0.3,
            "{:?}",
            oc.scales(false)
        );
        // A monotone map: a higher stated confidence stays higher.
        oc.modes[0].offset[0] = -2.5;
        let (mut lo, mut hi) = ([0.3f32], [0.9f32]);
        oc.adjust(false, &mut lo);
        oc.adjust(false, &mut hi);
        assert!(lo[0] < hi[0] && lo[0] < 0.3 && hi[0] < 0.9);
        // Offsets saturate instead of running away on an all-rejected stream.
        for _ in 0..100_000 {
            let mut c = [0.3f32];
            oc.adjust(false, &mut c);
            oc.record(false, &c, 0);
        }
        assert_eq!(oc.offsets(false)[0], -MAX_OFFSET);
    }

    /// A head twice as sharp as the truth (`P(accept) = sigmoid(z / 2)`), unbiased: an
    /// offset cannot fix it, the scale goes to about 1/2 and the reliability error drops.
    #[test]
    fn scale_corrects_an_overly_sharp_head() {
        let mut oc = OnlineCalibration::new(1, 0.05);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (mut err_before, mut err_after) = (0.0f64, 0.0f64);
        let n = 20_000;
        for i in 0..n {
            let z: f32 = rng.random_range(-4.0..4.0);
            let truth = sigmoid(z / 2.0);
            let mut conf = [sigmoid(z)];
            oc.adjust(false, &mut conf);
            if i >= n / 2 {
                err_before += (sigmoid(z) - truth).abs() as f64;
                err_after += (conf[0] - truth).abs() as f64;
            }
            let accepted = rng.random_bool(truth as f64) as usize;
            oc.record(false, &conf, accepted);
        }
        let a = oc.scales(false)[0];
        assert!((a - 0.5).abs() < 0.12, "scale {a}");
        assert!(oc.offsets(false)[0].abs() < 0.25, "{:?}", oc.offsets(false));
        assert!(
            err_after < 0.3 * err_before,
            "mean |c - p| {:.3} -> {:.3}",
            err_before / (n / 2) as f64,
            err_after / (n / 2) as f64
        );
    }
}
