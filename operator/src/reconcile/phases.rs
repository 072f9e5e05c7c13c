//! One reconcile of a DSparkDeployment, in phases over one state per pool:
//!
//! 1. [`tables`]: per pool, the cost table (created if missing), its profiling Job advanced,
//!    the ConfigMap the engines mount;
//! 2. [`observe`]: the pool's Deployment and the engine pods it owns;
//! 3. [`decide`]: the SLO autoscaler's replica counts (metrics measured when due);
//! 4. [`act`]: the owned objects applied, what the spec no longer names pruned;
//! 5. [`push`]: stored cost tables pushed to ready pods that do not hold them;
//! 6. [`report`]: the `/scale` replicas and the status, with an Event per transition.
//!
//! Each phase reads what the earlier ones put in [`PoolState`]; only [`Pass`] and the
//! per-deployment [`Runtime`] cross phases.

use std::time::Duration;

use dspark_types::CostTable;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use super::cache;
use super::context::{Context, Runtime};
use super::costs::{self, PushOutcome};
use super::inference_pool;
use super::names::pool_object_name;
use super::pool::{self, ADMIN_PORT};
use super::status::{self, PoolView, StatusInput};
use super::writers::{admin_token, apply, object_key, publish, write_replicas, write_status};
use super::{model, profiling, prune};
use crate::autoscale::metrics::PoolObservation;
use crate::autoscale::policy::{self, Behavior, PolicyInput, PoolInput, SloTargets};
use crate::autoscale::source;
use crate::crd::{
    AutoscalingMode, CostTablePhase, DSparkCostTable, DSparkDeployment, MetricsSource, NodePool,
    ScalingDecisionStatus, ScalingMode,
};
use crate::http::PodTarget;
use crate::telemetry::Metrics;
use crate::{Error, Result};

/// What every phase of one reconcile shares.
pub(super) struct Pass<'a> {
    pub dsd: &'a DSparkDeployment,
    pub ctx: &'a Context,
    pub ns: String,
    /// Wall time of this reconcile (status and Event timestamps).
    pub now_wall: k8s_openapi::jiff::Timestamp,
    /// Seconds since the operator started (the autoscaler's clock).
    pub now: f64,
    /// When to reconcile again; phases only shorten it.
    pub requeue: Duration,
}

/// One pool through a reconcile: its spec, the cost table in force (a Ready table only),
/// and the view the autoscaler, the pushes and the status read.
pub(super) struct PoolState<'a> {
    pub spec: &'a NodePool,
    pub table: Option<CostTable>,
    pub view: PoolView,
}

/// How long a remembered admin token is used before its Secret is read again.
const ADMIN_TOKEN_REREAD: Duration = Duration::from_secs(300);

/// The whole reconcile of `dsd`.
pub(super) async fn run(dsd: &DSparkDeployment, ctx: &Context, rt: &mut Runtime) -> Result<Action> {
    let ns = dsd
        .namespace()
        .ok_or_else(|| Error::NoNamespace(dsd.name_any()))?;
    // The remote sources' revisions before anything is keyed by them: what the status holds,
    // else what this operator resolved last time (a CRD older than this operator cannot
    // store it), else what the engine pods' fetches report (a new leader, after such a CRD):
    // keys and pod templates never fall back to "unresolved" while pods serve a revision.
    let with_resolved;
    let dsd = if dsd.unresolved_sources().is_empty() {
        dsd
    } else {
        let mut known = rt.resolved.clone();
        if known.is_empty() {
            let pods: Vec<Pod> = dsd
                .spec
                .pools
                .iter()
                .flat_map(|p| owned_engine_pods(&ctx.caches, &ns, dsd, p).1)
                .collect();
            known = model::resolutions(dsd, &pods.iter().collect::<Vec<_>>());
        }
        with_resolved = model::with_resolutions(dsd, &known);
        &with_resolved
    };
    let mut pass = Pass {
        dsd,
        ctx,
        ns,
        now_wall: k8s_openapi::jiff::Timestamp::now(),
        now: ctx.started.elapsed().as_secs_f64(),
        requeue: Duration::from_secs(dsd.spec.autoscaling.period_seconds.max(1) as u64),
    };
    // The token is remembered, re-read from its Secret every few minutes (a rotated token
    // reaches the pushes that soon) rather than fetched by every reconcile.
    let token = match &rt.admin_token {
        Some((t, read)) if read.elapsed() < ADMIN_TOKEN_REREAD => t.clone(),
        _ => {
            let t = admin_token(ctx, dsd, &pass.ns).await?;
            rt.admin_token = Some((t.clone(), std::time::Instant::now()));
            t
        }
    };
    // Cost tables are owned by every deployment of the namespace that uses their key.
    let others: Vec<_> = ctx
        .store
        .state()
        .into_iter()
        .filter(|d| {
            d.namespace().as_deref() == Some(pass.ns.as_str()) && d.meta().uid != dsd.meta().uid
        })
        .collect();
    let mut users: Vec<&DSparkDeployment> = others.iter().map(|d| d.as_ref()).collect();
    users.push(dsd);
    let mut pools = Vec::with_capacity(dsd.spec.pools.len());
    // Every pool's engine pods, for ModelAvailable (their fetch init containers).
    let mut engine_pods: Vec<Pod> = Vec::new();
    for p in &dsd.spec.pools {
        let (table, view) = tables(&mut pass, &users, p).await?;
        let mut state = PoolState {
            spec: p,
            table,
            view,
        };
        engine_pods.extend(observe(&pass, &mut state).await?);
        pools.push(state);
    }
    decide(&pass, rt, &mut pools).await;
    act(&pass, rt, &pools).await?;
    push(&mut pass, rt, &pools, &token).await;
    report(&pass, rt, pools, &engine_pods).await?;
    Ok(Action::requeue(pass.requeue))
}

