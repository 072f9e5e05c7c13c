//! The DSparkDeployment status, computed purely from what a reconcile saw. Deterministic: a
//! condition's `lastTransitionTime` moves only when its status does, measured values are
//! rounded, so an unchanged world writes nothing (no hot loop from the operator's own writes).

use std::collections::BTreeMap;

use super::names::selector_string;
use crate::autoscale::metrics::{Freshness, PoolObservation};
use crate::autoscale::policy::round_sig;
use crate::crd::{
    AutoscalingMode, CostTablePhase, DSparkDeployment, DSparkDeploymentStatus, PoolStatus,
    ScalingDecisionStatus, ScalingMode,
};
use crate::http::PodTarget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// One pool as a reconcile saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolView {
    pub name: String,
    pub cost_table: String,
    /// Revision of the table in the pool's ConfigMap.
    pub cost_table_revision: Option<i64>,
    pub phase: CostTablePhase,
    /// Why profiling failed, if it did.
    pub message: Option<String>,
    /// `spec.replicas` of the pool's Deployment (`None`: not created yet).
    pub current: Option<i32>,
    /// `status.replicas` of the pool's Deployment.
    pub replicas: i32,
    pub ready: i32,
    pub ready_pods: Vec<PodTarget>,
    /// Replicas this reconcile asks for.
    pub desired: i32,
    /// The pool's `minReplicas`: fewer ready than this (or than `desired`, if lower) is not
    /// available.
    pub min: i32,
    /// `status.updatedReplicas` of the pool's Deployment (pods of its current template).
    pub updated: i32,
    /// The Deployment controller has seen the Deployment's current generation.
    pub observed: bool,
    /// The Deployment's `Progressing=False` message when it exceeded its progress deadline.
    pub rollout_stalled: Option<String>,
}

impl PoolView {
    /// `pool` before anything is observed: no table, no replicas.
    pub fn new(pool: &crate::crd::NodePool) -> Self {
        Self {
            name: pool.name.clone(),
            cost_table: String::new(),
            cost_table_revision: None,
            phase: CostTablePhase::Pending,
            message: None,
            current: None,
            replicas: 0,
            ready: 0,
            ready_pods: Vec::new(),
            desired: 0,
            min: pool.min_replicas,
            updated: 0,
            observed: false,
            rollout_stalled: None,
        }
    }
}

/// Everything the status is computed from.
pub struct StatusInput<'a> {
    pub dsd: &'a DSparkDeployment,
    pub pools: &'a [PoolView],
    pub observations: &'a BTreeMap<String, PoolObservation>,
    pub breached: &'a BTreeMap<String, Option<bool>>,
    pub last_decision: Option<ScalingDecisionStatus>,
    /// Whether the autoscaler has looked at metrics yet.
    pub evaluated: bool,
    /// Whether the pods have their weights (the fetch init containers).
    pub model: super::model::ModelAvailability,
    /// The remote sources' resolved revisions (see [`super::model::resolutions`]).
    pub resolved: Vec<crate::crd::ResolvedSource>,
    /// The InferencePool kept for `spec.inferencePool` (see [`super::inference_pool`]).
    pub inference_pool: Option<String>,
    /// RFC 3339 time of this reconcile (used only for conditions that change).
    pub now: &'a str,
    pub old: &'a DSparkDeploymentStatus,
}

fn ms(x: Option<f64>) -> Option<f64> {
    x.map(|v| round_sig(v * 1e3, 3))
}

/// The condition types the operator writes; `status.conditions` is a map by type, so other
/// controllers may add their own next to them.
pub const OWN_CONDITIONS: [&str; 9] = [
    "Ready",
    "ModelAvailable",
    "Available",
    "Progressing",
    "Profiled",
    "Scaling",
    "MetricsAvailable",
    "Stalled",
    "Suspended",
];

/// `status` with only the operator's own conditions: what it compares and writes (with
/// server-side apply it then owns only those, and leaves the others to their writers).
pub fn own(status: &DSparkDeploymentStatus) -> DSparkDeploymentStatus {
    let mut s = status.clone();
    s.conditions
        .retain(|c| OWN_CONDITIONS.contains(&c.type_.as_str()));
    s
}

