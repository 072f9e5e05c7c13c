//! The HTTP front door: OpenAI-compatible API, probes and metrics on one port.
//!
//! One file per endpoint: [`chat`], [`responses`] (the Responses API; both read a
//! conversation through [`conversation`]) and [`completions`] validate and tokenize off the
//! async runtime, then share one response path ([`generate`]): every prompt x `n` choice is
//! submitted to the engine thread through a bounded admission queue (429 past it), and the
//! engine's events come back as SSE chunks or one answer, typed in [`openai`]. Dropping the
//! response (client gone) drops the event receivers, which the engine notices at its next
//! step and frees the sequences' KV blocks. Probes, metrics and `/v1/models` (and
//! `/v1/models/{id}`) live here; the cost-table admin API in [`admin`]; the drain on
//! SIGTERM in [`shutdown`].

pub mod admin;
mod chat;
mod completions;
mod conversation;
pub mod error;
mod generate;
pub mod openai;
mod responses;
pub mod shutdown;
mod tokenize;

use crate::chat::ChatTemplate;
use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::tokenizer::TextTokenizer;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use dspark_types::contract::paths;
use error::ApiError;
use openai::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct AppState {
    /// The name clients use (`--served-model-name`, else the model file's id).
    pub model_id: String,
    /// The model file's id, what cost tables are measured for.
    pub target_model_id: String,
    pub device: String,
    /// The SPS(B) cost table in force (shared with the engine thread).
    pub costs: Arc<crate::cost::CostTables>,
    pub speculation: String,
    pub policy: String,
    pub tok: Arc<TextTokenizer>,
    pub template: ChatTemplate,
    /// Structured outputs (`None` when llguidance could not read the tokenizer).
    pub grammars: Option<Arc<crate::constraint::Grammars>>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    /// Longest prompt + completion one request may use.
    pub max_seq: usize,
    /// Set on SIGTERM: `/ready` and new requests answer 503 ([`shutdown`]).
    pub draining: AtomicBool,
    pub inflight: AtomicUsize,
    /// The requests in flight as a drain ends them at its deadline.
    pub shutdown: shutdown::Shutdown,
    pub created: u64,
    /// Extra facts for `/ready` (speculation, cost table...), set by the serve command.
    pub ready_details: std::sync::RwLock<Value>,
    /// Finished windows of the online policy experiment, when one runs.
    pub experiment: Option<Arc<std::sync::Mutex<Vec<crate::experiment::Window>>>>,
}

/// What one request may cost: the `serve` flags that bound hostile inputs (docs/operations.md,
/// Limits).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest request body in bytes (`--max-request-bytes`): a larger one gets 413.
    pub max_request_bytes: usize,
    /// Work units (schema nodes and grammar symbols) the analysis and compilation of one
    /// request's structured-output constraint may spend (`--max-grammar-work`): past it, 400.
    pub max_grammar_work: u64,
    /// How long the engine may make no progress while requests are queued or running
    /// before `/health` and `/ready` fail (`--engine-stall-secs`).
    pub engine_stall: std::time::Duration,
}

/// `--max-request-bytes` by default: 2 MiB (axum's own default limit).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 2 * 1024 * 1024;
/// `--max-grammar-work` by default (the constraint layer's own default).
pub use crate::constraint::DEFAULT_MAX_GRAMMAR_WORK;
/// `--engine-stall-secs` by default: far longer than any step.
pub const DEFAULT_ENGINE_STALL_SECS: u64 = 120;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_grammar_work: DEFAULT_MAX_GRAMMAR_WORK,
            engine_stall: std::time::Duration::from_secs(DEFAULT_ENGINE_STALL_SECS),
        }
    }
}

/// The API router with the default [`Limits`].
pub fn router(state: Arc<AppState>) -> Router {
    router_with(state, Limits::default())
}