/// Phase 1: the pool's cost table exists (owned by every one of `users` with its key), its
/// profiling Job is advanced (Events for what happened), and the ConfigMap the engines mount
/// holds the table when it is Ready. Returns that table and the view's cost-table part.
async fn tables(
    pass: &mut Pass<'_>,
    users: &[&DSparkDeployment],
    p: &NodePool,
) -> Result<(Option<CostTable>, PoolView)> {
    let (dsd, ctx, ns) = (pass.dsd, pass.ctx, pass.ns.as_str());
    let client = &ctx.client;
    let Some(key) = dsd.cost_table_key(p) else {
        // A remote source's revision is known once a first fetch reports it: no table is
        // measured (or shared) for weights nobody has resolved yet; the engines start on
        // their default table meanwhile.
        apply::<ConfigMap>(ctx, ns, &pool::cost_table_config_map(dsd, p, None)).await?;
        pass.requeue = pass.requeue.min(Duration::from_secs(10));
        let waiting = dsd.unresolved_sources().join(", ");
        return Ok((
            None,
            PoolView {
                phase: CostTablePhase::Pending,
                message: Some(format!(
                    "waiting for the first fetch of {waiting} to resolve its revision (the cost table is keyed by it)"
                )),
                ..PoolView::new(p)
            },
        ));
    };
    let ct = costs::ensure_cost_table(ctx, ns, &key, costs::owners_of(&key, users)).await?;
    let (ct_status, progress) = profiling::advance(
        client,
        &ctx.caches.profiling_jobs,
        dsd,
        p,
        &key,
        &ct,
        pass.now_wall,
    )
    .await?;
    if Some(&ct_status) != ct.status.as_ref() {
        // The status was just written: the cached table is behind until its watch event.
        ctx.caches.forget::<DSparkCostTable>(ns, &ct.name_any());
    }
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
        pass.requeue = pass.requeue.min(Duration::from_secs(10));
    }
    let table = ct_status
        .table
        .clone()
        .filter(|_| ct_status.phase == CostTablePhase::Ready);
    let json = table.as_ref().map(CostTable::to_json_pretty);
    apply::<ConfigMap>(
        ctx,
        ns,
        &pool::cost_table_config_map(dsd, p, json.as_deref()),
    )
    .await?;
    let view = PoolView {
        cost_table: ct.name_any(),
        cost_table_revision: table.as_ref().map(|_| ct_status.revision),
        phase: ct_status.phase,
        message: ct_status.message.clone(),
        ..PoolView::new(p)
    };
    Ok((table, view))
}

/// The pool's engine Deployment (from the cache) and the pods it owns.
fn owned_engine_pods(
    caches: &super::cache::Caches,
    ns: &str,
    dsd: &DSparkDeployment,
    p: &NodePool,
) -> (Option<std::sync::Arc<Deployment>>, Vec<Pod>) {
    let current = caches.get::<Deployment>(ns, &pool_object_name(dsd, p));
    let selector = super::names::pool_selector(dsd, p);
    let pods: Vec<Pod> = cache::selected(&caches.pods, ns, &selector);
    let replica_sets: Vec<ReplicaSet> = cache::selected(&caches.replica_sets, ns, &selector);
    let owned = costs::owned_pods(
        &pods,
        &replica_sets,
        current.as_deref(),
        dsd.meta().uid.as_deref().unwrap_or_default(),
    );
    (current, owned)
}

