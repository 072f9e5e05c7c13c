//! The parallel backbone and its context cache against the dense equations, batched and
//! chunked feeds, kernel weight formats.

use super::*;

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

/// Markov drafters of `target` without and with context input.
fn markov_drafters(target: &Model) -> [(bool, DSparkDrafter); 2] {
    [false, true].map(|context_input| {
        let d = drafter(target, HeadKind::Markov, |c| {
            c.context_input = context_input
        });
        (context_input, d)
    })
}

#[test]
fn context_in_chunks_equals_context_at_once() {
    let target = tiny_target();
    for (_, d) in markov_drafters(&target) {
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
    for (context_input, d) in markov_drafters(&target) {
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
