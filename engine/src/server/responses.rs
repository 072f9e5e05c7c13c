//! `POST /v1/responses`, the Responses API (as vLLM and SGLang serve it): `input` items
//! become the same conversation a chat request carries ([`super::conversation`]: same
//! checks, same template, same tools), `instructions` a system message before it, and the
//! request goes down the shared generation path (speculation included). The answer is a
//! `response` object whose `output` holds a message item and / or `function_call` items;
//! streamed, the documented event sequence (`response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta`..., `.done` events, `response.completed`), each SSE frame
//! an `event:` line and a `data:` object with its `sequence_number`. Nothing is stored:
//! `previous_response_id` (and `conversation`, `background`) are refused with a 400.

use super::conversation::{self, call_id};
use super::error::ApiError;
use super::generate::{self, Finished, Render};
use super::openai::*;
use super::{check_model, gen_id, now_secs, request_span, AppState, Limits};
use crate::engine::TokenLogprob;
use crate::tools::{CallStream, Piece, ToolCall};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::Response;
use axum::Extension;
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

pub(super) async fn responses(
    State(st): State<Arc<AppState>>,
    Extension(limits): Extension<Limits>,
    headers: HeaderMap,
    body: Result<Json<ResponsesRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let model = req.model.clone().unwrap_or_else(|| "default".into());
    check_model(&st, &model)?;
    refuse_unsupported(&req)?;
    let common = CommonParams {
        model,
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        seed: req.seed,
        stream: req.stream,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        logit_bias: req.logit_bias.clone(),
        response_format: text_format(req.text.as_ref())?,
        min_p: req.min_p,
        repetition_penalty: req.repetition_penalty,
        ignore_eos: req.ignore_eos,
        ..Default::default()
    };
    let mut v = validate_common(&common, st.tok.vocab_size).map_err(own_names)?;
    // The closing `response.completed` event carries the usage.
    v.include_usage = true;
    let (msgs, item_of) = input_messages(&req.input)?;
    let mut messages =
        conversation::messages("input", &msgs).map_err(|e| item_index(e, &item_of))?;
    if let Some(i) = &req.instructions {
        messages.insert(0, crate::chat::ChatMessage::text("system", i.clone()));
    }
    let tools = chat_tools(req.tools.as_deref())?;
    let choice = req.tool_choice.as_ref().map(chat_tool_choice);
    let tools = conversation::tool_set(tools.as_deref(), choice.as_ref(), req.parallel_tool_calls)
        .map_err(own_names)?;
    let active = conversation::apply_tools(&st, &limits, tools, &mut v).await?;
    let prompt = conversation::prompt(&st, "input", messages, active.as_ref()).await?;
    let prompt = generate::check_length(&st, prompt, v.max_tokens).map_err(own_names)?;
    let render = ResponsesRender {
        head: head(&st, &req, &v),
        seq: 0,
        calls: active.map(CallStream::new),
        output: Vec::new(),
        open: None,
        reason: "stop",
    };
    let span = request_span(&st, "chat", &headers);
    generate::respond(&st, &limits, vec![prompt], v, None, span, "chat", render).await
}

/// What this server cannot do for a Responses request: continue a stored one, or run one
/// in the background.
fn refuse_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    const STATELESS: &str = "this server does not store responses (every response is returned with store: false); send the whole conversation as input items instead";
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!("previous_response_id is not supported: {STATELESS}"),
        ));
    }
    if req.conversation.is_some() {
        return Err(ApiError::invalid(
            "conversation",
            format!("conversation is not supported: {STATELESS}"),
        ));
    }
    if req.background == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background responses are not supported; stream the response instead",
        ));
    }
    Ok(())
}

/// Errors of the shared checks in this API's spellings (`max_output_tokens`,
/// `text.format`, flat tools).
fn own_names(mut e: ApiError) -> ApiError {
    let rename = |s: &str| {
        s.replace("max_tokens", "max_output_tokens")
            .replace("response_format", "text.format")
            .replace("].function.", "].")
            .replace("].function", "]")
    };
    e.param = e.param.as_deref().map(&rename);
    e.message = rename(&e.message);
    e
}

