//! The engine's Prometheus metrics (`dspark_` names; vLLM's set where one exists). The family
//! names are the operator contract's (`dspark_types::contract::metrics`); the Gateway API
//! Inference Extension's model-server protocol is also served in vLLM's spellings
//! ([`gie`]).

use dspark_types::contract::metrics as fam;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    pub finished_reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PositionLabel {
    pub position: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModePositionLabel {
    /// `greedy` or `sampled`.
    pub mode: String,
    pub position: u32,
}

/// A kind of engine step: `plain` (decodes only) or `verify` (verifies drafts).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepKindLabel {
    pub kind: String,
}

/// The arm of the online policy experiment (`serve --policy-experiment`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: String,
}

/// Per-arm series of the online policy experiment.
#[derive(Clone)]
pub struct ExperimentMetrics {
    /// 1 for the arm in force, 0 for the others.
    pub active: Family<PolicyLabel, Gauge>,
    pub tokens: Family<PolicyLabel, Counter>,
    pub seconds: Family<PolicyLabel, Counter<f64, AtomicU64>>,
    /// Integral of running requests over time (request-seconds).
    pub running_seconds: Family<PolicyLabel, Counter<f64, AtomicU64>>,
    pub windows: Family<PolicyLabel, Counter>,
    pub ttft: Family<PolicyLabel, Histogram, fn() -> Histogram>,
    pub itl: Family<PolicyLabel, Histogram, fn() -> Histogram>,
}

impl ExperimentMetrics {
    /// The label for `arm`.
    pub fn label(arm: &str) -> PolicyLabel {
        PolicyLabel {
            policy: arm.to_string(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: String,
}

/// The labels of [`gie::CACHE_CONFIG_INFO`], as vLLM spells them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigLabel {
    pub block_size: String,
    pub num_gpu_blocks: String,
}

/// The labels of [`gie::LORA_REQUESTS_INFO`] (no adapters are served).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoraLabel {
    pub running_lora_adapters: String,
    pub waiting_lora_adapters: String,
    pub max_lora: String,
}

/// The model-server metrics protocol of the Gateway API Inference Extension (GIE), in the
/// vLLM spellings a stock endpoint picker reads by default: the same gauges as the `dspark_`
/// families (one value, two names), plus the cache configuration and the (empty) LoRA
/// state as info gauges. docs/operations.md says how a picker is pointed at them.
pub mod gie {
    /// Requests waiting for admission (= `dspark_num_requests_waiting`).
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    /// Requests in the running batch (= `dspark_num_requests_running`).
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    /// Fraction (0-1) of KV blocks in use (= `dspark_kv_cache_usage_ratio`).
    pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
    /// The same fraction under the name older pickers read.
    pub const GPU_CACHE_USAGE: &str = "vllm:gpu_cache_usage_perc";
    /// 1, labelled with `block_size` (tokens) and `num_gpu_blocks` (the KV cache's blocks).
    pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
    /// 1, labelled `running_lora_adapters=""`, `waiting_lora_adapters=""`, `max_lora="0"`.
    pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
    /// Every family with its Prometheus type (all gauges).
    pub const FAMILIES: [&str; 6] = [
        NUM_REQUESTS_WAITING,
        NUM_REQUESTS_RUNNING,
        KV_CACHE_USAGE,
        GPU_CACHE_USAGE,
        CACHE_CONFIG_INFO,
        LORA_REQUESTS_INFO,
    ];
}

/// The OpenTelemetry GenAI server metrics, exported over OTLP when it is on (no-ops
/// otherwise).
pub struct GenAi {
    pub ttft: opentelemetry::metrics::Histogram<f64>,
    pub time_per_output_token: opentelemetry::metrics::Histogram<f64>,
    pub request_duration: opentelemetry::metrics::Histogram<f64>,
    pub token_usage: opentelemetry::metrics::Histogram<u64>,
    model: String,
}

impl GenAi {
    fn new(model: &str) -> Self {
        let m = dspark_telemetry::meter("dspark-engine");
        Self {
            ttft: m
                .f64_histogram("gen_ai.server.time_to_first_token")
                .with_unit("s")
                .with_description("Time to generate the first token")
                .build(),
            time_per_output_token: m
                .f64_histogram("gen_ai.server.time_per_output_token")
                .with_unit("s")
                .with_description("Time per output token after the first")
                .build(),
            request_duration: m
                .f64_histogram("gen_ai.server.request.duration")
                .with_unit("s")
                .with_description("Generative AI server request duration")
                .build(),
            token_usage: m
                .u64_histogram("gen_ai.client.token.usage")
                .with_unit("{token}")
                .with_description("Input and output tokens per request")
                .build(),
            model: model.to_string(),
        }
    }

