//! The operator's own Prometheus metrics (served on `/metrics` with `/healthz`), kept out of the
//! reconcile logic: the reconciler only bumps counters.

use dspark_types::contract::metrics::operator as om;
use dspark_types::contract::metrics::Family as ContractFamily;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds of the reconcile-duration buckets, seconds.
pub const RECONCILE_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The Kubernetes API verb of a request the operator sent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    /// `get` (a read or a list), `watch`, `create`, `patch`, `update`, `delete`, `other`.
    pub verb: &'static str,
}

/// Counters of what the operator did.
#[derive(Debug)]
pub struct Metrics {
    /// Reconciles finished, successfully or not (counted at the end, as controller-runtime's
    /// `controller_runtime_reconcile_total`: one that has started and not ended is not here).
    pub reconciles: AtomicU64,
    pub reconcile_errors: AtomicU64,
    /// Sum of reconcile durations, microseconds (the OTLP counter reads it).
    pub reconcile_micros: AtomicU64,
    /// Reconcile durations, seconds.
    pub reconcile_duration: Histogram,
    /// Requests sent to the Kubernetes API server, by verb (writes at rest show here).
    pub kube_requests: Family<VerbLabel, Counter>,
    pub scaling_decisions: AtomicU64,
    pub advisory_decisions: AtomicU64,
    pub profiling_jobs: AtomicU64,
    pub profiling_failures: AtomicU64,
    pub cost_tables_stored: AtomicU64,
    pub pushes: AtomicU64,
    pub push_failures: AtomicU64,
    pub leader: AtomicBool,
    /// Per (deployment `ns/name`, pool): what the last reconcile saw and decided.
    pub pools: Mutex<BTreeMap<(String, String), PoolGauges>>,
}

/// One pool's replicas and SLO measurements, as of the last reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolGauges {
    pub desired: i32,
    pub ready: i32,
    /// Measured p95s, seconds (None: no fresh data).
    pub ttft_p95: Option<f64>,
    pub itl_p95: Option<f64>,
    /// Live acceptance length (committed tokens per verify step).
    pub acceptance_length: Option<f64>,
    pub request_rate: f64,
}

/// A counter of [`Metrics`]: its Prometheus family and help text, its OTLP instrument, and
/// the field that counts.
type CounterDef = (
    ContractFamily,
    &'static str,
    &'static str,
    fn(&Metrics) -> &AtomicU64,
);

/// The plain counters of [`Metrics`], in exposition order.
const COUNTERS: [CounterDef; 9] = [
    (
        om::RECONCILES,
        "Reconciles finished (successfully or not).",
        "dspark.operator.reconciles",
        |m| &m.reconciles,
    ),
    (
        om::RECONCILE_ERRORS,
        "Reconciles that failed.",
        "dspark.operator.reconcile.errors",
        |m| &m.reconcile_errors,
    ),
    (
        om::SCALING_DECISIONS,
        "Replica changes applied.",
        "dspark.operator.scaling.decisions",
        |m| &m.scaling_decisions,
    ),
    (
        om::ADVISORY_DECISIONS,
        "Replica changes recorded but not applied (advisory mode).",
        "dspark.operator.scaling.advisory_decisions",
        |m| &m.advisory_decisions,
    ),
    (
        om::PROFILING_JOBS,
        "Profiling Jobs started.",
        "dspark.operator.profiling.jobs",
        |m| &m.profiling_jobs,
    ),
    (
        om::PROFILING_FAILURES,
        "Profiling attempts that failed.",
        "dspark.operator.profiling.failures",
        |m| &m.profiling_failures,
    ),
    (
        om::COST_TABLES_STORED,
        "Cost tables validated and stored.",
        "dspark.operator.cost_table.stored",
        |m| &m.cost_tables_stored,
    ),
    (
        om::COST_TABLE_PUSHES,
        "Cost tables pushed to engine pods.",
        "dspark.operator.cost_table.pushes",
        |m| &m.pushes,
    ),
    (
        om::COST_TABLE_PUSH_FAILURES,
        "Cost-table pushes that failed.",
        "dspark.operator.cost_table.push_failures",
        |m| &m.push_failures,
    ),
];

/// A gauge of each pool: its Prometheus family and help text, its OTLP instrument (if it is
/// exported over OTLP), and its value (`None`: no sample).
type PoolGaugeDef = (
    ContractFamily,
    &'static str,
    Option<&'static str>,
    fn(&PoolGauges) -> Option<f64>,
);

