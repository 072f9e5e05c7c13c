//! Teacher-forced dataset records on the real SmolLM2.

use super::*;
use dspark_engine::testutil::max_abs_diff;

/// The real SmolLM2-135M-Instruct (scripts/fetch-models.sh) and its tokenizer.
fn smollm2() -> (
    dspark_engine::model::Model,
    dspark_engine::tokenizer::TextTokenizer,
) {
    let cache = std::env::var_os("DSPARK_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/dspark")
        });
    let path = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    dspark_engine::loader::load(&path, &Device::Cpu, false).unwrap()
}

/// A teacher-forced record (`"forced": true`) is fed, not generated: its sequence starts
/// anchoring at the first token, keeps the target's hidden states and top-k at every
/// position (the top-1 is the target's own greedy prediction there), and ends with the
/// target's greedy continuation. Real SmolLM2 model (scripts/fetch-models.sh).
#[test]
fn teacher_forced_text_keeps_every_position() {
    let (model, tok) = smollm2();
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
    let mut kv = model.kv_cache(64 << 20, 16).unwrap();
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

/// Continuous batching in `generate`: five prompts of different lengths through a batch of
/// 2 (finished answers hand their place to the next prompt, whose prefill joins the decode
/// rows) give, in prompt order, the same greedy tokens as one prompt at a time, and the same
/// hidden states. Real SmolLM2 model.
#[test]
fn generation_refills_the_batch_and_matches_one_at_a_time() {
    let (model, tok) = smollm2();
    let texts = [
        "Say hi.",
        "Write a Python function that returns the sum of a list of integers.",
        "What is 2 + 3? Answer with one number.",
        "List three colours.",
        "Explain in one sentence what a hash map is, and give an example of its use in code.",
    ];
    let prompts: Vec<data::Prompt> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| data::Prompt {
            id: format!("p{i}"),
            domain: "chat".into(),
            prompt: t.to_string(),
            chat: true,
            forced: false,
        })
        .collect();
    let run = |batch: usize| {
        let opts = data::GenOptions {
            max_new_tokens: 20,
            batch,
            topk: TOPK,
            target_layers: vec![1, 5],
        };
        let mut steps = 0;
        let seqs = data::generate(&model, &tok, &prompts, &opts, &mut |_| steps += 1).unwrap();
        (seqs, steps)
    };
    let (one, steps_one) = run(1);
    let (two, steps_two) = run(2);
    assert_eq!(one.len(), 5);
    assert_eq!(two.len(), 5);
    // One forward per token of the longest live answer: a finished sequence's place is
    // taken at the next forward (fixed chunks of 2 would wait for each pair's longer one).
    let answer = |s: &data::Sequence| s.tokens.len() - s.meta.prompt_len;
    let (mut queue, mut slots, mut forwards) = (
        one.iter().map(answer).rev().collect::<Vec<_>>(),
        Vec::new(),
        0,
    );
    while !queue.is_empty() || !slots.is_empty() {
        while slots.len() < 2 {
            let Some(l) = queue.pop() else { break };
            slots.push(l);
        }
        forwards += 1;
        slots = slots
            .into_iter()
            .filter(|&l| l > 1)
            .map(|l| l - 1)
            .collect();
    }
    assert_eq!(steps_one, one.iter().map(answer).sum::<usize>());
    assert_eq!(steps_two, forwards, "forwards with a batch of 2");
    let lens: Vec<usize> = one.iter().map(answer).collect();
    let chunked: usize = lens.chunks(2).map(|c| *c.iter().max().unwrap()).sum();
    assert!(
        forwards < chunked,
        "answer lengths {lens:?}: refilled {forwards}, chunked {chunked}"
    );
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a.meta.id, b.meta.id);
        assert_eq!(a.meta.prompt_len, b.meta.prompt_len);
        assert_eq!(a.meta.fed, b.meta.fed);
        assert_eq!(a.tokens, b.tokens, "{}", a.meta.id);
        assert_eq!(a.topk_ids, b.topk_ids, "{}", a.meta.id);
        let f32s = |s: &data::Sequence| s.feats.to_dtype(DType::F32).unwrap();
        let d = max_abs_diff(&f32s(a), &f32s(b));
        assert!(d < 1e-2, "{}: hidden states differ by {d}", a.meta.id);
    }
}
