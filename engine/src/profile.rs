//! SPS(B) profiling: target-forward steps per second with B tokens in one batch, measured on
//! the actual model, device and dtype, written as a versioned cost table.
//!
//! Each point runs the same path as serving: B tokens spread over several sequences that
//! already hold a realistic context in the paged KV cache, one batched forward per step.

use crate::kv::KvCache;
use crate::model::{Model, SeqBatch};
use crate::sampling::SamplingParams;
use crate::speculative::dspark::{ContextFeed, DraftRequest};
use crate::speculative::speculator::Drafter;
use anyhow::Result;
use candle_core::Tensor;
use dspark_types::{CostTable, COST_TABLE_SCHEMA};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct ProfileOptions {
    /// Batch sizes to measure.
    pub grid: Vec<u32>,
    /// Context already in the cache for every sequence.
    pub context: usize,
    /// Tokens each sequence contributes per step (1 = plain decode, >1 = verify blocks).
    pub tokens_per_seq: usize,
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    /// Stop repeating once the relative standard error is below this.
    pub target_rel_err: f64,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            grid: vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
            context: 256,
            tokens_per_seq: 4,
            warmup: 2,
            min_reps: 5,
            max_reps: 60,
            target_rel_err: 0.02,
        }
    }
}

/// Log-spaced grid 1..=max with about `per_octave` points per doubling.
pub fn log_grid(max: u32, per_octave: u32) -> Vec<u32> {
    let mut g: Vec<u32> = Vec::new();
    let steps = ((max as f64).log2() * per_octave as f64).ceil() as u32;
    for i in 0..=steps {
        let b = 2f64.powf(i as f64 / per_octave as f64).round() as u32;
        let b = b.clamp(1, max);
        if g.last() != Some(&b) {
            g.push(b);
        }
    }
    g
}

/// One measured point: mean seconds per forward and its relative standard error.
pub struct Point {
    pub b: u32,
    pub seconds: f64,
    pub rel_err: f64,
    pub reps: usize,
    /// Repetitions dropped because the kernel pool ran them serially.
    pub dropped: usize,
}

/// Measures SPS(B) for every B of the grid. `progress(point)` is called for each at the end.
///
/// The points are measured in interleaved rounds (one step of every B per round, the order
/// reversed every other round), not one B after another: a machine whose speed drifts (a
/// neighbour's load, frequency, another process taking a core for a while) then slows every
/// point alike instead of making the points measured during the slow minutes look dear, and
/// the cost table's ratios SPS(B)/SPS(1), which are what the scheduler acts on, stay right.
/// A point's time is the median of its repetitions.
///
/// All points share one set of sequences (as many as the largest B needs, their contexts
/// filled once); B tokens go to the first `ceil(B / tokens_per_seq)` of them.
pub fn measure(
    model: &Model,
    kv: &mut KvCache,
    opts: &ProfileOptions,
    progress: &mut dyn FnMut(&Point),
) -> Result<Vec<Point>> {
    let grid: Vec<usize> = opts.grid.iter().map(|&b| b as usize).collect();
    let per_of = |b| per_seq(opts, b);
    let nseq = grid
        .iter()
        .map(|&b| b.div_ceil(per_of(b)))
        .max()
        .unwrap_or(0);
    let width = grid.iter().map(|&b| per_of(b)).max().unwrap_or(1);
    let mut tables = Vec::new();
    for _ in 0..nseq {
        let mut t = Vec::new();
        anyhow::ensure!(
            kv.ensure(&mut t, opts.context + width),
            "KV cache too small to profile {nseq} sequences with context {}",
            opts.context
        );
        tables.push(t);
    }
    let result = measure_on(model, kv, opts, &grid, &tables, progress);
    for mut t in tables {
        kv.truncate(&mut t, 0);
    }
    result
}

/// Tokens each sequence contributes to a step of `b` tokens.
fn per_seq(opts: &ProfileOptions, b: usize) -> usize {
    opts.tokens_per_seq.clamp(1, b.max(1))
}

