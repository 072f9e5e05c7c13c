//! Drafter files: save and load, target mismatches, the compact W1 layout, weight formats.

use super::*;

#[test]
fn default_target_layers_follow_the_reference_spread() {
    assert_eq!(default_target_layers(30, 3), vec![1, 14, 27]);
    assert_eq!(default_target_layers(36, 5), vec![1, 9, 17, 25, 33]);
    assert_eq!(default_target_layers(LAYERS, 3), vec![1, 2, 3]);
    assert_eq!(default_target_layers(2, 3), vec![0, 1]);
}

#[test]
fn save_load_round_trip_gives_identical_blocks() {
    let target = tiny_target();
    for head in [HeadKind::Parallel, HeadKind::Markov, HeadKind::Rnn] {
        let d = drafter(&target, head, |c| {
            c.sts_temperatures = Some(vec![1.5; GAMMA])
        });
        let dir = scratch_dir("roundtrip");
        d.save(&dir).unwrap();
        let e = DSparkDrafter::load(&dir, &target).unwrap();
        assert_eq!(e.config(), d.config());
        let params = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            ..Default::default()
        };
        let (mut kd, mut ke) = (cache(&d), cache(&e));
        let sd = prime(&target, &d, &mut kd, 1, 9, GAMMA, 64);
        let se = prime(&target, &e, &mut ke, 1, 9, GAMMA, 64);
        let a = draft(&d, &target, &mut kd, &[&sd], &params, 3);
        let b = draft(&e, &target, &mut ke, &[&se], &params, 3);
        assert_blocks_close(&a[0], &b[0], 0.0);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn mismatched_target_is_a_clear_error_naming_the_file() {
    let target = tiny_target();
    let d = drafter(&target, HeadKind::Markov, |_| {});
    let dir = scratch_dir("mismatch");
    d.save(&dir).unwrap();
    let cfg_path = dir.join("config.json");
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("hidden_size", (HIDDEN + 8).into(), "hidden_size"),
        ("vocab_size", (VOCAB + 1).into(), "vocab_size"),
        (
            "target_layer_ids",
            serde_json::json!([1, 2, LAYERS]),
            "layer id 6",
        ),
        (
            "target_layer_ids",
            serde_json::json!([3, 1, 2]),
            "ascending",
        ),
        (
            "sts_temperatures",
            serde_json::json!([1.0, 2.0]),
            "sts_temperatures",
        ),
    ];
    for (key, value, needle) in cases {
        let mut c = good.clone();
        c[key] = value;
        std::fs::write(&cfg_path, c.to_string()).unwrap();
        let err = format!("{:#}", DSparkDrafter::load(&dir, &target).err().unwrap());
        assert!(
            err.contains(&cfg_path.display().to_string()) && err.contains(needle),
            "{key}: {err}"
        );
    }
    // Heads that fit the config check but not the stored tensors: the weights file is named.
    let mut c = good.clone();
    c["num_attention_heads"] = 2.into();
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    let err = format!("{:#}", DSparkDrafter::load(&dir, &target).err().unwrap());
    assert!(
        err.contains("model.safetensors") && err.contains("layers.0.self_attn.q_proj.weight"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
    let err = format!("{:#}", DSparkDrafter::load(&dir, &target).err().unwrap());
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn compact_w1_keeps_draft_vocab_rows_and_shares_one_for_the_rest() {
    let target = tiny_target();
    let vocab: Vec<u32> = (0..VOCAB as u32).step_by(3).collect();
    for head in [HeadKind::Markov, HeadKind::Rnn] {
        let d = drafter(&target, head, |c| c.draft_vocab = Some(vocab.clone()));
        let c = d.compact_w1(&target).unwrap();
        assert!(c.config().compact_w1);
        assert_eq!(c.config().w1_rows(), vocab.len() + 1);
        assert_eq!(c.params[head::W1].dims()[0], vocab.len() + 1);
        // The reference: the full W1 with every out-of-vocabulary row set to their mean.
        let w1: Vec<Vec<f32>> = d.params[head::W1].to_vec2().unwrap();
        let others: Vec<usize> = (0..VOCAB).filter(|t| !t.is_multiple_of(3)).collect();
        let r = w1[0].len();
        let mean: Vec<f32> = (0..r)
            .map(|j| others.iter().map(|&t| w1[t][j]).sum::<f32>() / others.len() as f32)
            .collect();
        let mut rows = w1.clone();
        for &t in &others {
            rows[t] = mean.clone();
        }
        let mut tensors: HashMap<String, Tensor> = d
            .params
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let flat: Vec<f32> = rows.concat();
        tensors.insert(
            head::W1.into(),
            Tensor::from_vec(flat, (VOCAB, r), &Device::Cpu).unwrap(),
        );
        let reference =
            DSparkDrafter::from_tensors(&target, d.config().clone(), tensors, DType::F32).unwrap();
        // Anchors in and out of the draft vocabulary (the prompt's last token).
        let mut seen = [false, false];
        for id in 0..12u64 {
            let mut kvs = [cache(&c), cache(&reference), cache(&d)];
            let [kc, kr, kd] = &mut kvs;
            let sc = prime(&target, &c, kc, id, 9, GAMMA, 64);
            let sr = prime(&target, &reference, kr, id, 9, GAMMA, 64);
            let sd = prime(&target, &d, kd, id, 9, GAMMA, 64);
            let in_vocab = sc.anchor.is_multiple_of(3);
            seen[in_vocab as usize] = true;
            let a = draft(&c, &target, kc, &[&sc], &sampled(), 4);
            let b = draft(&reference, &target, kr, &[&sr], &sampled(), 4);
            assert_blocks_close(&a[0], &b[0], 1e-5);
            if in_vocab {
                let o = draft(&d, &target, kd, &[&sd], &sampled(), 4);
                assert_blocks_close(&a[0], &o[0], 1e-5);
            }
        }
        assert_eq!(seen, [true, true], "both kinds of anchor were drafted from");
        // Round trip, and what cannot be compacted.
        let dir = scratch_dir("compact-w1");
        c.save(&dir).unwrap();
        let back = DSparkDrafter::load(&dir, &target).unwrap();
        assert!(back.config().compact_w1);
        assert!(c.compact_w1(&target).is_err());
    }
    let full = drafter(&target, HeadKind::Markov, |_| {});
    assert!(full.compact_w1(&target).is_err(), "no draft vocabulary");
    let parallel = drafter(&target, HeadKind::Parallel, |c| {
        c.draft_vocab = Some(vocab.clone())
    });
    assert!(parallel.compact_w1(&target).is_err());
    let mut cfg = full.config().clone();
    cfg.compact_w1 = true;
    assert!(
        cfg.validate(&target.cfg).is_err(),
        "compact_w1 without draft_vocab"
    );
}

#[test]
fn drafter_weight_formats_parse_and_unknown_ones_are_errors() {
    assert_eq!(DrafterWeights::parse("q4_0").unwrap(), DrafterWeights::Q4_0);
    assert_eq!(DrafterWeights::parse("Q8_0").unwrap(), DrafterWeights::Q8_0);
    assert_eq!(DrafterWeights::default(), DrafterWeights::Q4_0);
    let e = DrafterWeights::parse("q5_k").unwrap_err().to_string();
    assert!(e.contains("q5_k") && e.contains("q4_0 or q8_0"), "{e}");
}
