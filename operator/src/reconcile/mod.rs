//! Reconciliation of a DSparkDeployment: per pool, the cost table (and its profiling), the
//! ConfigMap, the engine Deployment, Service and PodDisruptionBudget, the SLO autoscaler's
//! decision, the cost-table push to ready pods; then the status. One reconcile runs in
//! phases over one state per pool (`phases.rs`); this file holds the controller's side
//! (context, per-deployment memory, error backoff and reporting) and the shared writers.
//! Everything is written with server-side apply under one field manager; every decision is
//! published as an Event; errors back off exponentially per object.

pub mod cache;
pub mod costs;
pub mod inference_pool;
pub mod model;
pub mod names;
mod phases;
pub mod pool;
pub mod profiling;
pub mod prune;
pub mod status;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{watcher, Controller};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use tracing::{instrument, warn};

use crate::autoscale::metrics::{PoolObservation, PoolWindow};
use crate::autoscale::policy::PolicyState;
use crate::crd::{DSparkCostTable, DSparkDeployment, ScalingDecisionStatus, ScalingMode};
use crate::http::HttpClient;
use crate::telemetry::Metrics;
use crate::{Error, Result};
use cache::Cached;
use names::{LABEL_MANAGED_BY, MANAGER};
use pool::ADMIN_TOKEN_KEY;

/// Shared by every reconcile.
pub struct Context {
    pub client: kube::Client,
    pub http: HttpClient,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Every DSparkDeployment (the controller's cache): cost tables are owned by all their users.
    pub store: Store<DSparkDeployment>,
    /// What the reconciles read (watch-backed) and the memory of what they applied.
    pub caches: cache::Caches,
    /// Per-deployment memory of the autoscaler (kube-runtime never runs two reconciles of one
    /// object at once).
    runtime: Mutex<BTreeMap<String, Runtime>>,
    failures: Mutex<BTreeMap<String, Backoff>>,
    started: Instant,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        store: Store<DSparkDeployment>,
        caches: cache::Caches,
    ) -> Self {
        Self {
            client,
            http: HttpClient::new(Duration::from_secs(5)),
            recorder,
            metrics,
            store,
            caches,
            runtime: Mutex::default(),
            failures: Mutex::default(),
            started: Instant::now(),
        }
    }
}

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

/// What the autoscaler remembers about one deployment between reconciles.
#[derive(Default)]
struct Runtime {
    policy: PolicyState,
    windows: BTreeMap<String, PoolWindow>,
    observations: BTreeMap<String, PoolObservation>,
    breached: BTreeMap<String, Option<bool>>,
    last_eval: Option<f64>,
    last_decision: Option<ScalingDecisionStatus>,
    /// Digest each pod is known to hold.
    pushed: BTreeMap<String, String>,
    /// The generation whose pruning completed (listed fresh from the API server).
    pruned_generation: Option<i64>,
    /// The admin token and when it was read from its Secret.
    admin_token: Option<(String, Instant)>,
    /// The remote sources' resolved revisions as the last reconcile saw them: in force even
    /// where the status cannot hold them (a CRD older than this operator).
    resolved: Vec<crate::crd::ResolvedSource>,
    /// The InferencePool the last reconcile applied (`spec.inferencePool`).
    inference_pool: Option<String>,
    /// The generation a missing InferencePool CRD was announced for.
    inference_pool_warned: Option<i64>,
}

/// Error backoff: 5 s doubling per back-off level, at most 5 minutes.
pub fn backoff(level: u32) -> Duration {
    Duration::from_secs((5u64 << (level.clamp(1, 7) - 1)).min(300))
}

/// One object's consecutive failures and its back-off level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Consecutive failed reconciles.
    pub failures: u32,
    /// The back-off level (`backoff(level)` is the wait).
    pub level: u32,
    /// When the last failure was recorded.
    pub at: Instant,
}

impl Backoff {
    /// The state after one more failure at `now`. The level rises only for a failure that
    /// comes once most of the previous wait has passed (the retry it asked for): the watch
    /// events an object's own status writes cause re-run a failing reconcile many times
    /// within one wait, and counting each of those would push the next retry to the 5-minute
    /// cap within a second, long after the cause (a webhook, a quota) may be gone.
    pub fn fail(prev: Option<Backoff>, now: Instant) -> Backoff {
        match prev {
            None => Backoff {
                failures: 1,
                level: 1,
                at: now,
            },
            Some(b) => {
                let retried = now.saturating_duration_since(b.at) >= backoff(b.level) / 2;
                Backoff {
                    failures: b.failures.saturating_add(1),
                    level: if retried { b.level + 1 } else { b.level },
                    at: now,
                }
            }
        }
    }
}

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

