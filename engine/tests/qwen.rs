//! Qwen2 and Qwen3 from a Hugging Face folder and from GGUF, against an independent
//! implementation.
//!
//! The test builds each family small, with random weights: Qwen3 (q/k norms, GQA, untied LM
//! head, NEOX RoPE) and Qwen2 (q/k/v biases instead of the norms), written as a Hugging Face
//! folder (config.json + safetensors) and as GGUF files with llama.cpp's tensor names and
//! metadata. The reference is candle-transformers' `models::qwen3` / `models::qwen2`
//! (written by the candle team from the Hugging Face code), run on the same folder. (The real
//! Qwen2.5-Coder-1.5B GGUF is checked against llama.cpp in model_correctness.rs.)

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use dspark_engine::model::{argmax, Model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::Path;

const VOCAB: usize = 384;
const HIDDEN: usize = 128;
const INTER: usize = 256;
const LAYERS: usize = 3;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const THETA: f64 = 1_000_000.0;
const EPS: f64 = 1e-6;

#[derive(Clone, Copy, PartialEq)]
enum Family {
    Qwen2,
    Qwen3,
}

impl Family {
    /// Qwen3 sets its own head size; Qwen2's is hidden / heads.
    fn head_dim(self) -> usize {
        match self {
            Family::Qwen2 => HIDDEN / HEADS,
            Family::Qwen3 => 64,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
}

fn config_json(fam: Family) -> serde_json::Value {
    let head_dim = fam.head_dim();
    serde_json::json!({
        "architectures": [match fam { Family::Qwen2 => "Qwen2ForCausalLM", Family::Qwen3 => "Qwen3ForCausalLM" }],
        "model_type": fam.name(),
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": head_dim,
        "attention_bias": fam == Family::Qwen2,
        "max_position_embeddings": 512,
        "sliding_window": 4096,
        "max_window_layers": LAYERS,
        "tie_word_embeddings": false,
        "rope_theta": THETA,
        "rms_norm_eps": EPS,
        "use_sliding_window": false,
        "hidden_act": "silu",
    })
}

/// HF tensor name -> (GGUF name, shape). Norm weights get values around 1, biases small
/// values around 0.
fn tensors(fam: Family) -> Vec<(String, String, Vec<usize>)> {
    let hd = fam.head_dim();
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_string(),
            "token_embd.weight".to_string(),
            vec![VOCAB, HIDDEN],
        ),
        (
            "model.norm.weight".into(),
            "output_norm.weight".into(),
            vec![HIDDEN],
        ),
        (
            "lm_head.weight".into(),
            "output.weight".into(),
            vec![VOCAB, HIDDEN],
        ),
    ];
    for i in 0..LAYERS {
        let l = |hf: &str, gg: &str, shape: Vec<usize>| {
            (
                format!("model.layers.{i}.{hf}.weight"),
                format!("blk.{i}.{gg}.weight"),
                shape,
            )
        };
        v.extend([
            l("input_layernorm", "attn_norm", vec![HIDDEN]),
            l("post_attention_layernorm", "ffn_norm", vec![HIDDEN]),
            l("self_attn.q_proj", "attn_q", vec![HEADS * hd, HIDDEN]),
            l("self_attn.k_proj", "attn_k", vec![KV_HEADS * hd, HIDDEN]),
            l("self_attn.v_proj", "attn_v", vec![KV_HEADS * hd, HIDDEN]),
            l("self_attn.o_proj", "attn_output", vec![HIDDEN, HEADS * hd]),
            l("mlp.gate_proj", "ffn_gate", vec![INTER, HIDDEN]),
            l("mlp.up_proj", "ffn_up", vec![INTER, HIDDEN]),
            l("mlp.down_proj", "ffn_down", vec![HIDDEN, INTER]),
        ]);
        match fam {
            Family::Qwen3 => v.extend([
                l("self_attn.q_norm", "attn_q_norm", vec![hd]),
                l("self_attn.k_norm", "attn_k_norm", vec![hd]),
            ]),
            Family::Qwen2 => {
                for (hf, gg, n) in [
                    ("q_proj", "attn_q", HEADS * hd),
                    ("k_proj", "attn_k", KV_HEADS * hd),
                    ("v_proj", "attn_v", KV_HEADS * hd),
                ] {
                    v.push((
                        format!("model.layers.{i}.self_attn.{hf}.bias"),
                        format!("blk.{i}.{gg}.bias"),
                        vec![n],
                    ));
                }
            }
        }
    }
    v
}

fn md_u32(k: &str, v: usize) -> (&str, gguf_file::Value) {
    (k, gguf_file::Value::U32(v as u32))
}

fn md_f32(k: &str, v: f64) -> (&str, gguf_file::Value) {
    (k, gguf_file::Value::F32(v as f32))
}

/// Writes the model as an HF folder and as F32 and Q8_0 GGUF files under `dir`.
fn write_model(fam: Family, dir: &Path) -> HashMap<String, Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let dev = Device::Cpu;
    let mut hf = HashMap::new();
    for (name, _, shape) in tensors(fam) {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.ends_with(".bias") {
            (0..n).map(|_| rng.random_range(-0.5..0.5)).collect()
        } else if shape.len() == 1 {
            (0..n).map(|_| rng.random_range(0.7..1.3)).collect()
        } else {
            let b = (3.0 / shape[1] as f32).sqrt();
            (0..n).map(|_| rng.random_range(-b..b)).collect()
        };
        hf.insert(name, Tensor::from_vec(data, shape, &dev).unwrap());
    }
    let hf_dir = dir.join("hf");
    std::fs::create_dir_all(&hf_dir).unwrap();
    std::fs::write(
        hf_dir.join("config.json"),
        serde_json::to_string_pretty(&config_json(fam)).unwrap(),
    )
    .unwrap();
    candle_core::safetensors::save(&hf, hf_dir.join("model.safetensors")).unwrap();
    for (file, dtype) in [("f32.gguf", GgmlDType::F32), ("q8_0.gguf", GgmlDType::Q8_0)] {
        let a = fam.name();
        let keys: Vec<String> = [
            "embedding_length",
            "feed_forward_length",
            "block_count",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "rope.freq_base",
            "attention.layer_norm_rms_epsilon",
            "context_length",
            "vocab_size",
        ]
        .iter()
        .map(|k| format!("{a}.{k}"))
        .collect();
        let k = |i: usize| keys[i].as_str();
        let md: Vec<(&str, gguf_file::Value)> = vec![
            ("general.architecture", gguf_file::Value::String(a.into())),
            md_u32(k(0), HIDDEN),
            md_u32(k(1), INTER),
            md_u32(k(2), LAYERS),
            md_u32(k(3), HEADS),
            md_u32(k(4), KV_HEADS),
            md_u32(k(5), fam.head_dim()),
            md_u32(k(6), fam.head_dim()),
            md_f32(k(7), THETA),
            md_f32(k(8), EPS),
            md_u32(k(9), 512),
            md_u32(k(10), VOCAB),
        ];
        let qts: Vec<(String, QTensor)> = tensors(fam)
            .into_iter()
            .map(|(h, g, shape)| {
                // Norms stay f32 (as in real files); matrices in the file's type.
                let dt = if shape.len() == 1 {
                    GgmlDType::F32
                } else {
                    dtype
                };
                (g, QTensor::quantize(&hf[&h], dt).unwrap())
            })
            .collect();
        let mdr: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let tr: Vec<(&str, &QTensor)> = qts.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut f = std::fs::File::create(dir.join(file)).unwrap();
        gguf_file::write(&mut f, &mdr, &tr).unwrap();
    }
    hf
}

