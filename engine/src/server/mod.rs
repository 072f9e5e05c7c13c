//! The HTTP front door: OpenAI-compatible API, probes and metrics on one port.
//!
//! Handlers validate and tokenize off the async runtime, submit to the engine thread through
//! a bounded admission queue (429 past it), and stream the engine's events back as SSE or
//! collect them into one response. Dropping the response (client gone) drops the event
//! receiver, which the engine notices at its next step and frees the sequence's KV blocks.

pub mod admin;
pub mod error;
pub mod openai;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::engine::{EngineHandle, Event, GenRequest, SubmitError, TokenLogprob, Usage};
use crate::metrics::Metrics;
use crate::tokenizer::TextTokenizer;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::ApiError;
use futures::{Stream, StreamExt};
use openai::*;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

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
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    /// Longest prompt + completion one request may use.
    pub max_seq: usize,
    pub draining: AtomicBool,
    pub inflight: AtomicUsize,
    pub created: u64,
    /// Extra facts for `/ready` (speculation, cost table...), set by the serve command.
    pub ready_details: std::sync::RwLock<Value>,
    /// Finished windows of the online policy experiment, when one runs.
    pub experiment: Option<Arc<std::sync::Mutex<Vec<crate::experiment::Window>>>>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/experiment", get(experiment))
        .with_state(state)
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

async fn ready(State(st): State<Arc<AppState>>) -> Response {
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
    let code = if st.draining.load(Ordering::SeqCst) {
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

async fn models(State(st): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: st.model_id.clone(),
            object: "model",
            created: st.created,
            owned_by: "dspark",
            max_model_len: st.max_seq,
        }],
    })
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

struct Prepared {
    prompt: Vec<u32>,
    v: Validated,
    max_tokens: usize,
    logprobs: Option<usize>,
}

fn check_lengths(
    st: &AppState,
    prompt: Vec<u32>,
    v: Validated,
    logprobs: Option<usize>,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let room = st.max_seq.saturating_sub(prompt.len());
    let max_tokens = v.max_tokens.unwrap_or(room);
    if prompt.len() + max_tokens > st.max_seq || room == 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Shorten the prompt or lower max_tokens.",
                st.max_seq,
                prompt.len() + max_tokens,
                prompt.len(),
                max_tokens
            ),
        ));
    }
    Ok(Prepared {
        prompt,
        v,
        max_tokens,
        logprobs,
    })
}

/// The request's trace span, `{operation} {model}` per the OpenTelemetry GenAI conventions,
/// a child of the caller's trace when the request carries W3C trace context.
fn request_span(st: &AppState, operation: &'static str, headers: &HeaderMap) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!(
        target: dspark_telemetry::TRACE_TARGET,
        "request",
        otel.name = format!("{operation} {}", st.model_id),
        otel.kind = "server",
        gen_ai.operation.name = operation,
        gen_ai.system = "dspark",
        gen_ai.request.model = %st.model_id,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.response.finish_reasons = Empty,
        dspark.speculation = %st.speculation,
        dspark.policy = %st.policy,
        dspark.draft_tokens = Empty,
        dspark.accepted_draft_tokens = Empty,
    );
    if !span.is_disabled() {
        dspark_telemetry::set_parent_from_headers(&span, headers);
    }
    span
}

fn submit(
    st: &Arc<AppState>,
    p: &Prepared,
    span: tracing::Span,
    operation: &'static str,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    if st.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable(
            "the server is shutting down; retry on another replica",
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    st.engine
        .submit(GenRequest {
            prompt: p.prompt.clone(),
            params: p.v.params.clone(),
            max_tokens: p.max_tokens,
            stop: p.v.stop.clone(),
            logprobs: p.logprobs,
            ignore_eos: p.v.ignore_eos,
            events: tx,
            arrived: Instant::now(),
            span,
            operation,
        })
        .map_err(|e| match e {
            SubmitError::QueueFull(_) => {
                st.metrics.requests_rejected.inc();
                ApiError::overloaded(e.to_string())
            }
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        })?;
    Ok(rx)
}