fn object_key(dsd: &DSparkDeployment) -> String {
    format!("{}/{}", dsd.namespace().unwrap_or_default(), dsd.name_any())
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
    Metrics::inc(&ctx.metrics.reconciles);
    let key = object_key(&dsd);
    if dsd.meta().deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove everything this owns.
        ctx.runtime.lock().expect("runtime lock").remove(&key);
        ctx.metrics.forget_deployment(&key);
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

/// Writes the operator's part of the status (server-side apply of `status`: it owns only
/// the fields and conditions it sets, other writers keep theirs).
async fn write_status(
    ctx: &Context,
    dsd: &DSparkDeployment,
    ns: &str,
    status: &crate::crd::DSparkDeploymentStatus,
) -> std::result::Result<(), kube::Error> {
    let api: Api<DSparkDeployment> = Api::namespaced(ctx.client.clone(), ns);
    let mut patch = serde_json::json!({
        "apiVersion": DSparkDeployment::api_version(&()),
        "kind": DSparkDeployment::kind(&()),
        "status": status,
    });
    // A CRD older than this operator (installed by an older chart, not yet re-applied) lacks
    // the newest status fields, and the API server refuses the whole patch for one of them:
    // write the status without those, once each, rather than stop reporting at all.
    loop {
        match api
            .patch_status(
                &dsd.name_any(),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Err(kube::Error::Api(e)) => match undeclared_status_field(&e.message) {
                Some(field) if patch["status"].get(field).is_some() => {
                    static WARNED: std::sync::Mutex<Vec<String>> =
                        std::sync::Mutex::new(Vec::new());
                    let mut warned = WARNED.lock().expect("warned lock");
                    if !warned.iter().any(|f| f == field) {
                        warned.push(field.to_string());
                        warn!(
                            field,
                            "the installed CRD has no status.{field} (older than this \
                             operator): writing statuses without it; apply crds/ to store it"
                        );
                    }
                    patch["status"]
                        .as_object_mut()
                        .expect("status is an object")
                        .remove(field);
                }
                _ => return Err(kube::Error::Api(e)),
            },
            other => return other.map(|_| ()),
        }
    }
}

/// The top-level status field an API server's "field not declared in schema" refusal names
/// (`.status.NAME: field not declared in schema`).
fn undeclared_status_field(message: &str) -> Option<&str> {
    let (before, _) = message.split_once(": field not declared in schema")?;
    let path = &before[before.rfind(".status.")? + ".status.".len()..];
    let field = path.split(['.', '[']).next()?;
    (!field.is_empty()).then_some(field)
}

/// Applies `obj` with server-side apply, unless it is what this process applied last time
/// and nobody wrote it since (see `cache.rs`); returns the object as stored.
async fn apply<K: Cached>(ctx: &Context, ns: &str, obj: &K) -> Result<Arc<K>> {
    let name = obj.meta().name.clone().unwrap_or_default();
    apply_body(ctx, ns, &name, obj).await
}

/// [`apply`] of a partial object (`body`: the fields the operator owns) named `name`.
async fn apply_body<K: Cached>(
    ctx: &Context,
    ns: &str,
    name: &str,
    body: &(impl Serialize + std::fmt::Debug),
) -> Result<Arc<K>> {
    if let Some(cached) = ctx.caches.unchanged::<K>(ns, name, body) {
        return Ok(cached);
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let stored = api
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(body),
        )
        .await
        .map_err(|source| Error::Apply {
            kind: K::kind(&()).into(),
            name: name.to_string(),
            source,
        })?;
    ctx.caches.remember(ns, name, body, &stored);
    Ok(Arc::new(stored))
}

/// Records an Event on the deployment in the background, as client-go's recorder does: an
/// Event is a report, not part of converging, so a slow API server delays it, not the
/// reconcile (the first reconcile of a deployment records about ten).
async fn publish(
    ctx: &Context,
    dsd: &DSparkDeployment,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: reason.into(),
        secondary: None,
    };
    let (recorder, reference) = (ctx.recorder.clone(), dsd.object_ref(&()));
    tokio::spawn(async move {
        if let Err(e) = recorder.publish(&ev, &reference).await {
            warn!("could not publish event {}: {e}", ev.reason);
        }
    });
}

