//! The `serve` wiring: from [`AppOptions`] to a running engine thread and the HTTP state
//! (model, tokenizer, KV cache, drafter, cost table, start-up profile, metrics). The
//! loaders it shares with the other subcommands live in [`crate::loader`].

use crate::loader::{build_drafter, device, device_name, load};
use crate::model::Model;
use anyhow::{Context, Result};

/// Everything `serve` needs besides the network address.
#[derive(Debug, Clone)]
pub struct AppOptions {
    pub model: std::path::PathBuf,
    /// The model id cost tables are keyed by, when it is not the file name (a remote source:
    /// name plus resolved revision, see [`crate::source::Fetched::model_id`]).
    pub model_id: Option<String>,
    pub device: String,
    pub served_model_name: Option<String>,
    pub kv_cache_mb: usize,
    pub kv_block_size: usize,
    /// Element type of the KV cache slots (F16 or F32).
    pub kv_cache_dtype: candle_core::DType,
    pub max_model_len: Option<usize>,
    pub engine: crate::engine::EngineConfig,
    pub show_progress: bool,
    /// DSpark drafter checkpoint folder for `parallel` / `dspark-*` speculation; without
    /// one, an untrained (random) drafter of the right head type is built.
    pub drafter: Option<std::path::PathBuf>,
    /// SPS(B) cost table file, hot-reloaded; without it the built-in default is used until
    /// one is pushed over the admin API.
    pub cost_table: Option<std::path::PathBuf>,
    /// Without `cost_table`, measure SPS(B) at start-up (a few seconds) instead of starting
    /// on the built-in default; only for the dspark policy, the one that reads the table.
    pub startup_profile: bool,
    /// No speculation was asked for: serve with the shipped drafter of this model when one of
    /// these folders holds one (see [`crate::loader::shipped_drafter`]), with this policy.
    pub shipped_drafter: Option<ShippedDrafter>,
}

/// Where to look for a shipped drafter, and the verify policy to run it with.
#[derive(Debug, Clone)]
pub struct ShippedDrafter {
    pub search: Vec<std::path::PathBuf>,
    pub policy: crate::speculative::VerifyPolicy,
    /// Verify up to the drafter's own block size (no `--gamma` was given).
    pub own_gamma: bool,
}

/// Measures a small SPS(B) table on the serving model and KV cache (verify-shaped steps:
/// sequences of up to 4 new tokens after a 64-token context, B = 1..32) and installs it.
fn startup_profile(
    model: &Model,
    kv: &mut crate::kv::KvCache,
    drafter: Option<&mut crate::speculative::speculator::Drafter>,
    gamma: usize,
    costs: &crate::cost::CostTables,
    device: &str,
) -> Result<()> {
    use crate::profile::{
        cost_table, log_grid, measure, measure_draft, DraftProfileOptions, ProfileOptions,
    };
    let t0 = std::time::Instant::now();
    let opts = ProfileOptions {
        grid: log_grid(32, 2),
        context: 64,
        tokens_per_seq: 4,
        max_reps: 8,
        ..Default::default()
    };
    let points = measure(model, kv, &opts, &mut |_| {}).context("start-up profile")?;
    // The drafter's time per call, so the scheduler prices drafting (up to the batch sizes
    // the SPS grid covers and the policy's block).
    let draft_points = match drafter {
        Some(d) => {
            let opts = DraftProfileOptions {
                seqs: log_grid(32, 1),
                max_len: gamma.min(d.model.config().block_size),
                context: 64,
                reps: 5,
            };
            measure_draft(model, d, &opts, &mut |_, _, _| {}).context("start-up drafter profile")?
        }
        None => Vec::new(),
    };
    let table = cost_table(model, device, None, None, &points, draft_points);
    let active = costs
        .install(
            &table.to_json_pretty(),
            dspark_types::CostTableSource::StartupProfile,
        )
        .map_err(|e| anyhow::anyhow!("start-up profile made an unusable table: {e}"))?;
    tracing::info!(
        seconds = format!("{:.1}", t0.elapsed().as_secs_f64()),
        sps1 = format!("{:.1}", active.sps(1)),
        sps4 = format!("{:.1}", active.sps(4)),
        sps16 = format!("{:.1}", active.sps(16)),
        draft1_ms = active
            .table
            .draft_seconds(1, gamma as u32)
            .map(|t| format!("{:.2}", t * 1e3)),
        "measured the SPS(B) cost table at start-up (give --cost-table to skip)"
    );
    Ok(())
}

