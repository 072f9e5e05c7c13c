//! Public drafter checkpoints in their own layouts, against the reference code.
//!
//! `tests/reference/drafter_reference.py` runs DeepSeek DeepSpec's `Qwen3DSparkModel` and
//! z-lab's `DFlashDraftModel` themselves (PyTorch, f32, CPU) on a tiny random Qwen3 target
//! and tiny random drafters it saves with `save_pretrained` (DeepSpec: vanilla / gated / RNN
//! Markov heads, a confidence head with and without `W1`, the rank-0 DFlash variant; z-lab
//! DFlash with `block_size` at the top level and inside `dflash_config`; blocks of 7 and 16).
//! It also writes the target's hidden states of a prompt and the reference's outputs for the
//! first block after it. This test loads those folders unchanged, feeds the SAME hidden states
//! and anchor to the engine's drafter and compares per-position base logits, sequential-head
//! biases, confidence logits (max |diff|) and greedy draft tokens (identical); then converts
//! each checkpoint to the engine's compact form and back, and serves them: greedy output
//! identical to plain decoding under every verify policy.
//!
//! The reference code and its PyTorch venv come from `scripts/setup-reference.sh` (run by
//! `make setup`, and by this test when its cache is missing); only when that cannot build
//! them (no mirror of the reference repositories) does the test say so and pass, unless
//! `DSPARK_REQUIRE_REFERENCE=1`.

mod common;

use candle_core::{DType, Device, Tensor};
use dspark_engine::engine::EngineConfig;
use dspark_engine::model::Model;
use dspark_engine::runtime::AppOptions;
use dspark_engine::speculative::dspark::{DSparkDrafter, Layout};
use dspark_engine::speculative::{Speculation, VerifyPolicy};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Largest |diff| accepted between the engine and the reference, f32 on both sides.
const TOL: f32 = 1e-4;

fn cache_dir() -> PathBuf {
    common::cache_dir()
}