/// `text.format` as the chat API's `response_format`.
fn text_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")) else {
        return Ok(None);
    };
    match format.get("type").and_then(|t| t.as_str()) {
        Some("json_schema") => {
            let schema = format.get("schema").ok_or_else(|| {
                ApiError::invalid(
                    "text.format.schema",
                    "text.format json_schema needs a schema",
                )
            })?;
            Ok(Some(json!({"type": "json_schema", "json_schema": {
                "name": format.get("name"),
                "schema": schema,
                "strict": format.get("strict").and_then(|s| s.as_bool()).unwrap_or(false),
            }})))
        }
        Some("text") | Some("json_object") => Ok(Some(format.clone())),
        other => Err(ApiError::invalid(
            "text.format.type",
            format!(
                "text.format type {} is not supported (text, json_object, json_schema)",
                other.map_or("(missing)".to_string(), |o| format!("'{o}'"))
            ),
        )),
    }
}

/// Flat function tools as the chat API's (`{"type": "function", "function": {...}}`); other
/// types stay as they are (and are refused by the shared check).
fn chat_tools(tools: Option<&[Value]>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    Ok(Some(
        tools
            .iter()
            .map(
                |t| match (t.get("type").and_then(|k| k.as_str()), t.as_object()) {
                    (Some("function"), Some(o)) if !o.contains_key("function") => {
                        let mut f = o.clone();
                        f.remove("type");
                        json!({"type": "function", "function": f})
                    }
                    _ => t.clone(),
                },
            )
            .collect(),
    ))
}

/// `{"type": "function", "name"}` as the chat API's tool choice.
fn chat_tool_choice(c: &Value) -> Value {
    match c.get("name") {
        Some(name) if c.get("type").and_then(|t| t.as_str()) == Some("function") => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => c.clone(),
    }
}

/// The input items as chat messages (consecutive function calls are one assistant
/// message, as chat clients send them), and for each message the item it came from.
fn input_messages(input: &ResponsesInput) -> Result<(Vec<Message>, Vec<usize>), ApiError> {
    let items = match input {
        ResponsesInput::Text(t) => {
            return Ok((
                vec![message("user", MessageContent::Text(t.clone()))],
                vec![0],
            ))
        }
        ResponsesInput::Items(items) => items,
    };
    if items.is_empty() {
        return Err(ApiError::invalid("input", "input must not be empty"));
    }
    let mut msgs: Vec<Message> = Vec::with_capacity(items.len());
    let mut item_of = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |f: &str| format!("input[{i}]{f}");
        let field = |name: &str| {
            item.get(name).and_then(|v| v.as_str()).ok_or_else(|| {
                ApiError::invalid(
                    &at(&format!(".{name}")),
                    format!("a {} item needs {name} (a string)", kind_of(item)),
                )
            })
        };
        // A message's content or a tool result's output: a string or input_text parts.
        let text_of = |name: &str, needs: &str| match item.get(name) {
            Some(Value::String(s)) => Ok(MessageContent::Text(s.clone())),
            Some(Value::Array(parts)) => Ok(MessageContent::Parts(text_parts(parts))),
            _ => Err(ApiError::invalid(&at(&format!(".{name}")), needs)),
        };
        match kind_of(item) {
            "message" => {
                let role = field("role")?;
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(ApiError::invalid(
                        &at(".role"),
                        format!("unknown role '{role}'; use user, system, developer or assistant (tool results are function_call_output items)"),
                    ));
                }
                let content = text_of(
                    "content",
                    "a message item needs content: a string or a list of input_text parts",
                )?;
                msgs.push(message(role, content));
                item_of.push(i);
            }
            "function_call" => {
                let call = json!({
                    "id": field("call_id")?,
                    "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?},
                });
                // Calls follow the assistant message they belong to, or each other.
                match msgs.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => {
                        let mut m = message("assistant", MessageContent::Text(String::new()));
                        m.content = None;
                        m.tool_calls = Some(vec![call]);
                        msgs.push(m);
                        item_of.push(i);
                    }
                }
            }
            "function_call_output" => {
                let output = text_of(
                    "output",
                    "a function_call_output item needs output (a string)",
                )?;
                let mut m = message("tool", output);
                m.tool_call_id = Some(field("call_id")?.to_string());
                msgs.push(m);
                item_of.push(i);
            }
            other => {
                return Err(ApiError::invalid(
                    &at(".type"),
                    format!("input item type '{other}' is not supported (message, function_call, function_call_output)"),
                ))
            }
        }
    }
    Ok((msgs, item_of))
}

