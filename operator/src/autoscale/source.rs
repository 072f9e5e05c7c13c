//! Where the autoscaler's metrics come from: scraping each ready engine pod's `/metrics` by pod
//! IP (the default), or PromQL against a Prometheus server. Thin I/O over [`super::metrics`].

use dspark_types::contract::{paths, ports};
use futures::future::join_all;
use hyper::Method;

use super::metrics::{parse_exposition, Freshness, PoolObservation, PoolWindow};
use crate::http::{encode_query, HttpClient};
use crate::http::{pod_url, PodTarget};

/// Scrapes every pod concurrently into `window` at time `now`; returns the pods that failed and
/// why (they go stale in the window, which holds the pool).
pub async fn scrape_pool(
    http: &HttpClient,
    pods: &[PodTarget],
    window: &mut PoolWindow,
    now: f64,
) -> Vec<(String, String)> {
    let results = join_all(pods.iter().map(|p| async move {
        let url = pod_url(&p.ip, i32::from(ports::HTTP), paths::METRICS);
        let r = http.send(Method::GET, &url, None, None).await;
        let parsed = match r {
            Ok(r) if r.status == 200 => parse_exposition(&r.body),
            Ok(r) => Err(format!("{url}: HTTP {}", r.status)),
            Err(e) => Err(e),
        };
        (p.name.clone(), parsed)
    }))
    .await;
    let mut failed = Vec::new();
    for (pod, r) in results {
        match r {
            Ok(s) => window.record(&pod, now, s),
            Err(e) => failed.push((pod, e)),
        }
    }
    failed
}

/// The PromQL queries for one pool over `window` seconds: the series labelled
/// `namespace`, `deployment` and `pool` as config/prometheus/prometheus.yaml labels them
/// (from the pod's `serving.dspark.dev/deployment` and `serving.dspark.dev/pool` labels).
/// Labels, not pod-name prefixes: deployment `a` with pool `b-c` and deployment `a-b` with
/// pool `c` both name their pods `a-b-c-*`.
pub fn pool_queries(namespace: &str, deployment: &str, pool: &str, window: i64) -> PoolQueries {
    let sel = format!(r#"namespace="{namespace}",deployment="{deployment}",pool="{pool}""#);
    let rate = |m: &str| format!("sum(rate({m}{{{sel}}}[{window}s]))");
    let p95 = |m: &str| {
        format!("histogram_quantile(0.95, sum by (le) (rate({m}_bucket{{{sel}}}[{window}s])))")
    };
    use dspark_types::contract::metrics::{
        E2E, ITL, RUNNING, SPEC_ACCEPTED_TOKENS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, TTFT, WAITING,
    };
    let (e2e, itl, running, waiting) = (E2E.name, ITL.name, RUNNING.name, WAITING.name);
    PoolQueries {
        ttft_p95: p95(TTFT.name),
        itl_p95: p95(itl),
        request_rate: rate(&format!("{e2e}_count")),
        tokens_per_request: format!(
            "({} + {}) / {}",
            rate(&format!("{itl}_count")),
            rate(&format!("{e2e}_count")),
            rate(&format!("{e2e}_count"))
        ),
        in_flight: format!("sum({running}{{{sel}}}) + sum({waiting}{{{sel}}})"),
        waiting: format!("sum({waiting}{{{sel}}})"),
        acceptance_length: format!(
            "1 + {} / {}",
            rate(&SPEC_ACCEPTED_TOKENS.sample()),
            rate(&SPEC_DRAFTS.sample())
        ),
        draft_length: format!(
            "{} / {}",
            rate(&SPEC_DRAFT_TOKENS.sample()),
            rate(&SPEC_DRAFTS.sample())
        ),
        age: format!("time() - max(timestamp({running}{{{sel}}}))"),
    }
}

/// PromQL for each field of a [`PoolObservation`].
#[derive(Debug, Clone, PartialEq)]
pub struct PoolQueries {
    pub ttft_p95: String,
    pub itl_p95: String,
    pub request_rate: String,
    pub tokens_per_request: String,
    pub in_flight: String,
    pub waiting: String,
    pub acceptance_length: String,
    pub draft_length: String,
    pub age: String,
}

/// The first sample of an instant-vector answer, `None` when empty or not a number.
pub fn parse_instant(body: &str) -> Result<Option<f64>, String> {
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("Prometheus answer is not JSON: {e}"))?;
    if v["status"] != "success" {
        return Err(format!(
            "Prometheus query failed: {}",
            v["error"].as_str().unwrap_or("unknown error")
        ));
    }
    let value = match v["data"]["resultType"].as_str() {
        Some("scalar") => &v["data"]["result"][1],
        _ => &v["data"]["result"][0]["value"][1],
    };
    Ok(value
        .as_str()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|x| x.is_finite()))
}

