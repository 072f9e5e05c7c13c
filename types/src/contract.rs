//! The engine's contract with the operator and the dashboards, written once: the ports and
//! paths an engine pod serves, the command-line flags and environment variables the operator
//! sets, the speculation and policy names with their flag spellings, and the Prometheus
//! metric families the engine and the operator expose.
//!
//! The engine's CLI (clap attributes) and metric registry, the operator's pod and Job
//! builders and its metrics parser, and the dashboard / alert-rule check all read these
//! definitions; a string written anywhere else is a bug.

/// The ports an engine pod listens on.
pub mod ports {
    /// OpenAI-compatible API, `/health`, `/ready`, `/metrics`.
    pub const HTTP: u16 = 8000;
    /// Admin API (cost tables, state), token-protected.
    pub const ADMIN: u16 = 8001;
}

/// HTTP paths of an engine pod.
pub mod paths {
    /// Liveness: the process serves HTTP.
    pub const HEALTH: &str = "/health";
    /// Readiness: the model is loaded and the engine loop runs (503 while draining).
    pub const READY: &str = "/ready";
    /// Prometheus text exposition.
    pub const METRICS: &str = "/metrics";
    /// Admin: the engine's state (cost table in force, its revision and source).
    pub const ADMIN_STATE: &str = "/admin/v1/state";
    /// Admin: `PUT` installs a cost table.
    pub const ADMIN_COST_TABLE: &str = "/admin/v1/cost-table";
    /// OpenAI Chat Completions API.
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
    /// OpenAI (legacy) Completions API.
    pub const COMPLETIONS: &str = "/v1/completions";
    /// OpenAI Responses API.
    pub const RESPONSES: &str = "/v1/responses";
    /// The served models; `GET {MODELS}/{id}` is one model (404 `model_not_found`).
    pub const MODELS: &str = "/v1/models";
    /// vLLM's extension: text -> token ids.
    pub const TOKENIZE: &str = "/tokenize";
    /// vLLM's extension: token ids -> text.
    pub const DETOKENIZE: &str = "/detokenize";
    /// The online policy experiment's finished windows.
    pub const EXPERIMENT: &str = "/experiment";
}

/// Long flag names (without the leading `--`) of `dspark-engine serve` and `profile` that
/// the operator sets. [`arg`] spells one on a command line.
pub mod flags {
    pub const MODEL: &str = "model";
    pub const DRAFTER: &str = "drafter";
    /// Where `hf://`, `s3://` and `https://` sources are downloaded to (shared by replicas).
    pub const CACHE: &str = "cache";
    pub const SPECULATION: &str = "speculation";
    pub const POLICY: &str = "policy";
    pub const HOST: &str = "host";
    pub const PORT: &str = "port";
    pub const ADMIN_PORT: &str = "admin-port";
    pub const ADMIN_TOKEN_FILE: &str = "admin-token-file";
    pub const DRAIN_TIMEOUT_SECS: &str = "drain-timeout-secs";
    /// A cost table file to start with (serve).
    pub const COST_TABLE: &str = "cost-table";
    /// Where `profile` writes the measured table.
    pub const OUTPUT: &str = "output";
    /// `profile`: also write the compact form (container termination message).
    pub const COMPACT: &str = "compact";
    pub const NODE_TYPE: &str = "node-type";
    /// `profile`: the file the compact table goes to (the pod's termination-message path).
    pub const TERMINATION_LOG: &str = "termination-log";
    /// `fetch`, `serve`, `profile`: a file of revisions a deployment pinned, one
    /// `SOURCE REVISION` per line (see [`super::pins`]).
    pub const REVISION_PINS: &str = "revision-pins";

    /// `--NAME` as one command-line word.
    pub fn arg(name: &str) -> String {
        format!("--{name}")
    }
}

