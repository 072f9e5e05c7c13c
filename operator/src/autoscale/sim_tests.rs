//! The policy driven over synthetic metric series: step load, ramp, spike, noise, stale data,
//! several pools, and random series (proptest) checking the invariants.

use dspark_types::{CostTable, COST_TABLE_SCHEMA};
use proptest::prelude::*;

use super::metrics::{Freshness, PoolObservation};
use super::policy::*;

const PERIOD: f64 = 15.0;
const STARTUP: f64 = 60.0;
const TOKENS_PER_REQUEST: f64 = 100.0;

fn table(scale: f64) -> CostTable {
    CostTable {
        schema: COST_TABLE_SCHEMA,
        model_id: "m".into(),
        drafter_id: None,
        engine_version: "0.1.0".into(),
        device: "gpu".into(),
        node_type: Some("t".into()),
        dtype: "bf16".into(),
        measured_at: "2026-01-01T00:00:00Z".into(),
        points: [
            (1, 100.0),
            (2, 95.0),
            (4, 90.0),
            (8, 80.0),
            (16, 60.0),
            (32, 35.0),
            (64, 18.0),
        ]
        .into_iter()
        .map(|(b, s)| (b, s * scale))
        .collect(),
        draft_points: Vec::new(),
    }
}

fn input() -> PolicyInput {
    PolicyInput {
        slo: SloTargets {
            ttft_p95: 1.0,
            itl_p95: 0.05,
        },
        behavior: Behavior {
            up_window: 0.0,
            down_window: 300.0,
            max_up: 4,
            max_down: 1,
            target_utilization: 0.8,
        },
        external_total: None,
    }
}

/// A simulated pool: replicas become ready `STARTUP` seconds after they are asked for, and
/// latency grows with utilisation against the pool's true capacity.
struct SimPool {
    name: &'static str,
    min: i32,
    max: i32,
    cost: f64,
    table: CostTable,
    use_table: bool,
    desired: i32,
    /// (time asked, count) of replicas not ready yet.
    starting: Vec<(f64, i32)>,
    ready: i32,
    true_capacity: f64,
    /// ITL of a single request (the hardware's floor).
    floor_itl: f64,
}

impl SimPool {
    fn new(name: &'static str, min: i32, max: i32, cost: f64, speed: f64) -> Self {
        let table = table(speed);
        let mut cap = replica_capacity(&table, 2.0, 3.0, input().slo.itl_p95);
        if cap.streams == 0 {
            cap = replica_capacity(&table, 2.0, 3.0, 1.0);
        }
        let floor_itl = 1.0 / (table.sps(4) * 2.0);
        Self {
            name,
            min,
            max,
            cost,
            table,
            use_table: true,
            desired: min,
            starting: Vec::new(),
            ready: min,
            true_capacity: cap.tokens_per_second,
            floor_itl,
        }
    }

    fn advance(&mut self, now: f64) {
        type Batches = Vec<(f64, i32)>;
        let (done, pending): (Batches, Batches) = self
            .starting
            .iter()
            .copied()
            .partition(|(t, _)| now - t >= STARTUP);
        self.ready += done.iter().map(|x| x.1).sum::<i32>();
        self.starting = pending;
    }

    fn set(&mut self, now: f64, to: i32) {
        if to > self.desired {
            self.starting.push((now, to - self.desired));
        } else if to < self.desired {
            let mut drop = self.desired - to;
            while drop > 0 {
                if let Some(last) = self.starting.last_mut() {
                    last.1 -= 1;
                    if last.1 == 0 {
                        self.starting.pop();
                    }
                } else {
                    self.ready -= 1;
                }
                drop -= 1;
            }
        }
        self.desired = to;
    }