/// Logits of every position from candle-transformers' Qwen3.
fn reference(
    fam: Family,
    dir: &Path,
    hf: &HashMap<String, Tensor>,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    use candle_transformers::models::{qwen2, qwen3};
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("hf/model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    };
    let ids = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let h = match fam {
        Family::Qwen3 => {
            let cfg: qwen3::Config = serde_json::from_value(config_json(fam)).unwrap();
            qwen3::Model::new(&cfg, vb).unwrap().forward(&ids, 0)
        }
        Family::Qwen2 => {
            let cfg: qwen2::Config = serde_json::from_value(config_json(fam)).unwrap();
            qwen2::Model::new(&cfg, vb).unwrap().forward(&ids, 0, None)
        }
    };
    let h = h.unwrap().squeeze(0).unwrap();
    h.matmul(&hf["lm_head.weight"].t().unwrap())
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn ours(path: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let m = Model::load(path, &Device::Cpu, &|_, _| {}).unwrap();
    let mut kv = m.kv_cache(16 << 20, 16).unwrap();
    m.logits_for(tokens, &mut kv).unwrap()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_family(fam: Family) {
    let dir = std::env::temp_dir().join(format!("dspark-{}-{}", fam.name(), std::process::id()));
    let hf = write_model(fam, &dir);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let tokens: Vec<u32> = (0..70).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    let want = reference(fam, &dir, &hf, &tokens);
    let scale = want.iter().flatten().map(|v| v.abs()).fold(0.0, f32::max);
    let from_hf = ours(&dir.join("hf"), &tokens);
    let from_f32 = ours(&dir.join("f32.gguf"), &tokens);
    let from_q8 = ours(&dir.join("q8_0.gguf"), &tokens);
    let (d_hf, d_f32, d_q8) = (
        max_abs_diff(&from_hf, &want),
        max_abs_diff(&from_f32, &want),
        max_abs_diff(&from_q8, &want),
    );
    let top1 = |l: &[Vec<f32>]| l.iter().map(|r| argmax(r)).collect::<Vec<_>>();
    let agree_q8 = top1(&from_q8)
        .iter()
        .zip(top1(&want))
        .filter(|(a, b)| **a == *b)
        .count();
    println!(
        "{} vs candle-transformers over {} positions (logit scale {scale:.2}): max |diff| HF folder {d_hf:.2e}, F32 GGUF {d_f32:.2e}, Q8_0 GGUF {d_q8:.2e} (top-1 {agree_q8}/{})",
        fam.name(),
        tokens.len(),
        tokens.len()
    );
    assert_eq!(from_hf.len(), tokens.len());
    assert!(d_hf <= 1e-3 * scale.max(1.0), "HF folder differs by {d_hf}");
    assert!(
        d_f32 <= 1e-3 * scale.max(1.0),
        "F32 GGUF differs by {d_f32}"
    );
    assert_eq!(top1(&from_hf), top1(&want), "HF folder greedy tokens");
    assert_eq!(top1(&from_f32), top1(&want), "F32 GGUF greedy tokens");
    // Q8_0 weights and activations: close, not equal.
    assert!(d_q8 <= 0.05 * scale.max(1.0), "Q8_0 GGUF differs by {d_q8}");
    assert!(agree_q8 * 10 >= tokens.len() * 9, "Q8_0 top-1 {agree_q8}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qwen3_hf_folder_and_gguf_match_candle_transformers() {
    check_family(Family::Qwen3);
}

/// Qwen2's q/k/v biases, from both formats. (The unsupported-architecture message is
/// tested in model_correctness.rs.)
#[test]
fn qwen2_hf_folder_and_gguf_match_candle_transformers() {
    check_family(Family::Qwen2);
}