/// The gauges of [`PoolGauges`], in exposition order.
const POOL_GAUGES: [PoolGaugeDef; 6] = [
    (
        om::POOL_DESIRED_REPLICAS,
        "Replicas the operator wants for the pool.",
        Some("dspark.operator.pool.desired_replicas"),
        |g| Some(f64::from(g.desired)),
    ),
    (
        om::POOL_READY_REPLICAS,
        "Ready engine pods of the pool.",
        Some("dspark.operator.pool.ready_replicas"),
        |g| Some(f64::from(g.ready)),
    ),
    (
        om::POOL_TTFT_P95,
        "Measured p95 time to first token of the pool (fresh data only).",
        Some("dspark.operator.pool.ttft_p95"),
        |g| g.ttft_p95,
    ),
    (
        om::POOL_ITL_P95,
        "Measured p95 inter-token latency of the pool (fresh data only).",
        Some("dspark.operator.pool.itl_p95"),
        |g| g.itl_p95,
    ),
    (
        om::POOL_ACCEPTANCE_LENGTH,
        "Live acceptance length of the pool's engines.",
        Some("dspark.operator.pool.acceptance_length"),
        |g| g.acceptance_length,
    ),
    (
        om::POOL_REQUEST_RATE,
        "Finished requests per second of the pool.",
        None,
        |g| Some(g.request_rate),
    ),
];

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: AtomicU64::default(),
            reconcile_errors: AtomicU64::default(),
            reconcile_micros: AtomicU64::default(),
            reconcile_duration: Histogram::new(RECONCILE_BUCKETS),
            kube_requests: Family::default(),
            scaling_decisions: AtomicU64::default(),
            advisory_decisions: AtomicU64::default(),
            profiling_jobs: AtomicU64::default(),
            profiling_failures: AtomicU64::default(),
            cost_tables_stored: AtomicU64::default(),
            pushes: AtomicU64::default(),
            push_failures: AtomicU64::default(),
            leader: AtomicBool::default(),
            pools: Mutex::default(),
        }
    }
}

/// The API verb of a request: its method, and for a GET whether it watches.
pub fn kube_verb(method: &hyper::Method, query: Option<&str>) -> &'static str {
    let watches = || {
        query
            .unwrap_or_default()
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1")
    };
    match *method {
        hyper::Method::GET if watches() => "watch",
        hyper::Method::GET => "get",
        hyper::Method::POST => "create",
        hyper::Method::PATCH => "patch",
        hyper::Method::PUT => "update",
        hyper::Method::DELETE => "delete",
        _ => "other",
    }
}

impl Metrics {
    /// Records one finished reconcile that took `elapsed`.
    pub fn observe_reconcile(&self, elapsed: std::time::Duration) {
        Self::inc(&self.reconciles);
        self.reconcile_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        self.reconcile_duration.observe(elapsed.as_secs_f64());
    }

    /// Counts one request to the API server.
    pub fn count_request(&self, method: &hyper::Method, query: Option<&str>) {
        self.kube_requests
            .get_or_create(&VerbLabel {
                verb: kube_verb(method, query),
            })
            .inc();
    }

    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a pool's state after a reconcile.
    pub fn set_pool(&self, deployment: &str, pool: &str, g: PoolGauges) {
        self.pools
            .lock()
            .expect("pool gauges lock")
            .insert((deployment.to_string(), pool.to_string()), g);
    }

    /// Forgets the pools of `deployment` not in `pools` (removed or renamed).
    pub fn retain_pools(&self, deployment: &str, pools: &[&str]) {
        self.pools
            .lock()
            .expect("pool gauges lock")
            .retain(|(d, p), _| d != deployment || pools.contains(&p.as_str()));
    }

    /// Forgets every pool of a deleted deployment.
    pub fn forget_deployment(&self, deployment: &str) {
        self.pools
            .lock()
            .expect("pool gauges lock")
            .retain(|(d, _), _| d != deployment);
    }

