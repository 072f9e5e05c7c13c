//! Teacher-forced dataset records on the real SmolLM2.

use super::*;

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