/// The status to write.
pub fn build(i: &StatusInput<'_>) -> DSparkDeploymentStatus {
    let pools: Vec<PoolStatus> = i
        .pools
        .iter()
        .map(|v| {
            let obs = i.observations.get(&v.name);
            PoolStatus {
                name: v.name.clone(),
                desired_replicas: v.desired,
                ready_replicas: v.ready,
                cost_table: (!v.cost_table.is_empty()).then(|| v.cost_table.clone()),
                cost_table_revision: v.cost_table_revision,
                ttft_p95_ms: ms(obs.and_then(|o| o.ttft_p95)),
                itl_p95_ms: ms(obs.and_then(|o| o.itl_p95)),
                acceptance_length: obs
                    .and_then(|o| o.acceptance_length)
                    .map(|t| round_sig(t, 3)),
            }
        })
        .collect();
    let breached: Vec<Option<bool>> = i
        .pools
        .iter()
        .map(|v| i.breached.get(&v.name).copied().flatten())
        .collect();
    let slo = if breached.contains(&Some(true)) {
        "Breached"
    } else if !breached.is_empty() && breached.iter().all(|b| *b == Some(false)) {
        "Met"
    } else {
        "Unknown"
    };
    let mut conditions = vec![
        ready_condition(i.pools),
        available_condition(i.pools),
        progressing_condition(i.pools),
        profiled_condition(i),
        scaling_condition(i),
        metrics_condition(i),
        condition(
            "ModelAvailable",
            i.model.ok,
            &i.model.reason,
            i.model.message.clone(),
        ),
    ];
    for c in &mut conditions {
        c.observed_generation = i.dsd.metadata.generation;
        let previous = i.old.conditions.iter().find(|o| o.type_ == c.type_);
        c.last_transition_time = match previous {
            Some(o) if o.status == c.status => o.last_transition_time.clone(),
            _ => Time(i.now.parse().expect("reconcile time is RFC 3339")),
        };
    }
    DSparkDeploymentStatus {
        observed_generation: i.dsd.metadata.generation,
        conditions,
        replicas: i.pools.iter().map(|v| v.replicas).sum(),
        ready_replicas: i.pools.iter().map(|v| v.ready).sum(),
        desired_replicas: i.pools.iter().map(|v| v.desired).sum(),
        selector: Some(selector_string(i.dsd)),
        slo_status: Some(slo.into()),
        pools,
        last_scaling_decision: i.last_decision.clone(),
        resolved_sources: i.resolved.clone(),
        inference_pool: i.inference_pool.clone(),
    }
}

fn condition(type_: &str, ok: Option<bool>, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.into(),
        status: match ok {
            Some(true) => "True",
            Some(false) => "False",
            None => "Unknown",
        }
        .into(),
        reason: reason.into(),
        message,
        last_transition_time: Time(Default::default()),
        observed_generation: None,
    }
}

/// Pools with fewer ready replicas than they need to count as serving: their minimum (or
/// what they are asked for, if that is lower).
fn below_minimum(pools: &[PoolView]) -> Vec<String> {
    pools
        .iter()
        .filter(|v| v.ready < v.min.min(v.desired))
        .map(|v| {
            format!(
                "{}: {}/{} ready (minimum {})",
                v.name,
                v.ready,
                v.desired,
                v.min.min(v.desired)
            )
        })
        .collect()
}

fn stalled_rollouts(pools: &[PoolView]) -> Vec<String> {
    pools
        .iter()
        .filter_map(|v| {
            let m = v.rollout_stalled.as_ref()?;
            Some(format!("pool {}: {m}", v.name))
        })
        .collect()
}

/// `Available`: every pool has its minimum of ready replicas and at least one serves. A
/// scale-up above the minimum keeps it True.
fn available_condition(pools: &[PoolView]) -> Condition {
    let ready: i32 = pools.iter().map(|v| v.ready).sum();
    let desired: i32 = pools.iter().map(|v| v.desired).sum();
    let below = below_minimum(pools);
    if ready == 0 {
        condition(
            "Available",
            Some(false),
            "NoReplicas",
            "no engine replica is ready".into(),
        )
    } else if !below.is_empty() {
        condition(
            "Available",
            Some(false),
            "MinimumReplicasUnavailable",
            below.join("; "),
        )
    } else {
        condition(
            "Available",
            Some(true),
            "MinimumReplicasAvailable",
            format!("{ready}/{desired} engine replicas ready"),
        )
    }
}

/// `Progressing`, as the pools' Deployments report it: False (`RolloutStalled`) when one
/// exceeded its progress deadline; True while one rolls out or scales (`RollingOut`) or once
/// every pool runs its desired replicas of the current template (`RolloutComplete`).
fn progressing_condition(pools: &[PoolView]) -> Condition {
    let stalled = stalled_rollouts(pools);
    if !stalled.is_empty() {
        return condition(
            "Progressing",
            Some(false),
            "RolloutStalled",
            stalled.join("; "),
        );
    }
    let moving: Vec<String> = pools
        .iter()
        .filter(|v| {
            v.current.is_none()
                || !v.observed
                || v.updated < v.desired
                || v.replicas != v.desired
                || v.ready < v.desired
        })
        .map(|v| {
            format!(
                "{}: {}/{} updated, {}/{} ready",
                v.name, v.updated, v.desired, v.ready, v.desired
            )
        })
        .collect();
    if moving.is_empty() {
        condition(
            "Progressing",
            Some(true),
            "RolloutComplete",
            "every pool runs its desired replicas of the current template".into(),
        )
    } else {
        condition("Progressing", Some(true), "RollingOut", moving.join("; "))
    }
}

