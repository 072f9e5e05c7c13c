//! The operator's own Prometheus metrics (served on `/metrics` with `/healthz`), kept out of the
//! reconcile logic: the reconciler only bumps counters.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

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
}

impl Metrics {
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
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
            "dspark_operator_reconciles_total",
            "Reconciles run.",
            g(&self.reconciles),
        );
        counter(
            "dspark_operator_reconcile_errors_total",
            "Reconciles that failed.",
            g(&self.reconcile_errors),
        );
        counter(
            "dspark_operator_scaling_decisions_total",
            "Replica changes applied.",
            g(&self.scaling_decisions),
        );
        counter(
            "dspark_operator_advisory_decisions_total",
            "Replica changes recorded but not applied (advisory mode).",
            g(&self.advisory_decisions),
        );
        counter(
            "dspark_operator_profiling_jobs_total",
            "Profiling Jobs started.",
            g(&self.profiling_jobs),
        );
        counter(
            "dspark_operator_profiling_failures_total",
            "Profiling attempts that failed.",
            g(&self.profiling_failures),
        );
        counter(
            "dspark_operator_cost_tables_stored_total",
            "Cost tables validated and stored.",
            g(&self.cost_tables_stored),
        );
        counter(
            "dspark_operator_cost_table_pushes_total",
            "Cost tables pushed to engine pods.",
            g(&self.pushes),
        );
        counter(
            "dspark_operator_cost_table_push_failures_total",
            "Cost-table pushes that failed.",
            g(&self.push_failures),
        );
        let secs = g(&self.reconcile_micros) as f64 / 1e6;
        let _ = writeln!(
            out,
            "# HELP dspark_operator_reconcile_duration_seconds_sum Time spent reconciling.\n# TYPE dspark_operator_reconcile_duration_seconds_sum counter\ndspark_operator_reconcile_duration_seconds_sum {secs}"
        );
        let leader = u8::from(self.leader.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP dspark_operator_leader Whether this replica holds the leader Lease.\n# TYPE dspark_operator_leader gauge\ndspark_operator_leader {leader}"
        );
        out
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
}
