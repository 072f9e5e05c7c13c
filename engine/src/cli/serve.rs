//! `dspark-engine serve`: the flags, the engine and HTTP servers they start, and the drain
//! on SIGTERM.

use anyhow::{Context, Result};
use dspark_engine::engine::EngineConfig;
use dspark_engine::loader;
use dspark_engine::runtime::{self, AppOptions};
use dspark_engine::server::router_with;
use dspark_engine::speculative::{PolicyKind, Speculation, VerifyPolicy};
use dspark_types::contract::{env as cenv, flags, ports};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A GGUF file or a Hugging Face model folder, or a remote source fetched into --cache
    /// first: hf://ORG/REPO[@REVISION][/FILE], s3://BUCKET/KEY, https://URL.
    #[arg(long = flags::MODEL, env = cenv::MODEL)]
    pub model: String,
    #[command(flatten)]
    pub sources: super::SourceArgs,
    #[arg(long = flags::HOST, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long = flags::PORT, default_value_t = ports::HTTP)]
    pub port: u16,
    /// Name clients use in the `model` field (the alias `default` always works).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[command(flatten)]
    pub compute: loader::ComputeArgs,
    /// Memory budget of the paged KV cache.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_mb: usize,
    #[arg(long, default_value_t = 16)]
    pub kv_block_size: usize,
    /// KV cache element type: f16 (half the memory and attention reads) or f32.
    #[arg(long, default_value = "f16", env = cenv::KV_CACHE_DTYPE)]
    pub kv_cache_dtype: String,
    /// Longest prompt + completion (default: the model's context, capped by the KV budget).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Admission queue bound: past it, requests get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// On SIGTERM (or SIGINT): admission stops (`/ready` and new requests get 503), requests
    /// in flight may finish for this long, then the ones left end with a 503 error (an error
    /// event when streaming) and the process exits 0. Keep it below the pod's
    /// terminationGracePeriodSeconds.
    #[arg(long = flags::DRAIN_TIMEOUT_SECS, env = "DSPARK_DRAIN_TIMEOUT_SECS", default_value_t = 25)]
    pub drain_timeout_secs: u64,
    /// Largest request body in bytes: a larger one gets 413 (OpenAI error format).
    #[arg(long, env = "DSPARK_MAX_REQUEST_BYTES", default_value_t = dspark_engine::server::DEFAULT_MAX_REQUEST_BYTES)]
    pub max_request_bytes: usize,
    /// Work budget of one request's structured-output constraint (schema nodes visited by
    /// the max_tokens check; llguidance's grammar size, lexer fuel and per-mask work are
    /// shares of it, the default giving its defaults): past it, 400 naming this limit.
    #[arg(long, env = "DSPARK_MAX_GRAMMAR_WORK", default_value_t = dspark_engine::server::DEFAULT_MAX_GRAMMAR_WORK)]
    pub max_grammar_work: u64,
    /// Seconds the engine may make no progress while requests are queued or running before
    /// /health and /ready fail (the liveness probe then restarts the pod).
    #[arg(long, env = "DSPARK_ENGINE_STALL_SECS", default_value_t = dspark_engine::server::DEFAULT_ENGINE_STALL_SECS)]
    pub engine_stall_secs: u64,
    /// Drafter for speculative decoding: none | ngram (prompt lookup) | parallel (DFlash
    /// baseline) | dspark-markov | dspark-rnn. Default: the head of --drafter when given, else
    /// the model's shipped drafter when --drafters holds one (with --policy dspark unless
    /// --policy says otherwise), else none.
    #[arg(long = flags::SPECULATION)]
    pub speculation: Option<String>,
    /// Where shipped drafters are looked for when --speculation is not given: folders
    /// separated by ':', each a drafter checkpoint or a folder of them; a drafter serves the
    /// models its manifest.json lists in `target_models`. Default: the image's
    /// /usr/share/dspark/drafters, then ./drafters, then the source checkout's drafters/.
    #[arg(long, env = cenv::DRAFTERS)]
    pub drafters: Option<String>,
    /// DSpark drafter checkpoint folder (config.json + model.safetensors), local or remote
    /// like --model. Without it, the model drafters start untrained (random weights).
    #[arg(long = flags::DRAFTER)]
    pub drafter: Option<String>,
    /// How many draft tokens each request verifies: fixed (always gamma) | threshold
    /// (the prefix whose survival stays above --threshold) | dspark (the load-aware
    /// scheduler maximising tau * SPS(B) with the cost table). Default: dspark when the
    /// drafter is chosen for you (no --speculation), fixed with an explicit --speculation.
    #[arg(long = flags::POLICY, env = cenv::POLICY)]
    pub policy: Option<String>,
    /// Draft block size (the longest block the scheduler may verify). Default: the drafter's
    /// own block size when the drafter is chosen for you (no --speculation), else 4.
    #[arg(long, env = cenv::GAMMA)]
    pub gamma: Option<usize>,
    /// Survival threshold of the threshold policy.
    #[arg(long, env = cenv::THRESHOLD, default_value_t = 0.5)]
    pub threshold: f32,
    /// Online recalibration of a model drafter's confidences from verify outcomes: the SGD
    /// step of a per-position scale and offset on the logit, on top of STS, per decoding
    /// mode (0: off). Keeps the threshold and dspark policies honest on traffic unlike the
    /// calibration data.
    #[arg(long, env = cenv::ONLINE_CALIBRATION, default_value_t = dspark_engine::speculative::recalibrate::DEFAULT_STEP)]
    pub online_calibration: f32,
    /// Prompt lookup beside a model drafter (dspark-*, parallel): a sequence whose last
    /// tokens occur earlier in its context verifies the continuation found there instead of
    /// the drafter's block when that promises more tokens per second (rates learnt live per
    /// match length). `false` turns it off.
    #[arg(long, env = "DSPARK_PROMPT_LOOKUP", default_value_t = true, action = clap::ArgAction::Set)]
    pub prompt_lookup: bool,
    /// Turn off automatic prefix caching (full prompt blocks shared by content between
    /// requests and kept after them until the cache needs the room).
    #[arg(long, env = "DSPARK_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Online on/off experiment: alternate these verify policies on live traffic, one per
    /// window (comma list of dspark, none, fixed:G, threshold:T; e.g. dspark,none). Needs a
    /// drafter (--speculation). Results: /metrics (dspark_experiment_*), GET /experiment,
    /// `dspark-engine experiment-report`.
    #[arg(long, env = cenv::POLICY_EXPERIMENT)]
    pub policy_experiment: Option<String>,
    /// Seconds per experiment window.
    #[arg(long, env = cenv::EXPERIMENT_WINDOW, default_value_t = 30.0)]
    pub experiment_window: f64,
    /// SPS(B) cost table (JSON from `dspark-engine profile`), hot-reloaded when it changes.
    /// Without one the built-in conservative default is used until one is pushed.
    #[arg(long = flags::COST_TABLE, env = cenv::COST_TABLE)]
    pub cost_table: Option<PathBuf>,
    /// Without --cost-table, measure SPS(B) on this machine at start-up (seconds on a small
    /// model, about a minute for a 1.5B on two CPU cores) for the dspark policy instead of
    /// starting on the built-in default table.
    #[arg(long, env = "DSPARK_STARTUP_PROFILE", default_value_t = true, action = clap::ArgAction::Set)]
    pub startup_profile: bool,
    /// Port of the admin API (cost-table push, state), on --host; needs a token.
    #[arg(long = flags::ADMIN_PORT)]
    pub admin_port: Option<u16>,
    /// File holding the admin API's bearer token (else the DSPARK_ADMIN_TOKEN variable).
    #[arg(long = flags::ADMIN_TOKEN_FILE)]
    pub admin_token_file: Option<PathBuf>,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    loader::init_threads(a.compute.threads);
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
    let model = a.sources.resolve(&a.model)?;
    let drafter = a
        .drafter
        .as_deref()
        .map(|d| a.sources.resolve(d))
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
        device: a.compute.device.clone(),
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
            prompt_lookup: a.prompt_lookup,
            faults: Default::default(),
        },
        show_progress: true,
        drafter: drafter.map(|d| d.path),
        cost_table: a.cost_table.clone(),
        startup_profile: a.startup_profile,
        shipped_drafter,
    })?;
    // Signals and the drain run on their own runtime on this thread, so that they are
    // handled even while every worker of the server's runtime is busy; the handlers are in
    // place before the address is printed (a SIGTERM right after start-up drains too).
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut signals = {
        let _in = control.enter();
        Signals::install()?
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let server = rt.block_on(async {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        // The bound address (`--port 0` picks a free one).
        let addr = listener.local_addr()?;
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
        Ok::<_, anyhow::Error>(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ))
    })?;
    let timeout = Duration::from_secs(a.drain_timeout_secs);
    control.block_on(async {
        signals.recv().await;
        dspark_engine::server::shutdown::drain(&state, timeout).await
    });
    server.abort();
    // Work that never yields (a blocking task, a stuck handler) must not keep the process.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// SIGTERM (Kubernetes stopping the pod) and SIGINT (Ctrl-C).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (inside a runtime).
    fn install() -> Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("install the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("install the SIGINT handler")?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
    }
}
