//! The online on/off experiment (`serve --policy-experiment dspark,none[,fixed:G]
//! --experiment-window SECS`): the engine alternates verify policies ("arms") in fixed
//! windows on live traffic and records, per window, what each arm delivered at what load.
//! The DSpark paper compares policies offline only; this answers "does speculation pay on
//! MY traffic" with the traffic itself.
//!
//! Switching happens between steps, so every step is verified under one policy and the
//! output stays lossless. A sequence's drafter context is dropped when its arm turns
//! speculation off (it decodes plainly to its end). So a window that turns speculation back on
//! starts with sequences that cannot speculate: until the last of them finishes (or one window
//! length has passed) the window is *settling*, and nothing of it is counted (its length is
//! recorded as `unsettled_s`); its measured part, one window long, starts after. Every counted
//! step thus runs the window's arm on all its sequences (before, such windows counted plain
//! decoding as the speculating arm's, a bias towards `none` that grew with load).
//!
//! Per arm, exported as metrics (label `policy`): committed tokens, wall seconds, the
//! integral of running requests over time (so tokens / running-seconds is the per-user
//! rate and running-seconds / seconds the mean load), TTFT and ITL histograms, windows.
//! `GET /experiment` lists the finished windows; `dspark-engine experiment-report` pairs
//! neighbouring windows of two arms whose loads match and reports the throughput ratio with
//! a confidence interval ([`report`], pure).

use crate::speculative::VerifyPolicy;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// One arm: its label (as given: `dspark`, `none`, `fixed:3`) and its policy (`None`:
/// speculation off).
#[derive(Debug, Clone, PartialEq)]
pub struct Arm {
    pub label: String,
    pub policy: Option<VerifyPolicy>,
}

/// Parses `--policy-experiment`: comma-separated `dspark`, `none`, `fixed:G`,
/// `threshold:T` (the contract's grammar, shared with the operator's CRD rule); `gamma` is
/// the block size of `dspark` and `threshold`.
pub fn parse_arms(spec: &str, gamma: usize) -> Result<Vec<Arm>, String> {
    use dspark_types::contract::experiment::{self, ArmKind};
    Ok(experiment::parse_arms(spec)?
        .into_iter()
        .map(|(label, kind)| Arm {
            label,
            policy: match kind {
                ArmKind::None => None,
                ArmKind::Dspark => Some(VerifyPolicy::Dspark { gamma }),
                ArmKind::Fixed(g) => Some(VerifyPolicy::Fixed { gamma: g as usize }),
                ArmKind::Threshold(t) => Some(VerifyPolicy::Threshold {
                    gamma,
                    threshold: t,
                }),
            },
        })
        .collect())
}

/// One finished window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub arm: String,
    /// Seconds since the experiment started, at the window's start.
    pub start_s: f64,
    pub seconds: f64,
    /// Tokens committed to requests in the window.
    pub tokens: u64,
    /// Integral of the running requests over the window (request-seconds).
    pub running_seconds: f64,
    /// Requests that finished in the window.
    pub finished: u64,
    /// Seconds before the measured part, while sequences of a `none` window that could not
    /// speculate still ran (not counted in the other fields).
    #[serde(default)]
    pub unsettled_s: f64,
}

impl Window {
    /// Committed tokens per second.
    pub fn throughput(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
    /// Mean running requests.
    pub fn load(&self) -> f64 {
        self.running_seconds / self.seconds.max(1e-9)
    }
    /// Tokens per second per running request.
    pub fn per_user(&self) -> f64 {
        self.tokens as f64 / self.running_seconds.max(1e-9)
    }
}

/// The experiment's live state in the engine thread.
pub struct Experiment {
    pub arms: Vec<Arm>,
    pub window: Duration,
    current: usize,
    t0: Instant,
    started: Instant,
    last_tick: Instant,
    acc: Window,
    /// Sequences of the previous arm that decode without a drafter in this speculating
    /// window: while any runs (until `settle_by`), the window is settling.
    carry: std::collections::HashSet<u64>,
    settle_by: Option<Instant>,
    /// Finished windows, shared with the HTTP side.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<Window>>>,
}

impl Experiment {
    pub fn new(arms: Vec<Arm>, window: Duration, now: Instant) -> Self {
        let acc = Window {
            arm: arms[0].label.clone(),
            start_s: 0.0,
            seconds: 0.0,
            tokens: 0,
            running_seconds: 0.0,
            finished: 0,
            unsettled_s: 0.0,
        };
        Self {
            arms,
            window,
            current: 0,
            t0: now,
            started: now,
            last_tick: now,
            acc,
            carry: Default::default(),
            settle_by: None,
            log: Default::default(),
        }
    }

