//! Training tests on a tiny random Llama target (a Hugging Face folder written here): the
//! fixtures they share; the tests by topic in the files beside this one.

mod calibration;
mod drafter;
mod teacher_forced;
mod training;

use crate::calibrate::{acceptance, ece, fit_sts, sigmoid, Mode, Samples};
use crate::data::{topk_probs, Dataset, DatasetMeta, SeqMeta, Sequence};
use crate::loss::{dspark_loss, LossConfig};
use crate::model::{Blocks, TrainDrafter};
use crate::*;
use candle_core::{Device, Var};
use dspark_engine::kv::KvCache;
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
    let mut kv = target.kv_cache(bytes, 16).unwrap();
    let out = target
        .forward_fresh(tokens, &mut kv, tokens.len(), layers)
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
        compact_w1: false,
    }
}