/// `Ready`: available and no rollout stalled. Pods still starting above each pool's minimum
/// (a normal scale-up) do not make it False.
fn ready_condition(pools: &[PoolView]) -> Condition {
    let stalled = stalled_rollouts(pools);
    let below = below_minimum(pools);
    let ready: i32 = pools.iter().map(|v| v.ready).sum();
    let desired: i32 = pools.iter().map(|v| v.desired).sum();
    if !stalled.is_empty() {
        condition("Ready", Some(false), "RolloutStalled", stalled.join("; "))
    } else if ready == 0 {
        condition(
            "Ready",
            Some(false),
            "NoReplicas",
            "no engine replica is running".into(),
        )
    } else if !below.is_empty() {
        condition("Ready", Some(false), "ReplicasNotReady", below.join("; "))
    } else if ready < desired {
        condition(
            "Ready",
            Some(true),
            "MinimumReplicasReady",
            format!("{ready}/{desired} engine replicas ready; the others are starting"),
        )
    } else {
        condition(
            "Ready",
            Some(true),
            "AllReplicasReady",
            format!("{ready} engine replicas ready"),
        )
    }
}

fn profiled_condition(i: &StatusInput<'_>) -> Condition {
    let pools = i.pools;
    let failed: Vec<String> = pools
        .iter()
        .filter(|v| v.phase == CostTablePhase::Failed)
        .map(|v| {
            format!(
                "{}: {}",
                v.name,
                v.message.as_deref().unwrap_or("profiling failed")
            )
        })
        .collect();
    let profiling: Vec<&str> = pools
        .iter()
        .filter(|v| v.phase == CostTablePhase::Profiling)
        .map(|v| v.name.as_str())
        .collect();
    if pools.iter().all(|v| v.cost_table_revision.is_some()) {
        let tables: Vec<String> = pools
            .iter()
            .map(|v| {
                format!(
                    "{}: {} r{}",
                    v.name,
                    v.cost_table,
                    v.cost_table_revision.unwrap_or(0)
                )
            })
            .collect();
        return condition(
            "Profiled",
            Some(true),
            "CostTablesStored",
            tables.join("; "),
        );
    }
    // Some pool has no table yet: why.
    let (reason, message) = if !failed.is_empty() {
        (
            "ProfilingFailed",
            format!("{}; engines keep their default table", failed.join("; ")),
        )
    } else if !profiling.is_empty() {
        (
            "Profiling",
            format!("profiling Jobs running for pools {}", profiling.join(", ")),
        )
    } else if !i.dsd.spec.profiling.enabled {
        (
            "ProfilingDisabled",
            "profiling is disabled; engines use their default table".into(),
        )
    } else if !i.dsd.unresolved_sources().is_empty() {
        (
            "WaitingForRevision",
            format!(
                "waiting for the first fetch of {} to resolve its revision (cost tables are keyed by it); engines use their default table",
                i.dsd.unresolved_sources().join(", ")
            ),
        )
    } else {
        ("Pending", "waiting to profile".into())
    };
    condition("Profiled", Some(false), reason, message)
}

fn scaling_condition(i: &StatusInput<'_>) -> Condition {
    let a = &i.dsd.spec.autoscaling;
    let moving: Vec<String> = i
        .pools
        .iter()
        .filter(|v| v.current.is_some() && v.replicas != v.desired)
        .map(|v| format!("{}: {} -> {}", v.name, v.replicas, v.desired))
        .collect();
    if !moving.is_empty() {
        let up = i.pools.iter().any(|v| v.desired > v.replicas);
        let reason = if up { "ScalingUp" } else { "ScalingDown" };
        return condition("Scaling", Some(true), reason, moving.join("; "));
    }
    if i.dsd.spec.scaling_mode() == ScalingMode::External {
        return condition(
            "Scaling",
            Some(false),
            "ExternalReplicas",
            "scaling mode External: spec.replicas sets the total (scale subresource)".into(),
        );
    }
    if !a.enabled {
        return condition(
            "Scaling",
            Some(false),
            "AutoscalingDisabled",
            "autoscaling is disabled".into(),
        );
    }
    if a.mode == AutoscalingMode::Advisory {
        let last = i
            .last_decision
            .as_ref()
            .map(|d| {
                format!(
                    "; last advice: pool {} {} -> {}: {}",
                    d.pool, d.from_replicas, d.to_replicas, d.reason
                )
            })
            .unwrap_or_default();
        return condition(
            "Scaling",
            Some(false),
            "Advisory",
            format!("advisory mode: decisions are recorded, not applied{last}"),
        );
    }
    condition(
        "Scaling",
        Some(false),
        "Steady",
        "every pool has the replicas it needs".into(),
    )
}

