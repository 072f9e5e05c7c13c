//! Prometheus metric families: the name a family is registered under and its type.
//! Counters are exposed with a `_total` suffix, histograms as `_bucket` / `_sum` /
//! `_count` series.

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
pub const SPEC_DRAFT_TOKENS: Family = Family::new("dspark_spec_decode_num_draft_tokens", Counter);
pub const SPEC_ACCEPTED_TOKENS: Family =
    Family::new("dspark_spec_decode_num_accepted_tokens", Counter);
pub const SPEC_ACCEPTED_PER_POS: Family =
    Family::new("dspark_spec_decode_num_accepted_tokens_per_pos", Counter);
pub const LOOKUP_DRAFTS: Family = Family::new("dspark_spec_decode_lookup_drafts", Counter);
pub const LOOKUP_ACCEPTED_TOKENS: Family =
    Family::new("dspark_spec_decode_lookup_accepted_tokens", Counter);
pub const VERIFY_LENGTH: Family = Family::new("dspark_spec_decode_verify_length", Histogram);
pub const EXPECTED_TOKENS: Family = Family::new("dspark_scheduler_expected_tokens", Counter);
pub const COMMITTED_TOKENS: Family = Family::new("dspark_scheduler_committed_tokens", Counter);
pub const THETA: Family = Family::new("dspark_scheduler_theta", Gauge);
pub const STEP_COST_RATIO: Family = Family::new("dspark_scheduler_step_cost_ratio", Gauge);
pub const VERIFY_COST_FACTOR: Family = Family::new("dspark_scheduler_verify_cost_factor", Gauge);
pub const COST_TABLE_REVISION: Family = Family::new("dspark_cost_table_revision", Gauge);
pub const COST_TABLE_SOURCE: Family = Family::new("dspark_cost_table_source", Gauge);
pub const COST_TABLE_REFUSALS: Family = Family::new("dspark_cost_table_refusals", Counter);
pub const LIVE_ACCEPTANCE: Family = Family::new("dspark_spec_decode_live_acceptance_rate", Gauge);
pub const CALIBRATION_OFFSET: Family = Family::new("dspark_spec_decode_calibration_offset", Gauge);
pub const CALIBRATION_SCALE: Family = Family::new("dspark_spec_decode_calibration_scale", Gauge);
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
    LOOKUP_DRAFTS,
    LOOKUP_ACCEPTED_TOKENS,
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
    pub const RECONCILE_ERRORS: Family = Family::new("dspark_operator_reconcile_errors", Counter);
    pub const SCALING_DECISIONS: Family = Family::new("dspark_operator_scaling_decisions", Counter);
    pub const ADVISORY_DECISIONS: Family =
        Family::new("dspark_operator_advisory_decisions", Counter);
    pub const PROFILING_JOBS: Family = Family::new("dspark_operator_profiling_jobs", Counter);
    pub const PROFILING_FAILURES: Family =
        Family::new("dspark_operator_profiling_failures", Counter);
    pub const COST_TABLES_STORED: Family =
        Family::new("dspark_operator_cost_tables_stored", Counter);
    pub const COST_TABLE_PUSHES: Family = Family::new("dspark_operator_cost_table_pushes", Counter);
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
    pub const POOL_TTFT_P95: Family = Family::new("dspark_operator_pool_ttft_p95_seconds", Gauge);
    pub const POOL_ITL_P95: Family = Family::new("dspark_operator_pool_itl_p95_seconds", Gauge);
    pub const POOL_ACCEPTANCE_LENGTH: Family =
        Family::new("dspark_operator_pool_acceptance_length", Gauge);
    pub const POOL_REQUEST_RATE: Family = Family::new("dspark_operator_pool_request_rate", Gauge);
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
