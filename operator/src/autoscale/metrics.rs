//! Engine metrics, pure part: parse the Prometheus text exposition of an engine pod, keep a
//! sliding window of scrapes per pod, and reduce a pool's window to a [`PoolObservation`]
//! (p95 from histogram bucket deltas, rates from counter deltas, acceptance length from the
//! speculative-decoding counters). The I/O that fetches the text lives in `source.rs`.

use std::collections::{BTreeMap, VecDeque};

use dspark_types::contract::metrics::{
    Family as Fam, Kind, E2E, ITL, RUNNING, SPEC_ACCEPTED_TOKENS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS,
    TTFT, WAITING,
};

/// A cumulative histogram: `(upper bound, cumulative count)` sorted by bound, `+Inf` last.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Histogram {
    fn add_bucket(&mut self, le: f64, v: f64) {
        match self.buckets.iter_mut().find(|(b, _)| *b == le) {
            Some((_, c)) => *c += v,
            None => {
                self.buckets.push((le, v));
                self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// `self - earlier`, bucket by bucket. A counter that went down means the pod restarted:
    /// then `self` alone is the increase.
    pub fn delta(&self, earlier: &Histogram) -> Histogram {
        if self.count < earlier.count {
            return self.clone();
        }
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, c)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(b, _)| *b == le)
                    .map_or(0.0, |x| x.1);
                (le, (c - before).max(0.0))
            })
            .collect();
        Histogram {
            buckets,
            count: self.count - earlier.count,
            sum: (self.sum - earlier.sum).max(0.0),
        }
    }

    /// Adds another histogram's buckets (same bounds expected; unknown bounds are inserted).
    pub fn merge(&mut self, other: &Histogram) {
        for &(le, c) in &other.buckets {
            self.add_bucket(le, c);
        }
        self.count += other.count;
        self.sum += other.sum;
    }

    /// The `q` quantile by linear interpolation inside the bucket, as Prometheus'
    /// `histogram_quantile` does. `None` without observations. A quantile in the `+Inf` bucket
    /// returns the highest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last().map(|b| b.1).unwrap_or(0.0);
        if total <= 0.0 || self.buckets.len() < 2 {
            return None;
        }
        let rank = q * total;
        let mut lower_bound = 0.0;
        let mut lower_count = 0.0;
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(lower_bound);
                }
                let in_bucket = c - lower_count;
                if in_bucket <= 0.0 {
                    return Some(le);
                }
                return Some(lower_bound + (le - lower_bound) * (rank - lower_count) / in_bucket);
            }
            lower_bound = le;
            lower_count = c;
        }
        Some(lower_bound)
    }
}

/// What one scrape of one engine pod says (label sets summed per family).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scrape {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub running: f64,
    pub waiting: f64,
    pub drafts: f64,
    pub draft_tokens: f64,
    pub accepted: f64,
}

/// Parses the Prometheus text exposition format, keeping the families above. Unknown lines are
/// skipped; a malformed value is an error naming the line.
pub fn parse_exposition(text: &str) -> Result<Scrape, String> {
    let mut s = Scrape::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(i) => {
                let close = line[i..]
                    .find('}')
                    .ok_or_else(|| format!("line {}: unclosed label set", n + 1))?;
                (&line[..i], &line[i + 1..i + close], &line[i + close + 1..])
            }
            None => {
                let sp = line.find(char::is_whitespace).unwrap_or(line.len());
                (&line[..sp], "", &line[sp..])
            }
        };
        let Some(target) = family(name) else { continue };
        let value_text = rest.split_whitespace().next().unwrap_or("");
        let value = parse_float(value_text)
            .ok_or_else(|| format!("line {}: bad value '{value_text}' for {name}", n + 1))?;
        match target {
            Family::Hist(h, Part::Bucket) => {
                let le = label(labels, "le")
                    .and_then(|v| parse_float(&v))
                    .ok_or_else(|| {
                        format!("line {}: bucket of {name} without a valid le", n + 1)
                    })?;
                s.hist_mut(h).add_bucket(le, value);
            }
            Family::Hist(h, Part::Count) => s.hist_mut(h).count += value,
            Family::Hist(h, Part::Sum) => s.hist_mut(h).sum += value,
            Family::Running => s.running += value,
            Family::Waiting => s.waiting += value,
            Family::Drafts => s.drafts += value,
            Family::DraftTokens => s.draft_tokens += value,
            Family::Accepted => s.accepted += value,
        }
    }
    Ok(s)
}

#[derive(Clone, Copy)]
enum Hist {
    Ttft,
    Itl,
    E2e,
}

