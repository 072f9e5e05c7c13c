//! `dspark-engine` command line: `serve`, `profile`, `convert`, `experiment-report`, `fetch`.
//! Drafter training, calibration and evaluation are `dspark-train` (crate `train/`).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use dspark_engine::engine::EngineConfig;
use dspark_engine::loader;
use dspark_engine::runtime::{self, AppOptions};
use dspark_engine::server::router_with;
use dspark_engine::source;
use dspark_engine::speculative::{PolicyKind, Speculation, VerifyPolicy};
use dspark_engine::VERSION;
use dspark_types::contract::{env as cenv, flags, ports};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "dspark-engine", version = VERSION, about = "DSpark serving engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Measure SPS(B) (target forwards per second at B batch tokens) and write a cost table.
    Profile(ProfileArgs),
    /// Rewrite a drafter checkpoint: between layouts (native, DeepSpec DSpark, z-lab DFlash)
    /// and/or with --compact-w1.
    Convert(dspark_engine::speculative::dspark::convert::ConvertArgs),
    /// Summarise an online policy experiment (serve --policy-experiment): per-arm
    /// throughput, per-user rate and load, and each arm's throughput ratio over the baseline
    /// from load-matched neighbouring windows with a 95 % confidence interval.
    ExperimentReport(ReportArgs),
    /// Download a model source (hf://ORG/REPO[@REV][/FILE], s3://BUCKET/KEY, https://...)
    /// into the cache ahead of time, check it, and print where it is (JSON on stdout).
    Fetch(FetchArgs),
}