/// Loads the model, starts the engine thread and returns the HTTP state plus a one-line
/// summary of what is being served.
pub fn start(opts: &AppOptions) -> Result<(std::sync::Arc<crate::server::AppState>, String)> {
    use crate::engine::Engine;
    use crate::kv::KvCache;
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::Arc;
    let device = device(&opts.device)?;
    let (mut model, tok) = load(&opts.model, &device, opts.show_progress)?;
    if let Some(id) = &opts.model_id {
        model.id = id.clone();
    }
    let mut kv = KvCache::new_as(
        model.cfg.num_layers,
        model.cfg.kv_dim(),
        opts.kv_cache_mb * 1024 * 1024,
        opts.kv_block_size,
        &device,
        opts.kv_cache_dtype,
    )?;
    let mut max_seq = Engine::max_sequence_tokens(&model, &kv);
    if let Some(m) = opts.max_model_len {
        max_seq = max_seq.min(m);
    }
    let model_id = opts
        .served_model_name
        .clone()
        .unwrap_or_else(|| model.id.clone());
    let template = crate::chat::ChatTemplate::new(
        tok.chat_template.as_deref(),
        model.cfg.arch,
        &tok.bos_token,
        &tok.eos_token,
    )?;
    let metrics = Arc::new(crate::metrics::Metrics::new(&model_id));
    metrics.set_cache_config(opts.kv_block_size, kv.total_blocks());
    // Cost tables are checked against the model file's id (what `profile` records), not
    // the served name.
    let costs = Arc::new(crate::cost::CostTables::new(
        &model.id,
        &device_name(&device),
        Some(metrics.clone()),
    ));
    let summary = format!(
        "dspark-engine {} serving {model_id} ({} {}, {} layers) on {} | KV cache {} MiB {:?} = {} tokens in {} blocks | max sequence {} tokens",
        crate::VERSION,
        model.cfg.arch.name(),
        model.weights.dtype,
        model.cfg.num_layers,
        device_name(&device),
        opts.kv_cache_mb,
        kv.dtype(),
        kv.capacity_tokens(),
        kv.total_blocks(),
        max_seq,
    );
    let mut engine_cfg = opts.engine.clone();
    let mut drafter = build_drafter(
        engine_cfg.speculation,
        opts.drafter.as_deref(),
        engine_cfg.policy.gamma(),
        &model,
        kv.capacity_tokens(),
        opts.kv_block_size,
        kv.dtype(),
    )?;
    // The checkpoint speculation runs with, for /ready (None: no drafter, or one without
    // weights such as n-gram lookup).
    let mut drafter_path = drafter.as_ref().and(opts.drafter.clone());
    if let (None, Some(auto)) = (&drafter, &opts.shipped_drafter) {
        let names = [model.id.as_str(), model_id.as_str()];
        if let Some((path, kind)) = crate::loader::shipped_drafter(&auto.search, &names) {
            let policy = match crate::loader::drafter_block_size(&path) {
                Ok(g) if auto.own_gamma => auto.policy.with_gamma(g),
                _ => auto.policy.clone(),
            };
            // A shipped drafter that does not load on this model is reported and skipped:
            // the server still starts, without speculation.
            match build_drafter(
                kind,
                Some(&path),
                policy.gamma(),
                &model,
                kv.capacity_tokens(),
                opts.kv_block_size,
                kv.dtype(),
            ) {
                Ok(d) => {
                    tracing::info!(
                        drafter = %path.display(),
                        speculation = kind.flag(),
                        policy = policy.name(),
                        gamma = policy.gamma(),
                        "no --speculation: serving with the model's shipped drafter (--speculation none turns it off)"
                    );
                    (engine_cfg.speculation, engine_cfg.policy, drafter) = (kind, policy, d);
                    drafter_path = Some(path);
                }
                Err(e) => tracing::warn!(
                    drafter = %path.display(),
                    "the shipped drafter does not load on this model; serving without speculation: {e:#}"
                ),
            }
        }
    }
    if let Some(p) = &opts.cost_table {
        costs.watch_file(p, std::time::Duration::from_secs(1))?;
    } else if opts.startup_profile
        && (matches!(
            engine_cfg.policy,
            crate::speculative::VerifyPolicy::Dspark { .. }
        ) || engine_cfg.experiment.as_ref().is_some_and(|(arms, _)| {
            arms.iter().any(|a| {
                matches!(
                    a.policy,
                    Some(crate::speculative::VerifyPolicy::Dspark { .. })
                )
            })
        }))
    {
        startup_profile(
            &model,
            &mut kv,
            drafter.as_mut(),
            engine_cfg.policy.gamma(),
            &costs,
            &device_name(&device),
        )?;
    }
    let model = Arc::new(model);
    let tok = Arc::new(tok);
    let (mut engine, handle) = Engine::new(
        model.clone(),
        tok.clone(),
        kv,
        engine_cfg.clone(),
        metrics.clone(),
        costs.clone(),
    );
    if let Some(d) = drafter {
        engine = engine.with_drafter(d);
    }
    let experiment = engine.experiment_log();
    let grammars = match crate::constraint::Grammars::new(tok.clone(), model.cfg.vocab_size) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!("structured outputs are unavailable for this tokenizer: {e:#}");
            None
        }
    };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || engine.run())?;
    let state = Arc::new(crate::server::AppState {
        model_id,
        target_model_id: model.id.clone(),
        device: device_name(&model.device),
        costs,
        speculation: engine_cfg.speculation.flag().to_string(),
        policy: match &engine_cfg.experiment {
            Some((arms, _)) => format!(
                "experiment:{}",
                arms.iter()
                    .map(|a| a.label.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            None => engine_cfg.policy.name().to_string(),
        },
        tok,
        template,
        grammars,
        engine: handle,
        metrics,
        max_seq,
        draining: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        shutdown: Default::default(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        ready_details: std::sync::RwLock::new(serde_json::json!({
            "gamma": engine_cfg.policy.gamma(),
            "drafter": drafter_path.map(|p| p.display().to_string()),
        })),
        experiment,
    });
    Ok((state, summary))
}
