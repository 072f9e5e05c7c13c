//! Online recalibration of a confidence head on the traffic being served.
//!
//! STS (`calibrate`) fits the confidences on held-out data of the training distribution;
//! on a domain the drafter never saw, the head over-states acceptance (docs/benchmarks.md:
//! math, ECE 10-19 %), and the scheduler then verifies blocks that do not pay. Every verify
//! step tells the truth about the positions it reached, so the engine keeps, per decoding
//! mode and block position, a logit offset `d_k` on top of STS,
//! `c'_k = sigmoid(logit(c_k) + d_k)`, and moves it by one step of stochastic gradient
//! descent on the binary cross-entropy of `c'_k` against the outcome of every reached
//! position (`d_k -= rate * (c'_k - accepted_k)`). Its fixed point is
//! `mean c'_k = mean accepted_k` over recent traffic: calibration in the large, per
//! position, that follows a drift of the traffic. It only moves verify lengths: the
//! committed tokens are decided by the lossless verification alone.

/// The default step (`serve --online-calibration`): on the shipped drafter's math prompts,
/// a domain its calibration data lacks, it took greedy ECE of the survival estimate from
/// 19.1 % to 7.3 % within 515 verify cycles (0.02: 11.3 %, 0.1: 5.1 %) and left code and
/// chat, which the offline calibration fits, at 1.5-2.1 % (docs/benchmarks.md).
pub const DEFAULT_STEP: f32 = 0.05;

/// Offsets are clipped to this magnitude (a factor of e^4 on the odds).
pub const MAX_OFFSET: f32 = 4.0;

/// Per-mode, per-position logit offsets fitted online.
#[derive(Debug, Clone)]
pub struct OnlineCalibration {
    rate: f32,
    /// `[sampled, greedy]` offsets per block position.
    offsets: [Vec<f32>; 2],
    /// Outcomes seen per mode and position.
    seen: [Vec<u64>; 2],
}

fn logit(c: f32) -> f32 {
    let c = c.clamp(1e-6, 1.0 - 1e-6);
    (c / (1.0 - c)).ln()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl OnlineCalibration {
    /// `positions`: longest block; `rate`: SGD step on the logit offset per outcome.
    pub fn new(positions: usize, rate: f32) -> Self {
        Self {
            rate,
            offsets: [vec![0.0; positions], vec![0.0; positions]],
            seen: [vec![0; positions], vec![0; positions]],
        }
    }

    /// The offsets of a decoding mode (greedy or sampled).
    pub fn offsets(&self, greedy: bool) -> &[f32] {
        &self.offsets[greedy as usize]
    }

    /// Outcomes recorded per position for a decoding mode.
    pub fn seen(&self, greedy: bool) -> &[u64] {
        &self.seen[greedy as usize]
    }

    /// Applies the offsets to a block's confidences in place.
    pub fn adjust(&self, greedy: bool, confidence: &mut [f32]) {
        let d = &self.offsets[greedy as usize];
        for (k, c) in confidence.iter_mut().enumerate() {
            let off = d.get(k).copied().unwrap_or(0.0);
            if off != 0.0 {
                *c = sigmoid(logit(*c) + off);
            }
        }
    }

    /// Learns from one verified block: `confidence` as adjusted (and used) for the verified
    /// positions, of which the first `accepted` passed; positions after the first rejection
    /// were not decided and teach nothing.
    pub fn record(&mut self, greedy: bool, confidence: &[f32], accepted: usize) {
        let m = greedy as usize;
        let n = confidence.len().min(self.offsets[m].len());
        for (k, &c) in confidence.iter().enumerate().take(n.min(accepted + 1)) {
            let y = if k < accepted { 1.0 } else { 0.0 };
            let d = &mut self.offsets[m][k];
            *d = (*d - self.rate * (c - y)).clamp(-MAX_OFFSET, MAX_OFFSET);
            self.seen[m][k] += 1;
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
            assert!(oc.offsets(true)[k] < -1.0, "{:?}", oc.offsets(true));
        }
        // Position 1 only learns from blocks that reached it; positions never reached and
        // the other mode stay untouched.
        assert!(oc.seen(true)[1] < oc.seen(true)[0]);
        assert_eq!(oc.seen(true)[2..], [0, 0]);
        assert_eq!(oc.offsets(false), &[0.0; 4]);
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
        // A monotone map: a higher stated confidence stays higher.
        oc.offsets[0][0] = -2.5;
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
}
