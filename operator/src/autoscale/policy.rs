//! The SLO autoscaling policy. Pure: no I/O, no clock; the caller passes the time, what it
//! observed, and the state the policy returned last time.
//!
//! Per pool, two loops are combined:
//! - **predictive**: from the request rate, output tokens per request, requests in flight, live
//!   acceptance length and draft length, and the pool's SPS(B) table, the replicas needed so
//!   that each replica runs at `targetUtilization` of its capacity at the ITL target
//!   ([`replica_capacity`]);
//! - **reactive**: +1 replica when the p95 TTFT or ITL breaches the SLO (once the replicas
//!   already asked for are ready); -1 only when every p95 is comfortably under the SLO
//!   ([`COMFORT`]) and nothing waits.
//!
//! Recommendations are stabilised as the HPA does: a higher count must be recommended during
//! the whole scale-up window, a lower one during the whole scale-down window (and the window
//! must have been observed), then the step limits and the pool bounds apply. Stale or missing
//! metrics hold the pool where it is: they never scale down. Extra capacity asked for by one
//! pool goes to the cheapest pool that can meet the ITL SLO (its table says one replica can),
//! which matters when one Service spreads traffic over all pools.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use dspark_types::CostTable;

use super::metrics::{Freshness, PoolObservation};

/// A p95 below this fraction of its SLO counts as comfortably under it.
pub const COMFORT: f64 = 0.7;

/// The latency objectives, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloTargets {
    pub ttft_p95: f64,
    pub itl_p95: f64,
}

/// Stabilisation and step limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Behavior {
    pub up_window: f64,
    pub down_window: f64,
    pub max_up: i32,
    pub max_down: i32,
    pub target_utilization: f64,
}

/// One pool as the policy sees it.
#[derive(Debug, Clone)]
pub struct PoolInput<'a> {
    pub name: &'a str,
    pub min: i32,
    pub max: i32,
    /// Relative cost of one replica.
    pub cost: f64,
    /// Replicas currently asked for.
    pub current: i32,
    /// Replicas ready.
    pub ready: i32,
    pub table: Option<&'a CostTable>,
    pub obs: &'a PoolObservation,
}

/// What one replica sustains at the ITL target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Concurrent requests.
    pub streams: u32,
    /// Output tokens per second over those requests.
    pub tokens_per_second: f64,
}

const MAX_STREAMS: u32 = 1 << 16;

/// Capacity of one replica whose target forward runs at `table.sps(B)` steps per second, when
/// each request adds `1 + draft_length` tokens to B and commits `acceptance_length` tokens per
/// step: the most concurrent requests R with `SPS(R * (1 + draft_length)) * tau >= 1 / itl`.
/// Zero when even one request cannot meet the ITL target on this hardware.
pub fn replica_capacity(
    table: &CostTable,
    acceptance_length: f64,
    draft_length: f64,
    itl_target: f64,
) -> Capacity {
    let per_request = 1.0 + draft_length.max(0.0);
    let tau = acceptance_length.max(1.0);
    let sps = |r: u32| table.sps((r as f64 * per_request).ceil() as u32);
    let feasible = |r: u32| sps(r) * tau * itl_target >= 1.0;
    if !feasible(1) {
        return Capacity {
            streams: 0,
            tokens_per_second: 0.0,
        };
    }
    let (mut lo, mut hi) = (1u32, 2u32);
    while hi <= MAX_STREAMS && feasible(hi) {
        lo = hi;
        hi *= 2;
    }
    let hi = hi.min(MAX_STREAMS + 1);
    let (mut lo, mut hi) = (lo, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Capacity {
        streams: lo,
        tokens_per_second: lo as f64 * tau * sps(lo),
    }
}

/// Why a pool's replica count is what it is.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    /// The replica count was outside the pool's bounds.
    Bounds {
        min: i32,
        max: i32,
    },
    /// `spec.replicas` (the `/scale` subresource) fixes the total.
    External {
        total: i32,
    },
    /// A p95 is over its SLO.
    SloBreach {
        metric: &'static str,
        p95_ms: f64,
        slo_ms: f64,
    },
    /// The load needs more replicas than there are.
    PredictedLoad {
        needed: i32,
    },
    /// Every p95 is comfortably under its SLO and the load needs fewer replicas.
    UnderSlo {
        needed: Option<i32>,
    },
    /// Within the SLO, nothing to do.
    Steady,
    /// A change is recommended but has not held for the stabilisation window yet.
    Stabilizing {
        recommended: i32,
    },
    /// The SLO is breached but replicas asked for earlier are not ready yet.
    RolloutPending,
    /// Extra capacity asked for by another pool, placed here because it is cheaper.
    Rebalanced {
        from: String,
    },
    /// The SLO is breached but the cost table says one replica of this pool cannot meet the
    /// ITL target: more replicas here would not help.
    CannotMeetSlo,
    MetricsStale,
    MetricsMissing,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bounds { min, max } => write!(f, "replicas kept within the pool bounds [{min}, {max}]"),
            Self::External { total } => write!(f, "spec.replicas asks for {total} replicas in total; cheapest pools that meet the SLO first"),
            Self::SloBreach { metric, p95_ms, slo_ms } => write!(f, "p95 {metric} {p95_ms:.0} ms is over the {slo_ms:.0} ms SLO"),
            Self::PredictedLoad { needed } => write!(f, "load needs {needed} replicas at the ITL target (cost table, live acceptance length)"),
            Self::UnderSlo { needed: Some(n) } => write!(f, "comfortably under the SLO for the whole window; load needs {n} replicas"),
            Self::UnderSlo { needed: None } => write!(f, "comfortably under the SLO for the whole window"),
            Self::Steady => write!(f, "within the SLO"),
            Self::Stabilizing { recommended } => write!(f, "{recommended} replicas recommended, waiting for the stabilization window"),
            Self::RolloutPending => write!(f, "SLO breached, waiting for the replicas already requested to become ready"),
            Self::Rebalanced { from } => write!(f, "extra capacity for pool '{from}' placed on this cheaper pool that meets the SLO"),
            Self::CannotMeetSlo => write!(f, "SLO breached, and the cost table says this node type cannot meet the ITL target even with one request; not adding replicas here"),
            Self::MetricsStale => write!(f, "metrics are stale; holding (never scale down without fresh metrics)"),
            Self::MetricsMissing => write!(f, "no metrics; holding (never scale down without metrics)"),
        }
    }
}