/// The reference outputs, generated once per test binary; None (with a message) when the
/// reference code is not set up.
fn generated() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let env_file = cache_dir().join("reference-code/env.json");
        if !env_file.exists() {
            // Build the cache if this machine can (local mirrors of the reference repos).
            let setup =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/setup-reference.sh");
            let ok = std::process::Command::new("bash")
                .arg(&setup)
                .status()
                .is_ok_and(|s| s.success());
            eprintln!("{} ran: {}", setup.display(), if ok { "ok" } else { "failed" });
        }
        let Ok(text) = std::fs::read_to_string(&env_file) else {
            let msg = format!(
                "{} is missing and scripts/setup-reference.sh could not build it (it extracts the reference drafter code from local mirrors of deepseek-ai/DeepSpec and z-lab/dflash, see its output)",
                env_file.display()
            );
            if std::env::var("DSPARK_REQUIRE_REFERENCE").as_deref() == Ok("1") {
                panic!("{msg}");
            }
            eprintln!("SKIPPED: {msg}");
            return None;
        };
        let env: serde_json::Value = serde_json::from_str(&text).unwrap();
        // Outputs of earlier runs whose process is gone are removed (~17 MB each).
        for e in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(pid) = name.strip_prefix("dspark-reference-") {
                if !Path::new("/proc").join(pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let out = std::env::temp_dir().join(format!("dspark-reference-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/reference/drafter_reference.py");
        let status = std::process::Command::new(env["python"].as_str().unwrap())
            .arg(&script)
            .args(["--deepspec", env["deepspec"].as_str().unwrap()])
            .args(["--dflash", env["dflash"].as_str().unwrap()])
            .arg("--out")
            .arg(&out)
            .env("HF_HUB_OFFLINE", "1")
            .env("TQDM_DISABLE", "1")
            .status()
            .expect("run the reference script");
        assert!(status.success(), "{} failed", script.display());
        Some(out)
    })
    .as_deref()
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

fn target(dir: &Path) -> Model {
    Model::load(&dir.join("target"), &Device::Cpu, &|_, _| {}).unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &Tensor) -> f32 {
    let b: Vec<Vec<f32>> = b.to_vec2().unwrap();
    assert_eq!(a.len(), b.len(), "rows");
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// The engine's greedy block for the manifest's prompt and anchor, from the reference's
/// hidden states.
fn engine_block(
    d: &DSparkDrafter,
    target: &Model,
    m: &serde_json::Value,
    reference: &HashMap<String, Tensor>,
) -> dspark_engine::speculative::dspark::BlockTrace {
    let anchor_pos = m["anchor_pos"].as_u64().unwrap() as usize;
    let hidden: Vec<Tensor> = d
        .target_layers()
        .iter()
        .map(|i| reference[&format!("hidden.{i}")].clone())
        .collect();
    let mut kv = d.new_cache(1 << 20, 16, &Device::Cpu).unwrap();
    let mut table = Vec::new();
    let rows = d.config().block_rows(d.config().block_size);
    assert!(kv.ensure(&mut table, anchor_pos + rows));
    d.append_context(&mut kv, &table, 0, &hidden).unwrap();
    let anchor = m["anchor"].as_u64().unwrap() as u32;
    d.trace_greedy(&mut kv, target, anchor, anchor_pos, &table)
        .unwrap()
}

#[test]
fn reference_layouts_load_and_compute_the_reference_numbers() {
    let Some(dir) = generated() else { return };
    let m = manifest(dir);
    let target = target(dir);
    println!(
        "case                          layout    drafts  |dU|max    |dB|max    |dc|max    tokens"
    );
    for case in m["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let cdir = dir.join(name);
        let reference =
            candle_core::safetensors::load(cdir.join("reference.safetensors"), &Device::Cpu)
                .unwrap();
        let (d, layout) = DSparkDrafter::load_layout(&cdir, &target).unwrap();
        let want_layout = match case["layout"].as_str().unwrap() {
            "deepspec" => Layout::DeepSpec,
            _ => Layout::DFlash,
        };
        assert_eq!(layout, want_layout, "{name}");
        let block = case["block_size"].as_u64().unwrap() as usize;
        let drafts = if layout == Layout::DFlash {
            block - 1
        } else {
            block
        };
        assert_eq!(d.config().block_size, drafts, "{name}: drafts per block");
        let got = engine_block(&d, &target, &m, &reference);
        let du = max_diff(&got.base_logits, &reference["base_logits"]);
        let db = max_diff(&got.bias, &reference["bias"]);
        let dc = match (&got.confidence_logits, reference.get("confidence_logits")) {
            (Some(c), Some(r)) => max_diff(std::slice::from_ref(c), &r.unsqueeze(0).unwrap()),
            (None, None) => 0.0,
            (g, r) => panic!(
                "{name}: confidence head present here {} / in the reference {}",
                g.is_some(),
                r.is_some()
            ),
        };
        let want: Vec<u32> = reference["tokens"]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap();
        println!(
            "{name:<29} {:<9} {drafts:>6}  {du:.2e}   {db:.2e}   {dc:.2e}   {}",
            layout.name(),
            if got.tokens == want {
                "identical"
            } else {
                "DIFFER"
            }
        );
        assert!(
            du < TOL && db < TOL && dc < TOL,
            "{name}: max |diff| U {du}, B {db}, c {dc}"
        );
        assert_eq!(got.tokens, want, "{name}: greedy draft tokens");

        // The compact form (target's embedding / LM head, this engine's names) and back to
        // the checkpoint's own layout draft the same tokens.
        let (compact, copy_diff) = d.without_own_embeddings(&target).unwrap();
        assert_eq!(
            copy_diff, 0.0,
            "{name}: the stored embedding is the target's"
        );
        let native = cdir.with_extension("native");
        compact.save(&native).unwrap();
        let (n, l) = DSparkDrafter::load_layout(&native, &target).unwrap();
        assert_eq!(l, Layout::Native);
        let back = cdir.with_extension("back");
        n.save_as(&back, layout, &target).unwrap();
        let (b, l) = DSparkDrafter::load_layout(&back, &target).unwrap();
        assert_eq!(l, layout);
        for (form, x) in [("native", &n), ("back", &b)] {
            let t = engine_block(x, &target, &m, &reference);
            assert_eq!(t.tokens, want, "{name} ({form}): greedy draft tokens");
            let du = max_diff(&t.base_logits, &reference["base_logits"]);
            assert!(du < TOL, "{name} ({form}): |dU| {du}");
        }
    }
}

/// The engine's own target, run on the prompt, gives the hidden states the reference's
/// transformers target gave (so serving feeds the drafter what the reference feeds it).
#[test]
fn engine_target_hidden_states_match_the_reference_target() {
    let Some(dir) = generated() else { return };
    let m = manifest(dir);
    let target = target(dir);
    let prompt = common::json_ids(&m["prompt"]);
    let ids: Vec<usize> = common::json_ids(&m["layer_ids"])
        .into_iter()
        .map(|i| i as usize)
        .collect();
    let mut kv = target.kv_cache(1 << 20, 16).unwrap();
    let out = target.forward_fresh(&prompt, &mut kv, 1, &ids).unwrap();
    let reference = candle_core::safetensors::load(
        dir.join("deepspec-vanilla-b16/reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    for (i, h) in ids.iter().zip(&out.hidden) {
        let d = max_diff(&h.to_vec2().unwrap(), &reference[&format!("hidden.{i}")]);
        println!("target layer {i}: max |diff| {d:.2e}");
        assert!(d < TOL, "target layer {i} output: max |diff| {d}");
    }
    let logits: Vec<Vec<f32>> = out.logits.to_vec2().unwrap();
    let anchor = dspark_engine::model::argmax(&logits[0]);
    assert_eq!(
        anchor as u64,
        m["anchor"].as_u64().unwrap(),
        "the target's next token"
    );
}

#[test]
fn mismatched_checkpoints_are_refused_naming_the_key() {
    let Some(dir) = generated() else { return };
    let target = target(dir);
    let src = dir.join("deepspec-vanilla-b7-bf16");
    let bad = dir.join("bad-layout");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let try_cfg = |edit: &dyn Fn(&mut serde_json::Value)| -> String {
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::copy(src.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
        let mut c = cfg.clone();
        edit(&mut c);
        std::fs::write(bad.join("config.json"), c.to_string()).unwrap();
        format!(
            "{:#}",
            DSparkDrafter::load(&bad, &target).err().expect("refused")
        )
    };
    let e = try_cfg(&|c| c["num_target_layers"] = 7.into());
    assert!(
        e.contains("'num_target_layers' is 7") && e.contains("target's 5"),
        "{e}"
    );
    let e = try_cfg(&|c| c["hidden_size"] = 32.into());
    assert!(e.contains("hidden_size"), "{e}");
    let e = try_cfg(&|c| c["markov_head_type"] = "rnn".into());
    assert!(
        e.contains("markov_head.markov_w1") || e.contains("rnn_head") || e.contains("joint_proj"),
        "{e}"
    );
    let e = try_cfg(&|c| c["markov_head_type"] = "mlp".into());
    assert!(
        e.contains("'markov_head_type'") && e.contains("'vanilla', 'gated' or 'rnn'"),
        "{e}"
    );
    // A DFlash folder with a tensor it does not have.
    let src = dir.join("dflash-none-b7-bf16");
    std::fs::copy(src.join("config.json"), bad.join("config.json")).unwrap();
    let mut t =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    t.insert(
        "lm_head.weight".into(),
        Tensor::zeros((384, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&t, bad.join("model.safetensors")).unwrap();
    let e = format!(
        "{:#}",
        DSparkDrafter::load(&bad, &target).err().expect("refused")
    );
    assert!(e.contains("unexpected tensor 'lm_head.weight'"), "{e}");
}

/// Greedy completions of token prompts through a served engine.
fn serve_greedy(
    model: &Path,
    speculation: Speculation,
    policy: VerifyPolicy,
    drafter: Option<PathBuf>,
    prompts: &[Vec<u32>],
) -> Vec<(String, usize)> {
    let state = common::engine::start(AppOptions {
        kv_cache_mb: 16,
        kv_cache_dtype: DType::F32,
        max_model_len: Some(256),
        engine: EngineConfig {
            speculation,
            policy,
            ..Default::default()
        },
        drafter,
        ..common::engine::options(model.to_path_buf())
    });
    // A flat cost table (verifying more tokens is free, drafting nearly so): the dspark
    // policy then drafts even with these untrained drafters.
    let mut draft = Vec::new();
    for n in [1u32, 2, 4, 8] {
        for l in 1..=16u32 {
            draft.push((n, l, 1e-6));
        }
    }
    let table = serde_json::json!({
        "schema": 2, "model_id": state.target_model_id, "engine_version": dspark_engine::VERSION,
        "device": "cpu", "dtype": "f32", "measured_at": "2026-12-01T00:00:00Z",
        "points": (0..=10).map(|i| (1u32 << i, 100.0)).collect::<Vec<_>>(),
        "draft_points": draft,
    });
    common::engine::install_table(&state, &table.to_string());
    let submit = common::engine::Submit {
        params: &common::engine::greedy(),
        max_tokens: 24,
        ignore_eos: true,
        operation: "text_completion",
    };
    common::engine::generate_all(&state, prompts.to_vec(), &submit)
        .into_iter()
        .map(|(text, u)| (text, u.draft_tokens))
        .collect()
}

#[test]
fn served_reference_and_converted_drafters_decode_like_plain() {
    let Some(dir) = generated() else { return };
    let m = manifest(dir);
    let model = dir.join("target");
    let target = target(dir);
    let prompts: Vec<Vec<u32>> = vec![
        common::json_ids(&m["prompt"]),
        (0..20).map(|i| (i * 37 % 384) as u32).collect(),
        vec![5, 9, 200],
    ];
    let plain = serve_greedy(
        &model,
        Speculation::None,
        VerifyPolicy::Fixed { gamma: 1 },
        None,
        &prompts,
    );
    for case in m["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let cdir = dir.join(name);
        let (d, layout) = DSparkDrafter::load_layout(&cdir, &target).unwrap();
        let native = dir.join(format!("{name}.served-native"));
        d.without_own_embeddings(&target)
            .unwrap()
            .0
            .save(&native)
            .unwrap();
        let speculation = dspark_engine::loader::drafter_kind(&cdir).unwrap();
        let gamma = d.config().block_size;
        for (form, path) in [(layout.name(), &cdir), ("native", &native)] {
            for policy in [
                VerifyPolicy::Fixed { gamma },
                VerifyPolicy::Threshold {
                    gamma,
                    threshold: 0.05,
                },
                VerifyPolicy::Dspark { gamma },
            ] {
                let got = serve_greedy(
                    &model,
                    speculation,
                    policy.clone(),
                    Some(path.clone()),
                    &prompts,
                );
                let drafted: usize = got.iter().map(|g| g.1).sum();
                for (i, (g, p)) in got.iter().zip(&plain).enumerate() {
                    assert_eq!(
                        g.0, p.0,
                        "{name} ({form}, {policy:?}): prompt {i} differs from plain decoding"
                    );
                }
                println!("{name} ({form}, {policy:?}): identical to plain, {drafted} draft tokens");
                if !matches!(policy, VerifyPolicy::Threshold { .. }) {
                    assert!(
                        drafted > 0,
                        "{name} ({form}, {policy:?}): the drafter was used"
                    );
                }
            }
        }
    }
}

#[test]
fn convert_cli_writes_the_compact_form_and_back() {
    let Some(dir) = generated() else { return };
    let m = manifest(dir);
    let target = target(dir);
    let convert = |from: &Path, out: &Path, to: &str| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_dspark-engine"))
            .arg("convert")
            .arg("--model")
            .arg(dir.join("target"))
            .arg("--drafter")
            .arg(from)
            .arg("--out")
            .arg(out)
            .args(["--to", to])
            .output()
            .unwrap();
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success(),
            "convert {} --to {to}: {text}",
            from.display()
        );
        text
    };
    for (name, layout) in [
        ("deepspec-rnn-b7", "deepspec"),
        ("dflash-none-b16", "dflash"),
    ] {
        let src = dir.join(name);
        let native = dir.join(format!("{name}.cli-native"));
        let back = dir.join(format!("{name}.cli-back"));
        let text = convert(&src, &native, "native");
        assert!(
            text.contains(&format!("({layout},")) && text.contains("(native,"),
            "{text}"
        );
        convert(&native, &back, layout);
        let reference =
            candle_core::safetensors::load(src.join("reference.safetensors"), &Device::Cpu)
                .unwrap();
        let want: Vec<u32> = reference["tokens"]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (p, l) in [
            (&native, Layout::Native),
            (&back, DSparkDrafter::load_layout(&src, &target).unwrap().1),
        ] {
            let (d, got) = DSparkDrafter::load_layout(p, &target).unwrap();
            assert_eq!(got, l, "{}", p.display());
            assert_eq!(
                engine_block(&d, &target, &m, &reference).tokens,
                want,
                "{}",
                p.display()
            );
        }
        // Same layout in and out is refused: there is nothing to do.
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_dspark-engine"))
            .args(["convert", "--to", layout, "--model"])
            .arg(dir.join("target"))
            .arg("--drafter")
            .arg(&src)
            .arg("--out")
            .arg(dir.join("unused"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to convert"));
    }
    // A DSpark drafter has no DFlash form: refused, naming why.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_dspark-engine"))
        .args(["convert", "--to", "dflash", "--model"])
        .arg(dir.join("target"))
        .arg("--drafter")
        .arg(dir.join("deepspec-vanilla-b7-bf16"))
        .arg("--out")
        .arg(dir.join("unused"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("dflash layout"),
        "{err}"
    );
}
