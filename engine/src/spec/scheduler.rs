//! The hardware-aware prefix scheduler (`--policy dspark`): each step, choose every decoding
//! request's verify length to maximise `Theta = tau * SPS(B)`.
//!
//! Per request r the drafter's calibrated confidences give the prefix survival
//! `a_{r,j} = prod_{i<=j} c_{r,i}` (non-increasing in j). With verify lengths `l_r` the
//! target forward holds `B = base + sum_r l_r` tokens (`base` = one pending token per
//! decoding request plus the step's prefill tokens) and the expected committed tokens are
//! `tau = R + sum_r sum_{j<=l_r} a_{r,j}`.
//!
//! For a fixed number k of draft tokens taken, B is fixed and tau is largest with the k
//! highest survivals; since survivals fall along each request's prefix, the k highest always
//! form prefixes. So the optimum is `max_k f(k)` over the survivals sorted in descending
//! order, and the greedy walk below finds it whenever `f` is unimodal in k. It stops at the
//! first k where Theta does not improve: the early stop keeps verification lossless (the
//! DSpark paper's appendix gives a counterexample without it) and is what the paper does.
//! Cost: one sort, O(N log N) in candidate tokens. Pure: no I/O, no state.

/// Whether running a model drafter this step is expected to pay for itself: the scheduler's
/// objective with the drafter's own time added. `rates[k]`: live conditional acceptance of
/// position k; `n` decoding requests that would each verify up to `gamma` drafts;
/// `t_draft`: seconds per drafter call; `sps`: the cost table. Compares the best uniform
/// verify length against plain decoding (`n * SPS(n)` tokens/s). On a small target on a
/// CPU a drafter forward costs a good part of a target step, so a weak drafter loses
/// throughput unless this gate skips it.
pub fn drafting_pays(
    rates: &[f32],
    n: usize,
    gamma: usize,
    t_draft: f64,
    sps: &dyn Fn(usize) -> f64,
) -> bool {
    if n == 0 || gamma == 0 {
        return false;
    }
    let plain = n as f64 * sps(n);
    let (mut surv, mut tau) = (1.0f64, 1.0f64);
    for k in 1..=gamma {
        let r = rates.get(k - 1).copied().unwrap_or(0.5) as f64;
        surv *= if r.is_finite() {
            r.clamp(0.0, 1.0)
        } else {
            0.0
        };
        tau += surv;
        let t = 1.0 / sps(n * (1 + k)) + t_draft.max(0.0);
        if n as f64 * tau / t > plain {
            return true;
        }
    }
    false
}

/// The scheduler's choice for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Verify length per request, in input order.
    pub lens: Vec<usize>,
    /// Tokens in the target forward.
    pub b: usize,
    /// Expected committed tokens (sum over requests of 1 + survival of each verified token).
    pub tau: f64,
    /// `tau * SPS(b)`, the expected committed tokens per second.
    pub theta: f64,
}

/// Prefix survivals from per-position conditional confidences: the running product, clamped
/// to [0, 1] (a NaN confidence counts as 0).
pub fn survival(confidence: &[f32]) -> Vec<f64> {
    let mut a = 1.0f64;
    confidence
        .iter()
        .map(|&c| {
            let c = if c.is_nan() {
                0.0
            } else {
                (c as f64).clamp(0.0, 1.0)
            };
            a *= c;
            a
        })
        .collect()
}

