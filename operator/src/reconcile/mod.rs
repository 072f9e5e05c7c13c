//! Reconciliation of a DSparkDeployment: per pool, the cost table (and its profiling), the
//! ConfigMap, the engine Deployment, Service and PodDisruptionBudget, the SLO autoscaler's
//! decision, the cost-table push to ready pods; then the status. One reconcile runs in
//! phases over one state per pool (`phases.rs`); this file holds the controller's side (its
//! wiring, the error policy and failure reporting, suspension). Imports point downward only:
//! this file -> `phases` -> `writers` / `context` / `backoff` and the builders
//! (`pool`, `profiling`, `costs`, `status`, ...); nothing below imports this file.
//! Everything is written with server-side apply under one field manager; every decision is
//! published as an Event; errors back off exponentially per object.

mod backoff;
pub mod cache;
mod context;
pub mod costs;
pub mod inference_pool;
pub mod model;
pub mod names;
mod phases;
pub mod pool;
pub mod profiling;
pub mod prune;
pub mod status;
mod writers;

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, Controller};
use kube::{Api, Resource, ResourceExt};
use tracing::{instrument, warn};

use crate::crd::{DSparkCostTable, DSparkDeployment};
use crate::telemetry::Metrics;
use crate::{Error, Result};
use names::{LABEL_MANAGED_BY, MANAGER};
use writers::{object_key, publish, write_status};

pub use backoff::{backoff, Backoff};
pub use context::Context;

/// The controller: DSparkDeployments (in `namespace`, or all), reconciled when they
/// change, when an engine Deployment they own changes, when a cost table they use changes
/// (profiled, failed), and when a profiling Job of such a table progresses (Jobs are owned
/// by their table, so they are mapped to the table's users), so a finished profile is
/// stored and pushed at once rather than at the next requeue. The binary and the cluster
/// tests run the same wiring.
pub fn controller(client: &kube::Client, namespace: Option<&str>) -> Controller<DSparkDeployment> {
    fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        match namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let controller = Controller::new(
        api::<DSparkDeployment>(client, namespace),
        watcher::Config::default(),
    );
    let store = controller.store();
    controller
        .owns(
            api::<Deployment>(client, namespace),
            watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGER}")),
        )
        .owns(
            api::<DSparkCostTable>(client, namespace),
            watcher::Config::default(),
        )
        .watches(
            api::<Job>(client, namespace),
            watcher::Config::default().labels(&names::profiling_job_selector()),
            move |job: Job| {
                let all = store.state();
                names::users_of_profiling_job(
                    job.metadata.namespace.as_deref(),
                    job.metadata.labels.as_ref(),
                    all.iter().map(|d| d.as_ref()),
                )
                .into_iter()
                .map(ObjectRef::from_obj)
                .collect::<Vec<_>>()
            },
        )
}

/// Reconciles running at once by default (`--max-concurrent-reconciles`).
pub const DEFAULT_CONCURRENCY: u16 = 4;

/// kube-runtime's error policy: exponential backoff per object.
pub fn error_policy(dsd: Arc<DSparkDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = object_key(&dsd);
    let b = {
        let mut f = ctx.failures.lock().expect("failures lock");
        let b = Backoff::fail(f.get(&key).copied(), Instant::now());
        f.insert(key.clone(), b);
        b
    };
    Metrics::inc(&ctx.metrics.reconcile_errors);
    let wait = backoff(b.level);
    warn!(deployment = %key, failures = b.failures, ?wait, "reconcile failed: {error}");
    Action::requeue(wait)
}

/// Reconciles one DSparkDeployment.
#[instrument(
    name = "reconcile",
    skip_all,
    fields(otel.name = "reconcile", deployment = %object_key(&dsd), error = tracing::field::Empty)
)]
pub async fn reconcile(dsd: Arc<DSparkDeployment>, ctx: Arc<Context>) -> Result<Action> {
    ctx.caches.ready().await.map_err(Error::Cache)?;
    let t0 = Instant::now();
    let key = object_key(&dsd);
    if dsd.meta().deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove everything this owns.
        ctx.runtime.lock().expect("runtime lock").remove(&key);
        ctx.metrics.forget_deployment(&key);
        ctx.metrics.observe_reconcile(t0.elapsed());
        return Ok(Action::await_change());
    }
    if dsd.spec.suspend == Some(true) {
        let result = suspend(&dsd, &ctx).await;
        ctx.metrics.observe_reconcile(t0.elapsed());
        return result.map(|()| Action::await_change());
    }
    let mut rt = ctx
        .runtime
        .lock()
        .expect("runtime lock")
        .remove(&key)
        .unwrap_or_default();
    let result = phases::run(&dsd, &ctx, &mut rt).await;
    ctx.runtime
        .lock()
        .expect("runtime lock")
        .insert(key.clone(), rt);
    ctx.metrics.observe_reconcile(t0.elapsed());
    match &result {
        Ok(_) => {
            ctx.failures.lock().expect("failures lock").remove(&key);
        }
        Err(e) => {
            tracing::Span::current().record("error", tracing::field::display(e));
            let before = ctx
                .failures
                .lock()
                .expect("failures lock")
                .get(&key)
                .map_or(0, |b| b.failures);
            report_failure(&dsd, &ctx, e, before + 1).await;
        }
    }
    result
}

/// Makes a failed reconcile visible: a Warning Event with the error (the apiserver's message
/// for a refused request), and `Stalled=True` in the status when the error needs someone to
/// act (a refusal) or has lasted [`status::STALL_AFTER`] reconciles in a row.
async fn report_failure(dsd: &DSparkDeployment, ctx: &Context, e: &Error, failures: u32) {
    let reason = e.reason();
    let message = e.to_string();
    publish(ctx, dsd, EventType::Warning, reason, message.clone()).await;
    if e.is_transient() && failures < status::STALL_AFTER {
        return;
    }
    let Some(ns) = dsd.namespace() else { return };
    let old = status::own(&dsd.status.clone().unwrap_or_default());
    let now = profiling::rfc3339(k8s_openapi::jiff::Timestamp::now());
    let new = status::stalled(&old, dsd.metadata.generation, reason, &message, &now);
    if new == old {
        return;
    }
    if let Err(e) = write_status(ctx, dsd, &ns, &new).await {
        warn!("could not record the Stalled condition: {e}");
    }
}

/// `spec.suspend: true`: nothing owned is touched; the status says so (once, with an Event).
async fn suspend(dsd: &DSparkDeployment, ctx: &Context) -> Result<()> {
    let ns = dsd
        .namespace()
        .ok_or_else(|| Error::NoNamespace(dsd.name_any()))?;
    let old = status::own(&dsd.status.clone().unwrap_or_default());
    let now = profiling::rfc3339(k8s_openapi::jiff::Timestamp::now());
    let new = status::suspended(&old, dsd.metadata.generation, &now);
    if new == old {
        return Ok(());
    }
    if status::transitions(&old, &new)
        .iter()
        .any(|(t, ..)| t == status::SUSPENDED)
    {
        publish(
            ctx,
            dsd,
            EventType::Normal,
            status::SUSPENDED,
            "spec.suspend is true: reconciling stops until it is set back to false".into(),
        )
        .await;
    }
    write_status(ctx, dsd, &ns, &new).await?;
    Ok(())
}
