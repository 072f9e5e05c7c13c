//! Calibration (STS) and teacher-forced acceptance.

use super::*;

#[test]
fn sts_lowers_ece_on_overconfident_samples_and_keeps_ranking() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut s = Samples::default();
    for _ in 0..3000 {
        let mut z = Vec::new();
        let mut ok = Vec::new();
        for k in 0..5 {
            let u: f64 = rng.random_range(-2.0..2.5) - 0.2 * k as f64;
            z.push((3.0 * u) as f32); // over-confident: the true logit is u
            ok.push(rng.random::<f64>() < sigmoid(u));
        }
        s.z.push(z);
        s.ok.push(ok);
    }
    let r = fit_sts(&s, Mode::Greedy).unwrap();
    assert!(r.ece_all_after < 0.5 * r.ece_all_before, "{r:?}");
    for k in 0..5 {
        assert!(r.ece_after[k] <= r.ece_before[k] + 1e-9, "{r:?}");
        assert!(
            r.temperatures[k] > 1.5,
            "over-confidence needs T > 1: {r:?}"
        );
        // Ranking preserved at every position.
        let mut idx: Vec<usize> = (0..s.z.len()).collect();
        idx.sort_by(|&a, &b| s.z[a][k].total_cmp(&s.z[b][k]));
        let cal: Vec<f64> = idx
            .iter()
            .map(|&i| sigmoid(s.z[i][k] as f64 / r.temperatures[k]))
            .collect();
        assert!(cal.windows(2).all(|w| w[0] <= w[1]));
    }
    assert!(ece(&[0.5, 0.5], &[1.0, 0.0], 10) < 1e-12);
}

/// `n` synthetic blocks of `k` positions (generator seeded with `seed`), each from latent
/// values `u` uniform in `range`: `label` gives a block's head logits, greedy acceptances
/// and soft labels from its `u`, drawing from the same generator.
fn synthetic(
    seed: u64,
    n: usize,
    k: usize,
    range: std::ops::Range<f64>,
    label: impl Fn(&[f64], &mut ChaCha8Rng) -> (Vec<f32>, Vec<bool>, Vec<f32>),
) -> Samples {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut s = Samples::default();
    for _ in 0..n {
        let u: Vec<f64> = (0..k).map(|_| rng.random_range(range.clone())).collect();
        let (z, ok, soft) = label(&u, &mut rng);
        s.z.push(z);
        s.ok.push(ok);
        s.soft.push(soft);
    }
    s
}

#[test]
fn sts_in_sampled_mode_fits_the_expected_survival() {
    // Soft labels c*_k = sigmoid(u); the head says sigmoid(3u) (over-confident) and the
    // greedy labels are all "accepted", so only the sampled fit can be right.
    let s = synthetic(9, 3000, 4, -1.5..2.5, |u, _| {
        (
            u.iter().map(|&u| (3.0 * u) as f32).collect(),
            vec![true; 4],
            u.iter().map(|&u| sigmoid(u) as f32).collect(),
        )
    });
    let r = fit_sts(&s, Mode::Sampled).unwrap();
    assert_eq!(r.mode, Mode::Sampled);
    assert!(r.ece_all_after < 0.3 * r.ece_all_before, "{r:?}");
    for t in &r.temperatures {
        assert!((2.0..4.5).contains(t), "true temperature is 3: {r:?}");
    }
    // Against the greedy labels (all 1) the same confidences are far off.
    let g = fit_sts(&s, Mode::Greedy).unwrap();
    assert!(g.ece_all_before > 0.3, "{g:?}");
}

#[test]
fn greedy_sts_removes_a_bias_that_temperature_cannot() {
    // Greedy acceptance is sigmoid(u + 1) while the head says sigmoid(u): under-confident by
    // a constant logit margin, at every confidence level.
    let s = synthetic(11, 4000, 3, -2.5..1.5, |u, rng| {
        (
            u.iter().map(|&u| u as f32).collect(),
            u.iter()
                .map(|&u| rng.random::<f64>() < sigmoid(u + 1.0))
                .collect(),
            vec![0.5; 3],
        )
    });
    let r = fit_sts(&s, Mode::Greedy).unwrap();
    assert!(r.ece_after[0] < 0.4 * r.ece_before[0], "{r:?}");
    assert!((0.6..1.4).contains(&r.offsets[0]), "offset near +1: {r:?}");
    assert!(r.ece_all_after < 0.5 * r.ece_all_before, "{r:?}");
    // The sampled fit uses the soft labels (all 0.5 here): it pulls every position to 0.5.
    let p = fit_sts(&s, Mode::Sampled).unwrap();
    assert!(p.ece_after[0] < 0.3 * p.ece_before[0], "{p:?}");
}

#[test]
fn teacher_forced_acceptance_by_hand() {
    let s = Samples {
        z: vec![vec![0.0; 3]; 2],
        ok: vec![vec![true, true, false], vec![true, false, true]],
        soft: vec![vec![0.5, 0.5, 1.0], vec![1.0, 0.25, 0.0]],
    };
    // Greedy survival: [1, 1, 0] and [1, 0, 0] -> means [1, 0.5, 0].
    let g = acceptance(&s, Mode::Greedy);
    assert!((g.tau - 2.5).abs() < 1e-12, "{g:?}");
    assert_eq!(g.conditional, vec![1.0, 0.5, 0.0]);
    // Sampled survival: [0.5, 0.25, 0.25] and [1, 0.25, 0] -> means [0.75, 0.25, 0.125].
    let p = acceptance(&s, Mode::Sampled);
    assert!((p.tau - 2.125).abs() < 1e-12, "{p:?}");
    let want = [0.75, 0.25 / 0.75, 0.5];
    for (c, w) in p.conditional.iter().zip(want) {
        assert!((c - w).abs() < 1e-12, "{p:?}");
    }
}