    /// The attributes every GenAI metric carries.
    pub fn attrs(&self, operation: &'static str) -> [opentelemetry::KeyValue; 3] {
        [
            opentelemetry::KeyValue::new("gen_ai.operation.name", operation),
            opentelemetry::KeyValue::new("gen_ai.request.model", self.model.clone()),
            opentelemetry::KeyValue::new("gen_ai.system", "dspark"),
        ]
    }
}

pub struct Metrics {
    registry: Registry,
    pub genai: GenAi,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// Automatic prefix caching: prompt tokens looked up / found cached, cached blocks
    /// (registered, in use or kept), blocks evicted.
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub prefix_blocks: Gauge,
    pub prefix_evictions: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub request_success: Family<FinishLabel, Counter>,
    pub requests_rejected: Counter,
    pub batch_tokens: Histogram,
    pub steps: Counter,
    pub preemptions: Counter,
    pub spec_drafts: Counter,
    pub draft_skips: Counter,
    /// Steps that ran the model drafter (probes included).
    pub draft_steps: Counter,
    /// Due probes not run because even a perfect drafter would not pay at that load.
    pub draft_skipped_probes: Counter,
    /// Calls into model-drafter code (context feeds and drafts).
    pub drafter_calls: Counter,
    pub spec_draft_tokens: Counter,
    pub spec_accepted_tokens: Counter,
    /// Verified blocks from prompt lookup beside the model drafter, and their accepted
    /// tokens (also counted in the totals above).
    pub lookup_drafts: Counter,
    pub lookup_accepted_tokens: Counter,
    pub spec_accepted_per_pos: Family<PositionLabel, Counter>,
    /// Verify length chosen per request per step (0 = plain decode for a drafting request).
    pub verify_len: Histogram,
    /// Scheduler's expected committed tokens, summed over steps (compare with committed).
    pub expected_tokens: Counter<f64, AtomicU64>,
    /// Tokens committed by the requests the policy planned (the realised side of tau).
    pub committed_tokens: Counter,
    /// `tau * SPS(B)` of the last scheduled step (expected tokens per second).
    pub theta: Gauge<f64, AtomicU64>,
    /// Measured / table-predicted forward time per step kind (moving averages).
    pub step_cost_ratio: Family<StepKindLabel, Gauge<f64, AtomicU64>>,
    /// The factor drafting plans price a verifying forward by.
    pub verify_cost_factor: Gauge<f64, AtomicU64>,
    pub cost_table_revision: Gauge,
    /// 1 for the source of the table in force, 0 for the others.
    pub cost_table_source: Family<SourceLabel, Gauge>,
    pub cost_table_refusals: Counter,
    /// Live conditional acceptance rate per draft position (decayed; includes drafts the
    /// scheduler did not verify, scored against the committed tokens).
    pub live_acceptance: Family<PositionLabel, Gauge<f64, AtomicU64>>,
    pub calibration_offset: Family<ModePositionLabel, Gauge<f64, AtomicU64>>,
    pub calibration_scale: Family<ModePositionLabel, Gauge<f64, AtomicU64>>,
    pub experiment: ExperimentMetrics,
    /// [`gie::CACHE_CONFIG_INFO`]: set once the KV cache is built ([`Metrics::set_cache_config`]).
    pub cache_config: Family<CacheConfigLabel, Gauge>,
    /// [`gie::LORA_REQUESTS_INFO`].
    pub lora_info: Family<LoraLabel, Gauge>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ]
}

