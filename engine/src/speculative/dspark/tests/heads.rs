//! The sequential (Markov / RNN) and confidence heads, sampling, and request checks.

use super::*;

#[test]
fn markov_head_conditions_on_the_previous_token_parallel_does_not() {
    let target = tiny_target();
    for head in [HeadKind::Parallel, HeadKind::Markov] {
        let d = drafter(&target, head, |_| {});
        let mut kv = cache(&d);
        let s = prime(&target, &d, &mut kv, 5, 10, GAMMA, 64);
        // Different seeds draw different tokens; q_k may depend on them only through the head.
        let blocks: Vec<Proposal> = (0..6)
            .map(|seed| draft(&d, &target, &mut kv, &[&s], &sampled(), seed).remove(0))
            .collect();
        let mut changed = false;
        for b in &blocks[1..] {
            // Position 0 conditions on the anchor only.
            assert!(max_diff(&probs(&b.q[0]), &probs(&blocks[0].q[0])) < 1e-6);
            for k in 1..GAMMA {
                let d = max_diff(&probs(&b.q[k]), &probs(&blocks[0].q[k]));
                let same_prev = b.tokens[k - 1] == blocks[0].tokens[k - 1];
                match head {
                    HeadKind::Parallel => assert!(d < 1e-6, "parallel q_{k} moved by {d}"),
                    _ if same_prev && head == HeadKind::Markov => assert!(d < 1e-6),
                    _ => changed |= d > 1e-3,
                }
            }
        }
        assert_eq!(changed, head == HeadKind::Markov, "{head:?}");
    }
}

#[test]
fn confidences_are_probabilities_and_sts_is_monotone_and_order_preserving() {
    let target = tiny_target();
    for (head, conf) in [
        (HeadKind::Markov, true),
        (HeadKind::Parallel, true),
        (HeadKind::Rnn, false),
    ] {
        let mut d = drafter(&target, head, |c| c.enable_confidence_head = conf);
        let mut kv = cache(&d);
        let seqs: Vec<Seq> = (0..4)
            .map(|i| prime(&target, &d, &mut kv, 10 + i, 6 + 5 * i as usize, GAMMA, 64))
            .collect();
        let all: Vec<&Seq> = seqs.iter().collect();
        let raw = draft(&d, &target, &mut kv, &all, &sampled(), 2);
        let temps = vec![0.5, 1.0, 2.0, 3.0, 0.7, 1.5, 4.0];
        d.set_sts_temperatures(Some(temps.clone())).unwrap();
        let cal = draft(&d, &target, &mut kv, &all, &sampled(), 2);
        for (r, c) in raw.iter().zip(&cal) {
            assert_eq!(r.tokens, c.tokens, "STS must not change the draft");
            for (k, &t) in temps.iter().enumerate() {
                let (x, y) = (r.confidence[k], c.confidence[k]);
                assert!(x > 0.0 && x < 1.0 && y > 0.0 && y < 1.0);
                let want = 1.0 / (1.0 + (-(x / (1.0 - x)).ln() / t).exp());
                assert!((y - want).abs() < 1e-4, "{head:?} k={k}: {y} vs {want}");
                if t >= 1.0 {
                    assert!((y - 0.5).abs() <= (x - 0.5).abs() + 1e-6);
                } else {
                    assert!((y - 0.5).abs() + 1e-6 >= (x - 0.5).abs());
                }
            }
        }
        for k in 0..GAMMA {
            for (a, b) in raw.iter().zip(&cal) {
                for (a2, b2) in raw.iter().zip(&cal) {
                    if a.confidence[k] < a2.confidence[k] {
                        assert!(
                            b.confidence[k] <= b2.confidence[k],
                            "order changed at k={k}"
                        );
                    }
                }
            }
        }
        assert!(d.set_sts_temperatures(Some(vec![1.0; GAMMA - 1])).is_err());
        assert!(d
            .set_sts_greedy(Some(vec![1.0; GAMMA]), Some(vec![f32::NAN; GAMMA]))
            .is_err());
    }
}

#[test]
fn greedy_requests_use_the_greedy_calibration() {
    let target = tiny_target();
    let mut d = drafter(&target, HeadKind::Markov, |_| {});
    let mut kv = cache(&d);
    let s = prime(&target, &d, &mut kv, 3, 12, GAMMA, 64);
    let greedy = greedy();
    let raw_g = draft(&d, &target, &mut kv, &[&s], &greedy, 1).remove(0);
    let raw_s = draft(&d, &target, &mut kv, &[&s], &sampled(), 1).remove(0);
    let logit = |c: f32| (c / (1.0 - c)).ln();
    // Sampled temperatures only: both modes use them.
    d.set_sts_temperatures(Some(vec![2.0; GAMMA])).unwrap();
    let g = draft(&d, &target, &mut kv, &[&s], &greedy, 1).remove(0);
    for k in 0..GAMMA {
        assert!((logit(g.confidence[k]) - logit(raw_g.confidence[k]) / 2.0).abs() < 1e-3);
    }
    // With a greedy calibration, greedy requests use it and sampled ones do not.
    d.set_sts_greedy(Some(vec![0.5; GAMMA]), Some(vec![0.25; GAMMA]))
        .unwrap();
    let g = draft(&d, &target, &mut kv, &[&s], &greedy, 1).remove(0);
    let p = draft(&d, &target, &mut kv, &[&s], &sampled(), 1).remove(0);
    assert_eq!(g.tokens, raw_g.tokens);
    for k in 0..GAMMA {
        let want = logit(raw_g.confidence[k]) / 0.5 + 0.25;
        assert!((logit(g.confidence[k]) - want).abs() < 1e-3, "k={k}");
        let want = logit(raw_s.confidence[k]) / 2.0;
        assert!((logit(p.confidence[k]) - want).abs() < 1e-3, "k={k}");
    }
}