/// Greedy token-level scheduling with early stop.
///
/// `survivals[r]` lists `a_{r,1..=cap_r}` (callers truncate to each request's cap: remaining
/// max_tokens, context, block size). `base_b` counts the tokens the forward holds anyway;
/// `max_b` bounds B. `sps(B)` is the cost table.
pub fn schedule(
    survivals: &[Vec<f64>],
    base_b: usize,
    max_b: usize,
    sps: &dyn Fn(usize) -> f64,
) -> Schedule {
    let r = survivals.len();
    let mut lens = vec![0usize; r];
    let mut b = base_b;
    let mut tau = r as f64;
    let mut best = tau * sps(b.max(1));
    let mut cands: Vec<(f64, usize, usize)> = survivals
        .iter()
        .enumerate()
        .flat_map(|(ri, a)| a.iter().enumerate().map(move |(j, &v)| (v, j, ri)))
        .collect();
    // Descending survival; ties: earlier position first, then request order (deterministic).
    cands.sort_by(|x, y| {
        y.0.partial_cmp(&x.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(x.1.cmp(&y.1))
            .then(x.2.cmp(&y.2))
    });
    for (a, j, ri) in cands {
        if b >= max_b || a <= 0.0 {
            break;
        }
        // Survivals fall along a prefix, so the next candidate of a request always extends
        // it; a non-monotone input (not from `survival`) stops here rather than skipping.
        if j != lens[ri] {
            break;
        }
        let theta = (tau + a) * sps(b + 1);
        if theta > best {
            lens[ri] = j + 1;
            b += 1;
            tau += a;
            best = theta;
        } else {
            break;
        }
    }
    Schedule {
        lens,
        b,
        tau,
        theta: best,
    }
}

#[cfg(test)]
mod gate_tests {
    use super::drafting_pays;

    #[test]
    fn drafting_pays_when_acceptance_beats_the_drafter_cost() {
        let flat = |_b: usize| 100.0; // verifying is free: only the drafter's time counts
                                      // Plain: 1 token / 10 ms. Drafting 1 token at rate 0.5 costs 10 + 5 ms for 1.5
                                      // tokens: equal, not better; at rate 0.6 it pays.
        assert!(!drafting_pays(&[0.5], 1, 1, 0.005, &flat));
        assert!(drafting_pays(&[0.6], 1, 1, 0.005, &flat));
        // A free drafter with any acceptance pays on a flat table; none does not.
        assert!(drafting_pays(&[0.05], 1, 4, 0.0, &flat));
        assert!(!drafting_pays(&[0.0; 4], 1, 4, 0.0, &flat));
        // Linear cost (SPS(B) = 100 / B): verifying k tokens costs k + 1 steps, so even
        // near-perfect drafts cannot pay.
        let linear = |b: usize| 100.0 / b as f64;
        assert!(!drafting_pays(&[0.99; 7], 1, 7, 0.0, &linear));
        // Hand-computed: SPS(1) = 150, SPS(3) = 120, t_draft = 2 ms, rates 0.6, 0.5:
        // k=1: tau 1.6 / (1/SPS(2) + 0.002); k=2: tau 1.9 / (1/120 + 0.002) = 183.9 tok/s
        // > 150 -> pays; with rates 0.3, 0.3 k=2 gives 1.39 / 0.010333 = 134.5 < 150.
        let t = |b: usize| [0.0, 150.0, 130.0, 120.0][b.min(3)];
        assert!(drafting_pays(&[0.6, 0.5], 1, 2, 0.002, &t));
        assert!(!drafting_pays(&[0.3, 0.3], 1, 2, 0.002, &t));
        assert!(!drafting_pays(&[0.9], 0, 2, 0.0, &t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Theta of a verify-length vector.
    fn theta_of(
        survivals: &[Vec<f64>],
        lens: &[usize],
        base_b: usize,
        sps: &dyn Fn(usize) -> f64,
    ) -> f64 {
        let b = base_b + lens.iter().sum::<usize>();
        let tau: f64 = survivals.len() as f64
            + survivals
                .iter()
                .zip(lens)
                .map(|(a, &l)| a[..l].iter().sum::<f64>())
                .sum::<f64>();
        tau * sps(b)
    }

    /// Exhaustive optimum over all prefix-respecting verify-length vectors.
    fn brute_force(
        survivals: &[Vec<f64>],
        base_b: usize,
        max_b: usize,
        sps: &dyn Fn(usize) -> f64,
    ) -> (Vec<usize>, f64) {
        let mut lens = vec![0usize; survivals.len()];
        let mut best = (lens.clone(), theta_of(survivals, &lens, base_b, sps));
        loop {
            // Odometer over lens[r] in 0..=cap_r.
            let mut k = 0;
            loop {
                if k == lens.len() {
                    return best;
                }
                if lens[k] < survivals[k].len() {
                    lens[k] += 1;
                    break;
                }
                lens[k] = 0;
                k += 1;
            }
            if base_b + lens.iter().sum::<usize>() > max_b {
                continue;
            }
            let t = theta_of(survivals, &lens, base_b, sps);
            if t > best.1 + 1e-12 {
                best = (lens.clone(), t);
            }
        }
    }

    /// `f(k)`: Theta when the k highest survivals are taken.
    fn theta_curve(
        survivals: &[Vec<f64>],
        base_b: usize,
        max_b: usize,
        sps: &dyn Fn(usize) -> f64,
    ) -> Vec<f64> {
        let mut all: Vec<f64> = survivals.iter().flatten().copied().collect();
        all.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let mut tau = survivals.len() as f64;
        let mut out = vec![tau * sps(base_b)];
        for (k, a) in all.iter().enumerate() {
            if base_b + k + 1 > max_b {
                break;
            }
            tau += a;
            out.push(tau * sps(base_b + k + 1));
        }
        out
    }

    fn unimodal(f: &[f64]) -> bool {
        let peak = f
            .iter()
            .enumerate()
            .fold(0, |best, (i, &v)| if v > f[best] { i } else { best });
        f[..=peak].windows(2).all(|w| w[1] > w[0]) && f[peak..].windows(2).all(|w| w[1] <= w[0])
    }

    /// A random instance: requests with random confidences and a random decreasing SPS curve
    /// (per-token cost ratios between 1 and 2).
    fn instance() -> impl Strategy<Value = (Vec<Vec<f64>>, usize, Vec<f64>)> {
        (
            prop::collection::vec(prop::collection::vec(0.05f32..1.0, 0..5), 1..4),
            0usize..4,
            prop::collection::vec(1.0f64..2.0, 40),
        )
            .prop_map(|(conf, prefill, ratios)| {
                let surv: Vec<Vec<f64>> = conf.iter().map(|c| survival(c)).collect();
                let mut sps = vec![0.0, 100.0];
                for r in ratios {
                    let last = *sps.last().unwrap();
                    sps.push(last / r);
                }
                let base = surv.len() + prefill;
                (surv, base, sps)
            })
    }

    #[test]
    fn survival_is_the_running_product() {
        let a = survival(&[0.9, 0.5, f32::NAN, 1.5]);
        assert!((a[0] - 0.9).abs() < 1e-6 && (a[1] - 0.45).abs() < 1e-6);
        assert_eq!(a[2], 0.0);
        assert_eq!(a[3], 0.0);
    }

    #[test]
    fn flat_cost_verifies_everything_steep_cost_nothing() {
        let surv = vec![survival(&[0.9, 0.8, 0.7]), survival(&[0.6, 0.5])];
        let flat = schedule(&surv, 2, 64, &|_| 100.0);
        assert_eq!(flat.lens, vec![3, 2]);
        // Cost linear in B: every extra token costs a full step; no survival beats that.
        let steep = schedule(&surv, 2, 64, &|b| 100.0 / b as f64);
        assert_eq!(steep.lens, vec![0, 0]);
        assert_eq!(steep.b, 2);
        assert!((steep.tau - 2.0).abs() < 1e-9);
    }

    #[test]
    fn high_survival_prefixes_go_first_under_load() {
        // SPS halves when B grows from 2 to 3 tokens and stays flat after: only a strong
        // prefix is worth it, and then the rest follows.
        let surv = vec![survival(&[0.95, 0.9]), survival(&[0.3, 0.2])];
        let s = schedule(&surv, 2, 64, &|b| if b <= 2 { 100.0 } else { 80.0 });
        // Taking 0.95: (2.95)*80 = 236 > 200; 0.855: 3.805*80 > 236; 0.3: 4.105*80 > ...
        assert_eq!(s.lens, vec![2, 2]);
        let s = schedule(&surv, 2, 64, &|b| 100.0 * 0.8f64.powi(b as i32 - 2));
        // 2.95*80=236 > 200; 3.805*64=243.5 > 236; 4.105*51.2=210 < 243.5 -> stop.
        assert_eq!(s.lens, vec![2, 0]);
        assert_eq!(s.b, 4);
    }

    #[test]
    fn max_b_bounds_the_batch() {
        let surv = vec![survival(&[1.0, 1.0, 1.0, 1.0])];
        let s = schedule(&surv, 1, 3, &|_| 10.0);
        assert_eq!(s.lens, vec![2]);
        assert_eq!(s.b, 3);
    }

    #[test]
    fn empty_inputs() {
        let s = schedule(&[], 5, 64, &|_| 10.0);
        assert!(s.lens.is_empty());
        assert_eq!(s.b, 5);
        let s = schedule(&[vec![]], 1, 64, &|_| 10.0);
        assert_eq!(s.lens, vec![0]);
    }

    /// Where Theta is not unimodal the greedy early stop can miss the optimum. This instance
    /// documents the gap: a cost cliff at B=3 followed by a flat stretch makes taking many
    /// tokens pay, but the first step past the cliff loses, so the walk stops. The early
    /// stop is kept anyway: it is the paper's rule and part of its losslessness argument,
    /// and measured cost tables are smooth enough that the case is rare (see the property
    /// test below, which counts it).
    #[test]
    fn non_unimodal_gap_is_documented() {
        let surv = vec![survival(&[0.99, 0.99, 0.99, 0.99, 0.99]), vec![]];
        let sps = |b: usize| if b <= 2 { 100.0 } else { 60.0 };
        let g = schedule(&surv, 2, 64, &sps);
        let (opt, opt_theta) = brute_force(&surv, 2, 64, &sps);
        assert_eq!(g.lens, vec![0, 0]);
        assert_eq!(opt, vec![5, 0]);
        assert!(!unimodal(&theta_curve(&surv, 2, 64, &sps)));
        assert!(
            opt_theta > 1.3 * g.theta,
            "gap {} vs {}",
            opt_theta,
            g.theta
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// The greedy result equals the brute-force optimum whenever Theta is unimodal in
        /// the number of tokens taken; it never beats it (sanity) and respects prefixes.
        #[test]
        fn greedy_matches_brute_force_when_unimodal((surv, base, table) in instance(), max_extra in 0usize..12) {
            let sps = |b: usize| table[b.min(table.len() - 1)];
            let max_b = base + max_extra;
            let g = schedule(&surv, base, max_b, &sps);
            let (_, opt) = brute_force(&surv, base, max_b, &sps);
            prop_assert!(g.theta <= opt + 1e-9);
            prop_assert!(g.b <= max_b.max(base));
            prop_assert!((theta_of(&surv, &g.lens, base, &sps) - g.theta).abs() < 1e-9);
            for (l, a) in g.lens.iter().zip(&surv) {
                prop_assert!(*l <= a.len());
            }
            if unimodal(&theta_curve(&surv, base, max_b, &sps)) {
                prop_assert!((g.theta - opt).abs() <= 1e-9 * opt.max(1.0), "greedy {} opt {}", g.theta, opt);
            }
        }

        /// A flatter SPS curve (every per-token cost ratio no larger) never yields a shorter
        /// verify length for any request.
        #[test]
        fn flatter_cost_never_verifies_less((surv, base, table) in instance(), flatten in 0.0f64..1.0) {
            let steep = |b: usize| table[b.min(table.len() - 1)];
            // Raise each ratio to a power <= 1: ratios shrink toward 1.
            let mut flat = vec![0.0, 100.0];
            for w in table[1..].windows(2) {
                let ratio = (w[0] / w[1]).powf(flatten);
                let last = *flat.last().unwrap();
                flat.push(last / ratio);
            }
            let flat_sps = |b: usize| flat[b.min(flat.len() - 1)];
            let a = schedule(&surv, base, 64, &steep);
            let b = schedule(&surv, base, 64, &flat_sps);
            for (x, y) in a.lens.iter().zip(&b.lens) {
                prop_assert!(y >= x, "steep {:?} flat {:?}", a.lens, b.lens);
            }
        }
    }
}