impl Reason {
    /// CamelCase reason for events and conditions.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Bounds { .. } => "Bounds",
            Self::External { .. } => "ExternalReplicas",
            Self::SloBreach { .. } => "SloBreach",
            Self::PredictedLoad { .. } => "PredictedLoad",
            Self::UnderSlo { .. } => "UnderSlo",
            Self::Steady => "Steady",
            Self::Stabilizing { .. } => "Stabilizing",
            Self::RolloutPending => "RolloutPending",
            Self::Rebalanced { .. } => "Rebalanced",
            Self::CannotMeetSlo => "CannotMeetSlo",
            Self::MetricsStale => "Stale",
            Self::MetricsMissing => "Missing",
        }
    }
}

/// The policy's verdict for one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolDecision {
    pub pool: String,
    pub from: i32,
    pub to: i32,
    pub reason: Reason,
    /// Whether this pool's fresh p95s are over the SLO (`None`: no fresh data).
    pub breached: Option<bool>,
}

/// What the policy remembers between evaluations: recommendations inside the stabilisation
/// windows, and since when each pool has been observed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyState {
    pools: BTreeMap<String, PoolMemory>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct PoolMemory {
    since: f64,
    recommendations: VecDeque<(f64, i32)>,
}

/// Everything the policy reads besides the pools.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyInput {
    pub slo: SloTargets,
    pub behavior: Behavior,
    /// `spec.replicas`: a total fixed from outside.
    pub external_total: Option<i32>,
}

