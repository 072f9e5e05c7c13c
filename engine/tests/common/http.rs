//! The API on a loopback port and the HTTP helpers the tests talk to it with.

use serde_json::Value;
use std::time::Duration;

/// An axum router served on a loopback port by its own runtime (kept alive by the value).
pub struct Server {
    pub base: String,
    _rt: tokio::runtime::Runtime,
}

pub fn serve(app: axum::Router) -> Server {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    Server {
        base: format!("http://{addr}"),
        _rt: rt,
    }
}

/// A blocking client with a long timeout (a loaded CI machine is slow, never stuck).
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// POSTs `body` as JSON: the response, unread (a stream the caller reads as it comes).
pub fn post_response(base: &str, path: &str, body: &Value) -> reqwest::blocking::Response {
    client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .unwrap()
}

/// POSTs `body` as JSON: the status and the JSON answer (null when it is not JSON).
pub fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = post_response(base, path, &body);
    let code = r.status().as_u16();
    (code, r.json().unwrap_or(Value::Null))
}

/// GETs `url`: the status and the JSON answer (null when it is not JSON).
pub fn get(url: &str) -> (u16, Value) {
    let r = client().get(url).send().unwrap();
    let code = r.status().as_u16();
    (code, r.json().unwrap_or(Value::Null))
}

/// The JSON answer of a GET.
pub fn get_json(url: String) -> Value {
    client().get(url).send().unwrap().json().unwrap()
}

/// The `/metrics` page of the API at `base`.
pub fn metrics_page(base: &str) -> String {
    client()
        .get(format!("{base}/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap()
}

/// SSE `data:` payloads of a streaming response.
pub fn sse(base: &str, path: &str, body: Value) -> Vec<String> {
    sse_data(&post_response(base, path, &body).text().unwrap())
}

/// The message of an OpenAI-format error answer (`{"error": {"message": ...}}`).
pub fn error_message(e: &Value) -> &str {
    e["error"]["message"].as_str().unwrap()
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}

/// Value of the first sample of metric `name` in Prometheus text (NaN when absent).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| {
            l.starts_with(name)
                && (l.as_bytes().get(name.len()) == Some(&b' ')
                    || l.as_bytes().get(name.len()) == Some(&b'{'))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}