/// Observes a pool through Prometheus. Unreachable or empty answers give
/// [`Freshness::Missing`]; samples older than `max_age` seconds give [`Freshness::Stale`].
pub async fn prometheus_observe(
    http: &HttpClient,
    base_url: &str,
    q: &PoolQueries,
    max_age: f64,
) -> PoolObservation {
    let base = base_url.trim_end_matches('/');
    let ask = |query: &str| {
        let url = format!("{base}/api/v1/query?query={}", encode_query(query));
        async move {
            match http.send(Method::GET, &url, None, None).await {
                Ok(r) if r.status == 200 => parse_instant(&r.body),
                Ok(r) => Err(format!("{url}: HTTP {}", r.status)),
                Err(e) => Err(e),
            }
        }
    };
    let queries = [
        &q.age,
        &q.ttft_p95,
        &q.itl_p95,
        &q.request_rate,
        &q.tokens_per_request,
        &q.in_flight,
        &q.waiting,
        &q.acceptance_length,
        &q.draft_length,
    ];
    let answers = join_all(queries.iter().map(|s| ask(s))).await;
    let mut obs = PoolObservation::missing();
    let Ok(Some(age)) = answers[0] else {
        return obs;
    };
    if answers.iter().any(|a| a.is_err()) {
        obs.freshness = Freshness::Stale;
        return obs;
    }
    let get = |i: usize| answers[i].clone().ok().flatten();
    obs.freshness = if age > max_age {
        Freshness::Stale
    } else {
        Freshness::Fresh
    };
    obs.ttft_p95 = get(1);
    obs.itl_p95 = get(2);
    obs.request_rate = get(3).unwrap_or(0.0);
    obs.output_tokens_per_request = get(4);
    obs.in_flight = get(5).unwrap_or(0.0);
    obs.waiting = get(6).unwrap_or(0.0);
    obs.acceptance_length = get(7);
    obs.draft_length = get(8);
    obs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_select_the_pool_and_window() {
        let q = pool_queries("ns", "qwen", "h100", 60);
        assert_eq!(
            q.itl_p95,
            r#"histogram_quantile(0.95, sum by (le) (rate(dspark_inter_token_latency_seconds_bucket{namespace="ns",deployment="qwen",pool="h100"}[60s])))"#
        );
        // Deployment `a` + pool `b-c` and deployment `a-b` + pool `c` select different series.
        assert_ne!(
            pool_queries("ns", "a", "b-c", 60),
            pool_queries("ns", "a-b", "c", 60)
        );
        assert!(q
            .acceptance_length
            .starts_with("1 + sum(rate(dspark_spec_decode_num_accepted_tokens_total{"));
    }

    #[test]
    fn parses_instant_vectors_scalars_and_errors() {
        let v = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1700000000.1,"0.042"]}]}}"#;
        assert_eq!(parse_instant(v).unwrap(), Some(0.042));
        let empty = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert_eq!(parse_instant(empty).unwrap(), None);
        let nan = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"NaN"]}]}}"#;
        assert_eq!(parse_instant(nan).unwrap(), None);
        let scalar = r#"{"status":"success","data":{"resultType":"scalar","result":[1,"3"]}}"#;
        assert_eq!(parse_instant(scalar).unwrap(), Some(3.0));
        let err = r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#;
        assert!(parse_instant(err).unwrap_err().contains("parse error"));
    }
}