#[test]
fn reduced_draft_vocab_gives_zero_q_outside_it() {
    let target = tiny_target();
    let vocab: Vec<u32> = (0..VOCAB as u32).filter(|i| i % 3 == 1).collect();
    let full = drafter(&target, HeadKind::Parallel, |_| {});
    let reduced = drafter(&target, HeadKind::Parallel, |c| {
        c.draft_vocab = Some(vocab.clone())
    });
    let markov = drafter(&target, HeadKind::Markov, |c| {
        c.draft_vocab = Some(vocab.clone())
    });
    let (mut kf, mut kr, mut km) = (cache(&full), cache(&reduced), cache(&markov));
    let sf = prime(&target, &full, &mut kf, 6, 12, GAMMA, 64);
    let sr = prime(&target, &reduced, &mut kr, 6, 12, GAMMA, 64);
    let sm = prime(&target, &markov, &mut km, 6, 12, GAMMA, 64);
    let f = draft(&full, &target, &mut kf, &[&sf], &sampled(), 4).remove(0);
    for b in [
        draft(&reduced, &target, &mut kr, &[&sr], &sampled(), 4).remove(0),
        draft(&markov, &target, &mut km, &[&sm], &sampled(), 4).remove(0),
    ] {
        for (t, q) in b.tokens.iter().zip(&b.q) {
            assert!(vocab.contains(t));
            let p = probs(q);
            assert_eq!(p.len(), VOCAB);
            assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-4);
            for (id, &x) in p.iter().enumerate() {
                assert!(vocab.contains(&(id as u32)) || x == 0.0, "q({id}) = {x}");
            }
        }
    }
    // Without a sequential head, the reduced q is the full q renormalised over the vocabulary.
    let r = draft(&reduced, &target, &mut kr, &[&sr], &sampled(), 4).remove(0);
    let (pf, pr) = (probs(&f.q[0]), probs(&r.q[0]));
    let mass: f32 = vocab.iter().map(|&i| pf[i as usize]).sum();
    for &i in &vocab {
        assert!((pr[i as usize] - pf[i as usize] / mass).abs() < 1e-5);
    }
    let greedy = greedy();
    let g = draft(&markov, &target, &mut km, &[&sm], &greedy, 4).remove(0);
    for (t, q) in g.tokens.iter().zip(&g.q) {
        assert!(vocab.contains(t));
        assert!(matches!(q, Dist::Greedy(x) if x == t));
    }
}

#[test]
fn greedy_params_give_deterministic_tokens() {
    let target = tiny_target();
    for head in [HeadKind::Markov, HeadKind::Rnn] {
        let d = drafter(&target, head, |c| c.mask_token_id = 0);
        let mut kv = cache(&d);
        let s = prime(&target, &d, &mut kv, 7, 11, GAMMA, 64);
        let greedy = greedy();
        let a = draft(&d, &target, &mut kv, &[&s], &greedy, 1).remove(0);
        let b = draft(&d, &target, &mut kv, &[&s], &greedy, 2).remove(0);
        assert_blocks_close(&a, &b, 0.0);
        for (t, q) in a.tokens.iter().zip(&a.q) {
            assert!(matches!(q, Dist::Greedy(x) if x == t));
        }
    }
}

#[test]
fn invalid_requests_are_clear_errors() {
    let target = tiny_target();
    let d = drafter(&target, HeadKind::Markov, |_| {});
    let mut kv = cache(&d);
    let s = prime(&target, &d, &mut kv, 8, 6, GAMMA, 64);
    let params = sampled();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut try_draft = |kv: &mut KvCache, gamma: usize, table: &[u32]| {
        let mut reqs = [DraftRequest {
            anchor: s.anchor,
            anchor_pos: s.anchor_pos,
            block_table: table,
            gamma,
            params: &params,
            history: None,
            rng: &mut rng,
            last_context: s.last_ctx.as_ref(),
        }];
        d.propose(kv, &target, &mut reqs)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(try_draft(&mut kv, 0, &s.table).contains("gamma 0"));
    assert!(try_draft(&mut kv, GAMMA + 1, &s.table).contains("block_size"));
    assert!(try_draft(&mut kv, GAMMA, &s.table[..1]).contains("does not cover"));
    let mut target_kv = target.kv_cache(1 << 20, 4).unwrap();
    assert!(try_draft(&mut target_kv, GAMMA, &s.table).contains("new_cache"));
    // A context-input drafter needs the last context feature.
    let d = drafter(&target, HeadKind::Markov, |c| c.context_input = true);
    let mut kv = cache(&d);
    let s = prime(&target, &d, &mut kv, 8, 6, GAMMA, 64);
    let mut reqs = [DraftRequest {
        anchor: s.anchor,
        anchor_pos: s.anchor_pos,
        block_table: &s.table,
        gamma: GAMMA,
        params: &params,
        history: None,
        rng: &mut ChaCha8Rng::seed_from_u64(0),
        last_context: None,
    }];
    let e = d.propose(&mut kv, &target, &mut reqs).unwrap_err();
    assert!(format!("{e:#}").contains("last context feature"), "{e:#}");
}