impl Metrics {
    pub fn new(model: &str) -> Self {
        let mut registry = Registry::with_labels(
            [(
                std::borrow::Cow::Borrowed("model_name"),
                std::borrow::Cow::Owned(model.to_string()),
            )]
            .into_iter(),
        );
        let m = Metrics {
            genai: GenAi::new(model),
            ttft: Histogram::new(latency_buckets()),
            itl: Histogram::new(latency_buckets()),
            e2e: Histogram::new(latency_buckets()),
            queue_time: Histogram::new(latency_buckets()),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_blocks: Gauge::default(),
            prefix_evictions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            requests_rejected: Counter::default(),
            batch_tokens: Histogram::new([
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
            ]),
            steps: Counter::default(),
            preemptions: Counter::default(),
            spec_drafts: Counter::default(),
            draft_skips: Counter::default(),
            draft_steps: Counter::default(),
            draft_skipped_probes: Counter::default(),
            drafter_calls: Counter::default(),
            spec_draft_tokens: Counter::default(),
            spec_accepted_tokens: Counter::default(),
            lookup_drafts: Counter::default(),
            lookup_accepted_tokens: Counter::default(),
            spec_accepted_per_pos: Family::default(),
            verify_len: Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0]),
            expected_tokens: Counter::default(),
            committed_tokens: Counter::default(),
            theta: Gauge::default(),
            step_cost_ratio: Family::default(),
            verify_cost_factor: Gauge::default(),
            cost_table_revision: Gauge::default(),
            cost_table_source: Family::default(),
            cost_table_refusals: Counter::default(),
            live_acceptance: Family::default(),
            calibration_offset: Family::default(),
            calibration_scale: Family::default(),
            experiment: ExperimentMetrics {
                active: Family::default(),
                tokens: Family::default(),
                seconds: Family::default(),
                running_seconds: Family::default(),
                windows: Family::default(),
                ttft: Family::new_with_constructor(latency_histogram),
                itl: Family::new_with_constructor(latency_histogram),
            },
            cache_config: Family::default(),
            lora_info: Family::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(fam::TTFT.name, "Time to first token", m.ttft.clone());
        r.register(fam::ITL.name, "Time between output tokens", m.itl.clone());
        r.register(fam::E2E.name, "End-to-end request latency", m.e2e.clone());
        r.register(
            fam::QUEUE_TIME.name,
            "Time spent waiting for admission",
            m.queue_time.clone(),
        );
        r.register(
            fam::RUNNING.name,
            "Requests in the running batch",
            m.running.clone(),
        );
        r.register(
            fam::WAITING.name,
            "Requests waiting for admission",
            m.waiting.clone(),
        );
        r.register(
            fam::KV_USAGE.name,
            "Fraction of KV cache blocks in use",
            m.kv_usage.clone(),
        );
        r.register(
            fam::PREFIX_QUERIES.name,
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        r.register(
            fam::PREFIX_HITS.name,
            "Prompt tokens found in the prefix cache (not prefilled)",
            m.prefix_hits.clone(),
        );
        r.register(
            fam::PREFIX_BLOCKS.name,
            "KV blocks registered in the prefix cache (in use or kept for reuse)",
            m.prefix_blocks.clone(),
        );
        r.register(
            fam::PREFIX_EVICTIONS.name,
            "Cached prefix blocks evicted to make room",
            m.prefix_evictions.clone(),
        );
        r.register(
            fam::PROMPT_TOKENS.name,
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            fam::GENERATION_TOKENS.name,
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            fam::REQUEST_SUCCESS.name,
            "Finished requests by finish reason",
            m.request_success.clone(),
        );
        r.register(
            fam::REQUESTS_REJECTED.name,
            "Requests refused because the admission queue was full",
            m.requests_rejected.clone(),
        );
        r.register(
            fam::BATCH_TOKENS.name,
            "Tokens (B) in each target forward",
            m.batch_tokens.clone(),
        );
        r.register(
            fam::STEPS.name,
            "Engine steps (target forwards)",
            m.steps.clone(),
        );
        r.register(
            fam::PREEMPTIONS.name,
            "Sequences preempted for lack of KV blocks",
            m.preemptions.clone(),
        );
        r.register(
            fam::SPEC_DRAFTS.name,
            "Draft blocks proposed",
            m.spec_drafts.clone(),
        );
        r.register(
            fam::DRAFT_SKIPPED_STEPS.name,
            "Steps where the dspark policy did not run the model drafter (expected not to pay)",
            m.draft_skips.clone(),
        );
        r.register(
            fam::DRAFT_STEPS.name,
            "Steps that ran the model drafter, probes included",
            m.draft_steps.clone(),
        );
        r.register(
            fam::SKIPPED_PROBES.name,
            "Due probes of the drafter not run: even a drafter that is never wrong would not pay at that load",
            m.draft_skipped_probes.clone(),
        );
        r.register(
            fam::DRAFTER_CALLS.name,
            "Calls into model-drafter code (context feeds and drafts); none in a step that drafts nothing",
            m.drafter_calls.clone(),
        );
        r.register(
            fam::SPEC_DRAFT_TOKENS.name,
            "Draft tokens verified",
            m.spec_draft_tokens.clone(),
        );
        r.register(
            fam::SPEC_ACCEPTED_TOKENS.name,
            "Draft tokens accepted",
            m.spec_accepted_tokens.clone(),
        );
        r.register(
            fam::LOOKUP_DRAFTS.name,
            "Verified draft blocks from prompt lookup beside the model drafter",
            m.lookup_drafts.clone(),
        );
        r.register(
            fam::LOOKUP_ACCEPTED_TOKENS.name,
            "Draft tokens accepted from prompt-lookup blocks beside the model drafter",
            m.lookup_accepted_tokens.clone(),
        );
        r.register(
            fam::SPEC_ACCEPTED_PER_POS.name,
            "Draft tokens accepted per position",
            m.spec_accepted_per_pos.clone(),
        );
        r.register(
            fam::VERIFY_LENGTH.name,
            "Draft tokens sent to verification per request per step",
            m.verify_len.clone(),
        );
        r.register(
            fam::EXPECTED_TOKENS.name,
            "Expected committed tokens (tau) of planned steps, from calibrated confidences",
            m.expected_tokens.clone(),
        );
        r.register(
            fam::COMMITTED_TOKENS.name,
            "Tokens actually committed by planned steps (realised tau)",
            m.committed_tokens.clone(),
        );
        r.register(
            fam::THETA.name,
            "tau * SPS(B) of the last scheduled step",
            m.theta.clone(),
        );
        r.register(
            fam::STEP_COST_RATIO.name,
            "Measured / cost-table forward time of decode-only steps, by kind (plain, verify)",
            m.step_cost_ratio.clone(),
        );
        r.register(
            fam::VERIFY_COST_FACTOR.name,
            "Factor the drafting plans price a verifying forward by (verify / plain ratio, 1-2)",
            m.verify_cost_factor.clone(),
        );
        r.register(
            fam::COST_TABLE_REVISION.name,
            "Revision of the SPS(B) cost table in force (0 = built-in default)",
            m.cost_table_revision.clone(),
        );
        r.register(
            fam::COST_TABLE_SOURCE.name,
            "1 for where the cost table in force came from (default, file, admin)",
            m.cost_table_source.clone(),
        );
        r.register(
            fam::COST_TABLE_REFUSALS.name,
            "Cost tables refused (malformed, non-monotone, incompatible)",
            m.cost_table_refusals.clone(),
        );
        r.register(
            fam::LIVE_ACCEPTANCE.name,
            "Live conditional acceptance rate per draft position (decayed)",
            m.live_acceptance.clone(),
        );
        r.register(
            fam::CALIBRATION_OFFSET.name,
            "Online logit offset on the drafter's calibrated confidence per decoding mode and draft position (serve --online-calibration)",
            m.calibration_offset.clone(),
        );
        r.register(
            fam::CALIBRATION_SCALE.name,
            "Online scale on the logit of the drafter's calibrated confidence per decoding mode and draft position (serve --online-calibration)",
            m.calibration_scale.clone(),
        );
        let e = &m.experiment;
        r.register(
            fam::EXPERIMENT_ACTIVE.name,
            "1 for the policy experiment's arm in force (serve --policy-experiment)",
            e.active.clone(),
        );
        r.register(
            fam::EXPERIMENT_TOKENS.name,
            "Tokens committed to requests while each experiment arm was in force",
            e.tokens.clone(),
        );
        r.register(
            fam::EXPERIMENT_SECONDS.name,
            "Wall seconds each experiment arm was in force",
            e.seconds.clone(),
        );
        r.register(
            fam::EXPERIMENT_RUNNING_SECONDS.name,
            "Integral of running requests over time per experiment arm (tokens / this = per-user tok/s; this / seconds = mean load)",
            e.running_seconds.clone(),
        );
        r.register(
            fam::EXPERIMENT_WINDOWS.name,
            "Finished experiment windows per arm",
            e.windows.clone(),
        );
        r.register(
            fam::EXPERIMENT_TTFT.name,
            "Time to first token of tokens emitted under each experiment arm",
            e.ttft.clone(),
        );
        r.register(
            fam::EXPERIMENT_ITL.name,
            "Inter-token latency under each experiment arm",
            e.itl.clone(),
        );
        r.register(
            gie::NUM_REQUESTS_WAITING,
            "Requests waiting for admission (GIE model-server protocol, vLLM spelling)",
            m.waiting.clone(),
        );
        r.register(
            gie::NUM_REQUESTS_RUNNING,
            "Requests in the running batch (GIE model-server protocol, vLLM spelling)",
            m.running.clone(),
        );
        r.register(
            gie::KV_CACHE_USAGE,
            "Fraction (0-1) of KV cache blocks in use (GIE model-server protocol, vLLM spelling)",
            m.kv_usage.clone(),
        );
        r.register(
            gie::GPU_CACHE_USAGE,
            "Fraction (0-1) of KV cache blocks in use (older vLLM spelling)",
            m.kv_usage.clone(),
        );
        r.register(
            gie::CACHE_CONFIG_INFO,
            "KV cache configuration: block size in tokens and number of blocks",
            m.cache_config.clone(),
        );
        r.register(
            gie::LORA_REQUESTS_INFO,
            "LoRA adapters running and waiting (none: this server serves no adapters)",
            m.lora_info.clone(),
        );
        m.lora_info
            .get_or_create(&LoraLabel {
                running_lora_adapters: String::new(),
                waiting_lora_adapters: String::new(),
                max_lora: "0".into(),
            })
            .set(1);
        Metrics { registry, ..m }
    }