#[derive(Clone, Copy)]
enum Part {
    Bucket,
    Count,
    Sum,
}

enum Family {
    Hist(Hist, Part),
    Running,
    Waiting,
    Drafts,
    DraftTokens,
    Accepted,
}

fn family(name: &str) -> Option<Family> {
    let part = |f: Fam| {
        debug_assert_eq!(f.kind, Kind::Histogram);
        match name.strip_prefix(f.name)? {
            "_bucket" => Some(Part::Bucket),
            "_count" => Some(Part::Count),
            "_sum" => Some(Part::Sum),
            _ => None,
        }
    };
    for (f, h) in [(TTFT, Hist::Ttft), (ITL, Hist::Itl), (E2E, Hist::E2e)] {
        if let Some(p) = part(f) {
            return Some(Family::Hist(h, p));
        }
    }
    [
        (RUNNING, Family::Running),
        (WAITING, Family::Waiting),
        (SPEC_DRAFTS, Family::Drafts),
        (SPEC_DRAFT_TOKENS, Family::DraftTokens),
        (SPEC_ACCEPTED_TOKENS, Family::Accepted),
    ]
    .into_iter()
    .find_map(|(f, fam)| f.owns(name).then_some(fam))
}

impl Scrape {
    fn hist_mut(&mut self, h: Hist) -> &mut Histogram {
        match h {
            Hist::Ttft => &mut self.ttft,
            Hist::Itl => &mut self.itl,
            Hist::E2e => &mut self.e2e,
        }
    }
}

fn parse_float(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

fn label(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(match e {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end?;
        if k == key {
            return Some(value);
        }
        rest = after[end + 1..].trim_start().trim_start_matches(',');
    }
    None
}

/// Whether a pool's metrics can be trusted for a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Every ready pod was scraped recently and the window spans enough time.
    Fresh,
    /// Some ready pods have no recent scrape, or the window is too short.
    Stale,
    /// No data at all.
    Missing,
}

/// A pool's load and latency over the SLO window: what the policy reads.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolObservation {
    pub freshness: Freshness,
    /// p95 time to first token, seconds (`None`: no request finished its prefill in the window).
    pub ttft_p95: Option<f64>,
    /// p95 inter-token latency, seconds.
    pub itl_p95: Option<f64>,
    /// Finished requests per second over all pods of the pool.
    pub request_rate: f64,
    /// Mean output tokens per finished request.
    pub output_tokens_per_request: Option<f64>,
    /// Mean requests in flight (running + waiting) over all pods, latest scrape.
    pub in_flight: f64,
    /// Requests waiting for admission, latest scrape.
    pub waiting: f64,
    /// Tokens committed per verification (accepted + 1).
    pub acceptance_length: Option<f64>,
    /// Draft tokens verified per verification (the B each request adds beyond its one token).
    pub draft_length: Option<f64>,
}

impl PoolObservation {
    /// An observation with no data.
    pub fn missing() -> Self {
        Self {
            freshness: Freshness::Missing,
            ttft_p95: None,
            itl_p95: None,
            request_rate: 0.0,
            output_tokens_per_request: None,
            in_flight: 0.0,
            waiting: 0.0,
            acceptance_length: None,
            draft_length: None,
        }
    }
}

/// Sliding window of timestamped scrapes per pod of one pool.
#[derive(Debug, Clone, Default)]
pub struct PoolWindow {
    pods: BTreeMap<String, VecDeque<(f64, Scrape)>>,
}

impl PoolWindow {
    /// Records a scrape of `pod` taken at `at` seconds (any monotonic clock).
    pub fn record(&mut self, pod: &str, at: f64, scrape: Scrape) {
        self.pods
            .entry(pod.to_string())
            .or_default()
            .push_back((at, scrape));
    }

    /// Drops scrapes older than `window` seconds before `now` (keeping one just outside, the
    /// baseline of the deltas) and pods not in `alive`.
    pub fn prune(&mut self, now: f64, window: f64, alive: &[String]) {
        self.pods.retain(|p, _| alive.contains(p));
        for q in self.pods.values_mut() {
            while q.len() >= 2 && q[1].0 <= now - window {
                q.pop_front();
            }
        }
    }

