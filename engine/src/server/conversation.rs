//! The conversation of a chat-style request, shared by `/v1/chat/completions` and
//! `/v1/responses`: its messages checked into chat-template messages (earlier tool calls
//! and their results included), the offered tools and tool choice checked into a
//! [`ToolSet`] (a forced call becomes the request's grammar), and the conversation rendered
//! by the model's chat template and tokenized. The Responses API turns its input items into
//! [`Message`]s first, so both endpoints check and render a conversation the same way, and
//! their greedy answers to one conversation are the same.

use super::error::ApiError;
use super::generate;
use super::openai::*;
use super::{AppState, Limits};
use crate::chat::ChatMessage;
use crate::constraint::GrammarSpec;
use crate::tools::{inline_tools, Tool, ToolChoice, ToolSet};
use serde_json::Value;
use std::sync::Arc;

/// The request's messages checked into template messages; errors name `field[i]`
/// (`messages` or `input`).
pub(super) fn messages(field: &str, msgs: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::invalid(
                &format!("{field}[{i}].role"),
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
                    &format!("{field}[{i}].content"),
                    format!(
                        "{field}[{i}].content is missing or null; a message of role '{}' needs content (a string or an array of text parts){}",
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
                            &format!("{field}[{i}].content[{j}].text"),
                            format!("{field}[{i}].content[{j}].text is missing or null; a text part needs its text"),
                        ));
                    }
                    if p.kind != "text" {
                        return Err(ApiError::invalid(
                            &format!("{field}[{i}].content"),
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
                    &format!("{field}[{i}].tool_call_id"),
                    "a tool message needs the tool_call_id of the call it answers",
                ));
            };
            msg.tool_call_id = Some(id.clone());
        }
        if let Some(calls) = &m.tool_calls {
            if m.role != "assistant" {
                return Err(ApiError::invalid(
                    &format!("{field}[{i}].tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            msg.tool_calls = Some(history_calls(field, i, calls)?);
        }
        messages.push(msg);
    }
    Ok(messages)
}

/// The tools the model sees (`None`: no tools, or `tool_choice: none`). A forced call
/// (`required` or a named function) becomes `v`'s grammar; when the model decides, the call
/// grammar is still compiled, which checks every tool's schema.
pub(super) async fn apply_tools(
    st: &Arc<AppState>,
    limits: &Limits,
    tools: Option<ToolSet>,
    v: &mut Validated,
) -> Result<Option<ToolSet>, ApiError> {
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
                generate::compile(st, limits, "tools", spec).await?;
            }
        }
    }
    let active = tools.filter(|t| t.active());
    if let Some(t) = &active {
        if auto_stops_after_one_call(t) {
            v.stop.push(crate::tools::CLOSE.to_string());
        }
    }
    Ok(active)
}

/// Whether the answer ends at the close of its first call: `tool_choice: auto` without
/// `parallel_tool_calls`, where the model is free to write but one call is all it may make.
/// The close tag is then a stop string (the splitter reads the unclosed block as the call,
/// and the choice ends with `tool_calls`) rather than text the model writes past until
/// `max_tokens`. Forced calls need none: their grammar ends after the last call allowed.
fn auto_stops_after_one_call(t: &ToolSet) -> bool {
    matches!(t.choice, crate::tools::ToolChoice::Auto) && !t.parallel
}

/// The conversation rendered by the model's chat template (with the tools the model sees)
/// and tokenized, off the async runtime; template errors name `field`.
pub(super) async fn prompt(
    st: &Arc<AppState>,
    field: &'static str,
    messages: Vec<ChatMessage>,
    active: Option<&ToolSet>,
) -> Result<Vec<u32>, ApiError> {
    let st2 = st.clone();
    let offered = active.map(|t| t.tools.clone());
    tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let tmpl = &st2.template;
        let text = if crate::tools::native_template(tmpl) {
            let json: Option<Vec<serde_json::Value>> =
                offered.map(|t| t.iter().map(Tool::to_json).collect());
            tmpl.render_with_tools(&messages, json.as_deref(), true)
        } else {
            tmpl.render(&inline_tools(messages, offered.as_deref()), true)
        }
        .map_err(|e| ApiError::invalid(field, e.to_string()))?;
        st2.tok
            .encode(&text, false)
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}

/// A call id, unique like OpenAI's (`call_` and 24 characters).
pub(super) fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// A finish reason, `tool_calls` when an answer that ended normally made calls.
pub(super) fn reason_with_calls(reason: &'static str, calls: usize) -> &'static str {
    if calls > 0 && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// Most tools one request may offer (OpenAI's limit).
const MAX_TOOLS: usize = 128;

/// The request's tools and tool choice, checked; `None` without tools.
pub(super) fn tool_set(
    tools: Option<&[Value]>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<Option<ToolSet>, ApiError> {
    let Some(list) = tools else {
        if tool_choice.is_some_and(|c| c != "none") {
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
    let choice = match tool_choice {
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
        parallel: parallel_tool_calls.unwrap_or(true),
    }))
}

/// An assistant message's earlier calls, checked, in the form templates take (arguments
/// parsed into an object).
fn history_calls(
    field: &str,
    i: usize,
    calls: &[serde_json::Value],
) -> Result<Vec<serde_json::Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = |f: &str| format!("{field}[{i}].tool_calls[{j}]{f}");
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