    /// What the metrics say when this pool serves `rate` requests/s.
    fn observe(&self, rate: f64, noise: f64) -> PoolObservation {
        if self.ready == 0 {
            return PoolObservation::missing();
        }
        let demand = rate * TOKENS_PER_REQUEST;
        let rho = demand / (self.ready as f64 * self.true_capacity);
        let itl = (0.04 * rho / 0.8).max(self.floor_itl) * (1.0 + noise);
        let ttft = (0.2 + 0.3 * rho * rho) * (1.0 + noise);
        let waiting = if rho > 1.0 { (rho - 1.0) * 50.0 } else { 0.0 };
        PoolObservation {
            freshness: Freshness::Fresh,
            ttft_p95: (rate > 0.0).then_some(ttft),
            itl_p95: (rate > 0.0).then_some(itl),
            request_rate: rate,
            output_tokens_per_request: (rate > 0.0).then_some(TOKENS_PER_REQUEST),
            in_flight: rate * (ttft + TOKENS_PER_REQUEST * itl * 0.7) + waiting,
            waiting,
            acceptance_length: Some(2.0),
            draft_length: Some(3.0),
        }
    }
}

struct Trace {
    /// (time, desired replicas per pool, decisions)
    steps: Vec<(f64, Vec<i32>, Vec<PoolDecision>)>,
    /// (time, max ITL p95 over pools)
    itl: Vec<(f64, f64)>,
}

impl Trace {
    fn replicas(&self, pool: usize) -> Vec<i32> {
        self.steps.iter().map(|s| s.1[pool]).collect()
    }

    /// Number of times a pool's replica count changes direction.
    fn reversals(&self, pool: usize) -> usize {
        let r = self.replicas(pool);
        let mut last = 0i32;
        let mut n = 0;
        for w in r.windows(2) {
            let d = (w[1] - w[0]).signum();
            if d != 0 {
                if last != 0 && d != last {
                    n += 1;
                }
                last = d;
            }
        }
        n
    }

    fn breach_seconds_after(&self, t0: f64, slo: f64) -> f64 {
        self.itl
            .iter()
            .filter(|(t, v)| *t >= t0 && *v > slo)
            .count() as f64
            * PERIOD
    }
}

/// Runs the policy every `PERIOD` seconds for `duration`. `load(t)` is the total request rate,
/// split over pools in proportion to their ready replicas (one Service over all pools);
/// `fault(t, pool)` can turn an observation stale or missing; `noise(t)` perturbs latencies.
fn simulate(
    pools: &mut [SimPool],
    cfg: &PolicyInput,
    duration: f64,
    load: impl Fn(f64) -> f64,
    noise: impl Fn(f64) -> f64,
    fault: impl Fn(f64, usize) -> Option<Freshness>,
) -> Trace {
    let mut state = PolicyState::default();
    let mut trace = Trace {
        steps: Vec::new(),
        itl: Vec::new(),
    };
    let mut t = 0.0;
    while t <= duration {
        for p in pools.iter_mut() {
            p.advance(t);
        }
        let total_ready: i32 = pools.iter().map(|p| p.ready).sum();
        let obs: Vec<PoolObservation> = pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let share = if total_ready > 0 {
                    p.ready as f64 / total_ready as f64
                } else {
                    0.0
                };
                let mut o = p.observe(load(t) * share, noise(t));
                if let Some(f) = fault(t, i) {
                    o.freshness = f;
                    if f == Freshness::Missing {
                        o = PoolObservation::missing();
                    }
                }
                o
            })
            .collect();
        trace
            .itl
            .push((t, obs.iter().filter_map(|o| o.itl_p95).fold(0.0, f64::max)));
        let inputs: Vec<PoolInput<'_>> = pools
            .iter()
            .zip(&obs)
            .map(|(p, o)| PoolInput {
                name: p.name,
                min: p.min,
                max: p.max,
                cost: p.cost,
                current: p.desired,
                ready: p.ready,
                table: p.use_table.then_some(&p.table),
                obs: o,
            })
            .collect();
        let decisions = decide(cfg, &inputs, &mut state, t);
        drop(inputs);
        for (p, d) in pools.iter_mut().zip(&decisions) {
            assert_eq!(d.from, p.desired);
            p.set(t, d.to);
        }
        trace
            .steps
            .push((t, pools.iter().map(|p| p.desired).collect(), decisions));
        t += PERIOD;
    }
    trace
}

fn no_fault(_: f64, _: usize) -> Option<Freshness> {
    None
}

fn quiet(_: f64) -> f64 {
    0.0
}

