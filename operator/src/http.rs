//! A small plain-HTTP client for talking to engine pods by pod IP (admin API, `/metrics`) and
//! to Prometheus, and how an engine pod is addressed. Every request has a deadline.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

/// A ready engine pod reachable by pod IP (the reconciler finds them, the autoscaler
/// scrapes them, the cost-table push writes to them).
#[derive(Debug, Clone, PartialEq)]
pub struct PodTarget {
    pub name: String,
    pub ip: String,
}

/// `http://{ip}:{port}{path}` (IPv6 literals bracketed).
pub fn pod_url(ip: &str, port: i32, path: &str) -> String {
    if ip.contains(':') {
        format!("http://[{ip}]:{port}{path}")
    } else {
        format!("http://{ip}:{port}{path}")
    }
}

/// A response: status code and body text.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// Cheap to clone; shares one connection pool.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }

    /// Sends one request; errors say which URL failed and why.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        bearer: Option<&str>,
        body: Option<String>,
    ) -> Result<Response, String> {
        let mut req = Request::builder().method(method).uri(url);
        if let Some(token) = bearer {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| format!("bad request to {url}: {e}"))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{url}: reading the body: {e}"))?
                .to_bytes();
            Ok(Response {
                status,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            })
        };
        tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| format!("{url}: no answer within {:?}", self.timeout))?
    }
}

/// Percent-encodes a query-string value (RFC 3986 unreserved characters pass).
pub fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_promql() {
        assert_eq!(
            encode_query(r#"sum(rate(x{a="b"}[60s]))"#),
            "sum%28rate%28x%7Ba%3D%22b%22%7D%5B60s%5D%29%29"
        );
    }

    #[tokio::test]
    async fn talks_to_a_local_server_and_times_out() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            assert!(req.contains("authorization: Bearer t0k"), "{req}");
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .await
                .unwrap();
        });
        let c = HttpClient::new(Duration::from_secs(2));
        let r = c
            .send(Method::GET, &format!("http://{addr}/x"), Some("t0k"), None)
            .await
            .unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));
        // A listener that never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let c = HttpClient::new(Duration::from_millis(200));
        let e = c
            .send(Method::GET, &format!("http://{addr}/"), None, None)
            .await
            .unwrap_err();
        assert!(e.contains("no answer"), "{e}");
        drop(silent);
    }
}
