//! `dspark-engine profile`: SPS(B) (target forwards per second at B batch tokens) and the
//! drafter's time per draft call measured on this machine, written as a cost table.

use anyhow::{Context, Result};
use dspark_engine::loader;
use dspark_engine::speculative::Speculation;
use dspark_types::contract::{env as cenv, flags};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// A GGUF file or a Hugging Face model folder, or a remote source (hf://, s3://,
    /// https://; see `fetch`).
    #[arg(long = flags::MODEL, env = cenv::MODEL)]
    pub model: String,
    #[command(flatten)]
    pub sources: super::SourceArgs,
    /// Where to write the table (default: stdout).
    #[arg(long = flags::OUTPUT)]
    pub output: Option<PathBuf>,
    /// One-line JSON of at most 4096 bytes (fits a container termination message).
    #[arg(long = flags::COMPACT)]
    pub compact: bool,
    /// Node type recorded in the table (e.g. the node-type label of the pool).
    #[arg(long = flags::NODE_TYPE, env = cenv::NODE_TYPE)]
    pub node_type: Option<String>,
    /// Drafter id recorded in the table.
    #[arg(long)]
    pub drafter_id: Option<String>,
    #[command(flatten)]
    pub compute: loader::ComputeArgs,
    /// Largest B to measure (log-spaced grid from 1).
    #[arg(long, default_value_t = 64)]
    pub max_batch: u32,
    /// Measure exactly these B (comma-separated, e.g. `1,4`) instead of the log grid.
    #[arg(long, value_delimiter = ',')]
    pub batches: Vec<u32>,
    /// Context tokens already cached for every sequence.
    #[arg(long, default_value_t = 256)]
    pub context: usize,
    /// Tokens each sequence contributes per step (1 = decode, >1 = verify blocks).
    #[arg(long, default_value_t = 4)]
    pub tokens_per_seq: usize,
    /// KV cache element type, as `serve --kv-cache-dtype` (profile what you serve).
    #[arg(long, default_value = "f16", env = cenv::KV_CACHE_DTYPE)]
    pub kv_cache_dtype: String,
    /// Most repetitions per point.
    #[arg(long, default_value_t = 60)]
    pub max_reps: usize,
    /// Fewest repetitions per point (raise it with --max-reps for a steady run to profile).
    #[arg(long, default_value_t = 5)]
    pub min_reps: usize,
    /// Also measure the drafter's time per draft call (the table's `draft_points`, which
    /// the dspark policy uses to price drafting): this drafter checkpoint folder (local or
    /// remote like --model)...
    #[arg(long = flags::DRAFTER)]
    pub drafter: Option<String>,
    /// ...of this kind (parallel | dspark-markov | dspark-rnn; default: the checkpoint's head).
    #[arg(long = flags::SPECULATION)]
    pub speculation: Option<String>,
    /// Largest number of drafting sequences to measure (default: --max-batch).
    #[arg(long)]
    pub max_draft_seqs: Option<u32>,
    /// Timed repetitions per drafter point (the median is kept; raise it on a noisy machine)
    #[arg(long, default_value_t = 7)]
    pub draft_reps: usize,
}

pub fn profile(a: ProfileArgs) -> Result<()> {
    use dspark_engine::kv::KvCache;
    use dspark_engine::profile::{cost_table, log_grid, measure, ProfileOptions};
    let device = a.compute.start()?;
    let fetched = a.sources.resolve(&a.model)?;
    let (mut model, _) = loader::load(&fetched.path, &device, true)?;
    if fetched.revision.is_some() {
        model.id = fetched.model_id();
    }
    let drafter = a
        .drafter
        .as_deref()
        .map(|d| a.sources.resolve(d))
        .transpose()?
        .map(|d| d.path);
    if a.batches.contains(&0) {
        anyhow::bail!("--batches: every B must be at least 1");
    }
    let grid = if a.batches.is_empty() {
        log_grid(a.max_batch.max(1), 2)
    } else {
        a.batches.clone()
    };
    let max_b = grid.iter().copied().max().unwrap_or(1);
    let opts = ProfileOptions {
        grid,
        context: a.context,
        tokens_per_seq: a.tokens_per_seq,
        min_reps: a.min_reps.max(2),
        max_reps: a.max_reps.max(a.min_reps),
        ..Default::default()
    };
    let need = (max_b as usize) * (a.context + a.tokens_per_seq + 16);
    let dtype = loader::parse_kv_dtype(&a.kv_cache_dtype)?;
    let kv_bytes =
        need * KvCache::bytes_per_token_as(model.cfg.num_layers, model.cfg.kv_dim(), dtype);
    let mut kv = KvCache::new_as(
        model.cfg.num_layers,
        model.cfg.kv_dim(),
        kv_bytes,
        16,
        &device,
        dtype,
    )?;
    eprintln!(
        "profiling {} on {} over B = {:?} (context {}, {} tokens per sequence)",
        model.id,
        loader::device_name(&device),
        opts.grid,
        a.context,
        a.tokens_per_seq
    );
    let points = measure(&model, &mut kv, &opts, &mut |p| {
        eprintln!(
            "  B={:>3}  {:>8.2} steps/s  {:>8.1} tokens/s  (+-{:.1}%, {} reps, {} dropped: pool serial)",
            p.b,
            1.0 / p.seconds,
            p.b as f64 / p.seconds,
            p.rel_err * 100.0,
            p.reps,
            p.dropped
        )
    })?;
    let mut draft_points = Vec::new();
    if let Some(path) = &drafter {
        let spec = match &a.speculation {
            Some(s) => Speculation::parse(s).with_context(|| {
                format!("unknown --speculation '{s}'; use parallel, dspark-markov or dspark-rnn")
            })?,
            None => loader::drafter_kind(path)?,
        };
        let max_n = a.max_draft_seqs.unwrap_or(a.max_batch).max(1);
        let mut d = loader::build_drafter(
            spec,
            Some(path),
            1,
            &model,
            max_n as usize * (a.context + 32),
            16,
            dtype,
        )?
        .with_context(|| {
            format!(
                "--speculation {} has no model drafter to profile",
                spec.flag()
            )
        })?;
        let opts = dspark_engine::profile::DraftProfileOptions {
            seqs: log_grid(max_n, 1),
            max_len: d.model.config().block_size,
            context: a.context,
            reps: a.draft_reps,
        };
        eprintln!(
            "profiling the drafter {} over sequences {:?} x draft lengths 1..={}",
            path.display(),
            opts.seqs,
            opts.max_len
        );
        draft_points =
            dspark_engine::profile::measure_draft(&model, &mut d, &opts, &mut |n, l, t| {
                if l == 1 || l as usize == opts.max_len {
                    eprintln!("  {n:>3} sequences x {l:>2} tokens  {:>8.3} ms", t * 1e3);
                }
            })?;
    }
    let table = cost_table(
        &model,
        &loader::device_name(&device),
        a.node_type,
        a.drafter_id,
        &points,
        draft_points,
    );
    table.validate()?;
    let text = if a.compact {
        table.to_compact()?
    } else {
        table.to_json_pretty()
    };
    match a.output {
        Some(p) => {
            std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?
        }
        None => println!("{text}"),
    }
    Ok(())
}
