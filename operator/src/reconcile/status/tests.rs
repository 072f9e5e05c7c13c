use super::*;
use crate::reconcile::pool::tests::sample;

fn view(name: &str, desired: i32, ready: i32, rev: Option<i64>) -> PoolView {
    PoolView {
        name: name.into(),
        cost_table: format!("{name}-ct"),
        cost_table_revision: rev,
        phase: if rev.is_some() {
            CostTablePhase::Ready
        } else {
            CostTablePhase::Profiling
        },
        message: None,
        current: Some(desired),
        replicas: desired,
        ready,
        ready_pods: Vec::new(),
        desired,
        min: desired,
        updated: desired,
        observed: true,
        rollout_stalled: None,
    }
}

fn obs(f: Freshness, itl: f64) -> PoolObservation {
    PoolObservation {
        freshness: f,
        itl_p95: Some(itl),
        acceptance_length: Some(2.34567),
        ..PoolObservation::missing()
    }
}

/// What a reconcile saw besides its pools: the deployment, the pools' metrics and SLO
/// verdicts, whether the autoscaler has looked yet; no scaling decision, nothing resolved, no
/// InferencePool, and the weights in place (a volume source).
struct Seen<'a> {
    dsd: &'a DSparkDeployment,
    observations: BTreeMap<String, PoolObservation>,
    breached: BTreeMap<String, Option<bool>>,
    evaluated: bool,
}

impl<'a> Seen<'a> {
    /// `dsd` with no metrics, not evaluated yet.
    fn new(dsd: &'a DSparkDeployment) -> Self {
        Seen {
            dsd,
            observations: BTreeMap::new(),
            breached: BTreeMap::new(),
            evaluated: false,
        }
    }

    /// The status a reconcile at `now` that saw `pools` computes over `old`.
    fn status(
        &self,
        pools: &[PoolView],
        now: &str,
        old: &DSparkDeploymentStatus,
    ) -> DSparkDeploymentStatus {
        build(&StatusInput {
            dsd: self.dsd,
            pools,
            observations: &self.observations,
            breached: &self.breached,
            last_decision: None,
            evaluated: self.evaluated,
            resolved: Vec::new(),
            inference_pool: None,
            model: super::super::model::ModelAvailability {
                ok: Some(true),
                reason: "VolumeSource".into(),
                message: String::new(),
            },
            now,
            old,
        })
    }
}

/// The condition of type `t` (there must be one).
fn cond<'s>(s: &'s DSparkDeploymentStatus, t: &str) -> &'s Condition {
    s.conditions.iter().find(|c| c.type_ == t).unwrap()
}

#[test]
fn status_is_deterministic_and_keeps_transition_times() {
    let mut d = sample();
    d.metadata.generation = Some(4);
    d.spec.autoscaling.mode = AutoscalingMode::Active;
    let pools = vec![view("h100", 2, 2, Some(1)), view("a100", 1, 0, None)];
    let seen = Seen {
        observations: BTreeMap::from([
            ("h100".to_string(), obs(Freshness::Fresh, 0.0312345)),
            ("a100".to_string(), obs(Freshness::Stale, 0.05)),
        ]),
        breached: BTreeMap::from([
            ("h100".to_string(), Some(false)),
            ("a100".to_string(), None),
        ]),
        evaluated: true,
        ..Seen::new(&d)
    };
    let old = DSparkDeploymentStatus::default();
    let s1 = seen.status(&pools, "2026-11-29T10:00:00Z", &old);
    assert_eq!(s1.observed_generation, Some(4));
    assert_eq!(
        (s1.replicas, s1.ready_replicas, s1.desired_replicas),
        (3, 2, 3)
    );
    assert_eq!(
        s1.selector.as_deref(),
        Some("serving.dspark.dev/deployment=qwen3-8b")
    );
    assert_eq!(s1.slo_status.as_deref(), Some("Unknown"));
    assert_eq!(s1.pools[0].itl_p95_ms, Some(31.2));
    assert_eq!(s1.pools[0].acceptance_length, Some(2.35));
    assert_eq!(cond(&s1, "Ready").reason, "ReplicasNotReady");
    assert_eq!(cond(&s1, "Profiled").reason, "Profiling");
    assert_eq!(cond(&s1, "MetricsAvailable").reason, "Stale");
    assert_eq!(cond(&s1, "Scaling").reason, "Steady");
    // Same world later: identical status, no write.
    let s2 = seen.status(&pools, "2026-11-29T10:05:00Z", &s1);
    assert_eq!(s1, s2);
    assert!(transitions(&s1, &s2).is_empty());
    let t = transitions(&old, &s1);
    assert_eq!(t.len(), 7);
}

