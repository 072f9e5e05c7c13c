//! What every subcommand loads with (serving, profiling, training, calibration,
//! evaluation): device selection, the compute thread pool, model + tokenizer loading with
//! progress, the KV cache element type, and the model drafter a speculation kind needs.
//! Nothing here knows about the HTTP server.

use crate::model::{Model, ModelSource};
use crate::tokenizer::TextTokenizer;
use anyhow::{Context, Result};
use candle_core::Device;
use std::path::{Path, PathBuf};

/// The compute flags of every subcommand that loads a model: the device and the kernel
/// threads.
#[derive(clap::Args)]
pub struct ComputeArgs {
    /// Compute device: cpu, or cuda[:N] in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Worker threads for the compute kernels (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ComputeArgs {
    /// Sizes the kernel thread pool ([`init_threads`]) and opens the [`device`].
    pub fn start(&self) -> Result<Device> {
        init_threads(self.threads);
        device(&self.device)
    }
}

pub fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        s if s.starts_with("cuda") => {
            let ord = s
                .strip_prefix("cuda")
                .and_then(|r| r.strip_prefix(':'))
                .map(|n| n.parse::<usize>())
                .transpose()
                .context("--device cuda:N needs a number")?
                .unwrap_or(0);
            Device::new_cuda(ord).with_context(|| {
                format!("cannot open CUDA device {ord} (build with --features cuda and check the driver)")
            })
        }
        other => anyhow::bail!("unknown device '{other}'; use cpu or cuda[:N]"),
    }
}

/// Name recorded in cost tables and checked against them.
pub fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(_) => "cuda".to_string(),
        Device::Metal(_) => "metal".to_string(),
    }
}

pub fn init_threads(n: Option<usize>) {
    let n = n.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    crate::kernels::pool::set_threads(n);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
}

/// Loads the model and its tokenizer, showing progress on stderr when `progress` is set.
pub fn load(path: &Path, device: &Device, progress: bool) -> Result<(Model, TextTokenizer)> {
    let bar = if progress {
        indicatif::ProgressBar::new(1)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading {msg} [{bar:30}] {pos}/{len} tensors groups",
        )
        .expect("valid template"),
    );
    bar.set_message(path.display().to_string());
    let cb = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let model = Model::load(path, device, &cb)?;
    bar.finish_and_clear();
    let tok = match ModelSource::detect(path)? {
        ModelSource::Gguf(p) => {
            let (_, ct) = crate::model::weights::open_gguf(&p)?;
            TextTokenizer::from_gguf(&ct)
                .with_context(|| format!("{}: cannot build the tokenizer", p.display()))?
        }
        ModelSource::HfDir(d) => TextTokenizer::from_hf_dir(&d)?,
    };
    Ok((model, tok))
}

/// `--kv-cache-dtype`: `f16` (default: half the memory and attention reads, llama.cpp's
/// default) or `f32`.
pub fn parse_kv_dtype(s: &str) -> Result<candle_core::DType> {
    match s.to_ascii_lowercase().as_str() {
        "f16" | "fp16" | "float16" | "half" => Ok(candle_core::DType::F16),
        "f32" | "fp32" | "float32" | "float" => Ok(candle_core::DType::F32),
        other => anyhow::bail!("--kv-cache-dtype must be f16 or f32, got '{other}'"),
    }
}

/// Where shipped drafters are looked for, in this order: `--drafters` / `DSPARK_DRAFTERS`
/// (folders separated by ':') when given; else the engine image's folder
/// ([`SHIPPED_DRAFTERS`]), then `drafters/` in the working directory, then the `drafters/`
/// of the source checkout this binary was built from (so `dspark-engine serve --model M`
/// run from a checkout finds M's drafter with no other flag). Folders that do not exist are
/// skipped by [`shipped_drafter`].
pub fn drafter_search_path(arg: Option<&str>) -> Vec<PathBuf> {
    match arg {
        Some(v) if !v.trim().is_empty() => std::env::split_paths(v.trim()).collect(),
        _ => {
            let mut v = vec![PathBuf::from(SHIPPED_DRAFTERS), PathBuf::from("drafters")];
            let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../drafters");
            if !v.contains(&checkout) {
                v.push(checkout);
            }
            v
        }
    }
}

/// The folder the engine images ship their drafters in.
pub const SHIPPED_DRAFTERS: &str = "/usr/share/dspark/drafters";