fn measure_on(
    model: &Model,
    kv: &mut KvCache,
    opts: &ProfileOptions,
    grid: &[usize],
    tables: &[Vec<u32>],
    progress: &mut dyn FnMut(&Point),
) -> Result<Vec<Point>> {
    // Fill the contexts (one batched prefill), then time the B-token steps.
    let vocab = model.cfg.vocab_size as u32;
    let ctx_batch: Vec<SeqBatch> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| SeqBatch {
            tokens: (0..opts.context)
                .map(|j| ((i * 7919 + j * 104_729) as u32 % (vocab - 1)) + 1)
                .collect(),
            start_pos: 0,
            block_table: t.clone(),
            num_logits: 0,
        })
        .collect();
    if opts.context > 0 && !ctx_batch.is_empty() {
        model.forward(&ctx_batch, kv, &[])?;
    }
    let steps: Vec<Vec<SeqBatch>> = grid
        .iter()
        .map(|&b| {
            let per = per_seq(opts, b);
            let mut left = b;
            tables
                .iter()
                .map(|t| {
                    let n = per.min(left);
                    left -= n;
                    SeqBatch {
                        tokens: (0..n as u32).map(|j| 100 + j).collect(),
                        start_pos: opts.context,
                        block_table: t.clone(),
                        num_logits: n,
                    }
                })
                .filter(|s| !s.tokens.is_empty())
                .collect()
        })
        .collect();
    for step in &steps {
        for _ in 0..opts.warmup {
            model.forward(step, kv, &[])?;
        }
    }
    let pool = crate::kernels::pool::global();
    let samples = sample_interleaved(steps.len(), opts, &mut |i| {
        let (serial, fallbacks) = (pool.serial_now(), pool.fallbacks());
        let t0 = Instant::now();
        let out = model.forward(&steps[i], kv, &[])?;
        // Logits must reach the host, as in serving.
        let _ = out.logits.to_vec2::<f32>()?;
        let dt = t0.elapsed().as_secs_f64();
        // A step the kernel pool ran on one thread (it saw a worker descheduled: another
        // process took a core for a moment) measures that moment, not the step, and is
        // 1.5-2x slower.
        let serial = serial || pool.serial_now() || pool.fallbacks() != fallbacks;
        Ok((dt, serial))
    })?;
    let mut points = Vec::new();
    for (&b, s) in grid.iter().zip(samples) {
        let p = s.point(b as u32);
        progress(&p);
        points.push(p);
    }
    Ok(points)
}

/// One point's repetitions.
#[derive(Debug, Default, Clone)]
struct Samples {
    times: Vec<f64>,
    dropped: usize,
}

impl Samples {
    /// Relative standard error of the mean.
    fn rel_err(&self) -> f64 {
        let n = self.times.len() as f64;
        if n < 2.0 {
            return f64::INFINITY;
        }
        let mean = self.times.iter().sum::<f64>() / n;
        let var = self.times.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (var / n).sqrt() / mean
    }

    fn point(&self, b: u32) -> Point {
        let mut t = self.times.clone();
        t.sort_by(f64::total_cmp);
        let m = t.len();
        let median = if m == 0 {
            f64::NAN
        } else if m % 2 == 1 {
            t[m / 2]
        } else {
            0.5 * (t[m / 2 - 1] + t[m / 2])
        };
        Point {
            b,
            seconds: median,
            rel_err: self.rel_err(),
            reps: m,
            dropped: self.dropped,
        }
    }
}

/// Rounds of one sample of every point (`sample(i)`: seconds and whether the step ran
/// serially), ascending then descending, until every point has `min_reps` samples and a
/// relative standard error below the target, or `max_reps` rounds. A serial repetition is
/// dropped and repeated, up to `max_reps` drops per point (then kept), so one such moment
/// cannot make a point look dear and a machine that is always contended still gets a table.
fn sample_interleaved(
    points: usize,
    opts: &ProfileOptions,
    sample: &mut dyn FnMut(usize) -> Result<(f64, bool)>,
) -> Result<Vec<Samples>> {
    let mut s = vec![Samples::default(); points];
    let min_reps = opts.min_reps.max(1);
    for round in 0..opts.max_reps.max(min_reps) {
        for k in 0..points {
            let i = if round % 2 == 0 { k } else { points - 1 - k };
            loop {
                let (t, serial) = sample(i)?;
                if serial && s[i].dropped < opts.max_reps {
                    s[i].dropped += 1;
                    continue;
                }
                s[i].times.push(t);
                break;
            }
        }
        let done = |p: &Samples| p.times.len() >= min_reps && p.rel_err() < opts.target_rel_err;
        if s.iter().all(done) {
            break;
        }
    }
    Ok(s)
}