/// One pool of `min..=max` replicas (reference cost and speed) under `load` and `noise` for
/// `duration`, the default input, no faults: the trace and the pool's replicas.
fn one_pool(
    min: i32,
    max: i32,
    duration: f64,
    load: impl Fn(f64) -> f64,
    noise: impl Fn(f64) -> f64,
) -> (Trace, Vec<i32>) {
    let mut pools = [SimPool::new("a", min, max, 1.0, 1.0)];
    let trace = simulate(&mut pools, &input(), duration, load, noise, no_fault);
    let r = trace.replicas(0);
    (trace, r)
}

/// A load of `base`, `high` during `during`.
fn step(base: f64, during: std::ops::Range<f64>, high: f64) -> impl Fn(f64) -> f64 {
    move |t: f64| if during.contains(&t) { high } else { base }
}

#[test]
fn capacity_follows_the_table_and_the_itl_target() {
    let t = table(1.0);
    // tau 2, 3 draft tokens per request: B = 4R; SPS(B) * 2 >= 20 up to B ~ 115.
    let c = replica_capacity(&t, 2.0, 3.0, 0.05);
    assert_eq!(c.streams, 28);
    assert!((c.tokens_per_second - 28.0 * 2.0 * t.sps(112)).abs() < 1e-9);
    // Without speculation each request adds one token and commits one.
    let plain = replica_capacity(&t, 1.0, 0.0, 0.05);
    assert!(plain.streams > 28);
    // A slower table cannot meet a tight target at all.
    let slow = replica_capacity(&table(0.1), 1.0, 0.0, 0.05);
    assert_eq!(slow.streams, 0);
    // A very loose target saturates at the cap instead of looping forever.
    let loose = replica_capacity(&t, 1.0, 0.0, 1e9);
    assert!(loose.streams >= 1 << 16);
}

#[test]
fn step_load_scales_up_fast_and_down_after_the_window() {
    let load = step(2.0, 300.0..1500.0, 20.0);
    let (trace, r) = one_pool(1, 20, 3000.0, load, quiet);
    let at = |t: f64| r[(t / PERIOD) as usize];
    assert_eq!(at(0.0), 1);
    // Predictive: the step is sized in one decision.
    assert!(at(300.0) >= 5, "{r:?}");
    assert!(trace.breach_seconds_after(300.0, 0.05) <= STARTUP + PERIOD);
    // Held while the load is high, no scale-down inside the window after it drops.
    assert!(r[(300.0 / PERIOD) as usize..(1500.0 / PERIOD) as usize]
        .windows(2)
        .all(|w| w[1] >= w[0]));
    assert_eq!(at(1500.0 + 285.0), at(1490.0));
    assert_eq!(at(3000.0), 1);
    assert!(trace.reversals(0) <= 1, "{r:?}");
}

#[test]
fn ramp_never_scales_down_while_rising() {
    let (trace, r) = one_pool(1, 40, 1800.0, |t: f64| 1.0 + t / 30.0, quiet);
    assert!(r.windows(2).all(|w| w[1] >= w[0]), "{r:?}");
    assert!(*r.last().unwrap() >= 10);
    // Only the startup lag of each step can breach.
    assert!(
        trace.breach_seconds_after(0.0, 0.05) <= 4.0 * PERIOD,
        "{:?}",
        trace.itl
    );
}

#[test]
fn spike_scales_up_then_waits_the_window_before_coming_down() {
    let load = step(3.0, 600.0..630.0, 40.0);
    let (trace, r) = one_pool(2, 20, 2400.0, load, quiet);
    let peak_at = r
        .iter()
        .position(|&x| x == *r.iter().max().unwrap())
        .unwrap();
    assert!(r[peak_at] > 2);
    let first_down = (peak_at..r.len()).find(|&i| r[i] < r[peak_at]).unwrap();
    assert!((first_down - peak_at) as f64 * PERIOD >= 300.0, "{r:?}");
    assert_eq!(*r.last().unwrap(), 2);
    assert!(trace.reversals(0) <= 1, "{r:?}");
}

fn lcg(seed: u64) -> impl Fn(f64) -> f64 {
    move |t: f64| {
        let mut x = seed ^ ((t as u64).wrapping_mul(0x9e3779b97f4a7c15));
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51afd7ed558ccd);
        x ^= x >> 33;
        (x % 10_000) as f64 / 10_000.0 * 0.3 - 0.15
    }
}

