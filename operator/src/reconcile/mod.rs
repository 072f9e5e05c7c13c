//! Reconciliation of a DSparkDeployment: per pool, the cost table (and its profiling), the
//! ConfigMap, the engine Deployment, Service and PodDisruptionBudget, the SLO autoscaler's
//! decision, the cost-table push to ready pods; then the status. Everything is written with
//! server-side apply under one field manager; every decision is published as an Event; errors
//! back off exponentially per object.

pub mod costs;
pub mod model;
pub mod pool;
pub mod profiling;
pub mod prune;
pub mod status;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dspark_types::CostTable;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::{info, instrument, warn};

use crate::autoscale::metrics::{PoolObservation, PoolWindow};
use crate::autoscale::policy::{self, Behavior, PolicyInput, PolicyState, PoolInput, SloTargets};
use crate::autoscale::source;
use crate::crd::{
    AutoscalingMode, CostTablePhase, DSparkDeployment, MetricsSource, ScalingDecisionStatus,
    ScalingMode,
};
use crate::http::HttpClient;
use crate::telemetry::Metrics;
use crate::{Error, Result};
use costs::{PodTarget, PushOutcome};
use pool::{ADMIN_PORT, ADMIN_TOKEN_KEY, LABEL_DEPLOYMENT, LABEL_POOL, MANAGER};
use status::{PoolView, StatusInput};

/// Shared by every reconcile.
pub struct Context {
    pub client: kube::Client,
    pub http: HttpClient,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Every DSparkDeployment (the controller's cache): cost tables are owned by all their users.
    pub store: Store<DSparkDeployment>,
    /// Per-deployment memory of the autoscaler (kube-runtime never runs two reconciles of one
    /// object at once).
    runtime: Mutex<BTreeMap<String, Runtime>>,
    failures: Mutex<BTreeMap<String, u32>>,
    started: Instant,
}

impl Context {
    pub fn new(
        client: kube::Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        store: Store<DSparkDeployment>,
    ) -> Self {
        Self {
            client,
            http: HttpClient::new(Duration::from_secs(5)),
            recorder,
            metrics,
            store,
            runtime: Mutex::default(),
            failures: Mutex::default(),
            started: Instant::now(),
        }
    }
}

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
}

/// Error backoff: 5 s doubling per consecutive failure of the same object, at most 5 minutes.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs((5u64 << (failures.clamp(1, 7) - 1)).min(300))
}

/// kube-runtime's error policy: exponential backoff per object.
pub fn error_policy(dsd: Arc<DSparkDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = object_key(&dsd);
    let n = {
        let mut f = ctx.failures.lock().expect("failures lock");
        let n = f.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    };
    Metrics::inc(&ctx.metrics.reconcile_errors);
    let wait = backoff(n);
    warn!(deployment = %key, failures = n, ?wait, "reconcile failed: {error}");
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
    let t0 = Instant::now();
    Metrics::inc(&ctx.metrics.reconciles);
    let key = object_key(&dsd);
    if dsd.meta().deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove everything this owns.
        ctx.runtime.lock().expect("runtime lock").remove(&key);
        ctx.metrics.forget_deployment(&key);
        return Ok(Action::await_change());
    }
    let mut rt = ctx
        .runtime
        .lock()
        .expect("runtime lock")
        .remove(&key)
        .unwrap_or_default();
    let result = reconcile_inner(&dsd, &ctx, &mut rt).await;
    ctx.runtime
        .lock()
        .expect("runtime lock")
        .insert(key.clone(), rt);
    ctx.metrics.reconcile_micros.fetch_add(
        t0.elapsed().as_micros() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
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
                .copied()
                .unwrap_or(0);
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
    let api: Api<DSparkDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = serde_json::json!({
        "apiVersion": DSparkDeployment::api_version(&()),
        "kind": DSparkDeployment::kind(&()),
        "status": new,
    });
    if let Err(e) = api
        .patch_status(
            &dsd.name_any(),
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        warn!("could not record the Stalled condition: {e}");
    }
}

async fn apply<K>(client: &kube::Client, ns: &str, obj: &K) -> Result<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .map_err(|source| Error::Apply {
        kind: K::kind(&()).into(),
        name,
        source,
    })
}

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
    if let Err(e) = ctx.recorder.publish(&ev, &dsd.object_ref(&())).await {
        warn!("could not publish event {reason}: {e}");
    }
}

