//! Training runs: the loss falls, a resumed run continues exactly, joined datasets split.

use super::*;

#[test]
fn a_few_steps_reduce_the_loss_and_resume_exactly() {
    let target = tiny_target();
    let layers = dspark_engine::speculative::dspark::default_target_layers(LAYERS, 3);
    let ds = synthetic_dataset(&target, &layers, 6, 40);
    let eval_loss = |dir: &Path| -> f32 {
        let d = DSparkDrafter::load(dir, &target).unwrap();
        let td = TrainDrafter::new(&target, &d).unwrap();
        let vm = VocabMap::new(&td.cfg);
        let mut tot = 0.0;
        for s in &ds.seqs {
            let anchors = [8usize, 16, 24, 30];
            let out = td.forward_seq(&target, s, &anchors).unwrap();
            let t = targets(s, &anchors, GAMMA, TOPK, &vm, &Device::Cpu).unwrap();
            tot += dspark_loss(&out, &t, GAMMA, &LossConfig::default())
                .unwrap()
                .total
                .to_scalar::<f32>()
                .unwrap();
        }
        tot
    };
    // One run of 30 steps straight ...
    let a = scratch_dir("run-a");
    let tc = train_config(HeadKind::Markov, 30);
    let tc1 = TrainConfig {
        steps: 1,
        ..tc.clone()
    };
    train(&target, &ds, &tc1, &a.join("init"), 1, &mut |_| {}).unwrap();
    let before = eval_loss(&a.join("init"));
    let st = train(&target, &ds, &tc, &a, 100, &mut |_| {}).unwrap();
    assert_eq!(st.step, 30);
    let after = eval_loss(&a);
    assert!(after < before * 0.95, "loss {before} -> {after}");
    // ... equals 12 steps, a stop, and a resume to 30 (checkpoint round trip).
    let b = scratch_dir("run-b");
    let mut stop_at_12 = tc.clone();
    stop_at_12.steps = 30;
    let mut n = 0;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train(&target, &ds, &stop_at_12, &b, 4, &mut |rep| {
            n = rep.step;
            if rep.step == 12 {
                panic!("simulated interruption");
            }
        })
    }));
    assert!(r.is_err() && n == 12);
    let st = train(&target, &ds, &tc, &b, 4, &mut |_| {}).unwrap();
    assert_eq!(st.step, 30);
    let va = candle_core::safetensors::load(a.join(VARS), &Device::Cpu).unwrap();
    let vb = candle_core::safetensors::load(b.join(VARS), &Device::Cpu).unwrap();
    for (k, x) in &va {
        let diff = dspark_engine::testutil::max_abs_diff(x, &vb[k]);
        assert!(diff < 1e-6, "{k} differs after resume by {diff}");
    }
    // The serving checkpoint loads and carries the trained (bf16-rounded) weights.
    let d = DSparkDrafter::load(&a, &target).unwrap();
    let w = &d.tensors()["fc.weight"];
    let v = va["fc.weight"]
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    assert_eq!(w.to_vec2::<f32>().unwrap(), v.to_vec2::<f32>().unwrap());
    // Resuming on a dataset that stores other target layers is refused with a clear error.
    let other = synthetic_dataset(&target, &[0, 1], 1, 20);
    let longer = TrainConfig {
        steps: 31,
        ..tc.clone()
    };
    let e = train(&target, &other, &tc, &a, 10, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("target layers"), "{e}");
    // ... and so is resuming with other settings.
    let e = train(&target, &ds, &longer, &a, 10, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("different settings"), "{e}");
    // A warm start from the trained run begins at its weights (one step at a negligible
    // learning rate: the loss is the trained one up to bf16 rounding, not the random one).
    let c = scratch_dir("run-c");
    let warm = TrainConfig {
        steps: 1,
        init: Some(a.clone()),
        optim: OptimConfig {
            lr: 1e-9,
            ..tc.optim
        },
        ..tc.clone()
    };
    train(&target, &ds, &warm, &c, 1, &mut |_| {}).unwrap();
    let warm_loss = eval_loss(&c);
    assert!(
        (warm_loss - after).abs() < 0.25 * (before - after),
        "warm start {warm_loss}, trained {after}, random {before}"
    );
    // A warm start on other data keeps the checkpoint's draft vocabulary (the other data
    // alone would pick a different one).
    let more = synthetic_dataset(&target, &ds.meta.target_layers, 2, 14);
    let own = DSparkDrafter::load(&a, &target)
        .unwrap()
        .config()
        .draft_vocab
        .clone();
    assert_ne!(new_config(&target, &more, &warm).draft_vocab, own);
    let e = scratch_dir("run-e");
    train(&target, &more, &warm, &e, 1, &mut |_| {}).unwrap();
    let kept = DSparkDrafter::load(&e, &target)
        .unwrap()
        .config()
        .draft_vocab
        .clone();
    assert_eq!(kept, own);
    std::fs::remove_dir_all(e).ok();
    // A checkpoint of another architecture is refused, naming the difference.
    let other_rank = TrainConfig {
        rank: tc.rank + 4,
        init: Some(a.clone()),
        ..tc.clone()
    };
    let e = train(
        &target,
        &ds,
        &other_rank,
        &scratch_dir("run-d"),
        1,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("differs from this run"), "{e}");
    for dir in [a, b, c] {
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn joined_datasets_split_each_part_alone_and_must_fit_together() {
    let target = tiny_target();
    let (a, b) = (
        synthetic_dataset(&target, &[0, 1], 6, 12),
        synthetic_dataset(&target, &[0, 1], 9, 10),
    );
    let dirs = [scratch_dir("ds-a"), scratch_dir("ds-b")];
    a.save(&dirs[0]).unwrap();
    b.save(&dirs[1]).unwrap();
    let joined = Dataset::load_all(&dirs).unwrap();
    assert_eq!(joined.seqs.len(), 15);
    assert_eq!(joined.parts, vec![6, 9]);
    assert_eq!(joined.meta.seqs.len(), 15);
    assert_eq!(joined.seqs[6].tokens, b.seqs[0].tokens);
    // Each part's held-out sequences are the ones it holds out alone (offset by the parts
    // before it), and every sequence lands on exactly one side.
    let (train, held) = joined.split(0.34);
    let (_, held_a) = a.split(0.34);
    let (_, held_b) = b.split(0.34);
    let want: Vec<usize> = held_a
        .iter()
        .copied()
        .chain(held_b.iter().map(|i| i + 6))
        .collect();
    assert_eq!(held, want);
    let mut all: Vec<usize> = train.iter().chain(&held).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..15).collect::<Vec<_>>());
    // A dataset of other target layers does not join.
    let c = synthetic_dataset(&target, &[1], 2, 10);
    let dir_c = scratch_dir("ds-c");
    c.save(&dir_c).unwrap();
    let e = Dataset::load_all(&[dirs[0].clone(), dir_c.clone()])
        .err()
        .expect("mismatched datasets must not join");
    assert!(e.to_string().contains("do not fit together"), "{e}");
    for d in dirs.iter().chain([&dir_c]) {
        std::fs::remove_dir_all(d).ok();
    }
}

#[test]
fn compact_w1_trains_and_serves_in_that_form() {
    // `--compact-w1`: W1 holds the draft vocabulary's rows + one shared row from step 0, the
    // loss still falls, and the serving checkpoint loads with the same compact table.
    let target = tiny_target();
    let layers = dspark_engine::speculative::dspark::default_target_layers(LAYERS, 3);
    let ds = synthetic_dataset(&target, &layers, 6, 40);
    let tc = TrainConfig {
        compact_w1: true,
        ..train_config(HeadKind::Markov, 30)
    };
    let dir = scratch_dir("run-compact");
    let st = train(&target, &ds, &tc, &dir, 100, &mut |_| {}).unwrap();
    let (first, last) = (st.log.first().unwrap().2, st.log.last().unwrap().2);
    assert!(last < first * 0.95, "ce {first} -> {last}");
    let d = DSparkDrafter::load(&dir, &target).unwrap();
    assert!(d.config().compact_w1);
    assert_eq!(
        d.tensors()[dspark_engine::speculative::dspark::W1].dims(),
        &[tc.draft_vocab + 1, tc.rank]
    );
}