/// Decides every pool's replicas at time `now` (seconds, any monotonic clock).
pub fn decide(
    input: &PolicyInput,
    pools: &[PoolInput<'_>],
    state: &mut PolicyState,
    now: f64,
) -> Vec<PoolDecision> {
    state
        .pools
        .retain(|name, _| pools.iter().any(|p| p.name == name));
    if let Some(total) = input.external_total {
        return distribute(input, pools, total);
    }
    let mut decisions: Vec<PoolDecision> = pools
        .iter()
        .map(|p| {
            let memory = state.pools.entry(p.name.to_string()).or_insert(PoolMemory {
                since: now,
                recommendations: VecDeque::new(),
            });
            decide_pool(input, p, memory, now)
        })
        .collect();
    rebalance(input, pools, &mut decisions);
    decisions
}

fn breach(input: &PolicyInput, obs: &PoolObservation) -> Option<Reason> {
    let checks = [
        ("TTFT", obs.ttft_p95, input.slo.ttft_p95),
        ("ITL", obs.itl_p95, input.slo.itl_p95),
    ];
    checks.into_iter().find_map(|(metric, p95, slo)| match p95 {
        Some(v) if v > slo => Some(Reason::SloBreach {
            metric,
            p95_ms: round_sig(v * 1e3, 3),
            slo_ms: slo * 1e3,
        }),
        _ => None,
    })
}

fn comfortable(input: &PolicyInput, obs: &PoolObservation) -> bool {
    let under = |p95: Option<f64>, slo: f64| p95.is_none_or(|v| v < COMFORT * slo);
    under(obs.ttft_p95, input.slo.ttft_p95)
        && under(obs.itl_p95, input.slo.itl_p95)
        && obs.waiting <= 0.0
}

/// Without a cost table: would the p95s, scaled by `current / (current - 1)`, stay within the
/// SLO with one replica less? Keeps a reactive-only pool from flapping at small counts.
fn survives_one_less(input: &PolicyInput, p: &PoolInput<'_>) -> bool {
    if p.current <= 1 {
        return p.obs.ttft_p95.is_none() && p.obs.itl_p95.is_none();
    }
    let scale = p.current as f64 / (p.current - 1) as f64;
    let ok = |p95: Option<f64>, slo: f64| p95.is_none_or(|v| v * scale < slo);
    ok(p.obs.ttft_p95, input.slo.ttft_p95) && ok(p.obs.itl_p95, input.slo.itl_p95)
}

/// Replicas the load needs on this pool, from its cost table; `None` without a table or when
/// one replica cannot meet the ITL target.
fn predicted(input: &PolicyInput, p: &PoolInput<'_>) -> Option<i32> {
    let cap = capacity(input, p)?;
    let u = input.behavior.target_utilization.clamp(0.05, 1.0);
    let demand = p.obs.request_rate * p.obs.output_tokens_per_request.unwrap_or(0.0);
    let by_tokens = demand / (cap.tokens_per_second * u);
    let by_streams = p.obs.in_flight / (cap.streams as f64 * u);
    Some((by_tokens.max(by_streams) - 1e-9).ceil().max(0.0) as i32)
}

fn capacity(input: &PolicyInput, p: &PoolInput<'_>) -> Option<Capacity> {
    let cap = replica_capacity(
        p.table?,
        p.obs.acceptance_length.unwrap_or(1.0),
        p.obs.draft_length.unwrap_or(0.0),
        input.slo.itl_p95,
    );
    (cap.streams > 0).then_some(cap)
}

/// The raw (unstabilised) recommendation of one pool and why.
fn recommend(input: &PolicyInput, p: &PoolInput<'_>) -> (i32, Reason) {
    match p.obs.freshness {
        Freshness::Missing => return (p.current, Reason::MetricsMissing),
        Freshness::Stale => return (p.current, Reason::MetricsStale),
        Freshness::Fresh => {}
    }
    let need = predicted(input, p);
    if let Some(reason) = breach(input, p.obs) {
        let hopeless = p.table.is_some()
            && capacity(input, p).is_none()
            && matches!(reason, Reason::SloBreach { metric: "ITL", .. });
        if hopeless {
            return (p.current, Reason::CannotMeetSlo);
        }
        if p.ready < p.current {
            return (p.current, Reason::RolloutPending);
        }
        return ((p.current + 1).max(need.unwrap_or(0)), reason);
    }
    match need {
        Some(n) if n > p.current => (n, Reason::PredictedLoad { needed: n }),
        _ if comfortable(input, p.obs) => match need {
            Some(n) if n >= p.current => (p.current, Reason::Steady),
            Some(n) => (n, Reason::UnderSlo { needed: Some(n) }),
            None if survives_one_less(input, p) => {
                (p.current - 1, Reason::UnderSlo { needed: None })
            }
            None => (p.current, Reason::Steady),
        },
        _ => (p.current, Reason::Steady),
    }
}

fn decide_pool(
    input: &PolicyInput,
    p: &PoolInput<'_>,
    memory: &mut PoolMemory,
    now: f64,
) -> PoolDecision {
    let b = &input.behavior;
    let (rec, mut reason) = recommend(input, p);
    let horizon = b.up_window.max(b.down_window);
    memory.recommendations.push_back((now, rec));
    while memory
        .recommendations
        .front()
        .is_some_and(|&(t, _)| t < now - horizon)
    {
        memory.recommendations.pop_front();
    }
    let within = |w: f64| {
        memory
            .recommendations
            .iter()
            .filter(move |&&(t, _)| t >= now - w)
            .map(|&(_, r)| r)
    };
    let mut to = p.current;
    if rec > p.current {
        let held = within(b.up_window).min().unwrap_or(rec);
        if held > p.current {
            to = held;
        } else {
            reason = Reason::Stabilizing { recommended: rec };
        }
    } else if rec < p.current {
        let held = within(b.down_window).max().unwrap_or(rec);
        if now - memory.since >= b.down_window && held < p.current {
            to = held;
        } else {
            reason = Reason::Stabilizing { recommended: rec };
        }
    }
    to = to.clamp(p.current - b.max_down.max(1), p.current + b.max_up.max(1));
    let bounded = to.clamp(p.min, p.max);
    if p.current < p.min || p.current > p.max || (bounded != to && bounded == p.current) {
        reason = Reason::Bounds {
            min: p.min,
            max: p.max,
        };
    }
    PoolDecision {
        pool: p.name.to_string(),
        from: p.current,
        to: bounded,
        reason,
        breached: (p.obs.freshness == Freshness::Fresh).then(|| breach(input, p.obs).is_some()),
    }
}

/// Cost of one replica per unit of capacity at the ITL target (lower is better); pools whose
/// table says they cannot meet the ITL SLO are not candidates.
fn unit_cost(input: &PolicyInput, p: &PoolInput<'_>) -> Option<f64> {
    match p.table {
        Some(_) => capacity(input, p).map(|c| p.cost / c.tokens_per_second),
        None => Some(f64::INFINITY),
    }
}

/// Moves the scale-ups asked for by SLO breaches or load to the cheapest pools that meet the
/// SLO and have headroom (cancelling their scale-down first). A unit whose cheaper target is
/// still rolling out earlier replicas is dropped: that capacity is on its way. A pool whose
/// table says it cannot meet the SLO never grows itself.
fn rebalance(input: &PolicyInput, pools: &[PoolInput<'_>], decisions: &mut [PoolDecision]) {
    let costs: Vec<Option<f64>> = pools.iter().map(|p| unit_cost(input, p)).collect();
    for origin in 0..pools.len() {
        let d = &decisions[origin];
        if d.to <= d.from
            || !matches!(
                d.reason,
                Reason::SloBreach { .. } | Reason::PredictedLoad { .. }
            )
        {
            continue;
        }
        let hopeless = costs[origin].is_none();
        let origin_cost = costs[origin].unwrap_or(f64::INFINITY);
        for _ in 0..d.to - d.from {
            let cheaper = (0..pools.len())
                .filter(|&i| i != origin && decisions[i].to < pools[i].max)
                .filter_map(|i| costs[i].filter(|&c| c < origin_cost).map(|c| (c, i)))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, target)) = cheaper else {
                if hopeless {
                    // Never grow a pool whose table says it cannot meet the SLO.
                    decisions[origin].to = decisions[origin].from;
                    decisions[origin].reason = Reason::CannotMeetSlo;
                }
                break;
            };
            decisions[origin].to -= 1;
            if pools[target].ready < pools[target].current {
                decisions[origin].reason = Reason::RolloutPending;
                continue;
            }
            decisions[target].to += 1;
            decisions[target].reason = Reason::Rebalanced {
                from: pools[origin].name.to_string(),
            };
        }
    }
}

