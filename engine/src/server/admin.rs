//! The admin API, on its own port behind a bearer token (`--admin-port`,
//! `--admin-token-file` or `DSPARK_ADMIN_TOKEN`):
//!
//! - `GET /admin/v1/state`: what is served and the cost table in force (revision, digest,
//!   source), as [`AdminState`].
//! - `GET /admin/v1/cost-table`: the cost table in force.
//! - `PUT /admin/v1/cost-table`: install a table. 200 with [`PushResponse`]; 400 when the
//!   table is malformed or not monotone, 409 when it was measured for another model, device
//!   or engine version; the current table stays on any error. The engine picks it up at its
//!   next step.

use super::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use dspark_types::{AdminState, CostTableError, CostTableSource, ErrorBody, PushResponse};
use std::sync::atomic::Ordering;
use std::sync::Arc;

struct Admin {
    app: Arc<AppState>,
    token: String,
}

/// The admin router. `token` must be non-empty (the caller refuses to start without one).
pub fn router(app: Arc<AppState>, token: String) -> Router {
    let st = Arc::new(Admin { app, token });
    Router::new()
        .route("/admin/v1/state", get(state))
        .route("/admin/v1/cost-table", get(get_table).put(put_table))
        .with_state(st)
}

/// Reads the admin token from a file (trailing whitespace trimmed); empty is an error.
pub fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    let t = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read admin token file {}: {e}", path.display()))?;
    let t = t.trim().to_string();
    anyhow::ensure!(
        !t.is_empty(),
        "admin token file {} is empty",
        path.display()
    );
    Ok(t)
}

fn error(code: StatusCode, kind: &str, msg: impl Into<String>) -> Response {
    (code, Json(ErrorBody::new(kind, msg))).into_response()
}

/// Whether `got` is the token `want`, in time independent of where they differ and of how
/// long `want` is: both are hashed (SHA-256, over their whole length) and the digests are
/// compared with no early exit. Comparing the bytes directly would need the lengths
/// compared too (a `u8` cast of the length difference accepted the token followed by 256
/// extra bytes).
fn token_matches(want: &[u8], got: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    if want.is_empty() || got.is_empty() {
        return false;
    }
    let (a, b) = (Sha256::digest(want), Sha256::digest(got));
    let diff = a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The 401 response when the bearer token does not match.
fn unauthorized(st: &Admin, headers: &HeaderMap) -> Option<Response> {
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if token_matches(st.token.as_bytes(), given.as_bytes()) {
        None
    } else {
        Some(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong admin bearer token (Authorization: Bearer <token>)",
        ))
    }
}

async fn state(State(st): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(r) = unauthorized(&st, &headers) {
        return r;
    }
    let a = &st.app;
    let ct = a.costs.current();
    Json(AdminState {
        model_id: a.target_model_id.clone(),
        engine_version: crate::VERSION.to_string(),
        device: a.device.clone(),
        speculation: a.speculation.clone(),
        policy: a.policy.clone(),
        cost_table_source: ct.source,
        cost_table_revision: ct.revision,
        cost_table_digest: ct.digest.clone(),
        requests_running: a.engine.running.load(Ordering::SeqCst),
        requests_waiting: a.engine.waiting.load(Ordering::SeqCst),
    })
    .into_response()
}

async fn get_table(State(st): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(r) = unauthorized(&st, &headers) {
        return r;
    }
    Json(st.app.costs.current().table.clone()).into_response()
}

async fn put_table(State(st): State<Arc<Admin>>, headers: HeaderMap, body: String) -> Response {
    if let Some(r) = unauthorized(&st, &headers) {
        return r;
    }
    match st.app.costs.install(&body, CostTableSource::Admin) {
        Ok(a) => Json(PushResponse {
            revision: a.revision,
            digest: a.digest.clone(),
        })
        .into_response(),
        Err(e) => {
            let code = match e {
                CostTableError::WrongModel { .. }
                | CostTableError::WrongDevice { .. }
                | CostTableError::WrongEngineVersion { .. } => StatusCode::CONFLICT,
                _ => StatusCode::BAD_REQUEST,
            };
            tracing::warn!("refused pushed cost table: {e}");
            error(code, "invalid_request_error", e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn only_the_token_itself_matches() {
        let t = b"s3cret-token";
        assert!(token_matches(t, t));
        // The token followed by 256 * k more bytes (the length difference used to go
        // through `as u8`), a prefix, one byte off, empty.
        for k in 1..=3 {
            let mut long = t.to_vec();
            long.extend(std::iter::repeat_n(0u8, 256 * k));
            assert!(!token_matches(t, &long), "token + {} zero bytes", 256 * k);
            let mut long = t.to_vec();
            long.extend(std::iter::repeat_n(b'x', 256 * k));
            assert!(!token_matches(t, &long), "token + {} bytes", 256 * k);
        }
        assert!(!token_matches(t, &t[..t.len() - 1]));
        assert!(!token_matches(t, b"s3cret-tokeN"));
        assert!(!token_matches(t, b""));
        assert!(!token_matches(b"", b""));
    }
}