    /// Publishes the KV cache's shape ([`gie::CACHE_CONFIG_INFO`]): `block_size` tokens per
    /// block, `blocks` blocks.
    pub fn set_cache_config(&self, block_size: usize, blocks: usize) {
        self.cache_config
            .get_or_create(&CacheConfigLabel {
                block_size: block_size.to_string(),
                num_gpu_blocks: blocks.to_string(),
            })
            .set(1);
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        encode(&mut s, &self.registry).expect("metrics encode into a String");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The registry exposes exactly the contract's engine families, each with its type: a
    /// family added here without the contract (or the reverse) fails, and so would a
    /// dashboard or the operator's parser reading a name the engine does not expose.
    #[test]
    fn the_registry_is_the_contract() {
        let m = Metrics::new("m");
        // Labelled families show up once they have a series.
        let pos = PositionLabel { position: 0 };
        let mode = ModePositionLabel {
            mode: "greedy".into(),
            position: 0,
        };
        let arm = ExperimentMetrics::label("dspark");
        let finish = FinishLabel {
            finished_reason: "stop".into(),
        };
        let source = SourceLabel {
            source: "default".into(),
        };
        let e = &m.experiment;
        drop(m.request_success.get_or_create(&finish));
        drop(m.spec_accepted_per_pos.get_or_create(&pos));
        drop(m.cost_table_source.get_or_create(&source));
        drop(m.live_acceptance.get_or_create(&pos));
        drop(m.step_cost_ratio.get_or_create(&StepKindLabel {
            kind: "plain".into(),
        }));
        drop(m.calibration_offset.get_or_create(&mode));
        drop(m.calibration_scale.get_or_create(&mode));
        drop(e.active.get_or_create(&arm));
        drop(e.tokens.get_or_create(&arm));
        drop(e.seconds.get_or_create(&arm));
        drop(e.running_seconds.get_or_create(&arm));
        drop(e.windows.get_or_create(&arm));
        drop(e.ttft.get_or_create(&arm));
        drop(e.itl.get_or_create(&arm));
        m.set_cache_config(16, 100);
        let text = m.render();
        let exposed: BTreeMap<&str, &str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split_once(' ').expect("# TYPE name kind"))
            .collect();
        let contract: BTreeMap<&str, &str> = fam::ENGINE
            .iter()
            .map(|f| (f.name, f.kind.type_word()))
            .chain(gie::FAMILIES.iter().map(|&f| (f, "gauge")))
            .collect();
        assert_eq!(exposed, contract);
        // The GIE families read the engine's own gauges, and the info gauges carry the
        // labels a picker parses.
        m.waiting.set(3);
        m.kv_usage.set(0.25);
        let text = m.render();
        let value = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .and_then(|l| l.rsplit(' ').next())
                .unwrap_or_else(|| panic!("{name} missing in {text}"))
                .parse::<f64>()
                .unwrap()
        };
        assert_eq!(value(gie::NUM_REQUESTS_WAITING), 3.0);
        assert_eq!(value(gie::KV_CACHE_USAGE), 0.25);
        assert_eq!(value(gie::GPU_CACHE_USAGE), 0.25);
        assert!(
            text.contains(
                r#"vllm:cache_config_info{model_name="m",block_size="16",num_gpu_blocks="100"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"vllm:lora_requests_info{model_name="m",running_lora_adapters="",waiting_lora_adapters="",max_lora="0"} 1"#), "{text}");
    }
}
