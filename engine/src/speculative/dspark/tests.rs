//! Drafter tests on a tiny random Llama target (a Hugging Face folder written here and loaded
//! through `Model::load`), plus an ignored timing run on the real SmolLM2 target.

use super::*;
use crate::model::SeqBatch;
use std::path::PathBuf;

use crate::testutil::{scratch_dir, tiny_target, HIDDEN, LAYERS, VOCAB};
const GAMMA: usize = 7;

fn drafter(target: &Model, head: HeadKind, edit: impl FnOnce(&mut DSparkConfig)) -> DSparkDrafter {
    let mut cfg = DSparkDrafter::default_config(target, head, GAMMA);
    cfg.markov_rank = 16;
    cfg.intermediate_size = 48;
    edit(&mut cfg);
    DSparkDrafter::random(target, cfg, 5).unwrap()
}

/// One sequence ready to draft: its drafter block table and anchor.
struct Seq {
    id: u64,
    table: Vec<u32>,
    anchor: u32,
    anchor_pos: usize,
    gamma: usize,
    /// What the last `append_context` returned.
    last_ctx: Option<Tensor>,
}

impl Seq {
    /// Its draft request (no penalties history).
    fn request<'a>(
        &'a self,
        params: &'a SamplingParams,
        rng: &'a mut ChaCha8Rng,
    ) -> DraftRequest<'a> {
        DraftRequest {
            anchor: self.anchor,
            anchor_pos: self.anchor_pos,
            block_table: &self.table,
            gamma: self.gamma,
            params,
            history: None,
            rng,
            last_context: self.last_ctx.as_ref(),
        }
    }
}

fn prompt(id: u64, len: usize) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + id);
    (0..len)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect()
}

fn target_hidden(target: &Model, d: &DSparkDrafter, tokens: &[u32]) -> Vec<Tensor> {
    let mut tkv = KvCache::new(LAYERS, target.cfg.kv_dim(), 1 << 20, 16, &Device::Cpu).unwrap();
    let mut table = Vec::new();
    assert!(tkv.ensure(&mut table, tokens.len()));
    let batch = SeqBatch {
        tokens: tokens.to_vec(),
        start_pos: 0,
        block_table: table,
        num_logits: 0,
    };
    target
        .forward(&[batch], &mut tkv, d.target_layers())
        .unwrap()
        .hidden
}

/// Runs the target over `prompt(id, len)`, appends every token but the last (the anchor) to
/// the drafter context, in chunks of `chunk` tokens.
fn prime(
    target: &Model,
    d: &DSparkDrafter,
    dkv: &mut KvCache,
    id: u64,
    len: usize,
    gamma: usize,
    chunk: usize,
) -> Seq {
    let tokens = prompt(id, len);
    let hidden = target_hidden(target, d, &tokens);
    assert_eq!(hidden.len(), d.target_layers().len());
    let mut table = Vec::new();
    assert!(dkv.ensure(&mut table, len - 1 + gamma));
    let mut start = 0;
    let mut last_ctx = None;
    while start < len - 1 {
        let n = chunk.min(len - 1 - start);
        let part: Vec<Tensor> = hidden
            .iter()
            .map(|h| h.narrow(0, start, n).unwrap())
            .collect();
        last_ctx = d.append_context(dkv, &table, start, &part).unwrap();
        start += n;
    }
    assert_eq!(last_ctx.is_some(), d.config().context_input && len > 1);
    Seq {
        id,
        table,
        anchor: tokens[len - 1],
        anchor_pos: len - 1,
        gamma,
        last_ctx,
    }
}

fn draft(
    d: &DSparkDrafter,
    target: &Model,
    dkv: &mut KvCache,
    seqs: &[&Seq],
    params: &SamplingParams,
    seed: u64,
) -> Vec<Proposal> {
    let mut rngs: Vec<ChaCha8Rng> = seqs
        .iter()
        .map(|s| ChaCha8Rng::seed_from_u64(seed * 1000 + s.id))
        .collect();
    let mut reqs: Vec<DraftRequest> = rngs
        .iter_mut()
        .zip(seqs)
        .map(|(rng, s)| s.request(params, rng))
        .collect();
    let blocks = d.propose(dkv, target, &mut reqs).unwrap();
    for (b, s) in blocks.iter().zip(seqs) {
        assert_eq!(
            (b.tokens.len(), b.q.len(), b.confidence.len()),
            (s.gamma, s.gamma, s.gamma)
        );
    }
    blocks
}