    /// Reduces the window to an observation. `ready` are the pool's ready pods; a pod without
    /// a scrape newer than `max_age` seconds, or a window spanning less than half of `window`,
    /// makes the result [`Freshness::Stale`].
    pub fn observe(
        &self,
        now: f64,
        window: f64,
        max_age: f64,
        ready: &[String],
    ) -> PoolObservation {
        let mut obs = PoolObservation::missing();
        let mut ttft = Histogram::default();
        let mut itl = Histogram::default();
        let mut e2e = Histogram::default();
        let (mut drafts, mut draft_tokens, mut accepted) = (0.0, 0.0, 0.0);
        let mut span = f64::INFINITY;
        let mut any = false;
        let mut stale = ready.is_empty();
        for pod in ready {
            let Some(q) = self.pods.get(pod) else {
                stale = true;
                continue;
            };
            let (Some((t0, first)), Some((t1, last))) = (q.front(), q.back()) else {
                stale = true;
                continue;
            };
            if now - t1 > max_age {
                stale = true;
                continue;
            }
            any = true;
            span = span.min(t1 - t0);
            ttft.merge(&last.ttft.delta(&first.ttft));
            itl.merge(&last.itl.delta(&first.itl));
            e2e.merge(&last.e2e.delta(&first.e2e));
            let d = |a: f64, b: f64| if a >= b { a - b } else { a };
            drafts += d(last.drafts, first.drafts);
            draft_tokens += d(last.draft_tokens, first.draft_tokens);
            accepted += d(last.accepted, first.accepted);
            obs.in_flight += last.running + last.waiting;
            obs.waiting += last.waiting;
        }
        if !any {
            return obs;
        }
        obs.freshness = if stale || span < window / 2.0 {
            Freshness::Stale
        } else {
            Freshness::Fresh
        };
        obs.ttft_p95 = ttft.quantile(0.95);
        obs.itl_p95 = itl.quantile(0.95);
        if span > 0.0 {
            obs.request_rate = e2e.count / span;
        }
        if e2e.count > 0.0 {
            obs.output_tokens_per_request = Some((itl.count + e2e.count) / e2e.count);
        }
        if drafts > 0.0 {
            obs.acceptance_length = Some(1.0 + accepted / drafts);
            obs.draft_length = Some(draft_tokens / drafts);
        }
        obs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"
# HELP dspark_time_to_first_token_seconds Time to first token.
# TYPE dspark_time_to_first_token_seconds histogram
dspark_time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 10
dspark_time_to_first_token_seconds_bucket{model_name="m",le="0.5"} 90
dspark_time_to_first_token_seconds_bucket{model_name="m",le="1"} 100
dspark_time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 100
dspark_time_to_first_token_seconds_count{model_name="m"} 100
dspark_time_to_first_token_seconds_sum{model_name="m"} 30.5
dspark_inter_token_latency_seconds_bucket{le="0.01"} 500
dspark_inter_token_latency_seconds_bucket{le="0.05"} 1000
dspark_inter_token_latency_seconds_bucket{le="+Inf"} 1000
dspark_inter_token_latency_seconds_count 1000
dspark_e2e_request_latency_seconds_bucket{le="+Inf"} 100
dspark_e2e_request_latency_seconds_count 100
dspark_num_requests_running 3
dspark_num_requests_waiting{model_name="m"} 1
dspark_spec_decode_num_drafts_total 200
dspark_spec_decode_num_draft_tokens_total 1400
dspark_spec_decode_num_accepted_tokens_total 600 1700000000000
some_other_metric{a="b"} 7
"#;

    #[test]
    fn parses_the_engine_families() {
        let s = parse_exposition(TEXT).unwrap();
        assert_eq!(s.ttft.buckets.len(), 4);
        assert_eq!(s.ttft.count, 100.0);
        assert_eq!(s.ttft.sum, 30.5);
        assert_eq!(s.itl.buckets[1], (0.05, 1000.0));
        assert_eq!((s.running, s.waiting), (3.0, 1.0));
        assert_eq!(
            (s.drafts, s.draft_tokens, s.accepted),
            (200.0, 1400.0, 600.0)
        );
    }

    #[test]
    fn names_a_bad_line() {
        let e = parse_exposition("dspark_num_requests_running abc").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        let e =
            parse_exposition("dspark_inter_token_latency_seconds_bucket{x=\"1\"} 3").unwrap_err();
        assert!(e.contains("le"), "{e}");
    }

    #[test]
    fn labels_with_escapes_and_commas() {
        assert_eq!(label(r#"a="x,\"y",le="0.5""#, "le").as_deref(), Some("0.5"));
        assert_eq!(
            label(r#"a="x,\"y",le="0.5""#, "a").as_deref(),
            Some("x,\"y")
        );
        assert_eq!(label(r#"a="1""#, "le"), None);
    }

    #[test]
    fn quantile_interpolates_like_prometheus() {
        let s = parse_exposition(TEXT).unwrap();
        // rank 95 of 100: inside (0.5, 1] holding 10 observations, 5 in.
        assert!((s.ttft.quantile(0.95).unwrap() - 0.75).abs() < 1e-9);
        // rank 50 inside (0.1, 0.5]: 40 of 80 -> 0.3
        assert!((s.ttft.quantile(0.5).unwrap() - 0.3).abs() < 1e-9);
        assert_eq!(Histogram::default().quantile(0.95), None);
        let tail = Histogram {
            buckets: vec![(0.1, 0.0), (f64::INFINITY, 5.0)],
            count: 5.0,
            sum: 10.0,
        };
        assert_eq!(tail.quantile(0.95), Some(0.1));
    }

    #[test]
    fn deltas_survive_counter_resets() {
        let a = parse_exposition(TEXT).unwrap();
        let mut b = a.clone();
        b.ttft.count = 5.0;
        b.ttft.buckets = vec![(0.1, 5.0), (f64::INFINITY, 5.0)];
        assert_eq!(b.ttft.delta(&a.ttft), b.ttft);
        assert_eq!(a.ttft.delta(&a.ttft).count, 0.0);
    }

    fn scrape_at(requests: f64, slow: bool) -> Scrape {
        let mut s = Scrape::default();
        let ttft_fast = if slow { requests * 0.5 } else { requests };
        s.ttft = Histogram {
            buckets: vec![(0.2, ttft_fast), (2.0, requests), (f64::INFINITY, requests)],
            count: requests,
            sum: 0.0,
        };
        s.itl = Histogram {
            buckets: vec![(0.02, requests * 9.0), (f64::INFINITY, requests * 9.0)],
            count: requests * 9.0,
            sum: 0.0,
        };
        s.e2e = Histogram {
            buckets: vec![(f64::INFINITY, requests)],
            count: requests,
            sum: 0.0,
        };
        s.drafts = requests * 2.0;
        s.draft_tokens = requests * 8.0;
        s.accepted = requests * 3.0;
        s.running = 2.0;
        s
    }

    #[test]
    fn window_reduces_to_rates_quantiles_and_tau() {
        let mut w = PoolWindow::default();
        let pods = vec!["a".to_string(), "b".to_string()];
        for i in 0..=12 {
            let t = i as f64 * 5.0;
            w.record("a", t, scrape_at(t, false));
            w.record("b", t, scrape_at(t * 2.0, true));
        }
        w.prune(60.0, 30.0, &pods);
        let o = w.observe(60.0, 30.0, 20.0, &pods);
        assert_eq!(o.freshness, Freshness::Fresh);
        // 30 s window: pod a did 30 requests, pod b 60.
        assert!((o.request_rate - 3.0).abs() < 1e-9, "{o:?}");
        assert!((o.output_tokens_per_request.unwrap() - 10.0).abs() < 1e-9);
        assert!((o.acceptance_length.unwrap() - 2.5).abs() < 1e-9);
        assert!((o.draft_length.unwrap() - 4.0).abs() < 1e-9);
        assert_eq!(o.in_flight, 4.0);
        // 90 first tokens, 30 slow ones in (0.2, 2]: p95 rank 85.5 -> 0.2 + 1.8 * 25.5/30
        assert!((o.ttft_p95.unwrap() - (0.2 + 1.8 * 25.5 / 30.0)).abs() < 1e-9);
    }

    #[test]
    fn missing_and_stale_pods_are_reported() {
        let mut w = PoolWindow::default();
        let pods = vec!["a".to_string(), "b".to_string()];
        assert_eq!(
            w.observe(0.0, 30.0, 20.0, &pods).freshness,
            Freshness::Missing
        );
        for i in 0..=12 {
            w.record("a", i as f64 * 5.0, scrape_at(i as f64, false));
        }
        // pod b never answered
        assert_eq!(
            w.observe(60.0, 30.0, 20.0, &pods).freshness,
            Freshness::Stale
        );
        // pod a's last scrape is too old
        let a = vec!["a".to_string()];
        assert_eq!(
            w.observe(100.0, 30.0, 20.0, &a).freshness,
            Freshness::Missing
        );
        // too short a window
        let mut w = PoolWindow::default();
        w.record("a", 0.0, scrape_at(0.0, false));
        w.record("a", 5.0, scrape_at(5.0, false));
        assert_eq!(w.observe(5.0, 60.0, 20.0, &a).freshness, Freshness::Stale);
        assert_eq!(
            w.observe(5.0, 60.0, 20.0, &[]).freshness,
            Freshness::Missing
        );
    }
}
