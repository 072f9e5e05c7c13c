//! Drafter tests on a tiny random Llama target (a Hugging Face folder written here and loaded
//! through `Model::load`), plus an ignored timing run on the real SmolLM2 target; by topic:
//! [`persistence`] (files, layouts, weight formats), [`backbone`] (the parallel backbone and
//! its context against the dense equations), [`heads`] (sequential and confidence heads,
//! sampling, request checks), [`timing`].

mod backbone;
mod heads;
mod persistence;
mod timing;

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
    let mut tkv = target.kv_cache(1 << 20, 16).unwrap();
    target
        .forward_fresh(tokens, &mut tkv, 0, d.target_layers())
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

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
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
