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
    /// The Hub token of a gated or private `hf://` source (fetch).
    pub const HF_TOKEN: &str = "HF_TOKEN";
    /// `1`: serve `hf://` sources from the cache without asking the Hub (the engine after
    /// its fetch init container resolved them).
    pub const HF_HUB_OFFLINE: &str = "HF_HUB_OFFLINE";
    /// The S3-compatible store's URL of an `s3://` source (non-AWS stores).
    pub const AWS_ENDPOINT_URL: &str = "AWS_ENDPOINT_URL";
    /// The region of an `s3://` source.
    pub const AWS_REGION: &str = "AWS_REGION";
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

pub mod experiment;
pub mod metrics;
pub mod source;

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