/// The admin token: read from the Secret, or a new random one in a new Secret.
async fn admin_token(ctx: &Context, dsd: &DSparkDeployment, ns: &str) -> Result<String> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = pool::admin_secret_name(dsd);
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

async fn reconcile_inner(
    dsd: &DSparkDeployment,
    ctx: &Context,
    rt: &mut Runtime,
) -> Result<Action> {
    let ns = dsd
        .namespace()
        .ok_or_else(|| Error::NoNamespace(dsd.name_any()))?;
    let client = &ctx.client;
    let now_wall = k8s_openapi::jiff::Timestamp::now();
    let now = ctx.started.elapsed().as_secs_f64();
    let spec = &dsd.spec;
    let token = admin_token(ctx, dsd, &ns).await?;

    let mut all: Vec<Arc<DSparkDeployment>> = ctx
        .store
        .state()
        .into_iter()
        .filter(|d| d.namespace().as_deref() == Some(ns.as_str()) && d.meta().uid != dsd.meta().uid)
        .collect();
    all.push(Arc::new(dsd.clone()));
    let all_refs: Vec<&DSparkDeployment> = all.iter().map(|d| d.as_ref()).collect();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let replica_sets_api: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let mut views: Vec<PoolView> = Vec::new();
    // Every pool's engine pods, for ModelAvailable (their fetch init containers).
    let mut engine_pods: Vec<Pod> = Vec::new();
    let mut tables: Vec<Option<CostTable>> = Vec::new();
    let mut requeue = Duration::from_secs(spec.autoscaling.period_seconds.max(1) as u64);

    for p in &spec.pools {
        let key = spec.cost_table_key(p);
        let ct =
            costs::ensure_cost_table(client, &ns, &key, costs::owners_of(&key, &all_refs)).await?;
        let (ct_status, progress) = profiling::advance(client, dsd, p, &key, &ct, now_wall).await?;
        match progress {
            profiling::Progress::Nothing => {}
            profiling::Progress::Started(job) => {
                Metrics::inc(&ctx.metrics.profiling_jobs);
                info!(pool = %p.name, %job, "profiling started");
                publish(
                    ctx,
                    dsd,
                    EventType::Normal,
                    "ProfilingStarted",
                    format!(
                        "pool {}: profiling Job {job} measures the cost table {} on node type {}",
                        p.name,
                        ct.name_any(),
                        p.node_type
                    ),
                )
                .await;
            }
            profiling::Progress::Stored { revision, job } => {
                Metrics::inc(&ctx.metrics.cost_tables_stored);
                publish(
                    ctx,
                    dsd,
                    EventType::Normal,
                    "CostTableStored",
                    format!(
                        "pool {}: cost table {} revision {revision} stored from Job {job}",
                        p.name,
                        ct.name_any()
                    ),
                )
                .await;
            }
            profiling::Progress::Failed {
                job,
                why,
                retry_after,
            } => {
                Metrics::inc(&ctx.metrics.profiling_failures);
                publish(ctx, dsd, EventType::Warning, "ProfilingFailed", format!("pool {}: profiling Job {job} failed: {why}; the engines keep their current table; next attempt after {retry_after}", p.name)).await;
            }
        }
        if ct_status.phase == CostTablePhase::Profiling {
            requeue = requeue.min(Duration::from_secs(10));
        }
        let table = ct_status
            .table
            .clone()
            .filter(|_| ct_status.phase == CostTablePhase::Ready);
        let json = table.as_ref().map(CostTable::to_json_pretty);
        apply::<ConfigMap>(
            client,
            &ns,
            &pool::cost_table_config_map(dsd, p, json.as_deref()),
        )
        .await?;

        let current = deployments.get_opt(&pool::pool_object_name(dsd, p)).await?;
        let selector = format!(
            "{LABEL_DEPLOYMENT}={},{LABEL_POOL}={}",
            dsd.name_any(),
            p.name
        );
        let pods = pods_api
            .list(&ListParams::default().labels(&selector))
            .await?;
        // Only pods this deployment owns (pod -> ReplicaSet -> Deployment -> this) get the
        // admin token and are scraped; matching labels are not enough.
        let replica_sets = replica_sets_api
            .list(&ListParams::default().labels(&selector))
            .await?;
        let owned = costs::owned_pods(
            &pods.items,
            &replica_sets.items,
            current.as_ref(),
            dsd.meta().uid.as_deref().unwrap_or_default(),
        );
        engine_pods.extend(owned.iter().cloned());
        views.push(PoolView {
            name: p.name.clone(),
            cost_table: ct.name_any(),
            cost_table_revision: table.as_ref().map(|_| ct_status.revision),
            phase: ct_status.phase,
            message: ct_status.message.clone(),
            current: current.as_ref().and_then(|d| d.spec.replicas),
            replicas: current
                .as_ref()
                .and_then(|d| d.status.as_ref()?.replicas)
                .unwrap_or(0),
            ready: current
                .as_ref()
                .and_then(|d| d.status.as_ref()?.ready_replicas)
                .unwrap_or(0),
            ready_pods: costs::ready_pods(&owned),
            desired: 0,
            min: p.min_replicas,
            updated: current
                .as_ref()
                .and_then(|d| d.status.as_ref()?.updated_replicas)
                .unwrap_or(0),
            observed: current.as_ref().is_some_and(|d| {
                d.status.as_ref().and_then(|s| s.observed_generation) >= d.metadata.generation
            }),
            rollout_stalled: current.as_ref().and_then(|d| {
                d.status
                    .as_ref()?
                    .conditions
                    .iter()
                    .flatten()
                    .find(|c| {
                        c.type_.as_deref() == Some("Progressing")
                            && c.status.as_deref() == Some("False")
                            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
                    })
                    .map(|c| {
                        c.message
                            .clone()
                            .unwrap_or_else(|| "progress deadline exceeded".into())
                    })
            }),
        });
        tables.push(table);
    }

    // Autoscaling.
    let a = &spec.autoscaling;
    let due = rt
        .last_eval
        .is_none_or(|t| now - t >= f64::from(a.period_seconds.max(1)) - 0.5);
    if a.enabled && due {
        let window = f64::from(spec.slo.window_seconds.max(1));
        let max_age = 2.0 * f64::from(a.period_seconds.max(1)) + 5.0;
        for v in &views {
            let obs = match (a.metrics_source, &a.prometheus_url) {
                (MetricsSource::Prometheus, Some(url)) => {
                    let q = source::pool_queries(&ns, &dsd.name_any(), &v.name, window as i64);
                    source::prometheus_observe(&ctx.http, url, &q, max_age).await
                }
                _ => {
                    let w = rt.windows.entry(v.name.clone()).or_default();
                    let failed = source::scrape_pool(&ctx.http, &v.ready_pods, w, now).await;
                    for (pod, e) in failed {
                        warn!(pool = %v.name, %pod, "metrics scrape failed: {e}");
                    }
                    let names: Vec<String> = v.ready_pods.iter().map(|p| p.name.clone()).collect();
                    w.prune(now, window, &names);
                    w.observe(now, window, max_age, &names)
                }
            };
            rt.observations.insert(v.name.clone(), obs);
        }
        rt.windows.retain(|k, _| views.iter().any(|v| &v.name == k));
        rt.last_eval = Some(now);
    }
    let external = spec.scaling_mode() == ScalingMode::External;
    let missing = PoolObservation::missing();
    let inputs: Vec<PoolInput<'_>> = spec
        .pools
        .iter()
        .zip(&views)
        .zip(&tables)
        .map(|((p, v), t)| PoolInput {
            name: &p.name,
            min: p.min_replicas,
            max: p.max_replicas,
            cost: p.cost,
            current: v.current.unwrap_or(p.min_replicas),
            ready: v.ready,
            table: t.as_ref(),
            obs: rt.observations.get(&p.name).unwrap_or(&missing),
        })
        .collect();
    let policy_input = PolicyInput {
        slo: SloTargets {
            ttft_p95: f64::from(spec.slo.ttft_p95_ms) / 1e3,
            itl_p95: f64::from(spec.slo.itl_p95_ms) / 1e3,
        },
        behavior: Behavior {
            up_window: f64::from(a.scale_up_stabilization_seconds),
            down_window: f64::from(a.scale_down_stabilization_seconds),
            max_up: a.max_scale_up_step,
            max_down: a.max_scale_down_step,
            target_utilization: a.target_utilization,
        },
        external_total: external.then(|| {
            let (lo, hi) = spec.pools.iter().fold((0, 0), |(lo, hi), p| {
                (lo + p.min_replicas, hi + p.max_replicas)
            });
            spec.replicas.unwrap_or_else(|| {
                let now: i32 = spec
                    .pools
                    .iter()
                    .zip(&views)
                    .map(|(p, v)| v.current.unwrap_or(p.min_replicas))
                    .sum();
                now.clamp(lo, hi)
            })
        }),
    };
    let decisions = if (a.enabled && due) || external {
        Some(policy::decide(&policy_input, &inputs, &mut rt.policy, now))
    } else {
        None
    };
    drop(inputs);
    let advisory = a.mode == AutoscalingMode::Advisory && !external;
    for (i, (p, v)) in spec.pools.iter().zip(views.iter_mut()).enumerate() {
        let current = v.current.unwrap_or(p.min_replicas);
        let mut desired = current.clamp(p.min_replicas, p.max_replicas);
        if let Some(d) = decisions.as_ref().map(|d| &d[i]) {
            rt.breached.insert(p.name.clone(), d.breached);
            let applied = !advisory || matches!(d.reason, policy::Reason::Bounds { .. });
            // One span per autoscaling evaluation of a pool: its inputs, verdict and reason
            // (a child of the reconcile span; never entered across an await).
            let obs = rt.observations.get(&p.name);
            drop(tracing::info_span!(
                "autoscale",
                otel.name = "autoscale decision",
                pool = %p.name,
                from = d.from,
                to = d.to,
                applied,
                reason = %d.reason,
                reason_code = d.reason.code(),
                breached = ?d.breached,
                ttft_p95_s = obs.and_then(|o| o.ttft_p95),
                itl_p95_s = obs.and_then(|o| o.itl_p95),
                request_rate = obs.map(|o| o.request_rate),
                acceptance_length = obs.and_then(|o| o.acceptance_length),
                slo_ttft_p95_s = policy_input.slo.ttft_p95,
                slo_itl_p95_s = policy_input.slo.itl_p95,
            ));
            if applied {
                desired = d.to;
            }
            // Advice repeated while it is not applied is recorded (and announced) once.
            let repeated = rt.last_decision.as_ref().is_some_and(|l| {
                !applied
                    && !l.applied
                    && l.pool == p.name
                    && (l.from_replicas, l.to_replicas) == (d.from, d.to)
                    && l.reason == d.reason.to_string()
            });
            if d.to != d.from && !repeated {
                if applied {
                    Metrics::inc(&ctx.metrics.scaling_decisions);
                } else {
                    Metrics::inc(&ctx.metrics.advisory_decisions);
                }
                let decision = ScalingDecisionStatus {
                    pool: p.name.clone(),
                    from_replicas: d.from,
                    to_replicas: d.to,
                    reason: d.reason.to_string(),
                    applied,
                    time: profiling::rfc3339(now_wall),
                };
                let verb = match (applied, d.to > d.from) {
                    (false, _) => "ScalingAdvised",
                    (true, true) => "ScaledUp",
                    (true, false) => "ScaledDown",
                };
                info!(pool = %p.name, from = d.from, to = d.to, applied, reason = %d.reason, "scaling decision");
                publish(
                    ctx,
                    dsd,
                    EventType::Normal,
                    verb,
                    format!(
                        "pool {}: {} -> {} replicas ({}): {}",
                        p.name,
                        d.from,
                        d.to,
                        d.reason.code(),
                        d.reason
                    ),
                )
                .await;
                rt.last_decision = Some(decision);
            }
        }
        v.desired = desired;
        let obs = rt.observations.get(&p.name);
        ctx.metrics.set_pool(
            &object_key(dsd),
            &p.name,
            crate::telemetry::PoolGauges {
                desired,
                ready: v.ready,
                ttft_p95: obs.and_then(|o| o.ttft_p95),
                itl_p95: obs.and_then(|o| o.itl_p95),
                acceptance_length: obs.and_then(|o| o.acceptance_length),
                request_rate: obs.map_or(0.0, |o| o.request_rate),
            },
        );
    }

    // Owned objects.
    for ((p, v), table) in spec.pools.iter().zip(&views).zip(&tables) {
        apply(
            client,
            &ns,
            &pool::engine_deployment(dsd, p, v.desired, table.is_some()),
        )
        .await?;
        apply::<Service>(client, &ns, &pool::pool_service(dsd, p)).await?;
        apply::<PodDisruptionBudget>(client, &ns, &pool::pool_pdb(dsd, p)).await?;
    }
    apply::<Service>(client, &ns, &pool::deployment_service(dsd)).await?;

    // What the spec no longer names: objects of removed or renamed pools, cost tables of
    // keys no pool uses any more.
    let pruned = prune::pool_objects(client, &ns, dsd).await?;
    if !pruned.is_empty() {
        info!(objects = ?pruned, "pruned");
        publish(
            ctx,
            dsd,
            EventType::Normal,
            "Pruned",
            format!(
                "deleted what the spec no longer names: {}",
                pruned.join(", ")
            ),
        )
        .await;
    }
    for released in prune::cost_tables(client, &ns, dsd).await? {
        let note = match &released {
            prune::Released::Kept(t) => {
                format!("cost table {t} is no longer used by this deployment; other deployments keep it")
            }
            prune::Released::Deleted(t) => format!(
                "cost table {t} is no longer used by any deployment: deleted with its profiling Jobs"
            ),
        };
        info!("{note}");
        publish(ctx, dsd, EventType::Normal, "CostTableReleased", note).await;
    }
    let pool_names: Vec<&str> = spec.pools.iter().map(|p| p.name.as_str()).collect();
    ctx.metrics.retain_pools(&object_key(dsd), &pool_names);
    rt.observations
        .retain(|k, _| pool_names.contains(&k.as_str()));
    rt.breached.retain(|k, _| pool_names.contains(&k.as_str()));

    // Push stored tables to ready pods that do not hold them yet.
    let alive: Vec<String> = views
        .iter()
        .flat_map(|v| v.ready_pods.iter().map(|p| p.name.clone()))
        .collect();
    rt.pushed.retain(|pod, _| alive.contains(pod));
    for (v, table) in views.iter().zip(&tables) {
        let Some(table) = table else { continue };
        let digest = table.digest();
        let todo: Vec<&PodTarget> = v
            .ready_pods
            .iter()
            .filter(|p| rt.pushed.get(&p.name) != Some(&digest))
            .collect();
        for pod in todo {
            match costs::push_to_pod(&ctx.http, pod, ADMIN_PORT, &token, table, 3).await {
                Ok(outcome) => {
                    rt.pushed.insert(pod.name.clone(), digest.clone());
                    if let PushOutcome::Pushed(r) = outcome {
                        Metrics::inc(&ctx.metrics.pushes);
                        publish(ctx, dsd, EventType::Normal, "CostTablePushed", format!("pool {}: pod {} took cost table {} (engine revision {}, digest {})", v.name, pod.name, v.cost_table, r.revision, r.digest)).await;
                    }
                }
                Err(e) => {
                    Metrics::inc(&ctx.metrics.push_failures);
                    requeue = requeue.min(Duration::from_secs(10));
                    publish(
                        ctx,
                        dsd,
                        EventType::Warning,
                        "CostTablePushFailed",
                        format!(
                            "pool {}: {e}; the pod reads the mounted ConfigMap instead",
                            v.name
                        ),
                    )
                    .await;
                }
            }
        }
    }

    write_replicas(client, &ns, dsd, views.iter().map(|v| v.desired).sum()).await?;

    // Status (only the operator's own conditions: others may add theirs).
    let old = status::own(&dsd.status.clone().unwrap_or_default());
    let new = status::build(&StatusInput {
        dsd,
        pools: &views,
        observations: &rt.observations,
        breached: &rt.breached,
        last_decision: rt
            .last_decision
            .clone()
            .or(old.last_scaling_decision.clone()),
        evaluated: rt.last_eval.is_some(),
        model: model::availability(dsd, &engine_pods.iter().collect::<Vec<_>>()),
        now: &profiling::rfc3339(now_wall),
        old: &old,
    });
    if old != new || dsd.status.is_none() {
        if let Some(c) = status::stalled_condition(&old) {
            publish(
                ctx,
                dsd,
                EventType::Normal,
                "Reconciled",
                format!(
                    "reconcile succeeded; no longer stalled (was {}: {})",
                    c.reason, c.message
                ),
            )
            .await;
        }
        for (t, ok, reason, message) in status::transitions(&old, &new) {
            let type_ = if !ok && t != "Scaling" {
                EventType::Warning
            } else {
                EventType::Normal
            };
            publish(ctx, dsd, type_, &reason, message).await;
        }
        let api: Api<DSparkDeployment> = Api::namespaced(client.clone(), &ns);
        let patch = serde_json::json!({
            "apiVersion": DSparkDeployment::api_version(&()),
            "kind": DSparkDeployment::kind(&()),
            "status": new,
        });
        api.patch_status(
            &dsd.name_any(),
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    }
    Ok(Action::requeue(requeue))
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
}
