//! The response path both generation endpoints share: a request's prompts times `n`
//! choices are submitted to the engine as separate sequences, then either collected into
//! one answer or streamed as SSE chunks (choices interleaved as their tokens come, each
//! ending with its finish reason, then the usage chunk when asked for, then `[DONE]`).
//! The endpoints only say how a chunk and an answer look ([`Render`]).

use super::error::ApiError;
use super::openai::{UsageOut, Validated};
use super::{AppState, InflightGuard, Limits};
use crate::engine::{Event, GenRequest, SubmitError, TokenLogprob, Usage};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// One tokenized prompt of a request, its length checked.
pub struct PromptIds {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
}

/// A finished choice (non-streaming).
pub struct Finished {
    pub index: usize,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub reason: &'static str,
}

/// How an endpoint renders its wire objects.
pub trait Render: Send + 'static {
    type Chunk: Serialize;
    type Answer: Serialize;
    /// New text (and logprobs, when asked for) of choice `index`: the chunks to send now
    /// (none while a renderer holds text back, e.g. a tool call being written).
    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: Option<Vec<TokenLogprob>>,
    ) -> Vec<Self::Chunk>;
    /// Choice `index` ended: what was held back, then its finish reason.
    fn finish(&mut self, index: usize, reason: &'static str) -> Vec<Self::Chunk>;
    /// The closing usage chunk (`stream_options.include_usage`).
    fn usage(&mut self, usage: UsageOut) -> Self::Chunk;
    /// The whole answer.
    fn answer(self, choices: Vec<Finished>, usage: UsageOut) -> Self::Answer;
    /// Streaming: the chunks sent before any token (the Responses API's
    /// `response.created`); none by default.
    fn start(&mut self) -> Vec<Self::Chunk> {
        Vec::new()
    }
    /// The SSE frame of a chunk: a `data:` line by default.
    fn frame(chunk: &Self::Chunk) -> SseEvent {
        frame(chunk)
    }
    /// Streaming: a failure after the stream began, as the endpoint reports it (the OpenAI
    /// error body by default).
    fn failure(&mut self, e: &ApiError) -> SseEvent {
        frame(&e.body())
    }
    /// Whether the stream ends with `data: [DONE]` (the Completions and Chat APIs do, the
    /// Responses API does not).
    const DONE: bool = true;
}

/// Token ids a client sent, checked against the vocabulary; errors name `param` and say
/// `what` holds the bad id.
pub fn token_ids(ids: &[i64], vocab: usize, param: &str, what: &str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&i| (i as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        format!("{what}token id {id} is out of the vocabulary (size {vocab})"),
                    )
                })
        })
        .collect()
}

/// Checks that `ids` and its completion fit the model's context.
pub fn check_length(
    st: &AppState,
    ids: Vec<u32>,
    max_tokens: Option<usize>,
) -> Result<PromptIds, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let room = st.max_seq.saturating_sub(ids.len());
    let max_tokens = max_tokens.unwrap_or(room);
    if ids.len() + max_tokens > st.max_seq || room == 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Shorten the prompt or lower max_tokens.",
                st.max_seq,
                ids.len() + max_tokens,
                ids.len(),
                max_tokens
            ),
        ));
    }
    Ok(PromptIds { ids, max_tokens })
}