    /// Whether the window is counting (not settling).
    pub fn measuring(&self) -> bool {
        self.settle_by.is_none()
    }

    /// The arm in force.
    pub fn arm(&self) -> &Arm {
        &self.arms[self.current]
    }

    /// Accounts the time since the last tick with the `running` sequences (returns the
    /// seconds counted: 0 while settling); when the window is over, closes it and switches to
    /// the next arm (the second value says so; the caller switches the policy).
    pub fn tick(&mut self, now: Instant, running: &[u64]) -> (f64, Option<&Arm>) {
        let dt = now.saturating_duration_since(self.last_tick).as_secs_f64();
        self.last_tick = now;
        if let Some(by) = self.settle_by {
            self.acc.unsettled_s += dt;
            if self.carry.is_empty() || now >= by {
                self.carry.clear();
                self.settle_by = None;
                self.started = now;
            }
            return (0.0, None);
        }
        self.acc.running_seconds += dt * running.len() as f64;
        if now.saturating_duration_since(self.started) < self.window {
            return (dt, None);
        }
        self.acc.seconds = now.saturating_duration_since(self.started).as_secs_f64();
        let next = (self.current + 1) % self.arms.len();
        let done = std::mem::replace(
            &mut self.acc,
            Window {
                arm: self.arms[next].label.clone(),
                start_s: now.saturating_duration_since(self.t0).as_secs_f64(),
                seconds: 0.0,
                tokens: 0,
                running_seconds: 0.0,
                finished: 0,
                unsettled_s: 0.0,
            },
        );
        if let Ok(mut log) = self.log.lock() {
            log.push(done);
        }
        // Speculation back on: the running sequences lost their drafter context.
        if self.arms[next].policy.is_some() && self.arms[self.current].policy.is_none() {
            self.carry = running.iter().copied().collect();
            if !self.carry.is_empty() {
                self.settle_by = Some(now + self.window);
            }
        }
        self.current = next;
        self.started = now;
        (dt, Some(&self.arms[next]))
    }

    /// `n` tokens were committed to requests.
    pub fn tokens(&mut self, n: usize) {
        if self.measuring() {
            self.acc.tokens += n as u64;
        }
    }

    /// Request `id` finished.
    pub fn finished(&mut self, id: u64) {
        self.carry.remove(&id);
        if self.measuring() {
            self.acc.finished += 1;
        }
    }
}

/// One arm's summary in a [`Report`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmSummary {
    pub arm: String,
    pub windows: usize,
    pub throughput: f64,
    pub per_user: f64,
    pub load: f64,
}

/// Throughput ratio of `arm` over `baseline` from load-matched neighbouring windows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub arm: String,
    pub baseline: String,
    /// Pairs used (neighbouring windows, loads within the tolerance).
    pub pairs: usize,
    /// Geometric mean of the paired throughput ratios.
    pub ratio: f64,
    /// 95 % confidence interval of the ratio (t interval on the log ratios); `None` below
    /// two pairs.
    pub ci95: Option<(f64, f64)>,
    /// The same for per-user tokens/s.
    pub per_user_ratio: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub arms: Vec<ArmSummary>,
    pub comparisons: Vec<Comparison>,
}

/// Two-sided 97.5 % quantile of Student's t with `df` degrees of freedom.
fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if df == 0 {
        f64::INFINITY
    } else {
        T.get(df - 1).copied().unwrap_or(1.96)
    }
}

