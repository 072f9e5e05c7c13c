//! The trainable drafter against the serving one: initialisation from the target, the
//! training forward vs `propose`, gradients vs finite differences.

use super::*;

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
        assert!(
            cfg.full_block,
            "trained on whole blocks, served on whole blocks"
        );
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
    // (head, draft vocabulary, context input, compact W1, drafts wanted): fewer drafts than
    // the block only match training with `full_block`, which training sets.
    for (head, dv, context_input, compact, gamma) in [
        (HeadKind::Markov, None, false, false, GAMMA),
        (HeadKind::Markov, Some(vocab.clone()), false, false, GAMMA),
        (HeadKind::Rnn, Some(vocab.clone()), false, false, GAMMA),
        (HeadKind::Parallel, None, false, false, GAMMA),
        (HeadKind::Markov, Some(vocab.clone()), true, false, GAMMA),
        // compact W1: half the ids (maybe the anchor) share W1's last row
        (HeadKind::Markov, Some(vocab.clone()), true, true, GAMMA),
        (HeadKind::Rnn, Some(vocab.clone()), false, true, GAMMA),
        (HeadKind::Markov, Some(vocab.clone()), true, true, 1),
        (HeadKind::Rnn, Some(vocab.clone()), false, false, 2),
    ] {
        let mut cfg = small_config(&target, head, dv.clone());
        cfg.context_input = context_input;
        cfg.full_block = gamma < GAMMA;
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
        assert!(kv.ensure(&mut table, anchor_pos + d.config().block_rows(gamma)));
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
            gamma,
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
        // Training: the drafted tokens as teacher-forced inputs (then any tokens: rows past
        // `gamma` are not compared, and inputs only enter the rows after them).
        let mut tokens = seq[..=anchor_pos].to_vec();
        tokens.extend_from_slice(&block.tokens);
        tokens.extend_from_slice(&seq[..GAMMA - gamma]);
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
        assert_eq!(block.tokens.len(), gamma);
        for k in 0..gamma {
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
    let t = targets(s, &anchors, GAMMA, TOPK, &vm, &Device::Cpu).unwrap();
    let lcfg = LossConfig::default();
    let loss = |td: &TrainDrafter| -> Tensor {
        let out = td.forward_seq(&target, s, &anchors).unwrap();
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
fn frozen_side_linear_matches_matmul_gradients() {
    // `lin_frozen` must give the tracked operand exactly the gradient candle's matmul gives
    // it, and the frozen operand none (that skipped product is what it saves).
    use crate::model::{lin_frozen, Frozen2};
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 7), &dev).unwrap()).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (5, 3), &dev).unwrap();
    let plain = (x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() * &probe)
        .unwrap()
        .sum_all()
        .unwrap();
    let g = plain.backward().unwrap();
    for (side, tracked, frozen) in [(Frozen2::Input, &w, &x), (Frozen2::Weight, &x, &w)] {
        let y = lin_frozen(x.as_tensor(), w.as_tensor(), side).unwrap();
        let want = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let diff = (&y - &want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5, "{side:?} forward");
        let gl = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (gl.get(tracked).unwrap(), g.get(tracked).unwrap());
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-5, "{side:?} gradient");
        assert!(
            gl.get(frozen).is_none(),
            "{side:?}: the frozen side got a gradient"
        );
    }
}
