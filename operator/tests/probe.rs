//! `dspark-operator probe URL`, the chart's `helm test` hook (the operator image has no shell
//! and no wget): exit 0 and the body on a 2xx answer, exit 1 and the reason otherwise.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output};

/// A one-connection HTTP server on loopback that answers `status` with `body`; its URL.
fn answer_once(status: &str, body: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let status = status.to_string();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).unwrap();
            if n == 0 {
                return;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"GET /healthz HTTP/1.1\r\n"), "{got:?}");
        let resp = format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(resp.as_bytes()).unwrap();
    });
    format!("http://{addr}/healthz")
}

fn probe(url: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dspark-operator"))
        .args(["probe", url, "--timeout-seconds", "5"])
        .env_remove("KUBECONFIG")
        .output()
        .unwrap()
}

#[test]
fn a_2xx_answer_exits_0_and_prints_the_body() {
    let out = probe(&answer_once("200 OK", "ok"));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}

#[test]
fn an_error_status_exits_1_naming_it() {
    let url = answer_once("503 Service Unavailable", "not leading");
    let out = probe(&url);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&url) && err.contains("503"), "{err}");
}

#[test]
fn nothing_listening_exits_1_naming_the_url() {
    // A port that was free a moment ago: bind, read it, close.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/healthz");
    let out = probe(&url);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&url));
}