    fn pool_snapshot(&self) -> Vec<((String, String), PoolGauges)> {
        self.pools
            .lock()
            .expect("pool gauges lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (family, help, _, field) in COUNTERS {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}",
                name = family.sample(),
                v = field(self).load(Ordering::Relaxed)
            );
        }
        let pools = self.pool_snapshot();
        for (family, help, _, f) in POOL_GAUGES {
            let name = family.name;
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for ((d, p), g) in &pools {
                if let Some(v) = f(g) {
                    let _ = writeln!(out, "{name}{{deployment=\"{d}\",pool=\"{p}\"}} {v}");
                }
            }
        }
        let leader = u8::from(self.leader.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP {n} Whether this replica holds the leader Lease.\n# TYPE {n} gauge\n{n} {leader}",
            n = om::LEADER.name
        );
        // The histogram and the labelled counter, in the library's exposition (it ends the
        // text with `# EOF`, so it comes last).
        let mut registry = Registry::default();
        registry.register(
            om::RECONCILE_DURATION.name,
            "Duration of one reconcile of a DSparkDeployment.",
            self.reconcile_duration.clone(),
        );
        registry.register(
            om::KUBE_REQUESTS.name,
            "Requests sent to the Kubernetes API server, by verb.",
            self.kube_requests.clone(),
        );
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// Exports the same counters and pool gauges over OTLP (observable instruments read at each
/// export; no-ops unless `dspark_telemetry::init` switched OTLP on).
pub fn export_otel(m: &Arc<Metrics>) {
    use opentelemetry::KeyValue;
    let meter = dspark_telemetry::meter("dspark-operator");
    for (_, _, name, field) in COUNTERS {
        let m = m.clone();
        let _ = meter
            .u64_observable_counter(name)
            .with_callback(move |o| o.observe(field(&m).load(Ordering::Relaxed), &[]))
            .build();
    }
    let mm = m.clone();
    let _ = meter
        .f64_observable_counter("dspark.operator.reconcile.duration")
        .with_unit("s")
        .with_description("Time spent reconciling")
        .with_callback(move |o| {
            o.observe(
                mm.reconcile_micros.load(Ordering::Relaxed) as f64 / 1e6,
                &[],
            )
        })
        .build();
    for (_, _, name, f) in POOL_GAUGES {
        let Some(name) = name else {
            continue;
        };
        let m = m.clone();
        let _ = meter
            .f64_observable_gauge(name)
            .with_callback(move |o| {
                for ((d, p), g) in m.pool_snapshot() {
                    if let Some(v) = f(&g) {
                        o.observe(
                            v,
                            &[KeyValue::new("deployment", d), KeyValue::new("pool", p)],
                        );
                    }
                }
            })
            .build();
    }
}

/// A Kubernetes client for `config` whose every request is counted in
/// `metrics.kube_requests` (a layer over kube's default stack).
pub fn counted_client(config: kube::Config, metrics: Arc<Metrics>) -> kube::Result<kube::Client> {
    let count =
        tower::util::MapRequestLayer::new(move |req: hyper::Request<kube::client::Body>| {
            metrics.count_request(req.method(), req.uri().query());
            req
        });
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&count)
        .build())
}

/// `/metrics` and `/healthz`.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.render() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .with_state(metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_leader() {
        let m = Metrics::default();
        Metrics::inc(&m.reconciles);
        m.leader.store(true, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("dspark_operator_reconciles_total 1\n"));
        assert!(text.contains("dspark_operator_leader 1\n"));
    }

    #[test]
    fn renders_the_reconcile_histogram_and_requests_by_verb() {
        let m = Metrics::default();
        m.observe_reconcile(std::time::Duration::from_millis(30));
        m.observe_reconcile(std::time::Duration::from_millis(700));
        assert_eq!(m.reconciles.load(Ordering::Relaxed), 2);
        let get = hyper::Method::GET;
        m.count_request(
            &get,
            Some("labelSelector=a%3Db&watch=true&timeoutSeconds=290"),
        );
        m.count_request(&get, Some("labelSelector=a"));
        m.count_request(&get, None);
        m.count_request(&hyper::Method::PATCH, Some("fieldManager=x&force=true"));
        let text = m.render();
        for line in [
            "dspark_operator_reconcile_duration_seconds_count 2\n",
            "dspark_operator_reconcile_duration_seconds_bucket{le=\"0.025\"} 0\n",
            "dspark_operator_reconcile_duration_seconds_bucket{le=\"0.05\"} 1\n",
            "dspark_operator_reconcile_duration_seconds_bucket{le=\"1.0\"} 2\n",
            "dspark_operator_kube_requests_total{verb=\"watch\"} 1\n",
            "dspark_operator_kube_requests_total{verb=\"get\"} 2\n",
            "dspark_operator_kube_requests_total{verb=\"patch\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // Every family in the text is one the contract names.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let series = line.split(['{', ' ']).next().unwrap();
            assert!(
                om::ALL.iter().any(|f| f.owns(series)),
                "{series} is not in the contract"
            );
        }
    }

    #[test]
    fn renders_pool_gauges_and_forgets_deleted_deployments() {
        let m = Metrics::default();
        m.set_pool(
            "ns/a",
            "h100",
            PoolGauges {
                desired: 3,
                ready: 2,
                ttft_p95: Some(0.25),
                itl_p95: None,
                acceptance_length: Some(2.5),
                request_rate: 1.5,
            },
        );
        let text = m.render();
        assert!(text.contains(
            "dspark_operator_pool_desired_replicas{deployment=\"ns/a\",pool=\"h100\"} 3\n"
        ));
        assert!(text.contains(
            "dspark_operator_pool_ttft_p95_seconds{deployment=\"ns/a\",pool=\"h100\"} 0.25\n"
        ));
        assert!(!text.contains("dspark_operator_pool_itl_p95_seconds{"));
        m.forget_deployment("ns/a");
        assert!(!m.render().contains("deployment=\"ns/a\""));
    }
}
