//! Test fixtures shared by the engine's unit tests: a tiny random Llama target written as a
//! Hugging Face folder and loaded through `Model::load` like any model.

use crate::kernels::QType;
use crate::model::attention::{AttnBatch, AttnSeq, PagedAttention};
use crate::model::Model;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Vocabulary, hidden size and layers of [`tiny_target`].
pub const VOCAB: usize = 96;
pub const HIDDEN: usize = 32;
pub const LAYERS: usize = 6;

/// The shipped DSpark Markov drafter of the default model (SmolLM2-135M).
pub fn shipped_drafter() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../drafters/smollm2-135m-dspark-markov")
}

/// A fresh, empty scratch folder unique to this process and call.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("dspark-test-{}-{n}-{tag}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `max |a - b|` over all elements (same shapes).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `len` values uniform in [-1, 1), every 37th (from the 6th) scaled by 8: occasional
/// outliers exercise the kernels' per-block scales.
pub fn random_with_outliers(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let v: f32 = rng.random_range(-1.0..1.0);
            if i % 37 == 5 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

/// An `n x k` matrix of [`random_with_outliers`] values quantised to `ty` by candle (the
/// blocks a GGUF file holds).
pub fn quantized(ty: QType, n: usize, k: usize, rng: &mut ChaCha8Rng) -> QTensor {
    let w = Tensor::from_vec(random_with_outliers(n * k, rng), (n, k), &Device::Cpu).unwrap();
    QTensor::quantize(&w, ty.ggml()).unwrap()
}

/// A causal attention op over `seqs` (scale 0.125, no window).
pub fn causal_attention(
    seqs: Vec<AttnSeq>,
    nh: usize,
    nkv: usize,
    hd: usize,
    bs: usize,
) -> PagedAttention {
    PagedAttention {
        seqs: std::sync::Arc::new(AttnBatch::new(seqs)),
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        scale: 0.125,
        window: None,
        causal: true,
    }
}

pub fn uniform(rng: &mut ChaCha8Rng, shape: &[usize], bound: f32) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..=bound)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// A tiny random Llama target, written as a Hugging Face folder and loaded like any model.
pub fn tiny_target() -> Model {
    let dir = scratch_dir("target");
    let (h, i, q, kv) = (HIDDEN, 64, 4 * 8, 2 * 8);
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut t = HashMap::new();
    let ones = Tensor::ones(h, DType::F32, &Device::Cpu).unwrap();
    t.insert(
        "model.embed_tokens.weight".to_string(),
        uniform(&mut rng, &[VOCAB, h], 1.0),
    );
    t.insert(
        "lm_head.weight".to_string(),
        uniform(&mut rng, &[VOCAB, h], 0.5),
    );
    t.insert("model.norm.weight".to_string(), ones.clone());
    for l in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        for (name, shape) in [
            ("self_attn.q_proj", [q, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, q]),
            ("mlp.gate_proj", [i, h]),
            ("mlp.up_proj", [i, h]),
            ("mlp.down_proj", [h, i]),
        ] {
            let bound = 1.0 / (shape[1] as f32).sqrt();
            t.insert(p(name), uniform(&mut rng, &shape, bound));
        }
        t.insert(p("input_layernorm"), ones.clone());
        t.insert(p("post_attention_layernorm"), ones.clone());
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    let model = Model::load(&dir, &Device::Cpu, &|_, _| {}).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    model
}