fn gen_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&st, &req.common.model)?;
    let v = validate_common(&req.common)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("unknown role '{}'; use system, user or assistant", m.role),
            ));
        }
        let content = match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].content"),
                            format!(
                                "content part type '{}' is not supported by a text model",
                                p.kind
                            ),
                        ));
                    }
                    s.push_str(p.text.as_deref().unwrap_or(""));
                }
                s
            }
        };
        let role = if m.role == "developer" {
            "system".into()
        } else {
            m.role.clone()
        };
        messages.push(ChatMessage { role, content });
    }
    let logprobs = if req.logprobs.unwrap_or(false) {
        let k = req.top_logprobs.unwrap_or(0);
        if !(0..=20).contains(&k) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs must be between 0 and 20, got {k}"),
            ));
        }
        Some(k as usize)
    } else {
        if req.top_logprobs.is_some_and(|k| k > 0) {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        None
    };
    let st2 = st.clone();
    let prompt = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let text = st2
            .template
            .render(&messages, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        st2.tok
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let p = check_lengths(&st, prompt, v, logprobs)?;
    st.inflight.fetch_add(1, Ordering::SeqCst);
    let guard = InflightGuard(st.clone());
    let rx = submit(&st, &p, request_span(&st, "chat", &headers), "chat")?;
    let id = gen_id("chatcmpl");
    let created = now_secs();
    let model = st.model_id.clone();
    if p.v.stream {
        let include_usage = p.v.include_usage;
        let stream = event_stream(rx, guard, move |ev, first| match ev {
            Chunk::Text(text, lps) => {
                let mut delta = json!({ "content": text });
                if first {
                    delta["role"] = json!("assistant");
                }
                vec![json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{ "index": 0, "delta": delta,
                                  "logprobs": lps.map(|l| chat_logprobs(&l)), "finish_reason": Value::Null }]
                })]
            }
            Chunk::Done(reason, usage) => {
                let mut v = vec![json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{ "index": 0, "delta": {}, "logprobs": Value::Null, "finish_reason": reason }]
                })];
                if include_usage {
                    v.push(json!({
                        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": usage_json(&usage)
                    }));
                }
                v
            }
        });
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let (text, lps, reason, usage) = collect(rx).await?;
    drop(guard);
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": text },
            "logprobs": if p.logprobs.is_some() { chat_logprobs(&lps) } else { Value::Null },
            "finish_reason": reason,
        }],
        "usage": usage_json(&usage),
    }))
    .into_response())
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&st, &req.common.model)?;
    let v = validate_common(&req.common)?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let prompts = req.prompt.into_vec();
    if prompts.len() != 1 {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "send exactly one prompt per request (got {})",
                prompts.len()
            ),
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=20).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be between 0 and 20, got {k}"),
            ))
        }
    };
    let mut v = v;
    if v.max_tokens.is_none() {
        v.max_tokens = Some(16);
    }
    let st2 = st.clone();
    let text = prompts.into_iter().next().unwrap_or_default();
    let prompt = tokio::task::spawn_blocking(move || {
        st2.tok
            .encode(&text, st2.tok.add_bos)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let p = check_lengths(&st, prompt, v, logprobs)?;
    st.inflight.fetch_add(1, Ordering::SeqCst);
    let guard = InflightGuard(st.clone());
    let rx = submit(
        &st,
        &p,
        request_span(&st, "text_completion", &headers),
        "text_completion",
    )?;
    let id = gen_id("cmpl");
    let created = now_secs();
    let model = st.model_id.clone();
    if p.v.stream {
        let include_usage = p.v.include_usage;
        let stream = event_stream(rx, guard, move |ev, _first| match ev {
            Chunk::Text(text, lps) => vec![json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{ "index": 0, "text": text, "logprobs": lps.map(|l| completion_logprobs(&l)), "finish_reason": Value::Null }]
            })],
            Chunk::Done(reason, usage) => {
                let mut v = vec![json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "text": "", "logprobs": Value::Null, "finish_reason": reason }]
                })];
                if include_usage {
                    v.push(json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage_json(&usage)
                    }));
                }
                v
            }
        });
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let (text, lps, reason, usage) = collect(rx).await?;
    drop(guard);
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "text": text,
            "logprobs": if p.logprobs.is_some() { completion_logprobs(&lps) } else { Value::Null },
            "finish_reason": reason,
        }],
        "usage": usage_json(&usage),
    }))
    .into_response())
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
    })
}

fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    json!({ "content": lps.iter().map(|t| json!({
        "token": t.text, "logprob": t.logprob, "bytes": t.text.as_bytes(),
        "top_logprobs": t.top.iter().map(|(s, l)| json!({"token": s, "logprob": l, "bytes": s.as_bytes()})).collect::<Vec<_>>(),
    })).collect::<Vec<_>>() })
}

fn completion_logprobs(lps: &[TokenLogprob]) -> Value {
    json!({
        "tokens": lps.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| t.top.iter().map(|(s, l)| (s.clone(), json!(l))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
    })
}

enum Chunk {
    Text(String, Option<Vec<TokenLogprob>>),
    Done(&'static str, Usage),
}

/// Collects a whole generation (non-streaming responses).
async fn collect(
    mut rx: UnboundedReceiver<Event>,
) -> Result<(String, Vec<TokenLogprob>, &'static str, Usage), ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta { text: t, logprobs } => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Finished { reason, usage } => return Ok((text, lps, reason.as_str(), usage)),
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the engine dropped the request"))
}

/// Turns engine events into SSE frames, ending with `[DONE]`.
fn event_stream<F>(
    rx: UnboundedReceiver<Event>,
    guard: InflightGuard,
    render: F,
) -> impl Stream<Item = Result<SseEvent, Infallible>>
where
    F: FnMut(Chunk, bool) -> Vec<Value> + Send + 'static,
{
    fn frames(v: Vec<Value>) -> Vec<SseEvent> {
        v.into_iter()
            .map(|j| SseEvent::default().data(j.to_string()))
            .collect()
    }
    let state = (rx, guard, render, true, false);
    futures::stream::unfold(
        state,
        |(mut rx, guard, mut render, mut first, done)| async move {
            if done {
                return None;
            }
            let (out, finished) = match rx.recv().await {
                Some(Event::Delta { text, logprobs }) => {
                    let lp = if logprobs.is_empty() {
                        None
                    } else {
                        Some(logprobs)
                    };
                    let f = frames(render(Chunk::Text(text, lp), first));
                    first = false;
                    (f, false)
                }
                Some(Event::Finished { reason, usage }) => {
                    let mut f = Vec::new();
                    if first {
                        f.extend(frames(render(Chunk::Text(String::new(), None), true)));
                    }
                    f.extend(frames(render(Chunk::Done(reason.as_str(), usage), false)));
                    f.push(SseEvent::default().data("[DONE]"));
                    (f, true)
                }
                Some(Event::Error(e)) => {
                    let body = ApiError::internal(e).body();
                    (
                        vec![
                            SseEvent::default()
                                .data(serde_json::to_string(&body).unwrap_or_default()),
                            SseEvent::default().data("[DONE]"),
                        ],
                        true,
                    )
                }
                None => (vec![], true),
            };
            Some((
                futures::stream::iter(out.into_iter().map(Ok)),
                (rx, guard, render, first, finished),
            ))
        },
    )
    .flatten()
}