/// An item's type (`message` when left out, as the Responses API allows for messages).
fn kind_of(item: &Value) -> &str {
    item.get("type")
        .and_then(|t| t.as_str())
        .unwrap_or("message")
}

fn message(role: &str, content: MessageContent) -> Message {
    Message {
        role: role.to_string(),
        content: Some(content),
        tool_calls: None,
        tool_call_id: None,
    }
}

/// Content parts: text parts (`input_text`, `output_text`, `text`) as text, others kept by
/// type (the shared check refuses them: a text model reads no images or files).
fn text_parts(parts: &[Value]) -> Vec<ContentPart> {
    parts
        .iter()
        .map(|p| {
            let kind = p.get("type").and_then(|t| t.as_str()).unwrap_or("");
            ContentPart {
                kind: match kind {
                    "input_text" | "output_text" | "text" => "text".to_string(),
                    other => other.to_string(),
                },
                text: p.get("text").and_then(|t| t.as_str()).map(str::to_string),
            }
        })
        .collect()
}

/// An error of the shared message check, which names `input[message]`, naming the item.
fn item_index(mut e: ApiError, item_of: &[usize]) -> ApiError {
    let index = e
        .param
        .as_deref()
        .and_then(|p| p.strip_prefix("input["))
        .and_then(|p| p.split(']').next())
        .and_then(|n| n.parse::<usize>().ok());
    if let Some((m, &i)) = index.and_then(|m| item_of.get(m).map(|i| (m, i))) {
        let (from, to) = (format!("input[{m}]"), format!("input[{i}]"));
        e.param = e.param.map(|p| p.replacen(&from, &to, 1));
        e.message = e.message.replace(&from, &to);
    }
    e
}

/// The response object without its status, output and usage: the request's settings as
/// OpenAI echoes them.
fn head(st: &AppState, req: &ResponsesRequest, v: &Validated) -> Value {
    json!({
        "id": gen_id("resp"),
        "object": "response",
        "created_at": now_secs(),
        "model": st.model_id,
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": null,
        "metadata": {},
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "store": false,
        "temperature": v.params.temperature,
        "text": {"format": req.text.as_ref().and_then(|t| t.get("format")).cloned()
            .unwrap_or_else(|| json!({"type": "text"}))},
        "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        "tools": req.tools.clone().unwrap_or_default(),
        "top_p": v.params.top_p,
        "truncation": "disabled",
        "user": null,
    })
}

/// A streamed event: its type (the `event:` line) and its data.
#[derive(serde::Serialize)]
pub(super) struct ResponseEvent {
    kind: &'static str,
    data: Value,
}

/// The message item being written.
struct OpenText {
    id: String,
    index: usize,
    text: String,
}

struct ResponsesRender {
    head: Value,
    /// The next event's `sequence_number`.
    seq: u64,
    /// The tools the model sees: its answer is split into text and calls.
    calls: Option<CallStream>,
    /// Finished output items.
    output: Vec<Value>,
    open: Option<OpenText>,
    reason: &'static str,
}

impl ResponsesRender {
    fn ev(&mut self, kind: &'static str, mut data: Value) -> ResponseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        ResponseEvent { kind, data }
    }