/// Submits every (prompt, choice) of a request and answers it: SSE when `v.stream`, one
/// JSON answer otherwise. Choice `p * n + k` is the `k`th sample of prompt `p`; with a
/// seed, it samples with `seed + k` (choices differ, and repeat).
#[allow(clippy::too_many_arguments)]
pub async fn respond<R: Render>(
    st: &Arc<AppState>,
    limits: &Limits,
    prompts: Vec<PromptIds>,
    v: Validated,
    logprobs: Option<usize>,
    span: tracing::Span,
    operation: &'static str,
    render: R,
) -> Result<Response, ApiError> {
    if st.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable(
            "the server is shutting down; retry on another replica",
        ));
    }
    if let Some(why) = st.engine.failure() {
        return Err(ApiError::unavailable(format!(
            "the engine has stopped ({why}); retry on another replica"
        )));
    }
    let constraint = match &v.grammar {
        None => None,
        Some((param, spec)) => {
            let max = prompts.iter().map(|p| p.max_tokens).min();
            Some(prepare(st, limits, param, spec.clone(), max).await?)
        }
    };
    st.inflight.fetch_add(1, Ordering::SeqCst);
    let guard = InflightGuard(st.clone());
    let several = prompts.len() * v.n > 1;
    let prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
    let mut rxs = Vec::with_capacity(prompts.len() * v.n);
    for p in &prompts {
        for k in 0..v.n {
            let mut params = v.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(k as u64));
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            st.shutdown.track(&tx);
            // With several choices each gets its own child span (the engine records a
            // sequence's usage on its span).
            let seq_span = if several {
                super::request_span_with_parent(st, operation, &span)
            } else {
                span.clone()
            };
            st.engine
                .submit(GenRequest {
                    prompt: p.ids.clone(),
                    params,
                    max_tokens: p.max_tokens,
                    stop: v.stop.clone(),
                    logprobs,
                    ignore_eos: v.ignore_eos,
                    events: tx,
                    arrived: Instant::now(),
                    span: seq_span,
                    operation,
                    constraint: constraint.as_ref().map(|c| c.fork()),
                })
                .map_err(|e| match e {
                    SubmitError::QueueFull(_) => {
                        st.metrics.requests_rejected.inc();
                        ApiError::overloaded(e.to_string())
                    }
                    SubmitError::Stopped => ApiError::unavailable(e.to_string()),
                })?;
            rxs.push(rx);
        }
    }
    if v.stream {
        let stream = sse(
            st.clone(),
            rxs,
            guard,
            render,
            prompt_tokens,
            v.n,
            v.include_usage,
        );
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let results = futures::future::join_all(rxs.into_iter().map(|rx| collect(st, rx))).await;
    drop(guard);
    let mut usage = UsageOut {
        prompt_tokens,
        ..Default::default()
    };
    let mut choices = Vec::with_capacity(results.len());
    for (index, r) in results.into_iter().enumerate() {
        let (text, lps, reason, u) = r?;
        add_usage(&mut usage, &u, index % v.n == 0);
        choices.push(Finished {
            index,
            text,
            logprobs: lps,
            reason,
        });
    }
    Ok(Json(render.answer(choices, usage)).into_response())
}

/// Compiles a request's structured-output constraint and checks that an output within
/// `max_tokens` can complete it, off the async runtime and within `--max-grammar-work`.
async fn prepare(
    st: &Arc<AppState>,
    limits: &Limits,
    param: &'static str,
    spec: crate::constraint::GrammarSpec,
    max_tokens: Option<usize>,
) -> Result<crate::constraint::Constraint, ApiError> {
    let Some(g) = st.grammars.clone() else {
        return Err(no_grammars(param));
    };
    let work = limits.max_grammar_work;
    tokio::task::spawn_blocking(move || {
        // The bound first: it is cheaper, and it refuses within the budget what
        // llguidance would only refuse after spending its own.
        fits_max_tokens(&g, work, param, &spec, max_tokens)?;
        compile_now(&g, work, param, &spec)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}

fn no_grammars(param: &str) -> ApiError {
    ApiError::invalid(
        param,
        "structured outputs are not available for this model's tokenizer",
    )
}

/// The over-budget error of `param`.
fn over_budget(param: &str, e: crate::constraint::OverBudget) -> ApiError {
    ApiError::over_budget(
        param,
        format!("{param}: {e}; simplify it, or ask the operator to raise --max-grammar-work"),
    )
}

/// Refuses a constraint no output within `max_tokens` can complete: its shortest text takes
/// more tokens of this model's vocabulary than the request allows (a sound lower bound, so
/// a request that could complete is never refused).
fn fits_max_tokens(
    g: &crate::constraint::Grammars,
    work: u64,
    param: &'static str,
    spec: &crate::constraint::GrammarSpec,
    max_tokens: Option<usize>,
) -> Result<(), ApiError> {
    let need = g
        .min_tokens(spec, work)
        .map_err(|e| over_budget(param, e))?;
    match max_tokens {
        Some(max) if max < need => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "the {param} constraint cannot be completed within max_tokens = {max}: its \
                 shortest output is {} bytes, at least {need} tokens of this model's \
                 vocabulary; raise max_tokens to {need} or more",
                crate::constraint::min_output_bytes(spec, work).unwrap_or(0)
            ),
        )),
        _ => Ok(()),
    }
}

/// Compiles `spec` on this thread within `work`; errors name `param`.
fn compile_now(
    g: &crate::constraint::Grammars,
    work: u64,
    param: &'static str,
    spec: &crate::constraint::GrammarSpec,
) -> Result<crate::constraint::Constraint, ApiError> {
    g.compile_within(spec, work).map_err(|e| {
        let msg = format!("{e:#}").replace("\n<non-verbose/>", "");
        let lower = msg.to_lowercase();
        let limit = [
            "fuel",
            "too large",
            "too many",
            "too complex",
            "grammar size",
        ]
        .iter()
        .any(|w| lower.contains(w));
        if limit {
            ApiError::over_budget(
                param,
                format!(
                    "{param} is too complex for this server's grammar limits \
                     (--max-grammar-work): {msg}"
                ),
            )
        } else {
            ApiError::invalid(param, format!("invalid {param}: {msg}"))
        }
    })
}

