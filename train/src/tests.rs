//! Training tests on a tiny random Llama target (a Hugging Face folder written here).

use crate::calibrate::{acceptance, ece, fit_sts, sigmoid, Mode, Samples};
use crate::data::{topk_probs, Dataset, DatasetMeta, SeqMeta, Sequence};
use crate::loss::{dspark_loss, LossConfig};
use crate::model::{Blocks, TrainDrafter};
use crate::*;
use candle_core::{Device, Var};
use dspark_engine::kv::KvCache;
use dspark_engine::model::SeqBatch;
use dspark_engine::sampling::SamplingParams;
use dspark_engine::speculative::dspark::DraftRequest;

use dspark_engine::testutil::{scratch_dir, tiny_target, HIDDEN, LAYERS, VOCAB};
const GAMMA: usize = 4;
const TOPK: usize = 8;

fn small_config(target: &Model, head: HeadKind, draft_vocab: Option<Vec<u32>>) -> DSparkConfig {
    let mut cfg = DSparkDrafter::default_config(target, head, GAMMA);
    cfg.markov_rank = 8;
    cfg.intermediate_size = 48;
    cfg.draft_vocab = draft_vocab;
    cfg
}

/// Target hidden states of `layers` (concatenated) and logits for every position of `tokens`.
fn target_pass(target: &Model, tokens: &[u32], layers: &[usize]) -> (Tensor, Vec<Vec<f32>>) {
    let bytes = (tokens.len() + 32) * KvCache::bytes_per_token(LAYERS, target.cfg.kv_dim());
    let mut kv = KvCache::new(LAYERS, target.cfg.kv_dim(), bytes, 16, &Device::Cpu).unwrap();
    let mut table = Vec::new();
    assert!(kv.ensure(&mut table, tokens.len()));
    let out = target
        .forward(
            &[SeqBatch {
                tokens: tokens.to_vec(),
                start_pos: 0,
                block_table: table,
                num_logits: tokens.len(),
            }],
            &mut kv,
            layers,
        )
        .unwrap();
    let feats = if out.hidden.is_empty() {
        Tensor::zeros((tokens.len(), 0), DType::F32, &Device::Cpu).unwrap()
    } else {
        Tensor::cat(&out.hidden, 1).unwrap()
    };
    (feats, out.logits.to_vec2().unwrap())
}

/// A greedy continuation of a random prompt by the tiny target, as a dataset sequence.
fn synthetic_dataset(target: &Model, layers: &[usize], n: usize, len: usize) -> Dataset {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut seqs = Vec::new();
    for i in 0..n {
        let prompt_len = 6;
        let mut tokens: Vec<u32> = (0..prompt_len)
            .map(|_| rng.random_range(0..VOCAB as u32))
            .collect();
        while tokens.len() < len + 1 {
            let (_, logits) = target_pass(target, &tokens, &[]);
            tokens.push(dspark_engine::model::argmax(logits.last().unwrap()));
        }
        let fed = len;
        let (feats, logits) = target_pass(target, &tokens[..fed], layers);
        let (mut ids, mut ps) = (Vec::new(), Vec::new());
        for l in &logits[prompt_len - 1..] {
            let (a, b) = topk_probs(l, TOPK);
            ids.extend(a);
            ps.extend(b);
        }
        seqs.push(Sequence {
            meta: SeqMeta {
                id: format!("s{i}"),
                domain: "test".into(),
                prompt_len,
                fed,
            },
            tokens,
            feats: feats.to_dtype(DType::F16).unwrap(),
            topk_ids: ids,
            topk_p: ps,
        });
    }
    Dataset {
        meta: DatasetMeta {
            format: data::FORMAT,
            model_id: target.id.clone(),
            vocab_size: VOCAB,
            hidden_size: HIDDEN,
            num_layers: LAYERS,
            target_layers: layers.to_vec(),
            topk: TOPK,
            max_new_tokens: len,
            generation: "greedy".into(),
            prompts: "synthetic".into(),
            seqs: seqs.iter().map(|s| s.meta.clone()).collect(),
            total_tokens: n * len,
            seconds: 0.0,
        },
        parts: vec![seqs.len()],
        seqs,
    }
}