/// Spreads a total fixed from outside: every pool its minimum, then one replica at a time to
/// the cheapest pool with headroom (pools that cannot meet the SLO last).
fn distribute(input: &PolicyInput, pools: &[PoolInput<'_>], total: i32) -> Vec<PoolDecision> {
    let mut to: Vec<i32> = pools.iter().map(|p| p.min).collect();
    let mut left = total - to.iter().sum::<i32>();
    let rank: Vec<(bool, f64)> = pools
        .iter()
        .map(|p| match unit_cost(input, p) {
            Some(c) if c.is_finite() => (false, c),
            Some(_) => (false, p.cost * 1e12),
            None => (true, p.cost),
        })
        .collect();
    while left > 0 {
        let Some(i) = (0..pools.len())
            .filter(|&i| to[i] < pools[i].max)
            .min_by(|&a, &b| {
                rank[a]
                    .0
                    .cmp(&rank[b].0)
                    .then(rank[a].1.total_cmp(&rank[b].1))
                    .then(a.cmp(&b))
            })
        else {
            break;
        };
        to[i] += 1;
        left -= 1;
    }
    pools
        .iter()
        .zip(to)
        .map(|(p, to)| PoolDecision {
            pool: p.name.to_string(),
            from: p.current,
            to,
            reason: Reason::External { total },
            breached: (p.obs.freshness == Freshness::Fresh).then(|| breach(input, p.obs).is_some()),
        })
        .collect()
}

/// Rounds to `digits` significant digits (keeps status and messages stable under noise).
pub fn round_sig(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let mag = x.abs().log10().floor() as i32;
    let scale = 10f64.powi(digits - 1 - mag);
    (x * scale).round() / scale
}
