//! The operator's own Prometheus metrics (served on `/metrics` with `/healthz`), kept out of the
//! reconcile logic: the reconciler only bumps counters.

use dspark_types::contract::metrics::operator as om;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::get;
use axum::Router;

/// Counters of what the operator did.
#[derive(Debug, Default)]
pub struct Metrics {
    pub reconciles: AtomicU64,
    pub reconcile_errors: AtomicU64,
    /// Sum of reconcile durations, microseconds.
    pub reconcile_micros: AtomicU64,
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

impl Metrics {
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
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        counter(
            &om::RECONCILES.sample(),
            "Reconciles run.",
            g(&self.reconciles),
        );
        counter(
            &om::RECONCILE_ERRORS.sample(),
            "Reconciles that failed.",
            g(&self.reconcile_errors),
        );
        counter(
            &om::SCALING_DECISIONS.sample(),
            "Replica changes applied.",
            g(&self.scaling_decisions),
        );
        counter(
            &om::ADVISORY_DECISIONS.sample(),
            "Replica changes recorded but not applied (advisory mode).",
            g(&self.advisory_decisions),
        );
        counter(
            &om::PROFILING_JOBS.sample(),
            "Profiling Jobs started.",
            g(&self.profiling_jobs),
        );
        counter(
            &om::PROFILING_FAILURES.sample(),
            "Profiling attempts that failed.",
            g(&self.profiling_failures),
        );
        counter(
            &om::COST_TABLES_STORED.sample(),
            "Cost tables validated and stored.",
            g(&self.cost_tables_stored),
        );
        counter(
            &om::COST_TABLE_PUSHES.sample(),
            "Cost tables pushed to engine pods.",
            g(&self.pushes),
        );
        counter(
            &om::COST_TABLE_PUSH_FAILURES.sample(),
            "Cost-table pushes that failed.",
            g(&self.push_failures),
        );
        let secs = g(&self.reconcile_micros) as f64 / 1e6;
        let _ = writeln!(
            out,
            "# HELP {n} Time spent reconciling (seconds, only ever grows).\n# TYPE {n} {t}\n{n} {secs}",
            n = om::RECONCILE_DURATION_SUM.name,
            t = om::RECONCILE_DURATION_SUM.kind.type_word()
        );
        let pools = self.pool_snapshot();
        type Field = fn(&PoolGauges) -> Option<f64>;
        let gauges: [(&str, &str, Field); 6] = [
            (
                om::POOL_DESIRED_REPLICAS.name,
                "Replicas the operator wants for the pool.",
                |g| Some(f64::from(g.desired)),
            ),
            (
                om::POOL_READY_REPLICAS.name,
                "Ready engine pods of the pool.",
                |g| Some(f64::from(g.ready)),
            ),
            (
                om::POOL_TTFT_P95.name,
                "Measured p95 time to first token of the pool (fresh data only).",
                |g| g.ttft_p95,
            ),
            (
                om::POOL_ITL_P95.name,
                "Measured p95 inter-token latency of the pool (fresh data only).",
                |g| g.itl_p95,
            ),
            (
                om::POOL_ACCEPTANCE_LENGTH.name,
                "Live acceptance length of the pool's engines.",
                |g| g.acceptance_length,
            ),
            (
                om::POOL_REQUEST_RATE.name,
                "Finished requests per second of the pool.",
                |g| Some(g.request_rate),
            ),
        ];
        for (name, help, f) in gauges {
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
        out
    }
}

/// Exports the same counters and pool gauges over OTLP (observable instruments read at each
/// export; no-ops unless `dspark_telemetry::init` switched OTLP on).
pub fn export_otel(m: &Arc<Metrics>) {
    use opentelemetry::KeyValue;
    let meter = dspark_telemetry::meter("dspark-operator");
    type Counter = fn(&Metrics) -> &AtomicU64;
    let counters: [(&'static str, Counter); 9] = [
        ("dspark.operator.reconciles", |m| &m.reconciles),
        ("dspark.operator.reconcile.errors", |m| &m.reconcile_errors),
        ("dspark.operator.scaling.decisions", |m| {
            &m.scaling_decisions
        }),
        ("dspark.operator.scaling.advisory_decisions", |m| {
            &m.advisory_decisions
        }),
        ("dspark.operator.profiling.jobs", |m| &m.profiling_jobs),
        ("dspark.operator.profiling.failures", |m| {
            &m.profiling_failures
        }),
        ("dspark.operator.cost_table.stored", |m| {
            &m.cost_tables_stored
        }),
        ("dspark.operator.cost_table.pushes", |m| &m.pushes),
        ("dspark.operator.cost_table.push_failures", |m| {
            &m.push_failures
        }),
    ];
    for (name, field) in counters {
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
    type Field = fn(&PoolGauges) -> Option<f64>;
    let pool_gauges: [(&'static str, Field); 5] = [
        ("dspark.operator.pool.desired_replicas", |g| {
            Some(f64::from(g.desired))
        }),
        ("dspark.operator.pool.ready_replicas", |g| {
            Some(f64::from(g.ready))
        }),
        ("dspark.operator.pool.ttft_p95", |g| g.ttft_p95),
        ("dspark.operator.pool.itl_p95", |g| g.itl_p95),
        ("dspark.operator.pool.acceptance_length", |g| {
            g.acceptance_length
        }),
    ];
    for (name, f) in pool_gauges {
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