fn train_config(head: HeadKind, steps: usize) -> TrainConfig {
    TrainConfig {
        head,
        block_size: GAMMA,
        layers: 1,
        rank: 8,
        draft_vocab: 64,
        steps,
        seqs_per_step: 2,
        anchors_per_seq: 4,
        seed: 3,
        heldout_frac: 0.25,
        loss: LossConfig::default(),
        optim: OptimConfig {
            lr: 1e-2,
            ..Default::default()
        },
        init: None,
        context_input: false,
        intermediate: 0,
        init_from_target: false,
    }
}

/// `--init-from-target`: the drafter layer starts as the target's last layer, attention and
/// norms exactly (up to bf16), the MLP as the strongest neurons when narrower; training from
/// it works and is recorded in the run's settings.
#[test]
fn init_from_target_copies_the_last_layer() {
    let target = dspark_engine::testutil::tiny_target();
    let ds = synthetic_dataset(&target, &[0, 1], 6, 24);
    let last = target.weights.layers.last().unwrap();
    let dense = |l: &dspark_engine::model::Linear| match &**l {
        candle_core::quantized::QMatMul::QTensor(q) => q.dequantize(&Device::Cpu).unwrap(),
        candle_core::quantized::QMatMul::Tensor(t)
        | candle_core::quantized::QMatMul::TensorF16(t) => t.clone(),
    };
    let full = target.cfg.intermediate_size;
    for inter in [0, full / 2] {
        let tc = TrainConfig {
            intermediate: inter,
            init_from_target: true,
            ..train_config(HeadKind::Markov, 1)
        };
        let cfg = new_config(&target, &ds, &tc);
        assert_eq!(cfg.intermediate_size, if inter == 0 { full } else { inter });
        let d = init_from_target(&target, cfg.clone(), 1).unwrap();
        let t = d.tensors();
        let bf = |x: &Tensor| {
            x.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let got = |n: &str| bf(&t[&format!("layers.0.{n}.weight")]);
        assert_eq!(got("self_attn.q_proj"), bf(&dense(&last.wq)));
        assert_eq!(got("self_attn.o_proj"), bf(&dense(&last.wo)));
        assert_eq!(got("input_layernorm"), bf(&last.attn_norm));
        assert_eq!(bf(&t["norm.weight"]), bf(&target.weights.final_norm));
        let gate = dense(&last.gate);
        let g = t["layers.0.mlp.gate_proj.weight"].clone();
        assert_eq!(g.dims(), &[cfg.intermediate_size, target.cfg.hidden_size]);
        // Every kept gate row is one of the target's rows, in the target's order.
        let rows = gate.to_vec2::<f32>().unwrap();
        let mut at = 0;
        for r in g.to_vec2::<f32>().unwrap() {
            let i = (at..rows.len())
                .find(|&i| bf(&Tensor::new(rows[i].as_slice(), &Device::Cpu).unwrap()) == r)
                .expect("a target row, in order");
            at = i + 1;
        }
        // And it trains (the settings are stored with the run).
        let out = scratch_dir(&format!("init-target-{inter}"));
        let st = train(&target, &ds, &tc, &out, 1, &mut |_| {}).unwrap();
        assert!(st.config.init_from_target && st.config.intermediate == inter);
        std::fs::remove_dir_all(out).ok();
    }
}

#[test]
fn training_forward_matches_serving_propose() {
    let target = tiny_target();
    let vocab: Vec<u32> = (0..VOCAB as u32).rev().step_by(2).collect();
    for (head, dv, context_input, compact) in [
        (HeadKind::Markov, None, false, false),
        (HeadKind::Markov, Some(vocab.clone()), false, false),
        (HeadKind::Rnn, Some(vocab.clone()), false, false),
        (HeadKind::Parallel, None, false, false),
        (HeadKind::Markov, Some(vocab.clone()), true, false),
        // compact W1: half the ids (maybe the anchor) share W1's last row
        (HeadKind::Markov, Some(vocab.clone()), true, true),
        (HeadKind::Rnn, Some(vocab.clone()), false, true),
    ] {
        let mut cfg = small_config(&target, head, dv.clone());
        cfg.context_input = context_input;
        let mut d = DSparkDrafter::random(&target, cfg, 7).unwrap();
        if compact {
            d = d.compact_w1(&target).unwrap();
        }
        let layers = d.target_layers().to_vec();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let seq: Vec<u32> = (0..20).map(|_| rng.random_range(0..VOCAB as u32)).collect();
        let anchor_pos = 13;
        let (feats, _) = target_pass(&target, &seq[..anchor_pos], &layers);
        // Serving: context, then one block at temperature 1.
        let mut kv = d.new_cache(1 << 20, 16, &Device::Cpu).unwrap();
        let mut table = Vec::new();
        assert!(kv.ensure(&mut table, anchor_pos + GAMMA));
        let hidden: Vec<Tensor> = (0..layers.len())
            .map(|i| feats.narrow(1, i * HIDDEN, HIDDEN).unwrap())
            .collect();
        let last = d.append_context(&mut kv, &table, 0, &hidden).unwrap();
        let params = SamplingParams::default();
        let mut srng = ChaCha8Rng::seed_from_u64(9);
        let mut reqs = [DraftRequest {
            anchor: seq[anchor_pos],
            anchor_pos,
            block_table: &table,
            gamma: GAMMA,
            params: &params,
            history: None,
            rng: &mut srng,
            last_context: last.as_ref(),
        }];
        let block = d
            .propose(&mut kv, &target, &mut reqs)
            .unwrap()
            .pop()
            .unwrap();
        // Training: the drafted tokens as teacher-forced inputs.
        let mut tokens = seq[..=anchor_pos].to_vec();
        tokens.extend_from_slice(&block.tokens);
        let td = TrainDrafter::new(&target, &d).unwrap();
        let out = td
            .forward(
                &target,
                &Blocks {
                    feats: &feats,
                    tokens: &tokens,
                    anchors: &[anchor_pos],
                },
            )
            .unwrap();
        let q: Vec<Vec<f32>> = candle_nn::ops::softmax(&out.logits, candle_core::D::Minus1)
            .unwrap()
            .to_vec2()
            .unwrap();
        let z: Vec<f32> = out.conf_logit.unwrap().to_vec1().unwrap();
        let ids: Vec<u32> = dv.clone().unwrap_or_else(|| (0..VOCAB as u32).collect());
        for k in 0..GAMMA {
            let serv = block.q[k]
                .dense(VOCAB)
                .expect("temperature 1 gives probabilities");
            for (row, &id) in ids.iter().enumerate() {
                let (a, b) = (q[k][row], serv[id as usize]);
                assert!(
                    (a - b).abs() < 1e-5,
                    "{head:?} k={k} id={id}: train {a} serve {b}"
                );
            }
            let c = sigmoid(z[k] as f64) as f32;
            assert!(
                (c - block.confidence[k]).abs() < 1e-5,
                "{head:?} confidence k={k}: {c} vs {}",
                block.confidence[k]
            );
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    let target = tiny_target();
    let cfg = small_config(&target, HeadKind::Rnn, Some((0..48).collect()));
    let d = DSparkDrafter::random(&target, cfg, 2).unwrap();
    let layers = d.target_layers().to_vec();
    let ds = synthetic_dataset(&target, &layers, 1, 24);
    let td = TrainDrafter::new(&target, &d).unwrap();
    let vm = VocabMap::new(&td.cfg);
    let s = &ds.seqs[0];
    let anchors = [6usize, 11, 15];
    let feats = s
        .feats
        .narrow(0, 0, 15)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let t = targets(s, &anchors, GAMMA, TOPK, &vm, &Device::Cpu).unwrap();
    let lcfg = LossConfig::default();
    let loss = |td: &TrainDrafter| -> Tensor {
        let out = td
            .forward(
                &target,
                &Blocks {
                    feats: &feats,
                    tokens: &s.tokens,
                    anchors: &anchors,
                },
            )
            .unwrap();
        dspark_loss(&out, &t, GAMMA, &lcfg).unwrap().total
    };
    let grads = loss(&td).backward().unwrap();
    let vars: HashMap<String, Var> = td.vars().into_iter().collect();
    let mut checked = 0;
    for name in [
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "rnn_head.proj.weight",
        "confidence_head.proj.weight",
        "mask_embedding",
    ] {
        let var = &vars[name];
        let g: Vec<f32> = grads
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let i = (0..g.len())
            .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
            .unwrap();
        let orig = var.as_tensor().copy().unwrap();
        let base: Vec<f32> = orig.flatten_all().unwrap().to_vec1().unwrap();
        let eps = 1e-2f32;
        let at = |delta: f32| -> f64 {
            let mut v = base.clone();
            v[i] += delta;
            var.set(&Tensor::from_vec(v, orig.shape(), &Device::Cpu).unwrap())
                .unwrap();
            loss(&td).to_scalar::<f32>().unwrap() as f64
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
        var.set(&Tensor::from_vec(base.clone(), orig.shape(), &Device::Cpu).unwrap())
            .unwrap();
        let an = g[i] as f64;
        assert!(
            (fd - an).abs() <= 0.05 * an.abs() + 2e-3,
            "{name}[{i}]: finite difference {fd}, autograd {an}"
        );
        checked += 1;
    }
    assert_eq!(checked, 9);
}

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
            let feats = s
                .feats
                .narrow(0, 0, 30)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let out = td
                .forward(
                    &target,
                    &Blocks {
                        feats: &feats,
                        tokens: &s.tokens,
                        anchors: &anchors,
                    },
                )
                .unwrap();
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

#[test]
fn sts_in_sampled_mode_fits_the_expected_survival() {
    // Soft labels c*_k = sigmoid(u); the head says sigmoid(3u) (over-confident) and the
    // greedy labels are all "accepted", so only the sampled fit can be right.
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut s = Samples::default();
    for _ in 0..3000 {
        let u: Vec<f64> = (0..4).map(|_| rng.random_range(-1.5..2.5)).collect();
        s.z.push(u.iter().map(|&u| (3.0 * u) as f32).collect());
        s.soft.push(u.iter().map(|&u| sigmoid(u) as f32).collect());
        s.ok.push(vec![true; 4]);
    }
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
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut s = Samples::default();
    for _ in 0..4000 {
        let u: Vec<f64> = (0..3).map(|_| rng.random_range(-2.5..1.5)).collect();
        s.z.push(u.iter().map(|&u| u as f32).collect());
        s.ok.push(
            u.iter()
                .map(|&u| rng.random::<f64>() < sigmoid(u + 1.0))
                .collect(),
        );
        s.soft.push(vec![0.5; 3]);
    }
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

/// A teacher-forced record (`"forced": true`) is fed, not generated: its sequence starts
/// anchoring at the first token, keeps the target's hidden states and top-k at every
/// position (the top-1 is the target's own greedy prediction there), and ends with the
/// target's greedy continuation. Real SmolLM2 model (scripts/fetch-models.sh).
#[test]
fn teacher_forced_text_keeps_every_position() {
    let cache = std::env::var_os("DSPARK_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/dspark")
        });
    let path = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let (model, tok) = dspark_engine::loader::load(&path, &Device::Cpu, false).unwrap();
    // Longer than one forward chunk (128 rows), so the chunks must join up.
    let text = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n".repeat(6);
    let p = data::Prompt {
        id: "t".into(),
        domain: "code-src".into(),
        prompt: text.clone(),
        chat: false,
        forced: true,
    };
    let opts = data::GenOptions {
        max_new_tokens: 64,
        batch: 4,
        topk: TOPK,
        target_layers: vec![1, 5],
    };
    let seqs = data::generate(&model, &tok, &[p], &opts, &mut |_| {}).unwrap();
    let s = &seqs[0];
    let fed = tok.encode(&text, tok.add_bos).unwrap();
    assert!(fed.len() > 128, "{} tokens", fed.len());
    assert_eq!(s.meta.prompt_len, 1);
    assert_eq!(s.meta.fed, fed.len());
    assert_eq!(&s.tokens[..fed.len()], &fed[..]);
    assert_eq!(s.tokens.len(), fed.len() + 1);
    assert_eq!(s.feats.dims(), &[fed.len(), 2 * model.cfg.hidden_size]);
    assert_eq!(s.topk_ids.len(), fed.len() * TOPK);
    assert_eq!(s.anchor_range(GAMMA), Some(1..=fed.len() - GAMMA));
    let mut kv = KvCache::new(
        model.cfg.num_layers,
        model.cfg.kv_dim(),
        64 << 20,
        16,
        &Device::Cpu,
    )
    .unwrap();
    let logits = model.logits_for(&fed, &mut kv).unwrap();
    for (t, row) in logits.iter().enumerate() {
        assert_eq!(
            s.topk(t, TOPK).0[0],
            dspark_engine::model::argmax(row),
            "position {t}"
        );
    }
    assert_eq!(
        *s.tokens.last().unwrap(),
        dspark_engine::model::argmax(logits.last().unwrap())
    );
}
