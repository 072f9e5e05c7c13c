//! What every subcommand loads with (serving, profiling, training, calibration,
//! evaluation): device selection, the compute thread pool, model + tokenizer loading with
//! progress, the KV cache element type, and the model drafter a speculation kind needs.
//! Nothing here knows about the HTTP server.

use crate::model::{Model, ModelSource};
use crate::tokenizer::TextTokenizer;
use anyhow::{Context, Result};
use candle_core::Device;
use std::path::Path;

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

/// Builds the model drafter that `speculation` needs, if any.
pub fn build_drafter(
    speculation: crate::speculative::Speculation,
    path: Option<&Path>,
    gamma: usize,
    model: &Model,
    target_kv_tokens: usize,
    block_size: usize,
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
    drafter.use_cpu_kernels()?;
    let c = drafter.config();
    let per_token = crate::kv::KvCache::bytes_per_token(
        c.num_hidden_layers,
        c.num_key_value_heads * c.head_dim,
    );
    let kv = drafter.new_cache(
        per_token * (target_kv_tokens + 64 * block_size),
        block_size,
        &model.device,
    )?;
    Ok(Some(crate::speculative::speculator::Drafter {
        model: drafter,
        kv,
    }))
}