/// Environment variables the engine reads (each backs the flag named in its doc).
pub mod env {
    /// `--model`.
    pub const MODEL: &str = "DSPARK_MODEL";
    /// `--cache`.
    pub const MODEL_CACHE: &str = "DSPARK_MODEL_CACHE";
    /// `--revision-pins`.
    pub const REVISION_PINS: &str = "DSPARK_REVISION_PINS";
    /// `--node-type` (profile) and the node type a pod reports.
    pub const NODE_TYPE: &str = "DSPARK_NODE_TYPE";
    /// `--policy`.
    pub const POLICY: &str = "DSPARK_POLICY";
    /// `--gamma`.
    pub const GAMMA: &str = "DSPARK_GAMMA";
    /// `--threshold`.
    pub const THRESHOLD: &str = "DSPARK_THRESHOLD";
    /// `--online-calibration`.
    pub const ONLINE_CALIBRATION: &str = "DSPARK_ONLINE_CALIBRATION";
    /// `--policy-experiment`.
    pub const POLICY_EXPERIMENT: &str = "DSPARK_POLICY_EXPERIMENT";
    /// `--experiment-window`.
    pub const EXPERIMENT_WINDOW: &str = "DSPARK_EXPERIMENT_WINDOW";
    /// `--cost-table`.
    pub const COST_TABLE: &str = "DSPARK_COST_TABLE";
    /// `--kv-cache-dtype`.
    pub const KV_CACHE_DTYPE: &str = "DSPARK_KV_CACHE_DTYPE";
    /// `--drafters` (where shipped drafters are looked for).
    pub const DRAFTERS: &str = "DSPARK_DRAFTERS";
}

/// Which drafter an engine runs (`--speculation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Speculation {
    /// Plain decoding.
    None,
    /// Prompt lookup, training-free.
    Ngram,
    /// The DFlash-style parallel drafter (no sequential head).
    Parallel,
    /// DSpark with the Markov head.
    DSparkMarkov,
    /// DSpark with the RNN head.
    DSparkRnn,
}

impl Speculation {
    /// Every kind, in flag order.
    pub const ALL: [Speculation; 5] = [
        Speculation::None,
        Speculation::Ngram,
        Speculation::Parallel,
        Speculation::DSparkMarkov,
        Speculation::DSparkRnn,
    ];

    /// The `--speculation` spelling.
    pub fn flag(self) -> &'static str {
        match self {
            Speculation::None => "none",
            Speculation::Ngram => "ngram",
            Speculation::Parallel => "parallel",
            Speculation::DSparkMarkov => "dspark-markov",
            Speculation::DSparkRnn => "dspark-rnn",
        }
    }

    /// The kind a `--speculation` value names.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.flag() == s)
    }

    /// Drafts with a model fed with the target's hidden states (it keeps a context cache).
    pub fn uses_model_drafter(self) -> bool {
        matches!(
            self,
            Speculation::Parallel | Speculation::DSparkMarkov | Speculation::DSparkRnn
        )
    }
}

/// How many draft tokens each request sends to verification (`--policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// The whole block of `gamma` tokens.
    Fixed,
    /// The prefix whose survival stays above `--threshold`.
    Threshold,
    /// The load-aware prefix scheduler over the cost table.
    Dspark,
}

impl PolicyKind {
    /// Every policy, in flag order.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Fixed, PolicyKind::Threshold, PolicyKind::Dspark];

    /// The `--policy` spelling.
    pub fn flag(self) -> &'static str {
        match self {
            PolicyKind::Fixed => "fixed",
            PolicyKind::Threshold => "threshold",
            PolicyKind::Dspark => "dspark",
        }
    }

    /// The policy a `--policy` value names.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.flag() == s)
    }
}