/// The first drafter checkpoint among `dirs` (each a drafter folder or a folder of them,
/// in name order) whose `manifest.json` lists, in `target_models`, a name that one of
/// `model_names` contains (case-insensitive: `SmolLM2-135M-Instruct` matches the file
/// `SmolLM2-135M-Instruct.Q4_1.gguf` and `hf://HuggingFaceTB/SmolLM2-135M-Instruct`), with
/// its speculation kind. Folders that do not exist or do not parse are skipped.
pub fn shipped_drafter(
    dirs: &[PathBuf],
    model_names: &[&str],
) -> Option<(PathBuf, crate::speculative::Speculation)> {
    let names: Vec<String> = model_names.iter().map(|n| n.to_lowercase()).collect();
    let fits = |d: &Path| -> bool {
        let Ok(text) = std::fs::read_to_string(d.join("manifest.json")) else {
            return false;
        };
        let Ok(m) = serde_json::from_str::<serde_json::Value>(&text) else {
            tracing::warn!("{}: manifest.json does not parse; skipped", d.display());
            return false;
        };
        m.get("target_models")
            .and_then(|t| t.as_array())
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str())
            .map(str::to_lowercase)
            .any(|t| !t.is_empty() && names.iter().any(|n| n.contains(&t)))
    };
    for dir in dirs {
        let mut candidates = vec![dir.clone()];
        if let Ok(rd) = std::fs::read_dir(dir) {
            let mut subs: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .collect();
            subs.sort();
            candidates.extend(subs);
        }
        for c in candidates {
            if fits(&c) {
                match drafter_kind(&c) {
                    Ok(kind) => return Some((c, kind)),
                    Err(e) => tracing::warn!("{}: not a drafter checkpoint: {e:#}", c.display()),
                }
            }
        }
    }
    None
}

/// The draft block size of a drafter checkpoint folder.
pub fn drafter_block_size(path: &Path) -> Result<usize> {
    let (_, cfg) = crate::speculative::dspark::DSparkDrafter::read_config(path)?;
    Ok(cfg.block_size.max(1))
}

/// The speculation kind of a drafter checkpoint folder, from its head type.
pub fn drafter_kind(path: &Path) -> Result<crate::speculative::Speculation> {
    use crate::speculative::dspark::{DSparkDrafter, HeadKind};
    use crate::speculative::Speculation;
    let (_, cfg) = DSparkDrafter::read_config(path)?;
    Ok(match cfg.markov_head_type {
        HeadKind::Parallel => Speculation::Parallel,
        HeadKind::Markov | HeadKind::Gated => Speculation::DSparkMarkov,
        HeadKind::Rnn => Speculation::DSparkRnn,
    })
}

