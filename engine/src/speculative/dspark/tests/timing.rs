//! An ignored timing run on the real SmolLM2 target.

use super::*;

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
        let mut tkv = target.kv_cache(64 << 20, 16).unwrap();
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
        for (name, params) in [("greedy", greedy()), ("T=1", sampled())] {
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
