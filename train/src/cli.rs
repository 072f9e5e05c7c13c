//! The `train`, `calibrate` and `eval` subcommands (argument structs and drivers; `main.rs`
//! only dispatches here).

use crate::calibrate::{acceptance, collect, fit_sts, Mode};
use crate::data::{self, Dataset, DatasetMeta, GenOptions};
use crate::eval::{aggregate, generate, markdown, Decoding, DomainStats, EvalDrafter};
use crate::loss::LossConfig;
use crate::model::TrainDrafter;
use crate::optim::OptimConfig;
use crate::{train, TrainConfig};
use anyhow::{bail, ensure, Context, Result};
use dspark_engine::loader;
use dspark_engine::speculative::dspark::{default_target_layers, DSparkDrafter, HeadKind};
use dspark_engine::speculative::recalibrate::OnlineCalibration;
use indicatif::{ProgressBar, ProgressStyle};
use std::cell::RefCell;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

fn parse_head(s: &str) -> Result<HeadKind> {
    Ok(match s {
        "parallel" | "none" => HeadKind::Parallel,
        "markov" | "dspark-markov" => HeadKind::Markov,
        "rnn" | "dspark-rnn" => HeadKind::Rnn,
        other => bail!("unknown head '{other}'; use parallel, dspark-markov or dspark-rnn"),
    })
}

/// A progress bar on a terminal. indicatif draws nothing when stderr is not one (the log
/// file of a niced background run), so there a thread prints one plain line a minute
/// (position, message, elapsed, ETA) until the bar is finished.
fn bar(len: u64, template: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(ProgressStyle::with_template(template).expect("valid template"));
    if !std::io::stderr().is_terminal() {
        let label = template
            .split_whitespace()
            .next()
            .filter(|w| !w.starts_with('{'))
            .unwrap_or("progress")
            .to_string();
        let b = b.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
            if b.is_finished() {
                break;
            }
            eprintln!(
                "{label}: {}/{} {} ({:.0?} elapsed, eta {:.0?})",
                b.position(),
                b.length().unwrap_or(0),
                b.message(),
                b.elapsed(),
                b.eta()
            );
        });
    }
    b
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Target model (GGUF file or Hugging Face folder).
    #[arg(long, env = "DSPARK_MODEL")]
    pub model: PathBuf,
    /// Prompt files (JSONL) to regenerate when the dataset does not exist yet.
    #[arg(long)]
    pub prompts: Vec<PathBuf>,
    /// Dataset cache folder (default ~/.cache/dspark/train/<model-id>/dataset). Repeat (or
    /// comma-separate) to train on several datasets of the same target as one; each is split
    /// into train and held-out on its own.
    #[arg(long, value_delimiter = ',')]
    pub dataset: Vec<PathBuf>,
    /// Only build the dataset.
    #[arg(long)]
    pub generate_only: bool,
    #[arg(long, default_value_t = 160)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 8)]
    pub gen_batch: usize,
    /// Target probabilities kept per position.
    #[arg(long, default_value_t = 20)]
    pub topk: usize,
    /// Target layers stored in a new dataset (default: the spread of 3).
    #[arg(long, value_delimiter = ',')]
    pub target_layers: Vec<usize>,
    /// Run folder (checkpoint + resumable state); required unless --generate-only.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// parallel | dspark-markov | dspark-rnn.
    #[arg(long, default_value = "dspark-markov")]
    pub head: String,
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    #[arg(long, default_value_t = 4)]
    pub seqs_per_step: usize,
    #[arg(long, default_value_t = 16)]
    pub anchors: usize,
    #[arg(long, default_value_t = 7)]
    pub block_size: usize,
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Rank r of the Markov/RNN head (the reference's 256; at equal budget it beat 64 on
    /// every domain, docs/benchmarks.md).
    #[arg(long, default_value_t = 256)]
    pub rank: usize,
    /// Draft vocabulary size (0: the full target vocabulary).
    #[arg(long, default_value_t = 8192)]
    pub draft_vocab: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.04)]
    pub warmup: f64,
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    #[arg(long, default_value_t = 4.0)]
    pub decay: f64,
    #[arg(long, default_value_t = 0.1)]
    pub heldout: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 50)]
    pub save_every: usize,
    /// Warm start from this drafter checkpoint (same architecture): its weights replace the
    /// random initialisation; the optimiser and the warm-up + cosine schedule start fresh.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Also add the last context feature to every block row's input (EAGLE-style).
    #[arg(long)]
    pub context_input: bool,
    /// Width of the drafter layers' MLP (default: the target's). A real-size target's
    /// (8,960 for Qwen2.5-1.5B) makes the layer 47M parameters; a narrower one trains on a
    /// CPU and drafts for a few percent of a target step.
    #[arg(long, default_value_t = 0)]
    pub intermediate: usize,
    /// Start the drafter layer from the target's last layer (attention, norms and the
    /// strongest --intermediate MLP neurons) instead of random weights.
    #[arg(long)]
    pub init_from_target: bool,
    /// Train W1 compact from the start (the draft vocabulary's rows + one shared row for every
    /// other previous token, as `dspark-engine convert --compact-w1` makes it): on a 151,936-token
    /// target the full W1 is 39M of the drafter's parameters, updated by AdamW every step.
    #[arg(long)]
    pub compact_w1: bool,
    #[command(flatten)]
    pub compute: loader::ComputeArgs,
}