/// The admin token: read from the Secret, or a new random one in a new Secret.
async fn admin_token(ctx: &Context, dsd: &DSparkDeployment, ns: &str) -> Result<String> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = names::admin_secret_name(dsd);
    if let Some(s) = api.get_opt(&name).await? {
        if let Some(t) = s.data.as_ref().and_then(|d| d.get(ADMIN_TOKEN_KEY)) {
            return Ok(String::from_utf8_lossy(&t.0).into_owned());
        }
    }
    let token = random_token()?;
    match api
        .create(&PostParams::default(), &pool::admin_secret(dsd, &token))
        .await
    {
        Ok(_) => Ok(token),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let s = api.get(&name).await?;
            Ok(s.data
                .and_then(|d| {
                    d.get(ADMIN_TOKEN_KEY)
                        .map(|t| String::from_utf8_lossy(&t.0).into_owned())
                })
                .unwrap_or_default())
        }
        Err(e) => Err(e.into()),
    }
}

/// Keeps `/scale` answering: writes down the scaling mode while `spec.scaling.mode` is unset
/// (`External` when `spec.replicas` is set, else `SLO`: what such manifests did before the
/// field), and `spec.replicas` when the operator owns it (`SLO`: the autoscaler's `total`) or
/// it is missing (`External`: the current `total`). A merge patch conditional on the
/// resource version read, so it never overwrites a concurrent write (that one reconciles).
async fn write_replicas(
    client: &kube::Client,
    ns: &str,
    dsd: &DSparkDeployment,
    total: i32,
) -> Result<()> {
    let mode = dsd.spec.scaling_mode();
    let mut spec = serde_json::Map::new();
    if dsd.spec.scaling.as_ref().and_then(|s| s.mode).is_none() {
        spec.insert("scaling".into(), serde_json::json!({ "mode": mode }));
    }
    let replicas = match mode {
        ScalingMode::Slo => Some(total),
        ScalingMode::External => dsd.spec.replicas.or(Some(total)),
    };
    if replicas != dsd.spec.replicas {
        spec.insert("replicas".into(), serde_json::json!(replicas));
    }
    if spec.is_empty() {
        return Ok(());
    }
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": dsd.resource_version() },
        "spec": spec,
    });
    let api: Api<DSparkDeployment> = Api::namespaced(client.clone(), ns);
    api.patch(
        &dsd.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(|source| Error::Apply {
        kind: DSparkDeployment::kind(&()).into(),
        name: dsd.name_any(),
        source,
    })?;
    Ok(())
}

fn random_token() -> Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(Error::Token)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(1), Duration::from_secs(5));
        assert_eq!(backoff(2), Duration::from_secs(10));
        assert_eq!(backoff(4), Duration::from_secs(40));
        assert_eq!(backoff(6), Duration::from_secs(160));
        assert_eq!(backoff(30), Duration::from_secs(300));
        assert!(backoff(u32::MAX) <= Duration::from_secs(300));
    }

    /// Failures re-run by watch events within one wait keep the level; a failure of the
    /// retry the wait asked for raises it; every failure counts as consecutive.
    #[test]
    fn only_retries_after_the_wait_raise_the_backoff() {
        let t0 = Instant::now();
        let mut b = Backoff::fail(None, t0);
        assert_eq!((b.failures, b.level), (1, 1));
        for i in 1..=8 {
            b = Backoff::fail(Some(b), t0 + Duration::from_millis(30 * i));
        }
        assert_eq!((b.failures, b.level), (9, 1));
        assert_eq!(backoff(b.level), Duration::from_secs(5));
        let after_wait = b.at + backoff(b.level);
        b = Backoff::fail(Some(b), after_wait);
        assert_eq!((b.failures, b.level), (10, 2));
        b = Backoff::fail(Some(b), after_wait + Duration::from_secs(1));
        assert_eq!(b.level, 2);
        b = Backoff::fail(Some(b), after_wait + Duration::from_secs(12));
        assert_eq!(b.level, 3);
    }

    /// The API server's refusal of a status field an older CRD lacks (its message as the
    /// e2e's previous-chart phase got it) names the field to leave out.
    #[test]
    fn an_undeclared_status_field_is_named() {
        let m = "failed to create typed patch object (/; serving.dspark.dev/v1alpha1, Kind=DSparkDeployment): .status.resolvedSources: field not declared in schema";
        assert_eq!(undeclared_status_field(m), Some("resolvedSources"));
        let nested = "failed to create typed patch object (x): .status.pools[name=\"a\"].newField: field not declared in schema";
        assert_eq!(undeclared_status_field(nested), Some("pools"));
        assert_eq!(
            undeclared_status_field(".spec.x: field not declared in schema"),
            None
        );
        assert_eq!(undeclared_status_field("conflict"), None);
    }
}