/// The API router with these limits.
pub fn router_with(state: Arc<AppState>, limits: Limits) -> Router {
    let max = limits.max_request_bytes;
    Router::new()
        .route(paths::CHAT_COMPLETIONS, post(chat::chat_completions))
        .route(paths::COMPLETIONS, post(completions::completions))
        .route(paths::RESPONSES, post(responses::responses))
        .route(paths::MODELS, get(models))
        // A catch-all: served names may hold slashes (`org/model`).
        .route(&format!("{}/{{*id}}", paths::MODELS), get(model))
        .route(paths::TOKENIZE, post(tokenize::tokenize))
        .route(paths::DETOKENIZE, post(tokenize::detokenize))
        .route(paths::HEALTH, get(health))
        .route(paths::READY, get(ready))
        .route(paths::METRICS, get(metrics))
        .route(paths::EXPERIMENT, get(experiment))
        .with_state(state)
        .layer(axum::Extension(limits))
        // The whole body is read by `limit_body` (within the limit), so the extractors'
        // own limit is the same one.
        .layer(axum::extract::DefaultBodyLimit::max(max))
        .layer(axum::middleware::from_fn_with_state(max, limit_body))
}

/// Most bytes of an over-limit body read and thrown away so that the client, still
/// sending, gets the 413 rather than a connection reset; and for how long.
const DRAIN_MAX_BYTES: u64 = 64 * 1024 * 1024;
const DRAIN_MAX_SECS: u64 = 10;

/// Reads the request body up to `max` bytes. A larger body (by its `Content-Length`, or as
/// it arrives) gets 413 in the OpenAI error format naming the limit; the rest of it is read
/// and dropped first (up to [`DRAIN_MAX_BYTES`] / [`DRAIN_MAX_SECS`]) unless the client
/// waits for `100 Continue` and has sent nothing yet: closing a connection with unread data
/// resets it, and the client would see that instead of the answer.
async fn limit_body(
    State(max): State<usize>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use futures::StreamExt;
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let expects_continue = parts
        .headers
        .get(header::EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
    let mut stream = body.into_data_stream();
    let mut too_large = declared.is_some_and(|n| n > max as u64);
    if too_large && expects_continue {
        return ApiError::too_large(max).into_response();
    }
    let mut buf: Vec<u8> = Vec::new();
    if !too_large {
        if let Some(n) = declared {
            buf.reserve_exact(n as usize);
        }
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    return ApiError::bad_request(format!("cannot read the request body: {e}"))
                        .into_response()
                }
            };
            if buf.len() + chunk.len() > max {
                too_large = true;
                break;
            }
            buf.extend_from_slice(&chunk);
        }
    }
    if too_large {
        drop(buf);
        let drain = async {
            let mut read = 0u64;
            while let Some(Ok(c)) = stream.next().await {
                read += c.len() as u64;
                if read > DRAIN_MAX_BYTES {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(std::time::Duration::from_secs(DRAIN_MAX_SECS), drain).await;
        return ApiError::too_large(max).into_response();
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(buf),
    ))
    .await
}

/// Why the engine is out of service: it died (a panic in a step), or it has made no
/// progress for longer than `--engine-stall-secs` while requests wait.
fn engine_down(st: &AppState, limits: &Limits) -> Option<(&'static str, String)> {
    if let Some(why) = st.engine.failure() {
        return Some(("engine_failed", format!("the engine has stopped: {why}")));
    }
    st.engine.stalled(limits.engine_stall).map(|d| {
        (
            "engine_stalled",
            format!(
                "the engine has made no progress for {:.1} s with requests waiting (limit {} s, --engine-stall-secs)",
                d.as_secs_f64(),
                limits.engine_stall.as_secs_f64()
            ),
        )
    })
}

/// Liveness: 200 while the engine thread runs and makes progress; 503 once it has died or
/// stalled, so that the liveness probe restarts the pod.
async fn health(State(st): State<Arc<AppState>>, Extension(limits): Extension<Limits>) -> Response {
    match engine_down(&st, &limits) {
        None => "ok".into_response(),
        Some((_, why)) => ApiError::unavailable(why).into_response(),
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The online policy experiment's finished windows (`serve --policy-experiment`), for
/// `dspark-engine experiment-report`.
async fn experiment(State(st): State<Arc<AppState>>) -> Response {
    match &st.experiment {
        Some(log) => {
            let windows = log.lock().map(|l| l.clone()).unwrap_or_default();
            Json(json!({ "windows": windows })).into_response()
        }
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"message": "no policy experiment runs on this engine (serve --policy-experiment ARMS)", "type": "not_found_error", "code": "no_experiment"}})),
        )
            .into_response(),
    }
}