/// Prometheus metric families: the name a family is registered under and its type.
/// Counters are exposed with a `_total` suffix, histograms as `_bucket` / `_sum` /
/// `_count` series.
pub mod metrics {
    /// A family's type.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        Counter,
        Gauge,
        Histogram,
    }

    impl Kind {
        /// The `# TYPE` word of the exposition.
        pub fn type_word(self) -> &'static str {
            match self {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            }
        }
    }

    /// One metric family.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Family {
        /// The registered name (a counter's without `_total`).
        pub name: &'static str,
        pub kind: Kind,
    }

    impl Family {
        const fn new(name: &'static str, kind: Kind) -> Self {
            Self { name, kind }
        }

        /// Whether `sample` (a series name in an exposition or a query) belongs to this
        /// family: the name itself for a gauge, `_total` for a counter, `_bucket`, `_sum`
        /// or `_count` for a histogram.
        pub fn owns(&self, sample: &str) -> bool {
            let Some(suffix) = sample.strip_prefix(self.name) else {
                return false;
            };
            match self.kind {
                Kind::Gauge => suffix.is_empty(),
                Kind::Counter => suffix == "_total",
                Kind::Histogram => matches!(suffix, "_bucket" | "_sum" | "_count"),
            }
        }

        /// The series name of a counter (`_total`) or a gauge.
        pub fn sample(&self) -> String {
            match self.kind {
                Kind::Counter => format!("{}_total", self.name),
                Kind::Gauge | Kind::Histogram => self.name.to_string(),
            }
        }
    }

    use Kind::{Counter, Gauge, Histogram};

    pub const TTFT: Family = Family::new("dspark_time_to_first_token_seconds", Histogram);
    pub const ITL: Family = Family::new("dspark_inter_token_latency_seconds", Histogram);
    pub const E2E: Family = Family::new("dspark_e2e_request_latency_seconds", Histogram);
    pub const QUEUE_TIME: Family = Family::new("dspark_request_queue_time_seconds", Histogram);
    pub const RUNNING: Family = Family::new("dspark_num_requests_running", Gauge);
    pub const WAITING: Family = Family::new("dspark_num_requests_waiting", Gauge);
    pub const KV_USAGE: Family = Family::new("dspark_kv_cache_usage_ratio", Gauge);
    pub const PREFIX_QUERIES: Family = Family::new("dspark_prefix_cache_queries", Counter);
    pub const PREFIX_HITS: Family = Family::new("dspark_prefix_cache_hits", Counter);
    pub const PREFIX_BLOCKS: Family = Family::new("dspark_prefix_cache_blocks", Gauge);
    pub const PREFIX_EVICTIONS: Family = Family::new("dspark_prefix_cache_evictions", Counter);
    pub const PROMPT_TOKENS: Family = Family::new("dspark_prompt_tokens", Counter);
    pub const GENERATION_TOKENS: Family = Family::new("dspark_generation_tokens", Counter);
    pub const REQUEST_SUCCESS: Family = Family::new("dspark_request_success", Counter);
    pub const REQUESTS_REJECTED: Family = Family::new("dspark_requests_rejected", Counter);
    pub const BATCH_TOKENS: Family = Family::new("dspark_batch_tokens", Histogram);
    pub const STEPS: Family = Family::new("dspark_engine_steps", Counter);
    pub const PREEMPTIONS: Family = Family::new("dspark_num_preemptions", Counter);
    pub const SPEC_DRAFTS: Family = Family::new("dspark_spec_decode_num_drafts", Counter);
    pub const DRAFT_SKIPPED_STEPS: Family =
        Family::new("dspark_spec_decode_draft_skipped_steps", Counter);
    pub const DRAFT_STEPS: Family = Family::new("dspark_spec_decode_draft_steps", Counter);
    pub const SKIPPED_PROBES: Family = Family::new("dspark_spec_decode_skipped_probes", Counter);
    pub const DRAFTER_CALLS: Family = Family::new("dspark_spec_decode_drafter_calls", Counter);
    pub const SPEC_DRAFT_TOKENS: Family =
        Family::new("dspark_spec_decode_num_draft_tokens", Counter);
    pub const SPEC_ACCEPTED_TOKENS: Family =
        Family::new("dspark_spec_decode_num_accepted_tokens", Counter);
    pub const SPEC_ACCEPTED_PER_POS: Family =
        Family::new("dspark_spec_decode_num_accepted_tokens_per_pos", Counter);
    pub const VERIFY_LENGTH: Family = Family::new("dspark_spec_decode_verify_length", Histogram);
    pub const EXPECTED_TOKENS: Family = Family::new("dspark_scheduler_expected_tokens", Counter);
    pub const COMMITTED_TOKENS: Family = Family::new("dspark_scheduler_committed_tokens", Counter);
    pub const THETA: Family = Family::new("dspark_scheduler_theta", Gauge);
    pub const STEP_COST_RATIO: Family = Family::new("dspark_scheduler_step_cost_ratio", Gauge);
    pub const VERIFY_COST_FACTOR: Family =
        Family::new("dspark_scheduler_verify_cost_factor", Gauge);
    pub const COST_TABLE_REVISION: Family = Family::new("dspark_cost_table_revision", Gauge);
    pub const COST_TABLE_SOURCE: Family = Family::new("dspark_cost_table_source", Gauge);
    pub const COST_TABLE_REFUSALS: Family = Family::new("dspark_cost_table_refusals", Counter);
    pub const LIVE_ACCEPTANCE: Family =
        Family::new("dspark_spec_decode_live_acceptance_rate", Gauge);
    pub const CALIBRATION_OFFSET: Family =
        Family::new("dspark_spec_decode_calibration_offset", Gauge);
    pub const CALIBRATION_SCALE: Family =
        Family::new("dspark_spec_decode_calibration_scale", Gauge);
    pub const EXPERIMENT_ACTIVE: Family = Family::new("dspark_experiment_active", Gauge);
    pub const EXPERIMENT_TOKENS: Family = Family::new("dspark_experiment_tokens", Counter);
    pub const EXPERIMENT_SECONDS: Family = Family::new("dspark_experiment_seconds", Counter);
    pub const EXPERIMENT_RUNNING_SECONDS: Family =
        Family::new("dspark_experiment_running_seconds", Counter);
    pub const EXPERIMENT_WINDOWS: Family = Family::new("dspark_experiment_windows", Counter);
    pub const EXPERIMENT_TTFT: Family =
        Family::new("dspark_experiment_time_to_first_token_seconds", Histogram);
    pub const EXPERIMENT_ITL: Family =
        Family::new("dspark_experiment_inter_token_latency_seconds", Histogram);

    /// Every family an engine exposes on `/metrics`.
    pub const ENGINE: &[Family] = &[
        TTFT,
        ITL,
        E2E,
        QUEUE_TIME,
        RUNNING,
        WAITING,
        KV_USAGE,
        PREFIX_QUERIES,
        PREFIX_HITS,
        PREFIX_BLOCKS,
        PREFIX_EVICTIONS,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_SUCCESS,
        REQUESTS_REJECTED,
        BATCH_TOKENS,
        STEPS,
        PREEMPTIONS,
        SPEC_DRAFTS,
        DRAFT_SKIPPED_STEPS,
        DRAFT_STEPS,
        SKIPPED_PROBES,
        DRAFTER_CALLS,
        SPEC_DRAFT_TOKENS,
        SPEC_ACCEPTED_TOKENS,
        SPEC_ACCEPTED_PER_POS,
        VERIFY_LENGTH,
        EXPECTED_TOKENS,
        COMMITTED_TOKENS,
        THETA,
        STEP_COST_RATIO,
        VERIFY_COST_FACTOR,
        COST_TABLE_REVISION,
        COST_TABLE_SOURCE,
        COST_TABLE_REFUSALS,
        LIVE_ACCEPTANCE,
        CALIBRATION_OFFSET,
        CALIBRATION_SCALE,
        EXPERIMENT_ACTIVE,
        EXPERIMENT_TOKENS,
        EXPERIMENT_SECONDS,
        EXPERIMENT_RUNNING_SECONDS,
        EXPERIMENT_WINDOWS,
        EXPERIMENT_TTFT,
        EXPERIMENT_ITL,
    ];

    /// The operator's own families (its `/metrics`).
    pub mod operator {
        use super::Family;
        use super::Kind::{Counter, Gauge, Histogram};

        pub const RECONCILES: Family = Family::new("dspark_operator_reconciles", Counter);
        pub const RECONCILE_ERRORS: Family =
            Family::new("dspark_operator_reconcile_errors", Counter);
        pub const SCALING_DECISIONS: Family =
            Family::new("dspark_operator_scaling_decisions", Counter);
        pub const ADVISORY_DECISIONS: Family =
            Family::new("dspark_operator_advisory_decisions", Counter);
        pub const PROFILING_JOBS: Family = Family::new("dspark_operator_profiling_jobs", Counter);
        pub const PROFILING_FAILURES: Family =
            Family::new("dspark_operator_profiling_failures", Counter);
        pub const COST_TABLES_STORED: Family =
            Family::new("dspark_operator_cost_tables_stored", Counter);
        pub const COST_TABLE_PUSHES: Family =
            Family::new("dspark_operator_cost_table_pushes", Counter);
        pub const COST_TABLE_PUSH_FAILURES: Family =
            Family::new("dspark_operator_cost_table_push_failures", Counter);
        /// Reconcile durations (its `_sum` is what dashboards have always read).
        pub const RECONCILE_DURATION: Family =
            Family::new("dspark_operator_reconcile_duration_seconds", Histogram);
        /// Requests to the Kubernetes API server, label `verb`.
        pub const KUBE_REQUESTS: Family = Family::new("dspark_operator_kube_requests", Counter);
        pub const POOL_DESIRED_REPLICAS: Family =
            Family::new("dspark_operator_pool_desired_replicas", Gauge);
        pub const POOL_READY_REPLICAS: Family =
            Family::new("dspark_operator_pool_ready_replicas", Gauge);
        pub const POOL_TTFT_P95: Family =
            Family::new("dspark_operator_pool_ttft_p95_seconds", Gauge);
        pub const POOL_ITL_P95: Family = Family::new("dspark_operator_pool_itl_p95_seconds", Gauge);
        pub const POOL_ACCEPTANCE_LENGTH: Family =
            Family::new("dspark_operator_pool_acceptance_length", Gauge);
        pub const POOL_REQUEST_RATE: Family =
            Family::new("dspark_operator_pool_request_rate", Gauge);
        pub const LEADER: Family = Family::new("dspark_operator_leader", Gauge);

        /// Every family the operator exposes.
        pub const ALL: &[Family] = &[
            RECONCILES,
            RECONCILE_ERRORS,
            SCALING_DECISIONS,
            ADVISORY_DECISIONS,
            PROFILING_JOBS,
            PROFILING_FAILURES,
            COST_TABLES_STORED,
            COST_TABLE_PUSHES,
            COST_TABLE_PUSH_FAILURES,
            RECONCILE_DURATION,
            KUBE_REQUESTS,
            POOL_DESIRED_REPLICAS,
            POOL_READY_REPLICAS,
            POOL_TTFT_P95,
            POOL_ITL_P95,
            POOL_ACCEPTANCE_LENGTH,
            POOL_REQUEST_RATE,
            LEADER,
        ];
    }

    /// The family, engine's or operator's, that a series name belongs to.
    pub fn family_of(sample: &str) -> Option<Family> {
        ENGINE
            .iter()
            .chain(operator::ALL)
            .find(|f| f.owns(sample))
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::metrics::{family_of, Kind, ENGINE, ITL, SPEC_DRAFTS};
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_round_trip_and_are_unique() {
        for k in Speculation::ALL {
            assert_eq!(Speculation::parse(k.flag()), Some(k));
        }
        for k in PolicyKind::ALL {
            assert_eq!(PolicyKind::parse(k.flag()), Some(k));
        }
        assert_eq!(Speculation::parse("dspark"), None);
        assert_eq!(PolicyKind::parse("none"), None);
        let all: Vec<_> = ENGINE.iter().chain(metrics::operator::ALL).collect();
        let names: HashSet<_> = all.iter().map(|f| f.name).collect();
        assert_eq!(names.len(), all.len(), "a family is listed twice");
        assert_eq!(flags::arg(flags::ADMIN_PORT), "--admin-port");
    }

    #[test]
    fn series_names_map_to_their_family() {
        assert_eq!(
            family_of("dspark_spec_decode_num_drafts_total"),
            Some(SPEC_DRAFTS)
        );
        assert_eq!(family_of("dspark_spec_decode_num_drafts"), None);
        assert_eq!(
            family_of("dspark_inter_token_latency_seconds_bucket"),
            Some(ITL)
        );
        assert_eq!(family_of("dspark_inter_token_latency_seconds"), None);
        assert_eq!(family_of("dspark_num_requests_running_total"), None);
        // A longer family sharing a prefix is not mistaken for the shorter one.
        let per_pos = family_of("dspark_spec_decode_num_accepted_tokens_per_pos_total").unwrap();
        assert_eq!(
            per_pos.name,
            "dspark_spec_decode_num_accepted_tokens_per_pos"
        );
        assert_eq!(SPEC_DRAFTS.sample(), "dspark_spec_decode_num_drafts_total");
        assert_eq!(ITL.kind, Kind::Histogram);
    }
}