#[derive(clap::Args)]
struct FetchArgs {
    /// hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY (or PREFIX/), https://URL.
    source: String,
    /// The cache folder (shared by replicas; default DSPARK_MODEL_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub).
    #[arg(long = flags::CACHE, env = cenv::MODEL_CACHE)]
    cache: Option<PathBuf>,
    /// A file of `SOURCE REVISION` lines: a Hub source listed there is fetched at that commit
    /// (the operator pins a branch once the first fetch resolved it). Missing: nothing pinned.
    #[arg(long = flags::REVISION_PINS, env = cenv::REVISION_PINS)]
    revision_pins: Option<PathBuf>,
    /// On failure, the error (at most 4096 bytes), on success the JSON printed on stdout: a
    /// Kubernetes init container's termination message, which the operator reads
    /// (ModelAvailable=False with the error; the resolved revision it pins and keys cost
    /// tables by).
    #[arg(long = flags::TERMINATION_LOG)]
    termination_log: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// A serving engine's base URL (reads GET /experiment)...
    #[arg(long, conflicts_with = "file")]
    url: Option<String>,
    /// ...or a saved copy of that JSON.
    #[arg(long)]
    file: Option<PathBuf>,
    /// The arm the others are compared with.
    #[arg(long, default_value = "none")]
    baseline: String,
    /// Most relative difference of mean load (running requests) between paired windows.
    #[arg(long, default_value_t = 0.25)]
    load_tolerance: f64,
    /// Windows dropped at the start (warm-up).
    #[arg(long, default_value_t = 1)]
    skip: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ProfileArgs {
    /// A GGUF file or a Hugging Face model folder, or a remote source (hf://, s3://,
    /// https://; see `fetch`).
    #[arg(long = flags::MODEL, env = cenv::MODEL)]
    model: String,
    /// The cache folder for remote sources (see `fetch --cache`).
    #[arg(long = flags::CACHE, env = cenv::MODEL_CACHE)]
    cache: Option<PathBuf>,
    /// Revisions the deployment pinned (see `fetch --revision-pins`).
    #[arg(long = flags::REVISION_PINS, env = cenv::REVISION_PINS)]
    revision_pins: Option<PathBuf>,
    /// Where to write the table (default: stdout).
    #[arg(long = flags::OUTPUT)]
    output: Option<PathBuf>,
    /// One-line JSON of at most 4096 bytes (fits a container termination message).
    #[arg(long = flags::COMPACT)]
    compact: bool,
    /// Node type recorded in the table (e.g. the node-type label of the pool).
    #[arg(long = flags::NODE_TYPE, env = cenv::NODE_TYPE)]
    node_type: Option<String>,
    /// Drafter id recorded in the table.
    #[arg(long)]
    drafter_id: Option<String>,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    threads: Option<usize>,
    /// Largest B to measure (log-spaced grid from 1).
    #[arg(long, default_value_t = 64)]
    max_batch: u32,
    /// Measure exactly these B (comma-separated, e.g. `1,4`) instead of the log grid.
    #[arg(long, value_delimiter = ',')]
    batches: Vec<u32>,
    /// Context tokens already cached for every sequence.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Tokens each sequence contributes per step (1 = decode, >1 = verify blocks).
    #[arg(long, default_value_t = 4)]
    tokens_per_seq: usize,
    /// KV cache element type, as `serve --kv-cache-dtype` (profile what you serve).
    #[arg(long, default_value = "f16", env = cenv::KV_CACHE_DTYPE)]
    kv_cache_dtype: String,
    /// Most repetitions per point.
    #[arg(long, default_value_t = 60)]
    max_reps: usize,
    /// Fewest repetitions per point (raise it with --max-reps for a steady run to profile).
    #[arg(long, default_value_t = 5)]
    min_reps: usize,
    /// Also measure the drafter's time per draft call (the table's `draft_points`, which
    /// the dspark policy uses to price drafting): this drafter checkpoint folder (local or
    /// remote like --model)...
    #[arg(long = flags::DRAFTER)]
    drafter: Option<String>,
    /// ...of this kind (parallel | dspark-markov | dspark-rnn; default: the checkpoint's head).
    #[arg(long = flags::SPECULATION)]
    speculation: Option<String>,
    /// Largest number of drafting sequences to measure (default: --max-batch).
    #[arg(long)]
    max_draft_seqs: Option<u32>,
    /// Timed repetitions per drafter point (the median is kept; raise it on a noisy machine)
    #[arg(long, default_value_t = 7)]
    draft_reps: usize,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A GGUF file or a Hugging Face model folder, or a remote source fetched into --cache
    /// first: hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY, https://URL.
    #[arg(long = flags::MODEL, env = cenv::MODEL)]
    model: String,
    /// The cache folder for remote sources (see `fetch --cache`).
    #[arg(long = flags::CACHE, env = cenv::MODEL_CACHE)]
    cache: Option<PathBuf>,
    /// Revisions the deployment pinned (see `fetch --revision-pins`).
    #[arg(long = flags::REVISION_PINS, env = cenv::REVISION_PINS)]
    revision_pins: Option<PathBuf>,
    #[arg(long = flags::HOST, default_value = "127.0.0.1")]
    host: String,
    #[arg(long = flags::PORT, default_value_t = ports::HTTP)]
    port: u16,
    /// Name clients use in the `model` field (the alias `default` always works).
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Worker threads for the compute kernels (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Memory budget of the paged KV cache.
    #[arg(long, default_value_t = 512)]
    kv_cache_mb: usize,
    #[arg(long, default_value_t = 16)]
    kv_block_size: usize,
    /// KV cache element type: f16 (half the memory and attention reads) or f32.
    #[arg(long, default_value = "f16", env = cenv::KV_CACHE_DTYPE)]
    kv_cache_dtype: String,
    /// Longest prompt + completion (default: the model's context, capped by the KV budget).
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Admission queue bound: past it, requests get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// On SIGTERM, how long in-flight requests may finish before the process exits.
    #[arg(long = flags::DRAIN_TIMEOUT_SECS, default_value_t = 30)]
    drain_timeout_secs: u64,
    /// Largest request body in bytes: a larger one gets 413 (OpenAI error format).
    #[arg(long, env = "DSPARK_MAX_REQUEST_BYTES", default_value_t = dspark_engine::server::DEFAULT_MAX_REQUEST_BYTES)]
    max_request_bytes: usize,
    /// Work budget of one request's structured-output constraint (schema nodes visited by
    /// the max_tokens check; llguidance's grammar size, lexer fuel and per-mask work are
    /// shares of it, the default giving its defaults): past it, 400 naming this limit.
    #[arg(long, env = "DSPARK_MAX_GRAMMAR_WORK", default_value_t = dspark_engine::server::DEFAULT_MAX_GRAMMAR_WORK)]
    max_grammar_work: u64,
    /// Seconds the engine may make no progress while requests are queued or running before
    /// /health and /ready fail (the liveness probe then restarts the pod).
    #[arg(long, env = "DSPARK_ENGINE_STALL_SECS", default_value_t = dspark_engine::server::DEFAULT_ENGINE_STALL_SECS)]
    engine_stall_secs: u64,
    /// Drafter for speculative decoding: none | ngram (prompt lookup) | parallel (DFlash
    /// baseline) | dspark-markov | dspark-rnn. Default: the head of --drafter when given, else
    /// the model's shipped drafter when --drafters holds one (with --policy dspark unless
    /// --policy says otherwise), else none.
    #[arg(long = flags::SPECULATION)]
    speculation: Option<String>,
    /// Where shipped drafters are looked for when --speculation is not given: folders
    /// separated by ':', each a drafter checkpoint or a folder of them; a drafter serves the
    /// models its manifest.json lists in `target_models`. Default: the image's
    /// /usr/share/dspark/drafters, then ./drafters, then the source checkout's drafters/.
    #[arg(long, env = cenv::DRAFTERS)]
    drafters: Option<String>,
    /// DSpark drafter checkpoint folder (config.json + model.safetensors), local or remote
    /// like --model. Without it, the model drafters start untrained (random weights).
    #[arg(long = flags::DRAFTER)]
    drafter: Option<String>,
    /// How many draft tokens each request verifies: fixed (always gamma) | threshold
    /// (the prefix whose survival stays above --threshold) | dspark (the load-aware
    /// scheduler maximising tau * SPS(B) with the cost table). Default: dspark when the
    /// drafter is chosen for you (no --speculation), fixed with an explicit --speculation.
    #[arg(long = flags::POLICY, env = cenv::POLICY)]
    policy: Option<String>,
    /// Draft block size (the longest block the scheduler may verify). Default: the drafter's
    /// own block size when the drafter is chosen for you (no --speculation), else 4.
    #[arg(long, env = cenv::GAMMA)]
    gamma: Option<usize>,
    /// Survival threshold of the threshold policy.
    #[arg(long, env = cenv::THRESHOLD, default_value_t = 0.5)]
    threshold: f32,
    /// Online recalibration of a model drafter's confidences from verify outcomes: the SGD
    /// step of a per-position scale and offset on the logit, on top of STS, per decoding
    /// mode (0: off). Keeps the threshold and dspark policies honest on traffic unlike the
    /// calibration data.
    #[arg(long, env = cenv::ONLINE_CALIBRATION, default_value_t = dspark_engine::speculative::recalibrate::DEFAULT_STEP)]
    online_calibration: f32,
    /// Turn off automatic prefix caching (full prompt blocks shared by content between
    /// requests and kept after them until the cache needs the room).
    #[arg(long, env = "DSPARK_NO_PREFIX_CACHE")]
    no_prefix_cache: bool,
    /// Online on/off experiment: alternate these verify policies on live traffic, one per
    /// window (comma list of dspark, none, fixed:G, threshold:T; e.g. dspark,none). Needs a
    /// drafter (--speculation). Results: /metrics (dspark_experiment_*), GET /experiment,
    /// `dspark-engine experiment-report`.
    #[arg(long, env = cenv::POLICY_EXPERIMENT)]
    policy_experiment: Option<String>,
    /// Seconds per experiment window.
    #[arg(long, env = cenv::EXPERIMENT_WINDOW, default_value_t = 30.0)]
    experiment_window: f64,
    /// SPS(B) cost table (JSON from `dspark-engine profile`), hot-reloaded when it changes.
    /// Without one the built-in conservative default is used until one is pushed.
    #[arg(long = flags::COST_TABLE, env = cenv::COST_TABLE)]
    cost_table: Option<PathBuf>,
    /// Without --cost-table, measure SPS(B) on this machine at start-up (a few seconds) for
    /// the dspark policy instead of starting on the built-in default table.
    #[arg(long, env = "DSPARK_STARTUP_PROFILE", default_value_t = true, action = clap::ArgAction::Set)]
    startup_profile: bool,
    /// Port of the admin API (cost-table push, state), on --host; needs a token.
    #[arg(long = flags::ADMIN_PORT)]
    admin_port: Option<u16>,
    /// File holding the admin API's bearer token (else the DSPARK_ADMIN_TOKEN variable).
    #[arg(long = flags::ADMIN_TOKEN_FILE)]
    admin_token_file: Option<PathBuf>,
}

fn main() -> Result<()> {
    dspark_engine::kernels::pool::pin_candle_threads();
    dspark_engine::kernels::pool::keep_freed_memory();
    // Logs (DSPARK_LOG_FORMAT=json for JSON), and OTLP traces + metrics when OTEL_* asks.
    let telemetry = dspark_telemetry::init("dspark-engine")?;
    let cli = Cli::parse();
    let res = run(cli);
    telemetry.flush();
    res
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Serve(a) => serve(a),
        Cmd::Profile(a) => profile(a),
        Cmd::Convert(a) => dspark_engine::speculative::dspark::convert::run(a),
        Cmd::ExperimentReport(a) => experiment_report(a),
        Cmd::Fetch(a) => fetch(a),
    }
}

fn fetch(a: FetchArgs) -> Result<()> {
    let f = match source::resolve_arg(&a.source, a.cache, a.revision_pins.as_deref()) {
        Ok(f) => f,
        Err(e) => {
            if let Some(p) = &a.termination_log {
                let mut msg = format!("{e:#}");
                if msg.len() > 4096 {
                    let mut cut = 4096;
                    while !msg.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    msg.truncate(cut);
                }
                if let Err(w) = std::fs::write(p, msg) {
                    eprintln!("cannot write the termination log {}: {w}", p.display());
                }
            }
            return Err(e);
        }
    };
    let report = serde_json::json!({
        "source": a.source,
        "path": f.path,
        "revision": f.revision,
        "model_id": f.model_id(),
    })
    .to_string();
    println!("{report}");
    if let Some(p) = &a.termination_log {
        std::fs::write(p, &report)
            .with_context(|| format!("cannot write the termination log {}", p.display()))?;
    }
    Ok(())
}

fn experiment_report(a: ReportArgs) -> Result<()> {
    use dspark_engine::experiment::{report, Window};
    let text = match (&a.url, &a.file) {
        (Some(u), _) => {
            let url = format!("{}/experiment", u.trim_end_matches('/'));
            let r = reqwest::blocking::get(&url).with_context(|| format!("cannot reach {url}"))?;
            let code = r.status();
            let body = r.text()?;
            anyhow::ensure!(code.is_success(), "{url}: HTTP {code}: {body}");
            body
        }
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        (None, None) => anyhow::bail!("give --url URL (a serving engine) or --file FILE"),
    };
    #[derive(serde::Deserialize)]
    struct Doc {
        windows: Vec<Window>,
    }
    let doc: Doc = serde_json::from_str(&text).context("not an /experiment document")?;
    let r = report(&doc.windows, &a.baseline, a.load_tolerance, a.skip);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let unsettled: f64 = doc.windows.iter().map(|w| w.unsettled_s).sum();
    println!(
        "{} windows ({} skipped as warm-up; {:.0} s not counted while windows that turn speculation on settled)\n",
        doc.windows.len(),
        a.skip.min(doc.windows.len()),
        unsettled
    );
    println!("| arm | windows | committed tok/s | per-user tok/s | mean running |");
    println!("|---|---:|---:|---:|---:|");
    for s in &r.arms {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} |",
            s.arm, s.windows, s.throughput, s.per_user, s.load
        );
    }
    println!(
        "\n| arm / {} | load-matched pairs | throughput ratio | 95 % CI | per-user ratio |",
        a.baseline
    );
    println!("|---|---:|---:|---|---:|");
    for c in &r.comparisons {
        let ci = c
            .ci95
            .map_or("-".to_string(), |(lo, hi)| format!("{lo:.3} - {hi:.3}"));
        println!(
            "| {} | {} | {:.3} | {} | {:.3} |",
            c.arm, c.pairs, c.ratio, ci, c.per_user_ratio
        );
    }
    if r.comparisons.is_empty() {
        println!("(no load-matched window pairs with '{}' yet)", a.baseline);
    }
    Ok(())
}