/// Phase 2: the pool's Deployment (replicas, rollout) and the engine pods it owns (pod ->
/// ReplicaSet -> Deployment -> this deployment; matching labels are not enough to get the
/// admin token or be scraped). Returns those pods.
async fn observe(pass: &Pass<'_>, state: &mut PoolState<'_>) -> Result<Vec<Pod>> {
    let (dsd, caches, ns) = (pass.dsd, &pass.ctx.caches, pass.ns.as_str());
    let p = state.spec;
    let (current, owned) = owned_engine_pods(caches, ns, dsd, p);
    let v = &mut state.view;
    let status = current.as_ref().and_then(|d| d.status.as_ref());
    v.current = current.as_ref().and_then(|d| d.spec.replicas);
    v.replicas = status.and_then(|s| s.replicas).unwrap_or(0);
    v.ready = status.and_then(|s| s.ready_replicas).unwrap_or(0);
    v.ready_pods = costs::ready_pods(&owned);
    v.updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
    v.observed = current.as_ref().is_some_and(|d| {
        d.status.as_ref().and_then(|s| s.observed_generation) >= d.metadata.generation
    });
    v.rollout_stalled = status.and_then(|s| {
        s.conditions
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
    });
    Ok(owned)
}

/// Phase 3: every pool's replica count. When an autoscaling period is due, each pool's
/// metrics are measured (Prometheus or a scrape of its ready pods); the policy decides
/// (every reconcile under external scaling); decisions are applied unless advisory, and
/// announced once (Event, span, counters); the pool gauges are set.
async fn decide(pass: &Pass<'_>, rt: &mut Runtime, pools: &mut [PoolState<'_>]) {
    let (dsd, ctx, now) = (pass.dsd, pass.ctx, pass.now);
    let spec = &dsd.spec;
    let a = &spec.autoscaling;
    let due = rt
        .last_eval
        .is_none_or(|t| now - t >= f64::from(a.period_seconds.max(1)) - 0.5);
    if a.enabled && due {
        let window = f64::from(spec.slo.window_seconds.max(1));
        let max_age = 2.0 * f64::from(a.period_seconds.max(1)) + 5.0;
        for v in pools.iter().map(|s| &s.view) {
            let obs = match (a.metrics_source, &a.prometheus_url) {
                (MetricsSource::Prometheus, Some(url)) => {
                    let q = source::pool_queries(&pass.ns, &dsd.name_any(), &v.name, window as i64);
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
        rt.windows
            .retain(|k, _| pools.iter().any(|s| &s.view.name == k));
        rt.last_eval = Some(now);
    }
    let external = spec.scaling_mode() == ScalingMode::External;
    let missing = PoolObservation::missing();
    let inputs: Vec<PoolInput<'_>> = pools
        .iter()
        .map(|s| PoolInput {
            name: &s.spec.name,
            min: s.spec.min_replicas,
            max: s.spec.max_replicas,
            cost: s.spec.cost,
            current: s.view.current.unwrap_or(s.spec.min_replicas),
            ready: s.view.ready,
            table: s.table.as_ref(),
            obs: rt.observations.get(&s.spec.name).unwrap_or(&missing),
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
                let now: i32 = pools
                    .iter()
                    .map(|s| s.view.current.unwrap_or(s.spec.min_replicas))
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
    for (i, state) in pools.iter_mut().enumerate() {
        let p = state.spec;
        let v = &mut state.view;
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
                    time: profiling::rfc3339(pass.now_wall),
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
}

/// Phase 4: every pool's Deployment, Service and PodDisruptionBudget and the deployment's
/// Service applied; objects of removed or renamed pools and cost tables of keys no pool
/// uses any more pruned; the runtime forgets pools that are gone.
async fn act(pass: &Pass<'_>, rt: &mut Runtime, pools: &[PoolState<'_>]) -> Result<()> {
    let (dsd, ctx, ns) = (pass.dsd, pass.ctx, pass.ns.as_str());
    // The owned objects are independent: applied at once, a first reconcile (every one a
    // create) takes one round trip instead of one per object. The first refusal is the
    // reconcile's error; the others' applies are repeated by the next reconcile.
    let per_pool = pools.iter().map(|s| async move {
        let deployment = pool::engine_deployment(dsd, s.spec, s.view.desired, s.table.is_some());
        let (service, pdb) = (pool::pool_service(dsd, s.spec), pool::pool_pdb(dsd, s.spec));
        futures::try_join!(
            apply(ctx, ns, &deployment),
            apply::<Service>(ctx, ns, &service),
            apply::<PodDisruptionBudget>(ctx, ns, &pdb),
        )
        .map(|_| ())
    });
    let service = pool::deployment_service(dsd);
    futures::try_join!(
        futures::future::try_join_all(per_pool),
        apply::<Service>(ctx, ns, &service),
    )?;

    // A new generation may leave objects behind: list them fresh until one reconcile of it
    // has pruned everything; at rest the caches are enough.
    let fresh = rt.pruned_generation != dsd.metadata.generation;
    inference_pool::phase(pass.ctx, pass.ns.as_str(), pass.dsd, rt, fresh).await?;
    let pruned = prune::pool_objects(ctx, ns, dsd, fresh).await?;
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
    let (released, complete) = prune::cost_tables(ctx, ns, dsd, fresh).await?;
    if complete {
        rt.pruned_generation = dsd.metadata.generation;
    }
    for released in released {
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
    let pool_names: Vec<&str> = dsd.spec.pools.iter().map(|p| p.name.as_str()).collect();
    ctx.metrics.retain_pools(&object_key(dsd), &pool_names);
    rt.observations
        .retain(|k, _| pool_names.contains(&k.as_str()));
    rt.breached.retain(|k, _| pool_names.contains(&k.as_str()));
    Ok(())
}

/// Phase 5: each pool's stored table pushed to its ready pods that do not hold it yet (by
/// digest); a failed push is announced and retried soon (the pod reads the mounted
/// ConfigMap meanwhile).
async fn push(pass: &mut Pass<'_>, rt: &mut Runtime, pools: &[PoolState<'_>], token: &str) {
    let (dsd, ctx) = (pass.dsd, pass.ctx);
    let alive: Vec<String> = pools
        .iter()
        .flat_map(|s| s.view.ready_pods.iter().map(|p| p.name.clone()))
        .collect();
    rt.pushed.retain(|pod, _| alive.contains(pod));
    for s in pools {
        let (v, Some(table)) = (&s.view, &s.table) else {
            continue;
        };
        let digest = table.digest();
        let todo: Vec<&PodTarget> = v
            .ready_pods
            .iter()
            .filter(|p| rt.pushed.get(&p.name) != Some(&digest))
            .collect();
        for pod in todo {
            match costs::push_to_pod(&ctx.http, pod, ADMIN_PORT, token, table, 3).await {
                Ok(outcome) => {
                    rt.pushed.insert(pod.name.clone(), digest.clone());
                    if let PushOutcome::Pushed(r) = outcome {
                        Metrics::inc(&ctx.metrics.pushes);
                        publish(ctx, dsd, EventType::Normal, "CostTablePushed", format!("pool {}: pod {} took cost table {} (engine revision {}, digest {})", v.name, pod.name, v.cost_table, r.revision, r.digest)).await;
                    }
                }
                Err(e) => {
                    Metrics::inc(&ctx.metrics.push_failures);
                    pass.requeue = pass.requeue.min(Duration::from_secs(10));
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
}

/// Phase 6: the total replicas behind `/scale`, then the status (only the operator's own
/// conditions: others may add theirs), patched when it changed, with an Event per
/// condition transition.
async fn report(
    pass: &Pass<'_>,
    rt: &mut Runtime,
    pools: Vec<PoolState<'_>>,
    engine_pods: &[Pod],
) -> Result<()> {
    let (dsd, ctx, ns) = (pass.dsd, pass.ctx, pass.ns.as_str());
    let client = &ctx.client;
    let views: Vec<PoolView> = pools.into_iter().map(|s| s.view).collect();
    write_replicas(client, ns, dsd, views.iter().map(|v| v.desired).sum()).await?;

    rt.resolved = model::resolutions(dsd, &engine_pods.iter().collect::<Vec<_>>());
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
        resolved: rt.resolved.clone(),
        inference_pool: rt.inference_pool.clone(),
        now: &profiling::rfc3339(pass.now_wall),
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
        write_status(ctx, dsd, ns, &new).await?;
    }
    Ok(())
}