fn metrics_condition(i: &StatusInput<'_>) -> Condition {
    if !i.dsd.spec.autoscaling.enabled {
        return condition(
            "MetricsAvailable",
            None,
            "AutoscalingDisabled",
            "metrics are not read while autoscaling is disabled".into(),
        );
    }
    if !i.evaluated {
        return condition(
            "MetricsAvailable",
            None,
            "NotEvaluated",
            "metrics not read yet".into(),
        );
    }
    let with = |f: Freshness| -> Vec<&str> {
        i.pools
            .iter()
            .filter(|v| i.observations.get(&v.name).map(|o| o.freshness) == Some(f))
            .map(|v| v.name.as_str())
            .collect()
    };
    let missing = with(Freshness::Missing);
    let stale = with(Freshness::Stale);
    if !missing.is_empty() {
        condition(
            "MetricsAvailable",
            Some(false),
            "Missing",
            format!(
                "no metrics for pools {}; not scaling down",
                missing.join(", ")
            ),
        )
    } else if !stale.is_empty() {
        condition(
            "MetricsAvailable",
            Some(false),
            "Stale",
            format!(
                "stale metrics for pools {}; not scaling down",
                stale.join(", ")
            ),
        )
    } else {
        condition(
            "MetricsAvailable",
            Some(true),
            "Fresh",
            "metrics of every pool are fresh".into(),
        )
    }
}

/// kstatus' "abnormal-true" condition: True while reconciles fail (reason and message say
/// why); absent once one succeeds ([`build`] never carries it).
pub const STALLED: &str = "Stalled";

/// Consecutive failures after which even a transient error stalls the deployment.
pub const STALL_AFTER: u32 = 3;

/// `reason: Suspended` while `spec.suspend` is true; absent once it is not ([`build`] never
/// carries it).
pub const SUSPENDED: &str = "Suspended";

/// The status after a failed reconcile: `old` with `Stalled=True` (`reason`, `message`) for
/// `generation`, everything else as it was. `status.observedGeneration` moves to
/// `generation` too: the operator has seen this generation and is stuck on it, which is
/// what kstatus needs to read the deployment as failed rather than still in progress. The
/// transition time stays while the deployment stays stalled.
pub fn stalled(
    old: &DSparkDeploymentStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
    now: &str,
) -> DSparkDeploymentStatus {
    with_true(old, generation, STALLED, reason, message, now)
}

/// The status of a suspended deployment: `old` with `Suspended=True`, everything else (the
/// last pools, replicas and conditions seen) as it was.
pub fn suspended(
    old: &DSparkDeploymentStatus,
    generation: Option<i64>,
    now: &str,
) -> DSparkDeploymentStatus {
    with_true(
        old,
        generation,
        SUSPENDED,
        SUSPENDED,
        "spec.suspend is true: the operator leaves the objects it owns as they are (no apply, \
         prune, scaling or cost-table push) until it is set back to false",
        now,
    )
}

/// `old` with condition `type_` True for `generation` (see [`stalled`]).
fn with_true(
    old: &DSparkDeploymentStatus,
    generation: Option<i64>,
    type_: &str,
    reason: &str,
    message: &str,
    now: &str,
) -> DSparkDeploymentStatus {
    let mut s = old.clone();
    s.observed_generation = generation;
    let mut c = condition(
        type_,
        Some(true),
        reason,
        message.chars().take(4096).collect(),
    );
    c.observed_generation = generation;
    c.last_transition_time = match old.conditions.iter().find(|o| o.type_ == type_) {
        Some(o) if o.status == "True" => o.last_transition_time.clone(),
        _ => Time(now.parse().expect("reconcile time is RFC 3339")),
    };
    s.conditions.retain(|o| o.type_ != type_);
    s.conditions.push(c);
    s
}

/// The `Stalled=True` condition of a status, if it has one.
pub fn stalled_condition(s: &DSparkDeploymentStatus) -> Option<&Condition> {
    s.conditions
        .iter()
        .find(|c| c.type_ == STALLED && c.status == "True")
}

/// Conditions whose status changed: `(type, now true, reason, message)`, for events.
pub fn transitions(
    old: &DSparkDeploymentStatus,
    new: &DSparkDeploymentStatus,
) -> Vec<(String, bool, String, String)> {
    new.conditions
        .iter()
        .filter(|c| {
            old.conditions
                .iter()
                .find(|o| o.type_ == c.type_)
                .is_none_or(|o| o.status != c.status || o.reason != c.reason)
        })
        .map(|c| {
            (
                c.type_.clone(),
                c.status == "True",
                c.reason.clone(),
                c.message.clone(),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests;
