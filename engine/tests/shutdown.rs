//! Graceful shutdown of the engine binary (`serve`) on SIGTERM: admission stops at once
//! (`/ready` and new requests 503, OpenAI error format), a request in flight that finishes
//! within `--drain-timeout-secs` is answered in full, one that cannot is ended with an error
//! (503 when not streaming, an error event before `[DONE]` when streaming), and the process
//! exits 0 either way, within a few seconds of the deadline.

mod common;

use common::http::{error_message, post_response};
use common::process::EngineProcess;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// The engine on the default model without start-up profiling or a drafter.
fn engine(drain_secs: u64) -> EngineProcess {
    EngineProcess::serve(
        &common::smollm2(),
        &[
            "--speculation",
            "none",
            "--startup-profile",
            "false",
            "--max-model-len",
            "4096",
            "--kv-cache-mb",
            "256",
            "--drain-timeout-secs",
            &drain_secs.to_string(),
        ],
    )
}

/// A request the stopping engine refused: 503 in OpenAI's error format, saying `why`.
fn assert_refused(code: u16, err: &Value, why: &str) {
    assert_eq!(code, 503, "{err}");
    assert_eq!(err["error"]["type"], "server_error", "{err}");
    assert!(error_message(err).contains(why), "{err}");
}

fn completion(max_tokens: usize, stream: bool) -> Value {
    json!({"model": "default", "prompt": "Once upon a time", "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true, "stream": stream})
}

/// A streaming completion, read line by line on its own thread: the lines arrive on the
/// returned channel (the first one tells the request is running), the thread ends with
/// the stream.
fn stream(base: &str, body: Value) -> std::sync::mpsc::Receiver<String> {
    let r = post_response(base, "/v1/completions", &body);
    assert_eq!(r.status().as_u16(), 200);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if let Some(data) = line.strip_prefix("data: ") {
                if tx.send(data.to_string()).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

/// The rest of a stream until it ends.
fn rest(rx: &std::sync::mpsc::Receiver<String>) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(d) = rx.recv_timeout(Duration::from_secs(120)) {
        out.push(d);
    }
    out
}

/// `/ready`'s count of requests the engine is running.
fn running(p: &EngineProcess) -> u64 {
    common::http::get(&format!("{}/ready", p.base)).1["requests_running"]
        .as_u64()
        .unwrap_or(0)
}

/// A request in flight at SIGTERM finishes within the (default-length) drain: its stream
/// ends with a finish reason and `[DONE]`, no error. Meanwhile `/ready` says 503 and a new
/// request gets 503 in OpenAI's error format. Then the process exits 0.
#[test]
fn sigterm_lets_a_request_in_flight_finish_and_exits_0() {
    let mut p = engine(25);
    let rx = stream(&p.base, completion(160, true));
    let first = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("a first chunk");
    assert!(first.contains("\"text\""), "{first}");
    p.sigterm();
    p.wait_for("/ready to answer 503", Duration::from_secs(30), |p| {
        p.status("/ready") == Some(503)
    });
    let (code, err) = common::http::post(&p.base, "/v1/completions", completion(4, false));
    assert_refused(code, &err, "shutting down");
    let rest = rest(&rx);
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert!(
        rest.iter().all(|d| !d.contains("\"error\"")),
        "an error in a request that could finish: {rest:?}"
    );
    let reason = rest
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from))
        .next();
    assert_eq!(reason.as_deref(), Some("length"), "{rest:?}");
    let status = p.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}:\n{}", p.log_text());
}

/// Requests that cannot finish within a 1 s drain (thousands of tokens) are ended at the
/// deadline: the non-streaming one gets 503 in OpenAI's error format, the streaming one an
/// error event and then `[DONE]`; the process exits 0 a few seconds after SIGTERM.
#[test]
fn sigterm_ends_what_cannot_finish_at_the_drain_deadline_and_exits_0() {
    let mut p = engine(1);
    let rx = stream(&p.base, completion(4000, true));
    rx.recv_timeout(Duration::from_secs(120))
        .expect("a first chunk");
    let base = p.base.clone();
    let plain = std::thread::spawn(move || {
        common::http::post(&base, "/v1/completions", completion(4000, false))
    });
    p.wait_for("both requests running", Duration::from_secs(60), |p| {
        running(p) >= 2
    });
    let t = Instant::now();
    p.sigterm();
    let (code, err) = plain.join().unwrap();
    assert_refused(code, &err, "drain timeout");
    let rest = rest(&rx);
    let n = rest.len();
    assert!(n >= 2, "{rest:?}");
    assert_eq!(rest[n - 1], "[DONE]", "{rest:?}");
    let last: Value = serde_json::from_str(&rest[n - 2]).unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain timeout")),
        "the event before [DONE]: {last}"
    );
    let status = p.wait_exit(Duration::from_secs(30));
    let took = t.elapsed();
    assert!(status.success(), "{status}:\n{}", p.log_text());
    assert!(
        took < Duration::from_secs(10),
        "exited {took:?} after SIGTERM with a 1 s drain"
    );
}