/// Builds the model drafter that `speculation` needs, if any: its matrices on the CPU
/// kernels in the format of `DSPARK_DRAFTER_WEIGHTS` (default Q4_0), its context cache of
/// `kv_dtype` (the target cache's).
pub fn build_drafter(
    speculation: crate::speculative::Speculation,
    path: Option<&Path>,
    gamma: usize,
    model: &Model,
    target_kv_tokens: usize,
    block_size: usize,
    kv_dtype: candle_core::DType,
) -> Result<Option<crate::speculative::speculator::Drafter>> {
    use crate::speculative::dspark::{DSparkDrafter, HeadKind};
    use crate::speculative::Speculation;
    let head = match speculation {
        Speculation::None | Speculation::Ngram => return Ok(None),
        Speculation::Parallel => HeadKind::Parallel,
        Speculation::DSparkMarkov => HeadKind::Markov,
        Speculation::DSparkRnn => HeadKind::Rnn,
    };
    let drafter = match path {
        Some(p) => {
            let (d, layout) = DSparkDrafter::load_layout(p, model)?;
            // The gated head is DeepSpec's variant of the Markov head.
            let kind = match d.config().markov_head_type {
                HeadKind::Gated => HeadKind::Markov,
                k => k,
            };
            if kind != head {
                anyhow::bail!(
                    "{}: drafter head is {:?} but --speculation {} needs {:?}",
                    p.display(),
                    d.config().markov_head_type,
                    speculation.flag(),
                    head
                );
            }
            let c = d.config();
            tracing::info!(
                drafter = %p.display(),
                layout = layout.name(),
                head = ?c.markov_head_type,
                drafts_per_block = c.block_size,
                target_layers = ?c.target_layer_ids,
                "loaded drafter"
            );
            if c.sts_temperatures.is_none() && c.sts_temperatures_greedy.is_none() {
                tracing::warn!(
                    drafter = %p.display(),
                    "the drafter has no STS temperatures: they default to 1, so the scheduler runs on uncalibrated confidences until online recalibration (--online-calibration) or `dspark-train calibrate` has run"
                );
            }
            d
        }
        None => {
            tracing::warn!(
                "--speculation {} without --drafter: using an UNTRAINED random drafter (lossless, but it will rarely be accepted)",
                speculation.flag()
            );
            let cfg = DSparkDrafter::default_config(model, head, gamma.max(1));
            DSparkDrafter::random(model, cfg, 0)?
        }
    };
    let mut drafter = drafter;
    drafter.use_cpu_kernels(crate::speculative::dspark::DrafterWeights::from_env()?)?;
    let c = drafter.config();
    let per_token = crate::kv::KvCache::bytes_per_token_as(
        c.num_hidden_layers,
        c.num_key_value_heads * c.head_dim,
        kv_dtype,
    );
    let kv = drafter.new_cache_as(
        per_token * (target_kv_tokens + 64 * block_size),
        block_size,
        &model.device,
        kv_dtype,
    )?;
    Ok(Some(crate::speculative::speculator::Drafter {
        model: drafter,
        kv,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::Speculation;

    /// Folders given to --drafters: a drafter folder itself or a folder of them, matched by
    /// the `target_models` of their manifests against the model's names, case-insensitively.
    #[test]
    fn shipped_drafters_match_the_models_their_manifests_name() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../drafters");
        let one = shipped.join("smollm2-135m-dspark-markov");
        let names = ["SmolLM2-135M-Instruct.Q4_1", "smollm2"];
        let found = |dirs: &[PathBuf], names: &[&str]| shipped_drafter(dirs, names);
        assert_eq!(
            found(std::slice::from_ref(&shipped), &names),
            Some((one.clone(), Speculation::DSparkMarkov))
        );
        assert_eq!(
            found(
                std::slice::from_ref(&one),
                &["hf-org/smollm2-135m-instruct@abc"]
            ),
            Some((one.clone(), Speculation::DSparkMarkov))
        );
        // Another model of the family, a missing folder: none.
        assert_eq!(
            found(std::slice::from_ref(&shipped), &["SmolLM2-360M-Instruct"]),
            None
        );
        assert_eq!(found(&[PathBuf::from("/nonexistent")], &names), None);
        // The real-size target's drafter (issue #50) by its GGUF file stem; its 0.5B sibling
        // has none.
        let qwen = shipped.join("qwen2.5-coder-1.5b-dspark-markov");
        assert_eq!(
            found(
                std::slice::from_ref(&shipped),
                &["qwen2.5-coder-1.5b-instruct-q4_k_m"]
            ),
            Some((qwen, Speculation::DSparkMarkov))
        );
        assert_eq!(
            found(
                std::slice::from_ref(&shipped),
                &["qwen2.5-coder-0.5b-instruct"]
            ),
            None
        );
        assert_eq!(
            drafter_search_path(Some("/a:/b")),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        let default = drafter_search_path(Some(" "));
        assert_eq!(default, drafter_search_path(None));
        assert_eq!(default[0], PathBuf::from(SHIPPED_DRAFTERS));
        // Without a flag, the checkout's drafters are found: the shipped SmolLM2 drafter.
        assert_eq!(
            found(&default, &["SmolLM2-135M-Instruct.Q4_1"])
                .map(|(p, _)| p.canonicalize().unwrap()),
            Some(
                shipped
                    .join("smollm2-135m-dspark-markov")
                    .canonicalize()
                    .unwrap()
            )
        );
    }

    /// The serving drafter's context cache takes the element type it is given (the target
    /// cache's), in either type.
    #[test]
    fn drafter_cache_takes_the_target_cache_type() {
        let target = crate::testutil::tiny_target();
        for dtype in [candle_core::DType::F16, candle_core::DType::F32] {
            let d = build_drafter(Speculation::DSparkMarkov, None, 4, &target, 64, 16, dtype)
                .unwrap()
                .expect("a model drafter");
            assert_eq!(d.kv.dtype(), dtype);
            assert!(d.kv.capacity_tokens() >= 64);
        }
        assert!(build_drafter(
            Speculation::None,
            None,
            4,
            &target,
            64,
            16,
            candle_core::DType::F16
        )
        .unwrap()
        .is_none());
    }
}