async fn ready(State(st): State<Arc<AppState>>, Extension(limits): Extension<Limits>) -> Response {
    let ct = st.costs.current();
    let mut body = json!({
        "status": if st.draining.load(Ordering::SeqCst) { "draining" } else { "ready" },
        "model": st.model_id,
        "speculation": st.speculation,
        "policy": st.policy,
        "requests_running": st.engine.running.load(Ordering::SeqCst),
        "requests_waiting": st.engine.waiting.load(Ordering::SeqCst),
        "cost_table": {
            "source": crate::cost::source_name(ct.source),
            "revision": ct.revision,
            "digest": ct.digest,
            "node_type": ct.table.node_type,
            "measured_at": ct.table.measured_at,
            "builtin_default": ct.source == dspark_types::CostTableSource::Default,
        },
    });
    if let (Some(b), Ok(extra)) = (body.as_object_mut(), st.ready_details.read()) {
        if let Some(e) = extra.as_object() {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
    }
    let failure = engine_down(&st, &limits);
    if let (Some((status, why)), Some(b)) = (&failure, body.as_object_mut()) {
        b.insert("status".into(), json!(status));
        b.insert("engine_error".into(), json!(why));
    }
    let code = if st.draining.load(Ordering::SeqCst) || failure.is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

fn model_card(st: &AppState) -> ModelCard {
    ModelCard {
        id: st.model_id.clone(),
        object: "model",
        created: st.created,
        owned_by: "dspark",
        max_model_len: st.max_seq,
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&st)],
    })
}

/// `GET /v1/models/{id}`: the served model (by its name; `default` is not listed, so it
/// is not found here either), else 404 `model_not_found`.
async fn model(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    if id == st.model_id {
        Ok(Json(model_card(&st)))
    } else {
        Err(ApiError::model_not_found(&id, &st.model_id))
    }
}

fn check_model(st: &AppState, model: &str) -> Result<(), ApiError> {
    if model == st.model_id || model == "default" {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model, &st.model_id))
    }
}

/// Counts a request as in flight until dropped (for draining on SIGTERM).
struct InflightGuard(Arc<AppState>);
impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A generation span with the OpenTelemetry GenAI fields the engine fills in at the end.
macro_rules! generation_span {
    ($st:expr, $operation:expr $(, parent: $parent:expr)?) => {{
        use tracing::field::Empty;
        tracing::info_span!(
            target: dspark_telemetry::TRACE_TARGET,
            $(parent: $parent,)?
            "request",
            otel.name = format!("{} {}", $operation, $st.model_id),
            otel.kind = "server",
            gen_ai.operation.name = $operation,
            gen_ai.system = "dspark",
            gen_ai.request.model = %$st.model_id,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            gen_ai.response.finish_reasons = Empty,
            dspark.speculation = %$st.speculation,
            dspark.policy = %$st.policy,
            dspark.draft_tokens = Empty,
            dspark.accepted_draft_tokens = Empty,
        )
    }};
}

/// The request's trace span, `{operation} {model}` per the OpenTelemetry GenAI conventions,
/// a child of the caller's trace when the request carries W3C trace context.
fn request_span(st: &AppState, operation: &'static str, headers: &HeaderMap) -> tracing::Span {
    let span = generation_span!(st, operation);
    if !span.is_disabled() {
        dspark_telemetry::set_parent_from_headers(&span, headers);
    }
    span
}

/// The span of one choice of a request that asks for several (`n`, several prompts).
fn request_span_with_parent(
    st: &AppState,
    operation: &'static str,
    parent: &tracing::Span,
) -> tracing::Span {
    generation_span!(st, operation, parent: parent)
}

fn gen_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}