fn serve(a: ServeArgs) -> Result<()> {
    loader::init_threads(a.threads);
    // No --speculation: the head of --drafter, or (once the model is loaded) its shipped
    // drafter; either runs the dspark policy unless --policy is given.
    let chosen = a.speculation.is_none();
    let mut speculation = match &a.speculation {
        Some(s) => Speculation::parse(s).with_context(|| {
            format!(
                "unknown --speculation '{s}'; use none, ngram, parallel, dspark-markov or dspark-rnn"
            )
        })?,
        None => Speculation::None, // until the drafter is known (below)
    };
    let policy_name = a
        .policy
        .clone()
        .unwrap_or_else(|| if chosen { "dspark" } else { "fixed" }.to_string());
    let gamma = a.gamma.unwrap_or(4);
    anyhow::ensure!(gamma >= 1, "--gamma must be at least 1");
    anyhow::ensure!(
        a.online_calibration.is_finite() && (0.0..=1.0).contains(&a.online_calibration),
        "--online-calibration must be a step between 0 (off) and 1, got {}",
        a.online_calibration
    );
    let policy = match PolicyKind::parse(&policy_name) {
        Some(PolicyKind::Fixed) => VerifyPolicy::Fixed { gamma },
        Some(PolicyKind::Threshold) => VerifyPolicy::Threshold {
            gamma,
            threshold: a.threshold,
        },
        Some(PolicyKind::Dspark) => VerifyPolicy::Dspark { gamma },
        None => anyhow::bail!("unknown --policy '{policy_name}'; use fixed, threshold or dspark"),
    };
    anyhow::ensure!(
        (0.0..=1.0).contains(&a.threshold),
        "--threshold must be in [0, 1], got {}",
        a.threshold
    );
    let mut experiment = match &a.policy_experiment {
        None => None,
        Some(spec) => {
            anyhow::ensure!(
                speculation != Speculation::None || (chosen && a.drafter.is_some()),
                "--policy-experiment compares verify policies of a drafter: give --speculation or --drafter"
            );
            anyhow::ensure!(
                a.experiment_window.is_finite() && a.experiment_window >= 1.0,
                "--experiment-window must be at least 1 second, got {}",
                a.experiment_window
            );
            let arms = dspark_engine::experiment::parse_arms(spec, gamma)
                .map_err(|e| anyhow::anyhow!("--policy-experiment: {e}"))?;
            Some((arms, Duration::from_secs_f64(a.experiment_window)))
        }
    };
    let admin_token = match (a.admin_port, &a.admin_token_file) {
        (None, _) => None,
        (Some(_), Some(f)) => Some(dspark_engine::server::admin::read_token(f)?),
        (Some(_), None) => Some(
            std::env::var("DSPARK_ADMIN_TOKEN")
                .ok()
                .filter(|t| !t.trim().is_empty())
                .map(|t| t.trim().to_string())
                .context(
                    "--admin-port needs a token: --admin-token-file FILE or DSPARK_ADMIN_TOKEN",
                )?,
        ),
    };
    let model = source::resolve_arg(&a.model, a.cache.clone(), a.revision_pins.as_deref())?;
    let drafter = a
        .drafter
        .as_deref()
        .map(|d| source::resolve_arg(d, a.cache.clone(), a.revision_pins.as_deref()))
        .transpose()?;
    let mut policy = policy;
    if let (true, Some(d)) = (chosen, &drafter) {
        speculation = loader::drafter_kind(&d.path)?;
        if a.gamma.is_none() {
            let g = loader::drafter_block_size(&d.path)?;
            policy = policy.with_gamma(g);
            if let (Some(spec), Some((arms, _))) = (&a.policy_experiment, experiment.as_mut()) {
                *arms = dspark_engine::experiment::parse_arms(spec, g)
                    .map_err(|e| anyhow::anyhow!("--policy-experiment: {e}"))?;
            }
        }
    }
    // Until a shipped drafter is found there is nothing to verify: no policy to profile for.
    let (policy, shipped_drafter) = if chosen && drafter.is_none() {
        let search = loader::drafter_search_path(a.drafters.as_deref());
        let plain = VerifyPolicy::Fixed { gamma };
        let own_gamma = a.gamma.is_none();
        (
            plain,
            Some(runtime::ShippedDrafter {
                search,
                policy,
                own_gamma,
            }),
        )
    } else {
        (policy, None)
    };
    let remote = model.revision.is_some();
    let (state, summary) = runtime::start(&AppOptions {
        model: model.path.clone(),
        model_id: remote.then(|| model.model_id()),
        device: a.device.clone(),
        served_model_name: a
            .served_model_name
            .clone()
            .or_else(|| remote.then(|| model.name.clone())),
        kv_cache_mb: a.kv_cache_mb,
        kv_block_size: a.kv_block_size,
        kv_cache_dtype: loader::parse_kv_dtype(&a.kv_cache_dtype)?,
        max_model_len: a.max_model_len,
        engine: EngineConfig {
            max_batch_tokens: a.max_batch_tokens,
            prefill_chunk: a.prefill_chunk,
            max_running: a.max_running,
            max_waiting: a.max_waiting,
            speculation,
            policy,
            online_calibration: a.online_calibration,
            experiment,
            prefix_cache: !a.no_prefix_cache,
            faults: Default::default(),
        },
        show_progress: true,
        drafter: drafter.map(|d| d.path),
        cost_table: a.cost_table.clone(),
        startup_profile: a.startup_profile,
        shipped_drafter,
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let mut admin_note = String::new();
        if let (Some(port), Some(token)) = (a.admin_port, admin_token) {
            let admin_addr = format!("{}:{port}", a.host);
            let l = tokio::net::TcpListener::bind(&admin_addr)
                .await
                .with_context(|| format!("cannot listen on {admin_addr} (admin API)"))?;
            let admin = dspark_engine::server::admin::router(state.clone(), token);
            tokio::spawn(async move { axum::serve(l, admin).await });
            admin_note = format!(" | admin http://{admin_addr}");
        }
        let ct = state.costs.current();
        println!(
            "{summary} | policy {} | cost table {} rev {} | http://{addr}{admin_note}",
            state.policy,
            dspark_engine::cost::source_name(ct.source),
            ct.revision
        );
        let limits = dspark_engine::server::Limits {
            max_request_bytes: a.max_request_bytes,
            max_grammar_work: a.max_grammar_work,
            engine_stall: Duration::from_secs(a.engine_stall_secs.max(1)),
        };
        let app = router_with(state.clone(), limits);
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        shutdown_signal().await;
        state.draining.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(a.drain_timeout_secs);
        tracing::info!(
            inflight = state.inflight.load(Ordering::SeqCst),
            "draining before exit (up to {}s)",
            a.drain_timeout_secs
        );
        while state.inflight.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = state.inflight.load(Ordering::SeqCst);
        if left > 0 {
            tracing::warn!(
                left,
                "drain deadline passed; exiting with requests in flight"
            );
        } else {
            tracing::info!("drained; exiting");
        }
        server.abort();
        Ok::<(), anyhow::Error>(())
    })
}

fn profile(a: ProfileArgs) -> Result<()> {
    use dspark_engine::kv::KvCache;
    use dspark_engine::profile::{cost_table, log_grid, measure, ProfileOptions};
    loader::init_threads(a.threads);
    let device = loader::device(&a.device)?;
    let fetched = source::resolve_arg(&a.model, a.cache.clone(), a.revision_pins.as_deref())?;
    let (mut model, _) = loader::load(&fetched.path, &device, true)?;
    if fetched.revision.is_some() {
        model.id = fetched.model_id();
    }
    let drafter = a
        .drafter
        .as_deref()
        .map(|d| source::resolve_arg(d, a.cache.clone(), a.revision_pins.as_deref()))
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

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}