/// Revision pins: the operator resolves a Hub branch once (the first fetch reports the commit)
/// and writes `SOURCE REVISION` lines into the pool's ConfigMap; every later fetch of that
/// exact source string (engine, init container, profiling Job) uses that commit, so replicas
/// started at different times serve the same bytes and the cost table keyed by the commit fits.
pub mod pins {
    /// The ConfigMap key (and file name next to the cost table) holding the pins.
    pub const KEY: &str = "revision-pins";

    /// The pins file's text for `(source, revision)` pairs.
    pub fn render<'a>(pins: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
        pins.into_iter()
            .map(|(s, r)| format!("{s} {r}\n"))
            .collect()
    }

    /// The revision pinned for `source` in `text`, if any.
    pub fn lookup<'a>(text: &'a str, source: &str) -> Option<&'a str> {
        text.lines().find_map(|l| {
            let (s, r) = l.trim().rsplit_once(' ')?;
            (s.trim() == source.trim() && !r.is_empty()).then_some(r)
        })
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn pins_round_trip_and_match_only_the_exact_source() {
            let t = super::render([("hf://o/r@main/m.gguf", "abc"), ("s3://b/k", "e1")]);
            assert_eq!(super::lookup(&t, "hf://o/r@main/m.gguf"), Some("abc"));
            assert_eq!(super::lookup(&t, " s3://b/k "), Some("e1"));
            assert_eq!(super::lookup(&t, "hf://o/r/m.gguf"), None);
            assert_eq!(super::lookup("", "x"), None);
        }
    }
}