/// The dataset folders of `--dataset` (default: the model's cache folder).
fn dataset_dirs(given: &[PathBuf], model: &dspark_engine::model::Model) -> Vec<PathBuf> {
    if given.is_empty() {
        vec![data::default_dir(&model.id)]
    } else {
        given.to_vec()
    }
}

/// Loads the datasets at `dirs`, generating a single missing one first from `prompts`.
fn dataset(
    model: &dspark_engine::model::Model,
    tok: &dspark_engine::tokenizer::TextTokenizer,
    dirs: &[PathBuf],
    a: &TrainArgs,
) -> Result<Dataset> {
    let missing: Vec<&PathBuf> = dirs
        .iter()
        .filter(|d| !d.join("meta.json").exists())
        .collect();
    let dir = match missing[..] {
        [] => return Dataset::load_all(dirs),
        [d] if dirs.len() == 1 => d.as_path(),
        _ => bail!(
            "no dataset at {}: generate each dataset on its own (one --dataset with --prompts), then train on them together",
            missing
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    if a.prompts.is_empty() {
        bail!(
            "no dataset at {} and no --prompts to generate one from",
            dir.display()
        );
    }
    let mut prompts = Vec::new();
    for p in &a.prompts {
        prompts.extend(data::read_prompts(p)?);
    }
    let layers = if a.target_layers.is_empty() {
        default_target_layers(model.cfg.num_layers, 3)
    } else {
        a.target_layers.clone()
    };
    // Teacher-forced texts feed up to 4 x --max-new-tokens tokens each.
    let most: usize = prompts
        .iter()
        .map(|p| a.max_new_tokens * if p.forced { 4 } else { 1 })
        .sum();
    let pb = bar(
        most as u64,
        "generating [{bar:30}] {pos}/{len} tokens (at most) {per_sec} {elapsed_precise}",
    );
    let t0 = Instant::now();
    let seqs = data::generate(
        model,
        tok,
        &prompts,
        &GenOptions {
            max_new_tokens: a.max_new_tokens,
            batch: a.gen_batch,
            topk: a.topk,
            target_layers: layers.clone(),
        },
        &mut |n| pb.set_position(n as u64),
    )?;
    pb.finish_and_clear();
    let names: Vec<String> = a.prompts.iter().map(|p| p.display().to_string()).collect();
    let ds = Dataset {
        meta: DatasetMeta {
            format: data::FORMAT,
            model_id: model.id.clone(),
            vocab_size: model.cfg.vocab_size,
            hidden_size: model.cfg.hidden_size,
            num_layers: model.cfg.num_layers,
            target_layers: layers,
            topk: a.topk,
            max_new_tokens: a.max_new_tokens,
            generation: match prompts.iter().filter(|p| p.forced).count() {
                0 => "greedy (temperature 0), batched engine forward".into(),
                n if n == prompts.len() => {
                    "teacher-forced text (no generation), engine forward in chunks of 128".into()
                }
                n => format!(
                    "greedy (temperature 0), batched engine forward; {n} teacher-forced texts"
                ),
            },
            prompts: names.join(","),
            total_tokens: seqs.iter().map(|s| s.meta.fed + 1).sum(),
            seqs: seqs.iter().map(|s| s.meta.clone()).collect(),
            seconds: t0.elapsed().as_secs_f64(),
        },
        parts: vec![seqs.len()],
        seqs,
    };
    ds.save(dir)?;
    eprintln!(
        "dataset: {} sequences, {} tokens, {:.0}s -> {}",
        ds.seqs.len(),
        ds.meta.total_tokens,
        ds.meta.seconds,
        dir.display()
    );
    Ok(ds)
}

pub fn run_train(a: TrainArgs) -> Result<()> {
    let device = a.compute.start()?;
    let (model, tok) = loader::load(&a.model, &device, true)?;
    let dirs = dataset_dirs(&a.dataset, &model);
    let ds = dataset(&model, &tok, &dirs, &a)?;
    if a.generate_only {
        return Ok(());
    }
    let out = a
        .out
        .clone()
        .context("--out RUN_FOLDER is required to train")?;
    let tc = TrainConfig {
        head: parse_head(&a.head)?,
        block_size: a.block_size,
        layers: a.layers,
        rank: a.rank,
        draft_vocab: a.draft_vocab,
        steps: a.steps,
        seqs_per_step: a.seqs_per_step,
        anchors_per_seq: a.anchors,
        seed: a.seed,
        heldout_frac: a.heldout,
        loss: LossConfig {
            decay: a.decay,
            ..Default::default()
        },
        optim: OptimConfig {
            lr: a.lr,
            warmup: a.warmup,
            clip: a.clip,
            ..Default::default()
        },
        init: a.init.clone(),
        context_input: a.context_input,
        intermediate: a.intermediate,
        init_from_target: a.init_from_target,
        compact_w1: a.compact_w1,
    };
    let pb = bar(
        tc.steps as u64,
        "training [{bar:30}] {pos}/{len} steps {elapsed_precise}<{eta_precise} {msg}",
    );
    let st = train(&model, &ds, &tc, &out, a.save_every, &mut |r| {
        pb.set_position(r.step as u64);
        pb.set_message(format!(
            "loss {:.3} acc@1 {:.2} lr {:.1e} {:.0} tok/s",
            r.loss, r.acc1, r.lr, r.tokens_per_s
        ));
    })?;
    pb.finish();
    let last = st.log.last().copied().unwrap_or_default();
    eprintln!(
        "trained {} steps ({} block tokens) in {:.0}s: loss {:.3} (ce {:.3} l1 {:.3} bce {:.3} c* {:.3} acc@1 {:.2}) -> {}",
        st.step,
        st.block_tokens,
        st.seconds,
        last.1,
        last.2,
        last.3,
        last.4,
        last.5,
        last.6,
        out.display()
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct CalibrateArgs {
    #[arg(long, env = "DSPARK_MODEL")]
    pub model: PathBuf,
    /// Drafter checkpoint folder; its config.json gets the temperatures.
    #[arg(long)]
    pub drafter: PathBuf,
    /// Dataset folders, as `train --dataset`.
    #[arg(long, value_delimiter = ',')]
    pub dataset: Vec<PathBuf>,
    /// Held-out fraction (must match training's --heldout).
    #[arg(long, default_value_t = 0.1)]
    pub heldout: f64,
    /// Blocks per held-out sequence.
    #[arg(long, default_value_t = 48)]
    pub anchors: usize,
    /// Also write the report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub compute: loader::ComputeArgs,
}

pub fn run_calibrate(a: CalibrateArgs) -> Result<()> {
    let device = a.compute.start()?;
    let (model, _) = loader::load(&a.model, &device, true)?;
    let ds = Dataset::load_all(&dataset_dirs(&a.dataset, &model))?;
    let mut d = DSparkDrafter::load(&a.drafter, &model)?;
    ds.check_fits(&model, d.target_layers())?;
    d.set_sts_temperatures(None)?;
    d.set_sts_offsets(None)?;
    d.set_sts_greedy(None, None)?;
    let td = TrainDrafter::new(&model, &d)?;
    let (_, held) = ds.split(a.heldout);
    let samples = collect(&model, &td, &ds, &held, a.anchors, 17)?;
    println!(
        "STS on {} held-out blocks ({} sequences), teacher-forced",
        samples.z.len(),
        held.len()
    );
    let mut reports = Vec::new();
    for mode in [Mode::Sampled, Mode::Greedy] {
        let r = fit_sts(&samples, mode)?;
        let acc = acceptance(&samples, mode);
        println!(
            "\n{}: tau {:.3}\n| position k | acceptance given earlier | T_k | b_k | ECE(prod c) before | after |\n|---|---|---|---|---|---|",
            mode.name(),
            acc.tau
        );
        for k in 0..r.temperatures.len() {
            println!(
                "| {} | {:.3} | {:.3} | {:+.2} | {:.4} | {:.4} |",
                k + 1,
                acc.conditional[k],
                r.temperatures[k],
                r.offsets[k],
                r.ece_before[k],
                r.ece_after[k]
            );
        }
        println!(
            "| all | | | | {:.4} | {:.4} |",
            r.ece_all_before, r.ece_all_after
        );
        let f32s = |v: &[f64]| Some(v.iter().map(|&t| t as f32).collect());
        match mode {
            Mode::Sampled => {
                d.set_sts_temperatures(f32s(&r.temperatures))?;
                d.set_sts_offsets(f32s(&r.offsets))?;
            }
            Mode::Greedy => d.set_sts_greedy(f32s(&r.temperatures), f32s(&r.offsets))?,
        }
        reports.push(serde_json::json!({ "sts": r, "acceptance": acc }));
    }
    // Rewrite config.json only: the weights are unchanged.
    let cfg_path = a.drafter.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(d.config())?)
        .with_context(|| format!("cannot write {}", cfg_path.display()))?;
    if let Some(j) = a.json {
        std::fs::write(&j, serde_json::to_string_pretty(&reports)?)?;
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct EvalArgs {
    #[arg(long, env = "DSPARK_MODEL")]
    pub model: PathBuf,
    /// NAME=FOLDER of a trained drafter (repeatable), e.g. dspark-markov=drafters/x.
    #[arg(long = "drafter")]
    pub drafters: Vec<String>,
    /// Also evaluate n-gram prompt lookup.
    #[arg(long)]
    pub ngram: bool,
    /// Also run plain decoding (speed baseline and losslessness check).
    #[arg(long)]
    pub plain: bool,
    /// DOMAIN=FILE prompt sets (repeatable).
    #[arg(long = "domain")]
    pub domains: Vec<String>,
    /// Prompts per domain.
    #[arg(long, default_value_t = 10)]
    pub limit: usize,
    #[arg(long, default_value_t = 96)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 7)]
    pub gamma: usize,
    /// Sampling temperature of target and drafter (0 = greedy). Above 0, drafts are
    /// verified by rejection sampling, so the acceptance is that of sampled decoding and the
    /// losslessness check does not apply (outputs are random).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seed of the sampling RNG (one stream per prompt, derived from it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Online recalibration step, as `serve --online-calibration` (0: off): model drafters'
    /// confidences get per-position scales and offsets learned over each domain's prompts in order,
    /// so ECE and the reliability diagram show the adapted confidences.
    #[arg(long, default_value_t = 0.0)]
    pub online_calibration: f32,
    /// JSON with every statistic (input of bench/drafter_table.py).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Folder for PNG plots: tau.png, acceptance.png (per position), reliability.png.
    #[arg(long)]
    pub plots: Option<PathBuf>,
    #[command(flatten)]
    pub compute: loader::ComputeArgs,
}

fn split_kv(s: &str) -> Result<(String, PathBuf)> {
    let (k, v) = s
        .split_once('=')
        .with_context(|| format!("'{s}' is not NAME=PATH"))?;
    Ok((k.to_string(), PathBuf::from(v)))
}

pub fn run_eval(a: EvalArgs) -> Result<()> {
    let device = a.compute.start()?;
    let (model, tok) = loader::load(&a.model, &device, true)?;
    let mut drafters: Vec<(String, EvalDrafter)> = Vec::new();
    if a.plain {
        drafters.push(("plain".into(), EvalDrafter::Plain));
    }
    if a.ngram {
        drafters.push(("ngram".into(), EvalDrafter::Ngram));
    }
    for d in &a.drafters {
        let (name, path) = split_kv(d)?;
        let mut dr = DSparkDrafter::load(&path, &model)?;
        dr.use_cpu_kernels(dspark_engine::speculative::dspark::DrafterWeights::from_env()?)?;
        drafters.push((name, EvalDrafter::Model(Box::new(dr))));
    }
    if drafters.is_empty() {
        bail!("nothing to evaluate: give --drafter NAME=DIR, --ngram or --plain");
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!(
            "--temperature must be a finite number >= 0, got {}",
            a.temperature
        );
    }
    ensure!(
        a.online_calibration.is_finite() && (0.0..=1.0).contains(&a.online_calibration),
        "--online-calibration must be a step between 0 (off) and 1, got {}",
        a.online_calibration
    );
    if cfg!(not(feature = "plots")) && a.plots.is_some() {
        bail!("--plots: this build has no plots (cargo feature `plots`)");
    }
    let sampled = a.temperature > 0.0;
    let mut stats: Vec<DomainStats> = Vec::new();
    for dom in &a.domains {
        let (domain, file) = split_kv(dom)?;
        let prompts: Vec<_> = data::read_prompts(&file)?
            .into_iter()
            .take(a.limit)
            .collect();
        let encoded = prompts
            .iter()
            .map(|p| data::encode_prompt(&tok, &model, p))
            .collect::<Result<Vec<_>>>()?;
        let mut plain_out: Option<Vec<Vec<u32>>> = None;
        for (name, d) in &drafters {
            let pb = bar(
                encoded.len() as u64,
                "{msg} [{bar:20}] {pos}/{len} prompts {elapsed_precise}",
            );
            pb.set_message(format!("{domain} / {name}"));
            let recal = (a.online_calibration > 0.0)
                .then(|| RefCell::new(OnlineCalibration::new(a.gamma, a.online_calibration)));
            let mut gens = Vec::new();
            for (i, p) in encoded.iter().enumerate() {
                gens.push(generate(
                    &model,
                    d,
                    p,
                    &Decoding {
                        max_new: a.max_new_tokens,
                        gamma: a.gamma,
                        stop: &tok.stop_ids,
                        temperature: a.temperature,
                        seed: a.seed.wrapping_add(i as u64),
                        recal: recal.as_ref(),
                    },
                )?);
                pb.inc(1);
            }
            pb.finish_and_clear();
            let mut s = aggregate(name, &domain, &gens, a.gamma);
            if let (Some(oc), EvalDrafter::Model(_)) = (&recal, d) {
                let greedy = a.temperature == 0.0;
                s.online_offsets = Some(oc.borrow().offsets(greedy).to_vec());
                s.online_scales = Some(oc.borrow().scales(greedy).to_vec());
            }
            let outs: Vec<Vec<u32>> = gens.into_iter().map(|g| g.tokens).collect();
            match (&plain_out, matches!(d, EvalDrafter::Plain) && !sampled) {
                (None, true) => plain_out = Some(outs),
                (Some(po), false) if !sampled => s.matches_plain = Some(*po == outs),
                _ => {}
            }
            eprintln!(
                "{domain:>6} {name:>14}: tau {:.2}  tok/s {:.1}",
                s.tau, s.tokens_per_s
            );
            stats.push(s);
        }
    }
    println!("{}", markdown(&stats, a.gamma));
    if let Some(j) = a.json {
        if let Some(parent) = j.parent() {
            std::fs::create_dir_all(parent).ok();
        }
        let doc = serde_json::json!({
            "model": model.id,
            "gamma": a.gamma,
            "max_new_tokens": a.max_new_tokens,
            "limit": a.limit,
            "decoding": if sampled {
                format!("sampled at temperature {} (rejection sampling), seed {}, single stream, every block verified in full", a.temperature, a.seed)
            } else {
                "greedy, single stream, every block verified in full".to_string()
            },
            "temperature": a.temperature,
            "stats": stats,
        });
        std::fs::write(&j, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", j.display()))?;
    }
    #[cfg(feature = "plots")]
    if let Some(dir) = &a.plots {
        for p in crate::plots::write_all(&stats, a.gamma, dir)? {
            eprintln!("plot -> {}", p.display());
        }
    }
    Ok(())
}
