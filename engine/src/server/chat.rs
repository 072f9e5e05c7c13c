//! `POST /v1/chat/completions`: messages (with earlier tool calls and results) rendered by
//! the model's chat template with the request's tools, then the shared generation path;
//! answers are split into content and tool calls (streamed as OpenAI streams them).

use super::error::ApiError;
use super::generate::{self, Finished, Render};
use super::openai::*;
use super::{check_model, gen_id, now_secs, request_span, AppState, Limits};
use crate::chat::ChatMessage;
use crate::constraint::GrammarSpec;
use crate::engine::TokenLogprob;
use crate::tools::{inline_tools, CallStream, Piece, Tool, ToolChoice, ToolSet};
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
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!(
                    "unknown role '{}'; use system, developer, user, assistant or tool",
                    m.role
                ),
            ));
        }
        let calls = m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
        let content = match &m.content {
            // OpenAI's rule: only an assistant message that makes calls may leave its
            // content out (or null).
            None if m.role == "assistant" && calls => String::new(),
            None => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].content"),
                    format!(
                        "messages[{i}].content is missing or null; a message of role '{}' needs content (a string or an array of text parts){}",
                        m.role,
                        if m.role == "assistant" {
                            " unless it carries tool_calls"
                        } else {
                            ""
                        }
                    ),
                ))
            }
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.iter().enumerate() {
                    if p.kind == "text" && p.text.is_none() {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].content[{j}].text"),
                            format!("messages[{i}].content[{j}].text is missing or null; a text part needs its text"),
                        ));
                    }
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
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = ChatMessage::text(role, content);
        if m.role == "tool" {
            let Some(id) = &m.tool_call_id else {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].tool_call_id"),
                    "a tool message needs the tool_call_id of the call it answers",
                ));
            };
            msg.tool_call_id = Some(id.clone());
        }
        if let Some(calls) = &m.tool_calls {
            if m.role != "assistant" {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            msg.tool_calls = Some(history_calls(i, calls)?);
        }
        messages.push(msg);
    }
    let tools = tool_set(&req)?;
    let mut v = v;
    if let Some(t) = tools.as_ref().filter(|t| t.active()) {
        match t.forced_grammar() {
            Some(g) => {
                if let Some((other, _)) = &v.grammar {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("a required tool call cannot be combined with {other}"),
                    ));
                }
                v.grammar = Some(("tools", GrammarSpec::ToolCalls(g)));
            }
            // The model decides; compiling the call grammar still checks every schema.
            None => {
                let spec = GrammarSpec::ToolCalls(t.any_call_grammar());
                generate::compile(&st, &limits, "tools", spec).await?;
            }
        }
    }
    let active = tools.filter(|t| t.active());
    if let Some(t) = &active {
        if auto_stops_after_one_call(t) {
            v.stop.push(crate::tools::CLOSE.to_string());
        }
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
    let offered = active.as_ref().map(|t| t.tools.clone());
    let prompt = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let tmpl = &st2.template;
        let text = if crate::tools::native_template(tmpl) {
            let json: Option<Vec<serde_json::Value>> =
                offered.map(|t| t.iter().map(Tool::to_json).collect());
            tmpl.render_with_tools(&messages, json.as_deref(), true)
        } else {
            tmpl.render(&inline_tools(messages, offered.as_deref()), true)
        }
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        st2.tok
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
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

/// A call id, unique like OpenAI's (`call_` and 24 characters).
fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// A finish reason, `tool_calls` when an answer that ended normally made calls.
fn reason_with_calls(reason: &'static str, calls: usize) -> &'static str {
    if calls > 0 && reason == "stop" {
        "tool_calls"
    } else {
        reason
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

/// Whether the answer ends at the close of its first call: `tool_choice: auto` without
/// `parallel_tool_calls`, where the model is free to write but one call is all it may make.
/// The close tag is then a stop string (the splitter reads the unclosed block as the call,
/// and the choice ends with `tool_calls`) rather than text the model writes past until
/// `max_tokens`. Forced calls need none: their grammar ends after the last call allowed.
fn auto_stops_after_one_call(t: &ToolSet) -> bool {
    matches!(t.choice, ToolChoice::Auto) && !t.parallel
}

/// Most tools one request may offer (OpenAI's limit).
const MAX_TOOLS: usize = 128;

/// The request's tools and tool choice, checked; `None` without tools.
fn tool_set(req: &ChatRequest) -> Result<Option<ToolSet>, ApiError> {
    let Some(list) = &req.tools else {
        if req.tool_choice.as_ref().is_some_and(|c| c != "none") {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice is only allowed when tools are given",
            ));
        }
        return Ok(None);
    };
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!("at most {MAX_TOOLS} tools are allowed, got {}", list.len()),
        ));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(|k| k.as_str()) != Some("function") {
            return Err(ApiError::invalid(
                &format!("tools[{i}].type"),
                "only tools of type 'function' are supported",
            ));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::invalid(
                &format!("tools[{i}].function"),
                "a tool needs a function object",
            )
        })?;
        let name = f.get("name").and_then(|n| n.as_str()).unwrap_or("");
        let valid = (1..=64).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("function names are 1-64 letters, digits, '_' or '-', got '{name}'"),
            ));
        }
        if tools.iter().any(|o| o.name == name) {
            return Err(ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("duplicate tool name '{name}'"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(serde_json::Value::Null) => {
                serde_json::json!({"type": "object", "properties": {}})
            }
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.parameters"),
                    "parameters must be a JSON schema object",
                ))
            }
        };
        tools.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(|d| d.as_str())
                .map(str::to_string),
            parameters,
        });
    }
    let choice = match &req.tool_choice {
        None => ToolChoice::Auto,
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or a function, got '{other}'"
                    ),
                ))
            }
        },
        Some(c) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(|n| n.as_str())
                .filter(|_| c.get("type").and_then(|t| t.as_str()) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a tool_choice object is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names '{name}', which is not among the tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice 'required' needs at least one tool",
        ));
    }
    Ok(Some(ToolSet {
        tools,
        choice,
        parallel: req.parallel_tool_calls.unwrap_or(true),
    }))
}

/// An assistant message's earlier calls, checked, in the form templates take (arguments
/// parsed into an object).
fn history_calls(
    i: usize,
    calls: &[serde_json::Value],
) -> Result<Vec<serde_json::Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = |f: &str| format!("messages[{i}].tool_calls[{j}]{f}");
            let f = c.get("function").ok_or_else(|| {
                ApiError::invalid(&at(".function"), "a tool call needs a function object")
            })?;
            let name = f.get("name").and_then(|n| n.as_str()).ok_or_else(|| {
                ApiError::invalid(&at(".function.name"), "a tool call needs a function name")
            })?;
            let arguments = match f.get("arguments") {
                Some(serde_json::Value::String(s)) => serde_json::from_str::<serde_json::Value>(s)
                    .map_err(|e| {
                        ApiError::invalid(
                            &at(".function.arguments"),
                            format!("arguments must be JSON text: {e}"),
                        )
                    })?,
                Some(v) if v.is_object() => v.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        &at(".function.arguments"),
                        "a tool call needs its arguments as a JSON string",
                    ))
                }
            };
            Ok(serde_json::json!({
                "id": c.get("id").cloned().unwrap_or_default(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }))
        })
        .collect()
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