#[test]
fn noise_does_not_flap() {
    for seed in 0..20 {
        let (trace, r) = one_pool(1, 20, 3600.0, |_| 15.0, lcg(seed));
        let settled = &r[(600.0 / PERIOD) as usize..];
        assert!(
            settled.windows(2).all(|w| w[0] == w[1]),
            "seed {seed}: {r:?}"
        );
        assert!(trace.reversals(0) == 0, "seed {seed}: {r:?}");
    }
}

#[test]
fn reactive_only_pool_converges_without_flapping() {
    for seed in 0..10 {
        let mut pools = [SimPool::new("a", 1, 20, 1.0, 1.0)];
        pools[0].use_table = false;
        let trace = simulate(&mut pools, &input(), 3600.0, |_| 12.0, lcg(seed), no_fault);
        let r = trace.replicas(0);
        // +1 per period once ready: converges to enough replicas, then holds.
        let end = *r.last().unwrap();
        assert!(end >= 3, "{r:?}");
        assert!(trace.reversals(0) == 0, "seed {seed}: {r:?}");
        assert!(
            trace.itl.iter().rev().take(100).all(|(_, v)| *v <= 0.05),
            "seed {seed}"
        );
    }
}

#[test]
fn stale_or_missing_metrics_never_scale_down() {
    let mut pools = [SimPool::new("a", 1, 20, 1.0, 1.0)];
    pools[0].set(0.0, 8);
    pools[0].ready = 8;
    pools[0].starting.clear();
    // Idle load (would scale down), but metrics are stale, then missing, then stale.
    let fault = |t: f64, _| match t as u64 {
        0..=899 => Some(Freshness::Stale),
        900..=1799 => Some(Freshness::Missing),
        _ => Some(Freshness::Stale),
    };
    let trace = simulate(&mut pools, &input(), 2400.0, |_| 0.5, quiet, fault);
    assert!(trace.replicas(0).iter().all(|&r| r == 8));
    let reasons: Vec<_> = trace.steps.iter().map(|s| s.2[0].reason.code()).collect();
    assert!(reasons.iter().all(|r| *r == "Stale" || *r == "Missing"));
    assert!(trace.steps.iter().all(|s| s.2[0].breached.is_none()));
    // Once fresh again, a full window must pass before the first scale-down.
    let fault = |t: f64, _| (t < 900.0).then_some(Freshness::Stale);
    let mut pools = [SimPool::new("a", 1, 20, 1.0, 1.0)];
    pools[0].set(0.0, 8);
    pools[0].ready = 8;
    pools[0].starting.clear();
    let trace = simulate(&mut pools, &input(), 2400.0, |_| 0.5, quiet, fault);
    let r = trace.replicas(0);
    let first_down = r.iter().position(|&x| x < 8).unwrap();
    assert!(first_down as f64 * PERIOD >= 900.0 + 300.0, "{r:?}");
}

#[test]
fn extra_capacity_goes_to_the_cheapest_pool_that_meets_the_slo() {
    // "big" is expensive; "cheap" costs less per token; "slow" is cheapest per replica but
    // its table says one replica cannot meet the ITL target.
    let mut pools = [
        SimPool::new("big", 1, 10, 4.0, 1.0),
        SimPool::new("cheap", 1, 10, 1.0, 0.8),
        SimPool::new("slow", 1, 10, 0.1, 0.1),
    ];
    let trace = simulate(&mut pools, &input(), 1200.0, |_| 25.0, quiet, no_fault);
    let last = &trace.steps.last().unwrap().1;
    assert_eq!(last[0], 1, "{:?}", trace.steps.last());
    assert!(last[1] > 1);
    assert_eq!(last[2], 1);
    assert!(trace
        .steps
        .iter()
        .flat_map(|s| &s.2)
        .any(|d| matches!(d.reason, Reason::Rebalanced { .. })));
}