    /// The response as it stands (`status`; `usage` once finished).
    fn response(&self, status: &str, usage: Option<&UsageOut>) -> Value {
        let mut r = self.head.clone();
        r["status"] = json!(status);
        r["output"] = json!(self.output);
        r["usage"] = usage.map_or(Value::Null, usage_json);
        if status == "incomplete" {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r
    }

    fn status(&self) -> &'static str {
        if self.reason == "length" {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// Opens the message item (events `output_item.added`, `content_part.added`).
    fn open_text(&mut self, out: &mut Vec<ResponseEvent>) {
        if self.open.is_some() {
            return;
        }
        let (id, index) = (gen_id("msg"), self.output.len());
        let item = json!({"id": id, "type": "message", "status": "in_progress",
            "role": "assistant", "content": []});
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        let e = self.ev(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        out.push(e);
        self.open = Some(OpenText {
            id,
            index,
            text: String::new(),
        });
    }

    fn text(&mut self, t: String, out: &mut Vec<ResponseEvent>) {
        self.open_text(out);
        let Some(o) = &self.open else { return };
        let data = json!({"item_id": o.id, "output_index": o.index, "content_index": 0,
            "delta": t, "logprobs": []});
        if let Some(o) = &mut self.open {
            o.text.push_str(&t);
        }
        let e = self.ev("response.output_text.delta", data);
        out.push(e);
    }

    /// Closes the message item being written (the `.done` events).
    fn close_text(&mut self, status: &str, out: &mut Vec<ResponseEvent>) {
        let Some(o) = self.open.take() else { return };
        let part =
            json!({"type": "output_text", "text": o.text, "annotations": [], "logprobs": []});
        let at = json!({"item_id": o.id, "output_index": o.index, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(o.text);
        done["logprobs"] = json!([]);
        let e = self.ev("response.output_text.done", done);
        out.push(e);
        let mut part_done = at;
        part_done["part"] = part.clone();
        let e = self.ev("response.content_part.done", part_done);
        out.push(e);
        let item = json!({"id": o.id, "type": "message", "status": status,
            "role": "assistant", "content": [part]});
        let e = self.ev(
            "response.output_item.done",
            json!({"output_index": o.index, "item": item}),
        );
        out.push(e);
        self.output.push(item);
    }

    /// A function call item, whole (its arguments in one delta).
    fn call(&mut self, c: ToolCall, out: &mut Vec<ResponseEvent>) {
        self.close_text("completed", out);
        let (id, index) = (gen_id("fc"), self.output.len());
        let mut item = json!({"id": id, "type": "function_call", "call_id": call_id(),
            "name": c.name, "arguments": "", "status": "in_progress"});
        let e = self.ev(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        let at = json!({"item_id": id, "output_index": index});
        let mut delta = at.clone();
        delta["delta"] = json!(c.arguments);
        let e = self.ev("response.function_call_arguments.delta", delta);
        out.push(e);
        let mut done = at;
        done["name"] = json!(c.name);
        done["arguments"] = json!(c.arguments);
        let e = self.ev("response.function_call_arguments.done", done);
        out.push(e);
        item["arguments"] = json!(c.arguments);
        item["status"] = json!("completed");
        let e = self.ev(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        self.output.push(item);
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<ResponseEvent> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => self.text(t, &mut out),
                Piece::Call(c) => self.call(c, &mut out),
            }
        }
        out
    }
}

/// `usage` as the Responses API spells it (with the engine's speculation extensions).
fn usage_json(u: &UsageOut) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
    })
}

impl Render for ResponsesRender {
    type Chunk = ResponseEvent;
    type Answer = Value;
    const DONE: bool = false;

    fn start(&mut self) -> Vec<ResponseEvent> {
        let r = self.response("in_progress", None);
        vec![
            self.ev("response.created", json!({"response": r})),
            self.ev("response.in_progress", json!({"response": r})),
        ]
    }

    fn frame(e: &ResponseEvent) -> SseEvent {
        SseEvent::default()
            .event(e.kind)
            .data(serde_json::to_string(&e.data).unwrap_or_default())
    }

    fn failure(&mut self, e: &ApiError) -> SseEvent {
        let body = e.body().error;
        let ev = self.ev(
            "error",
            json!({"code": body.code, "message": body.message, "param": body.param}),
        );
        Self::frame(&ev)
    }

    fn delta(
        &mut self,
        _index: usize,
        text: String,
        _logprobs: Option<Vec<TokenLogprob>>,
    ) -> Vec<ResponseEvent> {
        let pieces = match &mut self.calls {
            Some(s) => s.push(&text),
            None => vec![Piece::Text(text)],
        };
        self.pieces(pieces)
    }

    fn finish(&mut self, _index: usize, reason: &'static str) -> Vec<ResponseEvent> {
        self.reason = reason;
        let rest = self
            .calls
            .as_mut()
            .map(CallStream::finish)
            .unwrap_or_default();
        let mut out = self.pieces(rest);
        // An answer with nothing in it is still an (empty) message.
        if self.output.is_empty() {
            self.open_text(&mut out);
        }
        let status = self.status();
        self.close_text(status, &mut out);
        out
    }

    fn usage(&mut self, usage: UsageOut) -> ResponseEvent {
        let status = self.status();
        let kind = if status == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        let r = self.response(status, Some(&usage));
        self.ev(kind, json!({"response": r}))
    }

    fn answer(mut self, choices: Vec<Finished>, usage: UsageOut) -> Value {
        for c in choices {
            self.delta(c.index, c.text, None);
            self.finish(c.index, c.reason);
        }
        self.response(self.status(), Some(&usage))
    }
}
