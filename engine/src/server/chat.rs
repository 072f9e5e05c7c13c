//! `POST /v1/chat/completions`: messages (with earlier tool calls and results) rendered by
//! the model's chat template with the request's tools ([`conversation`]), then the shared
//! generation path; answers are split into content and tool calls (streamed as OpenAI
//! streams them).

use super::conversation::{self, call_id, reason_with_calls};
use super::error::ApiError;
use super::generate::{self, Finished, Render};
use super::openai::*;
use super::{check_model, gen_id, now_secs, request_span, AppState, Limits};
use crate::engine::TokenLogprob;
use crate::tools::{CallStream, Piece, ToolSet};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use axum::Json;
use std::sync::Arc;

pub(super) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    Extension(limits): Extension<Limits>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&st, &req.common.model)?;
    let v = validate_common(&req.common, st.tok.vocab_size)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let messages = conversation::messages("messages", &req.messages)?;
    let tools = conversation::tool_set(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let mut v = v;
    let active = conversation::apply_tools(&st, &limits, tools, &mut v).await?;
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
    let prompt = conversation::prompt(&st, "messages", messages, active.as_ref()).await?;
    let prompt = generate::check_length(&st, prompt, v.max_tokens)?;
    let render = ChatRender {
        id: gen_id("chatcmpl"),
        created: now_secs(),
        model: st.model_id.clone(),
        logprobs: logprobs.is_some(),
        started: vec![false; v.n],
        calls: active
            .as_ref()
            .map(|t| (0..v.n).map(|_| CallStream::new(t.clone())).collect()),
        tools: active,
        pending: vec![Vec::new(); v.n],
    };
    let span = request_span(&st, "chat", &headers);
    generate::respond(
        &st,
        &limits,
        vec![prompt],
        v,
        logprobs,
        span,
        "chat",
        render,
    )
    .await
}

struct ChatRender {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// Whether choice `i` sent its first chunk (the one with the role).
    started: Vec<bool>,
    /// The tools the model was offered (choice not `none`): answers are parsed for calls.
    tools: Option<ToolSet>,
    /// Streaming: one splitter per choice.
    calls: Option<Vec<CallStream>>,
    /// Logprobs of text a splitter holds back, sent with the next chunk.
    pending: Vec<Vec<TokenLogprob>>,
}

impl ChatRender {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<UsageOut>) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// One chunk of choice `index` with `delta`; the first carries the role, and any
    /// logprobs waiting go with it.
    fn choice_chunk(&mut self, index: usize, mut delta: ChatDelta) -> ChatChunk {
        if !self.started[index] {
            self.started[index] = true;
            delta.role = Some("assistant");
        }
        let lps = std::mem::take(&mut self.pending[index]);
        let choice = ChatChunkChoice {
            index,
            delta,
            logprobs: (self.logprobs && !lps.is_empty()).then(|| chat_logprobs(&lps)),
            finish_reason: None,
        };
        self.chunk(vec![choice], None)
    }

    fn pieces(&mut self, index: usize, pieces: Vec<Piece>) -> Vec<ChatChunk> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => out.push(self.choice_chunk(
                    index,
                    ChatDelta {
                        content: Some(t),
                        ..Default::default()
                    },
                )),
                Piece::Call(c) => {
                    let n = self.calls.as_ref().map_or(1, |s| s[index].calls) - 1;
                    let head = ToolCallDelta {
                        index: n,
                        id: Some(call_id()),
                        kind: Some("function"),
                        function: FunctionCallDelta {
                            name: Some(c.name),
                            arguments: String::new(),
                        },
                    };
                    let args = ToolCallDelta {
                        index: n,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta {
                            name: None,
                            arguments: c.arguments,
                        },
                    };
                    for d in [head, args] {
                        let delta = ChatDelta {
                            tool_calls: Some(vec![d]),
                            ..Default::default()
                        };
                        out.push(self.choice_chunk(index, delta));
                    }
                }
            }
        }
        out
    }
}

impl Render for ChatRender {
    type Chunk = ChatChunk;
    type Answer = ChatCompletion;

    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: Option<Vec<TokenLogprob>>,
    ) -> Vec<ChatChunk> {
        self.pending[index].extend(logprobs.unwrap_or_default());
        let pieces = match &mut self.calls {
            Some(streams) => streams[index].push(&text),
            None => vec![Piece::Text(text)],
        };
        self.pieces(index, pieces)
    }

    fn finish(&mut self, index: usize, reason: &'static str) -> Vec<ChatChunk> {
        let (pieces, calls) = match &mut self.calls {
            Some(streams) => (streams[index].finish(), streams[index].calls),
            None => (Vec::new(), 0),
        };
        let mut out = self.pieces(index, pieces);
        if !self.started[index] {
            out.push(self.choice_chunk(
                index,
                ChatDelta {
                    content: Some(String::new()),
                    ..Default::default()
                },
            ));
        }
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(reason_with_calls(reason, calls)),
        };
        out.push(self.chunk(vec![choice], None));
        out
    }

    fn usage(&mut self, usage: UsageOut) -> ChatChunk {
        self.chunk(vec![], Some(usage))
    }

    fn answer(self, choices: Vec<Finished>, usage: UsageOut) -> ChatCompletion {
        let tools = self.tools;
        ChatCompletion {
            choices: choices
                .into_iter()
                .map(|c| {
                    let (content, tool_calls, reason) = match &tools {
                        None => (Some(c.text), None, c.reason),
                        Some(t) => split_calls(t, &c.text, c.reason),
                    };
                    ChatChoice {
                        index: c.index,
                        message: AssistantMessage {
                            role: "assistant",
                            content,
                            tool_calls,
                        },
                        logprobs: self.logprobs.then(|| chat_logprobs(&c.logprobs)),
                        finish_reason: reason,
                    }
                })
                .collect(),
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model,
            usage,
        }
    }
}

/// A whole answer as content and calls (the same splitter as streaming).
fn split_calls(
    tools: &ToolSet,
    text: &str,
    reason: &'static str,
) -> (Option<String>, Option<Vec<ToolCallOut>>, &'static str) {
    let mut s = CallStream::new(tools.clone());
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(ToolCallOut {
                id: call_id(),
                kind: "function",
                function: FunctionCallOut {
                    name: c.name,
                    arguments: c.arguments,
                },
            }),
        }
    }
    if calls.is_empty() {
        return (Some(content), None, reason);
    }
    let reason = reason_with_calls(reason, calls.len());
    (
        (!content.is_empty()).then_some(content),
        Some(calls),
        reason,
    )
}

fn token_logprob(text: &str, logprob: f32, top: Option<Vec<ChatTokenLogprob>>) -> ChatTokenLogprob {
    ChatTokenLogprob {
        token: text.to_string(),
        logprob,
        bytes: text.as_bytes().to_vec(),
        top_logprobs: top,
    }
}

fn chat_logprobs(lps: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|t| {
                let top = t
                    .top
                    .iter()
                    .map(|(s, l)| token_logprob(s, *l, None))
                    .collect();
                token_logprob(&t.text, t.logprob, Some(top))
            })
            .collect(),
    }
}