/// What [`measure_draft`] measures.
#[derive(Debug, Clone)]
pub struct DraftProfileOptions {
    /// Numbers of drafting sequences.
    pub seqs: Vec<u32>,
    /// Draft lengths `1..=max_len` (at most the drafter's block size).
    pub max_len: usize,
    /// Context positions already in the drafter cache of every sequence.
    pub context: usize,
    /// Timed repetitions per point (after one warm-up); the median is kept.
    pub reps: usize,
}

impl Default for DraftProfileOptions {
    fn default() -> Self {
        Self {
            seqs: vec![1, 2, 4, 8, 16, 32, 64],
            max_len: 16,
            context: 256,
            reps: 7,
        }
    }
}

/// Rows fed into the drafter's context per sequence and call in the measurement: about
/// what a sequence commits per verify cycle.
const DRAFT_FEED_ROWS: usize = 2;

/// Seconds of one drafter call (the context feed of [`DRAFT_FEED_ROWS`] committed rows per
/// sequence, then one batched greedy draft) for every `(sequences, length)` of the grid, as
/// serving runs it: `[(n, l, seconds)]` sorted, for [`CostTable::draft_points`].
///
/// Each timed call follows a one-token target forward, as every draft in serving does: that
/// forward streams the target's weights through the caches, so the drafter reads its own
/// from memory again (back-to-back calls found them cached and cost about half).
pub fn measure_draft(
    target: &Model,
    d: &mut Drafter,
    opts: &DraftProfileOptions,
    progress: &mut dyn FnMut(u32, u32, f64),
) -> Result<Vec<(u32, u32, f64)>> {
    let hidden = target.cfg.hidden_size;
    let layers = d.model.target_layers().len();
    let max_len = opts.max_len.clamp(1, d.model.config().block_size);
    let dev = target.device.clone();
    let params = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let randn = |rows: usize| -> Result<Vec<Tensor>> {
        (0..layers)
            .map(|_| Ok(Tensor::randn(0f32, 1.0, (rows, hidden), &dev)?))
            .collect()
    };
    let ctx_hidden = randn(opts.context.max(1))?;
    let step_hidden = randn(DRAFT_FEED_ROWS)?;
    // The target forward before each timed call: one token at position 0 of a one-block
    // cache of its own.
    let block = 16;
    let mut target_kv = KvCache::new_as(
        target.cfg.num_layers,
        target.cfg.kv_dim(),
        block
            * KvCache::bytes_per_token_as(
                target.cfg.num_layers,
                target.cfg.kv_dim(),
                candle_core::DType::F16,
            ),
        block,
        &dev,
        candle_core::DType::F16,
    )?;
    let mut target_table = Vec::new();
    anyhow::ensure!(
        target_kv.ensure(&mut target_table, 1),
        "no block for the target forward"
    );
    let target_step = SeqBatch {
        tokens: vec![1],
        start_pos: 0,
        block_table: target_table,
        num_logits: 1,
    };
    let mut out = Vec::new();
    for &n in &opts.seqs {
        let n = n.max(1) as usize;
        let mut tables = Vec::new();
        for _ in 0..n {
            let mut t = Vec::new();
            anyhow::ensure!(
                d.kv.ensure(&mut t, opts.context + DRAFT_FEED_ROWS + max_len),
                "drafter KV cache too small to profile {n} drafting sequences"
            );
            tables.push(t);
        }
        let feeds: Vec<ContextFeed> = tables
            .iter()
            .map(|t| ContextFeed {
                table: t,
                start: 0,
                hidden: &ctx_hidden,
            })
            .collect();
        if opts.context > 0 {
            d.model.append_contexts(&mut d.kv, &feeds)?;
        }
        let mut rngs: Vec<ChaCha8Rng> = (0..n)
            .map(|i| ChaCha8Rng::seed_from_u64(i as u64))
            .collect();
        for l in 1..=max_len {
            let mut times = Vec::new();
            for rep in 0..=opts.reps.max(1) {
                // Every rep drafts the same tokens: priced as unseen ones.
                d.model.forget_memos();
                target.forward(std::slice::from_ref(&target_step), &mut target_kv, &[])?;
                let t0 = Instant::now();
                let feeds: Vec<ContextFeed> = tables
                    .iter()
                    .map(|t| ContextFeed {
                        table: t,
                        start: opts.context,
                        hidden: &step_hidden,
                    })
                    .collect();
                let last = d.model.append_contexts(&mut d.kv, &feeds)?;
                let mut reqs: Vec<DraftRequest> = tables
                    .iter()
                    .zip(rngs.iter_mut())
                    .zip(&last)
                    .enumerate()
                    .map(|(i, ((t, rng), c))| DraftRequest {
                        anchor: 100 + i as u32,
                        anchor_pos: opts.context + DRAFT_FEED_ROWS,
                        block_table: t,
                        gamma: l,
                        params: &params,
                        history: None,
                        rng,
                        last_context: c.as_ref(),
                    })
                    .collect();
                d.model.propose(&mut d.kv, target, &mut reqs)?;
                if rep > 0 {
                    times.push(t0.elapsed().as_secs_f64());
                }
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
            let med = times[times.len() / 2];
            progress(n as u32, l as u32, med);
            out.push((n as u32, l as u32, med));
        }
        for mut t in tables {
            d.kv.truncate(&mut t, 0);
        }
    }
    Ok(out)
}

/// Builds a valid cost table from measured points, their step times made non-decreasing
/// and convex in B ([`convex_step_times`]).
pub fn cost_table(
    model: &Model,
    device: &str,
    node_type: Option<String>,
    drafter_id: Option<String>,
    points: &[Point],
    draft_points: Vec<(u32, u32, f64)>,
) -> CostTable {
    let times: Vec<(u32, f64)> = points.iter().map(|p| (p.b, p.seconds)).collect();
    let pts = convex_step_times(&times)
        .into_iter()
        .map(|(b, t)| (b, 1.0 / t))
        .collect();
    CostTable {
        schema: if draft_points.is_empty() {
            1
        } else {
            COST_TABLE_SCHEMA
        },
        model_id: model.id.clone(),
        drafter_id,
        engine_version: crate::VERSION.to_string(),
        device: device.to_string(),
        node_type,
        dtype: model.weights.dtype.clone(),
        measured_at: rfc3339_now(),
        points: pts,
        draft_points,
    }
}

/// Measured step times `(B, seconds)` (B ascending) read on their lower convex hull, then
/// made non-decreasing: each extra token costs at least what the one before it did, as a
/// forward's cost grows (flat while the weight stream dominates, then linear in B).
///
/// Measurements are not: an odd slow point (B = 64 measured slower than B = 91 here, each
/// within 2 %) or a noisy fast one makes the step time concave somewhere, and a planner
/// reading it sees tokens beyond that point as nearly free and drafts where drafting only
/// costs. Carrying the running minimum of SPS forward (the table's old rule) keeps the
/// slow point and makes everything up to the next one free. On the hull the marginal cost
/// of a token never falls as B grows, so no such gift exists; a point above the hull (a
/// measurement slower than its neighbours suggest) is read on it.
pub fn convex_step_times(points: &[(u32, f64)]) -> Vec<(u32, f64)> {
    // Lower hull (Andrew's monotone chain): drop a vertex that lies on or above the chord
    // of its neighbours.
    let mut hull: Vec<(f64, f64)> = Vec::with_capacity(points.len());
    for &(b, t) in points {
        let p = (b as f64, t);
        while hull.len() >= 2 {
            let (o, a) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            let cross = (a.0 - o.0) * (p.1 - o.1) - (a.1 - o.1) * (p.0 - o.0);
            if cross > 0.0 {
                break;
            }
            hull.pop();
        }
        hull.push(p);
    }
    let on_hull = |x: f64| -> f64 {
        let i = hull.partition_point(|h| h.0 <= x);
        if i == 0 {
            return hull[0].1;
        }
        if i == hull.len() {
            return hull[i - 1].1;
        }
        let (a, b) = (hull[i - 1], hull[i]);
        a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)
    };
    let mut floor = 0f64;
    points
        .iter()
        .map(|&(b, _)| {
            floor = floor.max(on_hull(b as f64));
            (b, floor)
        })
        .collect()
}