fn sampled() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        ..Default::default()
    }
}

fn probs(q: &Dist) -> Vec<f32> {
    q.dense(VOCAB)
        .expect("expected a distribution, not a point mass")
        .into_owned()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn assert_blocks_close(a: &Proposal, b: &Proposal, tol: f32) {
    assert_eq!(a.tokens, b.tokens);
    for (qa, qb) in a.q.iter().zip(&b.q) {
        match (qa, qb) {
            (Dist::Greedy(x), Dist::Greedy(y)) => assert_eq!(x, y),
            _ => assert!(max_diff(&probs(qa), &probs(qb)) <= tol, "q differs"),
        }
    }
    assert!(
        max_diff(&a.confidence, &b.confidence) <= tol,
        "{:?} vs {:?}",
        a.confidence,
        b.confidence
    );
}

fn cache(d: &DSparkDrafter) -> KvCache {
    d.new_cache(1 << 20, 4, &Device::Cpu).unwrap()
}

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
fn batched_propose_equals_each_alone() {
    let target = tiny_target();
    for (head, context_input) in [
        (HeadKind::Markov, false),
        (HeadKind::Rnn, false),
        (HeadKind::Markov, true),
    ] {
        let d = drafter(&target, head, |c| c.context_input = context_input);
        let mut kv = cache(&d);
        let seqs = [
            prime(&target, &d, &mut kv, 1, 5, GAMMA, 64),
            prime(&target, &d, &mut kv, 2, 13, 4, 64),
            prime(&target, &d, &mut kv, 3, 22, GAMMA, 64),
        ];
        let all: Vec<&Seq> = seqs.iter().collect();
        let batched = draft(&d, &target, &mut kv, &all, &sampled(), 9);
        for (s, b) in seqs.iter().zip(&batched) {
            let alone = draft(&d, &target, &mut kv, &[s], &sampled(), 9);
            assert_blocks_close(b, &alone[0], 1e-5);
        }
    }
}

/// The block's normed outputs computed densely from the equations (no cache, no paging):
/// keys/values `[k_proj(c_{<anchor}); k_proj(block)]`, bidirectional attention in the block.
fn dense_reference(d: &DSparkDrafter, target: &Model, id: u64, len: usize, gamma: usize) -> Tensor {
    let tokens = prompt(id, len);
    let n = len - 1;
    let hidden: Vec<Tensor> = target_hidden(target, d, &tokens)
        .iter()
        .map(|h| h.narrow(0, 0, n).unwrap())
        .collect();
    let ctx = rms_norm(
        &d.fc.forward(&Tensor::cat(&hidden, 1).unwrap()).unwrap(),
        &d.hidden_norm,
        d.eps,
    )
    .unwrap();
    let anchor = target
        .embed(&Tensor::new(&[tokens[n]], &Device::Cpu).unwrap())
        .unwrap();
    let mut rows = vec![anchor];
    rows.extend(std::iter::repeat_n(d.mask_row.clone(), gamma - 1));
    let mut x = Tensor::cat(&rows, 0).unwrap();
    if d.cfg.context_input {
        x = x.broadcast_add(&ctx.narrow(0, n - 1, 1).unwrap()).unwrap();
    }
    let pos = |a: usize, b: usize| (a as u32..b as u32).collect::<Vec<u32>>();
    let (cc, sc) = d.rope_at(&pos(0, n)).unwrap();
    let (cb, sb) = d.rope_at(&pos(n, n + gamma)).unwrap();
    let (nh, nkv, hd) = (
        d.cfg.num_attention_heads,
        d.cfg.num_key_value_heads,
        d.cfg.head_dim,
    );
    for l in &d.layers {
        let h = rms_norm(&x, &l.input_norm, d.eps).unwrap();
        let (kc, vc) = d.key_values(l, &ctx, &cc, &sc).unwrap();
        let (kb, vb) = d.key_values(l, &h, &cb, &sb).unwrap();
        let k = Tensor::cat(&[kc, kb], 0).unwrap();
        let v = Tensor::cat(&[vc, vb], 0).unwrap();
        let q = rms_norm(
            &l.q.forward(&h).unwrap().reshape((gamma, nh, hd)).unwrap(),
            &l.q_norm,
            d.eps,
        )
        .unwrap();
        let q = rope(&q, &cb, &sb).unwrap();
        let heads: Vec<Tensor> = (0..nh)
            .map(|hh| {
                let kvh = hh / (nh / nkv);
                let qh = q.narrow(1, hh, 1).unwrap().squeeze(1).unwrap();
                let kh = k.narrow(1, kvh * hd, hd).unwrap();
                let vh = v.narrow(1, kvh * hd, hd).unwrap();
                let scores = (qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
                candle_nn::ops::softmax_last_dim(&scores)
                    .unwrap()
                    .matmul(&vh)
                    .unwrap()
            })
            .collect();
        x = (&x + l.o.forward(&Tensor::cat(&heads, 1).unwrap()).unwrap()).unwrap();
        let h = rms_norm(&x, &l.post_norm, d.eps).unwrap();
        let g = candle_nn::ops::silu(&l.gate.forward(&h).unwrap()).unwrap();
        x = (&x
            + l.down
                .forward(&(g * l.up.forward(&h).unwrap()).unwrap())
                .unwrap())
        .unwrap();
    }
    rms_norm(&x, &d.norm, d.eps).unwrap()
}

#[test]
fn batched_backbone_matches_the_dense_equations() {
    for context_input in [false, true] {
        backbone_matches_dense(context_input);
    }
}

fn backbone_matches_dense(context_input: bool) {
    let target = tiny_target();
    let d = drafter(&target, HeadKind::Markov, |c| {
        c.num_hidden_layers = 2;
        c.context_input = context_input;
    });
    let mut kv = cache(&d);
    let seqs = [
        prime(&target, &d, &mut kv, 1, 9, GAMMA, 64),
        prime(&target, &d, &mut kv, 2, 4, 3, 64),
    ];
    let params = sampled();
    let mut rngs = [ChaCha8Rng::seed_from_u64(0), ChaCha8Rng::seed_from_u64(1)];
    let reqs: Vec<DraftRequest> = rngs
        .iter_mut()
        .zip(&seqs)
        .map(|(rng, s)| s.request(&params, rng))
        .collect();
    let (h, _) = d.backbone(&mut kv, &target, &reqs).unwrap();
    let want = Tensor::cat(
        &[
            dense_reference(&d, &target, 1, 9, GAMMA),
            dense_reference(&d, &target, 2, 4, 3),
        ],
        0,
    )
    .unwrap();
    let diff = crate::testutil::max_abs_diff(&h, &want);
    assert!(
        diff < 1e-4,
        "paged batched backbone (context_input {context_input}) differs from the dense equations by {diff}"
    );
}

#[test]
fn context_in_chunks_equals_context_at_once() {
    let target = tiny_target();
    for context_input in [false, true] {
        let d = drafter(&target, HeadKind::Markov, |c| {
            c.context_input = context_input
        });
        let (mut k1, mut k2) = (cache(&d), cache(&d));
        let once = prime(&target, &d, &mut k1, 4, 17, GAMMA, 64);
        let chunked = prime(&target, &d, &mut k2, 4, 17, GAMMA, 5);
        let a = draft(&d, &target, &mut k1, &[&once], &sampled(), 1);
        let b = draft(&d, &target, &mut k2, &[&chunked], &sampled(), 1);
        assert_blocks_close(&a[0], &b[0], 1e-5);
    }
}

#[test]
fn contexts_fed_together_equal_each_fed_alone() {
    // The engine feeds every drafting sequence's backlog in one `append_contexts` pass:
    // rows of different sequences (and an empty feed) must not mix.
    let target = tiny_target();
    for context_input in [false, true] {
        let d = drafter(&target, HeadKind::Markov, |c| {
            c.context_input = context_input
        });
        let (mut alone_kv, mut together_kv) = (cache(&d), cache(&d));
        let lens = [(1u64, 9usize), (2, 1), (3, 20)];
        let alone: Vec<Seq> = lens
            .iter()
            .map(|&(id, len)| prime(&target, &d, &mut alone_kv, id, len, GAMMA, 64))
            .collect();
        let mut tables = Vec::new();
        let mut hidden = Vec::new();
        for &(id, len) in &lens {
            let h = target_hidden(&target, &d, &prompt(id, len));
            hidden.push(
                h.iter()
                    .map(|t| t.narrow(0, 0, len - 1).unwrap())
                    .collect::<Vec<_>>(),
            );
            let mut table = Vec::new();
            assert!(together_kv.ensure(&mut table, len - 1 + GAMMA));
            tables.push(table);
        }
        let feeds: Vec<ContextFeed> = tables
            .iter()
            .zip(&hidden)
            .map(|(table, hidden)| ContextFeed {
                table,
                start: 0,
                hidden,
            })
            .collect();
        let last = d.append_contexts(&mut together_kv, &feeds).unwrap();
        assert_eq!(last.len(), 3);
        // The one-token prompt has an empty context: nothing fed, no feature.
        assert!(last[1].is_none());
        for (i, (a, last)) in alone.iter().zip(last).enumerate() {
            if a.anchor_pos == 0 {
                continue;
            }
            assert_eq!(last.is_some(), context_input);
            if let (Some(x), Some(y)) = (&last, &a.last_ctx) {
                let (x, y) = (x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap());
                assert!(max_diff(&x, &y) < 1e-5, "sequence {i}");
            }
            let together = Seq {
                id: a.id,
                table: tables[i].clone(),
                anchor: a.anchor,
                anchor_pos: a.anchor_pos,
                gamma: a.gamma,
                last_ctx: last,
            };
            let x = draft(&d, &target, &mut together_kv, &[&together], &sampled(), 3);
            let y = draft(&d, &target, &mut alone_kv, &[a], &sampled(), 3);
            assert_blocks_close(&x[0], &y[0], 1e-5);
        }
    }
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
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
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
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
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
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
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
    let mut target_kv =
        KvCache::new(LAYERS, target.cfg.kv_dim(), 1 << 20, 4, &Device::Cpu).unwrap();
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

/// Wall time of one propose on the real target (SmolLM2-135M, 1 drafter layer, gamma 7):
/// `cargo test --release -p dspark-engine --lib speculative::dspark::tests::propose_timing -- --ignored --nocapture`.
#[test]
#[ignore = "needs the SmolLM2 GGUF; prints timings"]
fn propose_timing_smollm2() {
    let cache_dir = std::env::var("DSPARK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/dspark"));
    let path = cache_dir.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let target = Model::load(&path, &Device::Cpu, &|_, _| {}).unwrap();
    let top: Vec<u32> = (0..8192).collect();
    for (head, vocab) in [
        (HeadKind::Parallel, None),
        (HeadKind::Markov, None),
        (HeadKind::Rnn, None),
        (HeadKind::Markov, Some(top)),
    ] {
        let mut cfg = DSparkDrafter::default_config(&target, head, GAMMA);
        cfg.draft_vocab = vocab;
        let vd = cfg.draft_vocab_size();
        let d = DSparkDrafter::random(&target, cfg, 1).unwrap();
        let mut kv = d.new_cache(64 << 20, 16, &Device::Cpu).unwrap();
        let mut tkv = KvCache::new(
            target.cfg.num_layers,
            target.cfg.kv_dim(),
            64 << 20,
            16,
            &Device::Cpu,
        )
        .unwrap();
        let seqs: Vec<Seq> = (0..8u64)
            .map(|id| {
                let tokens: Vec<u32> = prompt(id, 64).iter().map(|t| t * 97 % 40_000).collect();
                let mut ttable = Vec::new();
                assert!(tkv.ensure(&mut ttable, tokens.len()));
                let batch = SeqBatch {
                    tokens: tokens.clone(),
                    start_pos: 0,
                    block_table: ttable.clone(),
                    num_logits: 0,
                };
                let hidden = target
                    .forward(&[batch], &mut tkv, d.target_layers())
                    .unwrap()
                    .hidden;
                tkv.truncate(&mut ttable, 0);
                let mut table = Vec::new();
                assert!(kv.ensure(&mut table, 63 + GAMMA));
                let ctx: Vec<Tensor> = hidden.iter().map(|h| h.narrow(0, 0, 63).unwrap()).collect();
                let last_ctx = d.append_context(&mut kv, &table, 0, &ctx).unwrap();
                Seq {
                    id,
                    table,
                    anchor: tokens[63],
                    anchor_pos: 63,
                    gamma: GAMMA,
                    last_ctx,
                }
            })
            .collect();
        for (name, params) in [
            (
                "greedy",
                SamplingParams {
                    temperature: 0.0,
                    ..Default::default()
                },
            ),
            ("T=1", sampled()),
        ] {
            for b in [1usize, 8] {
                let batch: Vec<&Seq> = seqs.iter().take(b).collect();
                draft(&d, &target, &mut kv, &batch, &params, 0);
                let runs = 10;
                let t0 = std::time::Instant::now();
                for r in 0..runs {
                    draft(&d, &target, &mut kv, &batch, &params, r);
                }
                let ms = t0.elapsed().as_secs_f64() * 1e3 / runs as f64;
                println!("{head:?} draft vocab {vd}, {name}, batch {b}: {ms:.2} ms per propose");
            }
        }
    }
}

/// The backbone on the CPU kernels tracks the dense one in either weight format: Q8_0
/// closely, Q4_0 within its coarser rounding, which is measurably further off (the format
/// is really applied); an f16 context cache adds next to nothing.
#[test]
fn kernel_weight_formats_track_the_dense_backbone() {
    let target = tiny_target();
    let run = |format: Option<DrafterWeights>, kv_dtype: DType| -> Tensor {
        let mut d = drafter(&target, HeadKind::Markov, |c| c.context_input = true);
        if let Some(f) = format {
            d.use_cpu_kernels(f).unwrap();
            assert!(d.layers[0].q.uses_kernel() && d.fc.uses_kernel());
        }
        let mut kv = d.new_cache_as(1 << 20, 4, &Device::Cpu, kv_dtype).unwrap();
        assert_eq!(kv.dtype(), kv_dtype);
        let s = prime(&target, &d, &mut kv, 1, 9, GAMMA, 64);
        let params = sampled();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let reqs = [s.request(&params, &mut rng)];
        d.backbone(&mut kv, &target, &reqs).unwrap().0
    };
    let dense = run(None, DType::F32);
    let scale = dense
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let err = |t: &Tensor| crate::testutil::max_abs_diff(t, &dense) / scale;
    let q8 = err(&run(Some(DrafterWeights::Q8_0), DType::F32));
    let q4_f32 = run(Some(DrafterWeights::Q4_0), DType::F32);
    let q4_f16 = run(Some(DrafterWeights::Q4_0), DType::F16);
    let f16_only = crate::testutil::max_abs_diff(&q4_f16, &q4_f32) / scale;
    let (q4, q4_f16) = (err(&q4_f32), err(&q4_f16));
    eprintln!("relative max error: q8_0 {q8}, q4_0 {q4}, q4_0 + f16 cache {q4_f16} ({f16_only} from the cache)");
    assert!(q8 < 0.02, "Q8_0 backbone off by {q8}");
    assert!(q4 < 0.25, "Q4_0 backbone off by {q4}");
    assert!(q4 > 2.0 * q8, "Q4_0 ({q4}) is not coarser than Q8_0 ({q8})");
    assert!(
        f16_only > 0.0 && f16_only < 0.01,
        "an f16 cache moved the backbone by {f16_only}"
    );
    assert!(q4_f16 < 0.25, "Q4_0 with an f16 cache off by {q4_f16}");
}

#[test]
fn drafter_weight_formats_parse_and_unknown_ones_are_errors() {
    assert_eq!(DrafterWeights::parse("q4_0").unwrap(), DrafterWeights::Q4_0);
    assert_eq!(DrafterWeights::parse("Q8_0").unwrap(), DrafterWeights::Q8_0);
    assert_eq!(DrafterWeights::default(), DrafterWeights::Q4_0);
    let e = DrafterWeights::parse("q5_k").unwrap_err().to_string();
    assert!(e.contains("q5_k") && e.contains("q4_0 or q8_0"), "{e}");
}