#[test]
fn a_failure_stalls_and_a_success_clears_it() {
    let mut d = sample();
    d.metadata.generation = Some(7);
    let pools = vec![view("h100", 1, 1, Some(1))];
    let seen = Seen::new(&d);
    let empty = DSparkDeploymentStatus::default();
    let mut ok = seen.status(&pools, "2026-11-29T10:00:00Z", &empty);
    ok.observed_generation = Some(6);
    // Stuck on generation 7.
    let stall = |s, reason, message, now| stalled(s, Some(7), reason, message, now);
    let s1 = stall(
        &ok,
        "ApplyFailed",
        "applying Service x: denied",
        "2026-11-29T10:01:00Z",
    );
    // Everything else as it was; the condition on the generation it is stuck on.
    assert_eq!(s1.observed_generation, Some(7));
    assert_eq!(s1.conditions.len(), ok.conditions.len() + 1);
    assert_eq!(s1.pools, ok.pools);
    let c = stalled_condition(&s1).unwrap();
    assert_eq!(
        (c.reason.as_str(), c.observed_generation),
        ("ApplyFailed", Some(7))
    );
    assert_eq!(c.message, "applying Service x: denied");
    // Still stalled later, same error: nothing changes (no write).
    let s2 = stall(
        &s1,
        "ApplyFailed",
        "applying Service x: denied",
        "2026-11-29T10:05:00Z",
    );
    assert_eq!(s1, s2);
    // Another error: reason and message follow, the transition time stays.
    let s3 = stall(&s2, "APIError", "forbidden", "2026-11-29T10:06:00Z");
    let c3 = stalled_condition(&s3).unwrap();
    assert_eq!(c3.reason, "APIError");
    assert_eq!(c3.last_transition_time, c.last_transition_time);
    // A successful reconcile drops it.
    let s4 = seen.status(&pools, "2026-11-29T10:07:00Z", &s3);
    assert!(stalled_condition(&s4).is_none());
    assert!(s4.conditions.iter().all(|c| c.type_ != STALLED));
}

#[test]
fn a_scale_up_keeps_ready_and_a_stalled_rollout_does_not() {
    let d = sample();
    let seen = Seen::new(&d);
    let old = DSparkDeploymentStatus::default();
    let status = |pools: &[PoolView]| seen.status(pools, "2026-11-29T10:00:00Z", &old);
    let get = |s: &DSparkDeploymentStatus, t: &str| {
        let c = cond(s, t);
        (c.status.clone(), c.reason.clone(), c.message.clone())
    };
    // 2 -> 3 with minReplicas 1: two ready, one starting.
    let mut v = view("h100", 3, 2, Some(1));
    v.min = 1;
    v.updated = 3;
    let s = status(std::slice::from_ref(&v));
    assert_eq!(get(&s, "Ready").0, "True");
    assert_eq!(get(&s, "Ready").1, "MinimumReplicasReady");
    assert_eq!(get(&s, "Available").1, "MinimumReplicasAvailable");
    assert_eq!(
        get(&s, "Progressing"),
        (
            "True".into(),
            "RollingOut".into(),
            "h100: 3/3 updated, 2/3 ready".into()
        )
    );
    // Below the minimum: not available, not ready.
    v.ready = 0;
    let s = status(&[v.clone(), view("a100", 1, 1, Some(1))]);
    assert_eq!(get(&s, "Available").1, "MinimumReplicasUnavailable");
    assert_eq!(get(&s, "Ready").1, "ReplicasNotReady");
    // Past the progress deadline.
    v.ready = 2;
    v.rollout_stalled = Some("ReplicaSet \"x\" has timed out progressing.".into());
    let s = status(std::slice::from_ref(&v));
    let p = get(&s, "Progressing");
    assert_eq!((p.0.as_str(), p.1.as_str()), ("False", "RolloutStalled"));
    assert!(p.2.starts_with("pool h100: ReplicaSet"), "{}", p.2);
    assert_eq!(get(&s, "Ready").1, "RolloutStalled");
    // Done.
    let s = status(&[view("h100", 2, 2, Some(1))]);
    assert_eq!(get(&s, "Progressing").1, "RolloutComplete");
    assert_eq!(get(&s, "Ready").1, "AllReplicasReady");
}

#[test]
fn conditions_follow_the_world() {
    let d = sample();
    let pools = vec![view("h100", 2, 2, Some(3))];
    let seen = Seen {
        observations: BTreeMap::from([("h100".to_string(), obs(Freshness::Fresh, 0.03))]),
        breached: BTreeMap::from([("h100".to_string(), Some(true))]),
        evaluated: true,
        ..Seen::new(&d)
    };
    let s = seen.status(
        &pools,
        "2026-11-29T10:00:00Z",
        &DSparkDeploymentStatus::default(),
    );
    assert_eq!(s.slo_status.as_deref(), Some("Breached"));
    assert_eq!(
        (
            cond(&s, "Ready").status.as_str(),
            cond(&s, "Ready").reason.as_str()
        ),
        ("True", "AllReplicasReady")
    );
    assert_eq!(cond(&s, "Profiled").message, "h100: h100-ct r3");
    assert_eq!(cond(&s, "MetricsAvailable").status, "True");
    // The sample is in advisory mode.
    assert_eq!(cond(&s, "Scaling").reason, "Advisory");
}