/// Current UTC time as RFC 3339 (seconds precision).
pub fn rfc3339_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_log_spaced_and_complete() {
        let g = log_grid(64, 2);
        assert_eq!(g.first(), Some(&1));
        assert_eq!(g.last(), Some(&64));
        assert!(g.windows(2).all(|w| w[0] < w[1]));
        assert!(g.contains(&8) && g.contains(&32));
    }

    /// The measurement of this session's sweep (B = 64 slower than 91): on the hull the
    /// marginal cost per token never falls, every point at or below its measurement, and a
    /// consistent table (flat, then linear) comes back unchanged.
    #[test]
    fn step_times_are_made_convex_and_non_decreasing() {
        let sps = [
            (1, 131.34),
            (2, 148.18),
            (3, 138.85),
            (4, 136.92),
            (6, 105.35),
            (8, 91.65),
            (11, 64.36),
            (16, 42.87),
            (23, 29.22),
            (32, 30.62),
            (45, 20.60),
            (64, 10.22),
            (91, 11.73),
            (128, 7.47),
        ];
        let measured: Vec<(u32, f64)> = sps.iter().map(|&(b, s)| (b, 1.0 / s)).collect();
        let t = convex_step_times(&measured);
        assert_eq!(t.len(), measured.len());
        for w in t.windows(2) {
            assert!(w[1].1 >= w[0].1, "non-decreasing: {w:?}");
        }
        let slope = |a: (u32, f64), b: (u32, f64)| (b.1 - a.1) / (b.0 - a.0) as f64;
        for w in t.windows(3) {
            assert!(
                slope(w[1], w[2]) >= slope(w[0], w[1]) - 1e-12,
                "marginal cost falls at {w:?}"
            );
        }
        for ((b, x), (_, m)) in t.iter().zip(&measured) {
            assert!(*x <= m.max(measured[0].1) + 1e-12, "B={b}: {x} above {m}");
        }
        // The slow B = 64 is read on the chord from 45 to 91, no longer as dear as 91.
        let at = |b: u32| t.iter().find(|p| p.0 == b).unwrap().1;
        assert!(at(64) < at(91) && at(64) < 1.0 / 10.22 * 0.8);
        // Flat to B = 4, then linear: unchanged.
        let clean: Vec<(u32, f64)> = [1u32, 2, 4, 8, 16, 32]
            .iter()
            .map(|&b| (b, 0.01 + 0.001 * b.saturating_sub(4) as f64))
            .collect();
        let back = convex_step_times(&clean);
        for (a, b) in back.iter().zip(&clean) {
            assert!((a.1 - b.1).abs() < 1e-15, "{a:?} vs {b:?}");
        }
    }

    /// A machine that slows down steadily while profiling (drift to 1.3x over the run) and
    /// has one burst of contention: measured one B after another, the last points would look
    /// ~25 % dearer than they are; in interleaved rounds every ratio to B = 1 stays within
    /// 5 % of the truth, and the burst does not show.
    #[test]
    fn interleaved_rounds_keep_ratios_under_drift() {
        let truth = [1.0, 1.1, 1.3, 1.5, 2.4, 4.0];
        let opts = ProfileOptions {
            min_reps: 9,
            max_reps: 9,
            target_rel_err: 0.0,
            ..Default::default()
        };
        let total = (truth.len() * opts.max_reps) as f64;
        let mut calls = 0usize;
        let mut dropped_once = false;
        let s = sample_interleaved(truth.len(), &opts, &mut |i| {
            calls += 1;
            if i == 2 && !dropped_once {
                dropped_once = true;
                return Ok((99.0, true));
            }
            let drift = 1.0 + 0.3 * calls as f64 / total;
            let burst = if (20..23).contains(&calls) { 3.0 } else { 1.0 };
            Ok((truth[i] * drift * burst, false))
        })
        .unwrap();
        let t: Vec<f64> = s
            .iter()
            .enumerate()
            .map(|(i, s)| s.point(i as u32).seconds)
            .collect();
        for (i, (&m, &x)) in t.iter().zip(&truth).enumerate() {
            let (got, want) = (m / t[0], x / truth[0]);
            assert!(
                (got / want - 1.0).abs() < 0.05,
                "B#{i}: ratio {got} vs {want}"
            );
        }
        assert!(s.iter().all(|p| p.times.len() == 9));
        assert_eq!((s[2].dropped, s[0].dropped), (1, 0));
        // The same drift measured point after point: the last point's ratio is far off.
        let seq: Vec<f64> = (0..truth.len())
            .map(|i| {
                let mid = (i as f64 + 0.5) / truth.len() as f64;
                truth[i] * (1.0 + 0.3 * mid)
            })
            .collect();
        assert!(seq[5] / seq[0] / (truth[5] / truth[0]) > 1.2);
    }

    #[test]
    fn timestamp_shape() {
        let t = rfc3339_now();
        assert_eq!(t.len(), 20);
        assert!(t.starts_with("20") && t.ends_with('Z'));
    }
}