/// Summarises finished windows: per arm totals (windows with no running request are
/// skipped: nothing to compare), and for every arm against `baseline` the throughput ratio
/// over pairs of neighbouring windows (each window of the arm with the nearest baseline
/// window before or after it) whose mean loads differ by at most `load_tolerance`
/// (relative), with a 95 % confidence interval. `skip` drops that many windows at the
/// start (warm-up).
pub fn report(windows: &[Window], baseline: &str, load_tolerance: f64, skip: usize) -> Report {
    let ws: Vec<&Window> = windows
        .iter()
        .skip(skip)
        .filter(|w| w.running_seconds > 0.0 && w.seconds > 0.0)
        .collect();
    let mut labels: Vec<&str> = Vec::new();
    for w in &ws {
        if !labels.contains(&w.arm.as_str()) {
            labels.push(&w.arm);
        }
    }
    let arms = labels
        .iter()
        .map(|&l| {
            let mine: Vec<&&Window> = ws.iter().filter(|w| w.arm == l).collect();
            let secs: f64 = mine.iter().map(|w| w.seconds).sum();
            let toks: f64 = mine.iter().map(|w| w.tokens as f64).sum();
            let run: f64 = mine.iter().map(|w| w.running_seconds).sum();
            ArmSummary {
                arm: l.to_string(),
                windows: mine.len(),
                throughput: toks / secs.max(1e-9),
                per_user: toks / run.max(1e-9),
                load: run / secs.max(1e-9),
            }
        })
        .collect();
    let mut comparisons = Vec::new();
    for &l in labels.iter().filter(|&&l| l != baseline) {
        let (mut logs, mut pu) = (Vec::new(), Vec::new());
        for (i, w) in ws.iter().enumerate().filter(|(_, w)| w.arm == l) {
            let before = ws[..i].iter().rev().find(|b| b.arm == baseline);
            let after = ws[i + 1..].iter().find(|b| b.arm == baseline);
            let best = [before, after].into_iter().flatten().min_by(|a, b| {
                let da = (a.load() - w.load()).abs();
                let db = (b.load() - w.load()).abs();
                da.partial_cmp(&db).unwrap_or(std::cmp::Ordering::Equal)
            });
            let Some(b) = best else { continue };
            let rel = (b.load() - w.load()).abs() / b.load().max(w.load()).max(1e-9);
            if rel > load_tolerance || b.tokens == 0 || w.tokens == 0 {
                continue;
            }
            logs.push((w.throughput() / b.throughput()).ln());
            pu.push((w.per_user() / b.per_user()).ln());
        }
        if logs.is_empty() {
            continue;
        }
        let n = logs.len() as f64;
        let mean = logs.iter().sum::<f64>() / n;
        let ci95 = (logs.len() >= 2).then(|| {
            let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
            let half = t975(logs.len() - 1) * (var / n).sqrt();
            ((mean - half).exp(), (mean + half).exp())
        });
        comparisons.push(Comparison {
            arm: l.to_string(),
            baseline: baseline.to_string(),
            pairs: logs.len(),
            ratio: mean.exp(),
            ci95,
            per_user_ratio: (pu.iter().sum::<f64>() / n).exp(),
        });
    }
    Report { arms, comparisons }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_parse_with_clear_errors() {
        let a = parse_arms("dspark,none,fixed:3", 7).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].policy, Some(VerifyPolicy::Dspark { gamma: 7 }));
        assert_eq!(a[1].policy, None);
        assert_eq!(a[2].policy, Some(VerifyPolicy::Fixed { gamma: 3 }));
        for (bad, needle) in [
            ("dspark", "at least two"),
            ("dspark,dspark", "twice"),
            ("dspark,fixed:0", "fixed:G"),
            ("dspark,threshold:2", "threshold:T"),
            ("dspark,ngram", "unknown arm 'ngram'"),
        ] {
            let e = parse_arms(bad, 4).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn windows_alternate_and_account_load() {
        let arms = parse_arms("dspark,none", 4).unwrap();
        let t = Instant::now();
        let mut e = Experiment::new(arms, Duration::from_secs(10), t);
        assert_eq!(e.arm().label, "dspark");
        e.tokens(100);
        assert_eq!(e.tick(t + Duration::from_secs(5), &[1, 2]), (5.0, None));
        let (dt, next) = e.tick(t + Duration::from_secs(10), &[1, 2, 3, 4]);
        assert_eq!((dt, next.unwrap().label.as_str()), (5.0, "none"));
        e.tokens(50);
        e.finished(1);
        assert_eq!(
            e.tick(t + Duration::from_secs(20), &[]).1.unwrap().label,
            "dspark"
        );
        // Nothing ran into the speculating window: it measures at once.
        assert!(e.measuring());
        let log = e.log.lock().unwrap().clone();
        assert_eq!(log.len(), 2);
        assert_eq!(log[0].arm, "dspark");
        assert_eq!(log[0].tokens, 100);
        assert!((log[0].running_seconds - (5.0 * 2.0 + 5.0 * 4.0)).abs() < 1e-9);
        assert!((log[0].load() - 3.0).abs() < 1e-9);
        assert_eq!(
            (log[1].arm.as_str(), log[1].tokens, log[1].finished),
            ("none", 50, 1)
        );
        assert!((log[1].start_s - 10.0).abs() < 1e-9);
    }

    #[test]
    fn a_window_turning_speculation_on_counts_only_once_the_plain_sequences_are_gone() {
        let arms = parse_arms("none,dspark", 4).unwrap();
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        let mut e = Experiment::new(arms, Duration::from_secs(10), t);
        e.tick(s(5), &[7, 8]);
        // none -> dspark with sequences 7 and 8 running (no drafter context any more).
        assert_eq!(e.tick(s(10), &[7, 8]).1.unwrap().label, "dspark");
        assert!(!e.measuring());
        e.tokens(40);
        e.finished(7);
        assert_eq!(e.tick(s(12), &[8, 9]), (0.0, None));
        e.finished(8);
        // The last plain sequence is gone: this tick ends the settling...
        assert_eq!(e.tick(s(13), &[9]), (0.0, None));
        assert!(e.measuring());
        e.tokens(100);
        e.finished(9);
        // ...and the measured part lasts one window from there.
        assert_eq!(e.tick(s(20), &[10]), (7.0, None));
        assert_eq!(e.tick(s(23), &[10]).1.unwrap().label, "none");
        let log = e.log.lock().unwrap().clone();
        let d = &log[1];
        assert_eq!((d.arm.as_str(), d.tokens, d.finished), ("dspark", 100, 1));
        assert!((d.seconds - 10.0).abs() < 1e-9 && (d.unsettled_s - 3.0).abs() < 1e-9);
        assert!((d.running_seconds - 10.0).abs() < 1e-9, "{d:?}");
        // A sequence that outlives the window length stops the wait there.
        e.tick(s(33), &[11]);
        assert!(!e.measuring());
        e.tick(s(40), &[11]);
        assert!(!e.measuring());
        e.tick(s(43), &[11]);
        assert!(e.measuring());
    }

    fn w(arm: &str, tokens: u64, load: f64) -> Window {
        Window {
            arm: arm.into(),
            start_s: 0.0,
            seconds: 10.0,
            tokens,
            running_seconds: 10.0 * load,
            finished: 1,
            unsettled_s: 0.0,
        }
    }

    #[test]
    fn report_pairs_neighbours_at_matched_load() {
        // dspark 1.2x none at load 4; one window at load 16 has no matching neighbour.
        let ws = vec![
            w("dspark", 1200, 4.0),
            w("none", 1000, 4.0),
            w("dspark", 1260, 4.2),
            w("none", 1050, 4.1),
            w("dspark", 3000, 16.0),
            w("none", 990, 3.9),
        ];
        let r = report(&ws, "none", 0.25, 0);
        assert_eq!(r.arms.len(), 2);
        let c = &r.comparisons[0];
        assert_eq!(
            (c.arm.as_str(), c.baseline.as_str(), c.pairs),
            ("dspark", "none", 2)
        );
        assert!((c.ratio - 1.2).abs() < 0.01, "{c:?}");
        let (lo, hi) = c.ci95.unwrap();
        assert!(lo <= c.ratio && c.ratio <= hi);
        // Identical ratios: a zero-width interval.
        assert!((hi - lo).abs() < 1e-9);
        // A wider spread widens it.
        let ws2 = vec![
            w("dspark", 1400, 4.0),
            w("none", 1000, 4.0),
            w("dspark", 1000, 4.0),
            w("none", 1000, 4.0),
        ];
        let c2 = &report(&ws2, "none", 0.25, 0).comparisons[0];
        let (lo2, hi2) = c2.ci95.unwrap();
        assert!(lo2 < 1.0 && hi2 > 1.3, "{c2:?}");
        // Skipping the warm-up window drops its pair.
        assert_eq!(report(&ws, "none", 0.25, 1).comparisons[0].pairs, 1);
        assert!(report(&ws, "nobody", 0.25, 0).comparisons.is_empty());
    }
}