#[test]
fn external_total_is_spread_cheapest_first() {
    let t_fast = table(1.0);
    let t_slow = table(0.1);
    let obs = PoolObservation::missing();
    let pool = |name, min, max, cost, table| PoolInput {
        name,
        min,
        max,
        cost,
        current: min,
        ready: min,
        table,
        obs: &obs,
    };
    let pools = [
        pool("expensive", 1, 10, 5.0, Some(&t_fast)),
        pool("cheap", 0, 3, 1.0, Some(&t_fast)),
        pool("too-slow", 0, 10, 0.1, Some(&t_slow)),
        pool("unknown", 0, 10, 0.5, None),
    ];
    let mut cfg = input();
    cfg.external_total = Some(9);
    let d = decide(&cfg, &pools, &mut PolicyState::default(), 0.0);
    let to: Vec<i32> = d.iter().map(|d| d.to).collect();
    // min 1 on expensive, 3 (max) on cheap, then expensive (known to meet the SLO) before
    // the pool without a table, and the pool that cannot meet the SLO last.
    assert_eq!(to, vec![6, 3, 0, 0]);
    assert!(d.iter().all(|d| d.reason == Reason::External { total: 9 }));
    cfg.external_total = Some(30);
    let d = decide(&cfg, &pools, &mut PolicyState::default(), 0.0);
    assert_eq!(
        d.iter().map(|d| d.to).collect::<Vec<_>>(),
        vec![10, 3, 7, 10]
    );
}

#[test]
fn bounds_win_and_say_so() {
    let obs = PoolObservation::missing();
    let p = PoolInput {
        name: "a",
        min: 3,
        max: 5,
        cost: 1.0,
        current: 1,
        ready: 1,
        table: None,
        obs: &obs,
    };
    let d = decide(
        &input(),
        std::slice::from_ref(&p),
        &mut PolicyState::default(),
        0.0,
    );
    assert_eq!((d[0].to, d[0].reason.code()), (3, "Bounds"));
    let p = PoolInput { current: 9, ..p };
    let d = decide(&input(), &[p], &mut PolicyState::default(), 0.0);
    assert_eq!(d[0].to, 5);
    assert!(d[0].reason.to_string().contains("[3, 5]"));
}

#[test]
fn reasons_read_well() {
    let r = Reason::SloBreach {
        metric: "ITL",
        p95_ms: 71.3,
        slo_ms: 50.0,
    };
    assert_eq!(r.to_string(), "p95 ITL 71 ms is over the 50 ms SLO");
    assert_eq!(round_sig(0.071_349, 3), 0.0713);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Over random load series with random stale stretches: replicas stay within bounds and
    /// step limits, never fall on stale or missing data, and never fall within the
    /// scale-down window after a rise (no flapping).
    #[test]
    fn invariants_hold_over_random_series(
        loads in proptest::collection::vec(0.0f64..60.0, 4..12),
        stale in proptest::collection::vec(any::<bool>(), 12),
        seed in any::<u64>(),
        min in 0i32..3,
        span in 1i32..15,
        with_table in any::<bool>(),
    ) {
        let max = min + span;
        let mut pools = [SimPool::new("a", min, max, 1.0, 1.0)];
        pools[0].use_table = with_table;
        let seg = 240.0;
        let load = |t: f64| loads[((t / seg) as usize).min(loads.len() - 1)];
        let fault = |t: f64, _| stale[((t / seg) as usize).min(stale.len() - 1)].then_some(Freshness::Stale);
        let cfg = input();
        let trace = simulate(&mut pools, &cfg, seg * loads.len() as f64, load, lcg(seed), fault);
        let mut last_up: Option<f64> = None;
        for (t, reps, ds) in &trace.steps {
            let d = &ds[0];
            prop_assert!(reps[0] >= min && reps[0] <= max);
            if d.from >= min && d.from <= max {
                prop_assert!(d.to - d.from <= cfg.behavior.max_up);
                prop_assert!(d.from - d.to <= cfg.behavior.max_down);
            }
            if d.to < d.from && d.from <= max {
                prop_assert!(!stale[((t / seg) as usize).min(stale.len() - 1)], "scaled down on stale data at {t}");
                if let Some(u) = last_up {
                    prop_assert!(t - u >= cfg.behavior.down_window, "down at {t} after up at {u}");
                }
            }
            if d.to > d.from {
                last_up = Some(*t);
            }
        }
    }
}