/// Compiles a structured-output grammar off the async runtime; errors name `param`.
pub(super) async fn compile(
    st: &Arc<AppState>,
    limits: &Limits,
    param: &'static str,
    spec: crate::constraint::GrammarSpec,
) -> Result<crate::constraint::Constraint, ApiError> {
    let Some(g) = st.grammars.clone() else {
        return Err(no_grammars(param));
    };
    let work = limits.max_grammar_work;
    tokio::task::spawn_blocking(move || compile_now(&g, work, param, &spec))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
}

/// Adds one choice's usage; `first_of_prompt`: its prompt's first choice (the prompt and
/// its cached tokens count once).
fn add_usage(total: &mut UsageOut, u: &Usage, first_of_prompt: bool) {
    if first_of_prompt {
        total.prompt_tokens_details.cached_tokens += u.cached_tokens;
    }
    total.completion_tokens += u.completion_tokens;
    total.total_tokens = total.prompt_tokens + total.completion_tokens;
    total.draft_tokens += u.draft_tokens;
    total.accepted_draft_tokens += u.accepted_draft_tokens;
}

/// Collects one whole generation.
async fn collect(
    st: &AppState,
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
            Event::Error(e) => return Err(failed(st, e)),
        }
    }
    Err(failed(st, "the engine dropped the request".into()))
}

/// A request the engine failed: 503 when the engine itself has died or the server ended it
/// at its drain deadline (the replica is out of service; another may answer), 500 when only
/// this request failed.
fn failed(st: &AppState, e: String) -> ApiError {
    if st.engine.failure().is_some() || st.shutdown.cancelled() {
        ApiError::unavailable(e)
    } else {
        ApiError::internal(e)
    }
}

/// A `data:` frame of `v` as JSON.
pub fn frame<T: Serialize>(v: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(v).unwrap_or_default())
}

/// The renderer's opening chunks, then the merged event streams of every choice as SSE
/// frames, ending with `[DONE]` (where the endpoint sends it).
fn sse<R: Render>(
    st: Arc<AppState>,
    rxs: Vec<UnboundedReceiver<Event>>,
    guard: InflightGuard,
    mut render: R,
    prompt_tokens: usize,
    n: usize,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let choices = rxs.len();
    // Each choice's events, then `None` when its channel closes: a choice that closes
    // without finishing (the engine died) ends the stream with an error event.
    let merged = futures::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
        UnboundedReceiverStream::new(rx)
            .map(Some)
            .chain(futures::stream::once(futures::future::ready(None)))
            .map(move |ev| (i, ev))
    }));
    let mut ended = vec![false; choices];
    let mut open = choices;
    let mut usage = UsageOut {
        prompt_tokens,
        total_tokens: prompt_tokens,
        ..Default::default()
    };
    let mut done = false;
    let start: Vec<_> = render.start().iter().map(R::frame).map(Ok).collect();
    let events = merged
        .map(move |(i, ev)| {
            let _hold = &guard;
            let mut out = Vec::new();
            if done {
                return None;
            }
            let ev = match ev {
                Some(ev) => ev,
                None if ended[i] => return Some(out),
                None => Event::Error("the engine dropped the request".into()),
            };
            match ev {
                Event::Delta { text, logprobs } => {
                    let lp = (!logprobs.is_empty()).then_some(logprobs);
                    out.extend(render.delta(i, text, lp).iter().map(R::frame));
                }
                Event::Finished { reason, usage: u } => {
                    ended[i] = true;
                    out.extend(render.finish(i, reason.as_str()).iter().map(R::frame));
                    add_usage(&mut usage, &u, i % n == 0);
                    open -= 1;
                    if open == 0 {
                        if include_usage {
                            out.push(R::frame(&render.usage(usage.clone())));
                        }
                        if R::DONE {
                            out.push(SseEvent::default().data("[DONE]"));
                        }
                        done = true;
                    }
                }
                Event::Error(e) => {
                    ended[i] = true;
                    out.push(render.failure(&failed(&st, e)));
                    if R::DONE {
                        out.push(SseEvent::default().data("[DONE]"));
                    }
                    done = true;
                }
            }
            // An event may give no frame (text a renderer holds back); `None` ends the
            // stream after `[DONE]`.
            Some(out)
        })
        .take_while(|out| futures::future::ready(out.is_some()))
        .flat_map(|out| futures::stream::iter(out.unwrap_or_default().into_iter().map(Ok)));
    futures::stream::iter(start).chain(events)
}
