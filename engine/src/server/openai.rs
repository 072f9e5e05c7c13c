//! OpenAI wire types for `/v1/chat/completions`, `/v1/completions`, `/v1/models` and the
//! `/v1/responses` request (its answer and events are built in [`super::responses`]), and
//! the validation of requests into engine settings.

use super::error::ApiError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StringOrVec {
    One(String),
    Many(Vec<String>),
}

impl StringOrVec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrVec::One(s) => vec![s],
            StringOrVec::Many(v) => v,
        }
    }
}

/// A completions prompt: text, several texts, token ids, or several token-id lists.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// One prompt of a request, before tokenizing.
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
}

impl PromptInput {
    pub fn into_prompts(self) -> Vec<Prompt> {
        match self {
            PromptInput::Text(s) => vec![Prompt::Text(s)],
            PromptInput::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
            PromptInput::Tokens(t) => vec![Prompt::Tokens(t)],
            PromptInput::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<MessageContent>,
    /// An assistant's earlier calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": "<JSON text>"}}]` (checked by the chat endpoint, so errors name them).
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Parameters common to both endpoints (the Responses API fills them from its own
/// spellings).
#[derive(Debug, Deserialize, Default)]
pub struct CommonParams {
    pub model: String,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<StringOrVec>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's form) -> bias added to its logit.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    /// "strict"}}`.
    pub response_format: Option<serde_json::Value>,
    /// Extensions (vLLM's guided decoding): a JSON schema, a regular expression, a Lark
    /// grammar the output must follow.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    /// Extension (vLLM's): whitespace allowed between the tokens of JSON outputs, a regular
    /// expression (e.g. `[ \n\t]+`). Without it JSON outputs are compact and numbers have at
    /// most [`crate::constraint::MAX_NUMBER_DIGITS`] digits in a row.
    pub guided_whitespace_pattern: Option<String>,
    /// Extension (vLLM): drop tokens below `min_p` times the most likely one's probability.
    pub min_p: Option<f32>,
    /// Extension (vLLM, Hugging Face): penalise tokens already in the prompt or output.
    pub repetition_penalty: Option<f32>,
    /// Extension (as in vLLM): keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Vec<serde_json::Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// `/v1/responses` request: the fields this server reads (others, such as `metadata`,
/// `user`, `reasoning`, `include`, are accepted and ignored).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    /// The served model or `default` (the served model when left out).
    pub model: Option<String>,
    pub input: ResponsesInput,
    /// A system message before the input.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Flat function tools: `[{"type": "function", "name", "description", "parameters",
    /// "strict"}]`.
    pub tools: Option<Vec<serde_json::Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "name"}`.
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema",
    /// "strict"}}`.
    pub text: Option<serde_json::Value>,
    #[serde(default)]
    pub stream: bool,
    /// Accepted; responses are never stored.
    pub store: Option<bool>,
    /// Refused (400): nothing is stored to continue from.
    pub previous_response_id: Option<String>,
    pub conversation: Option<serde_json::Value>,
    pub background: Option<bool>,
    /// Extensions, as on the other endpoints.
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    #[serde(default)]
    pub ignore_eos: bool,
}

/// The Responses API's `input`: a user message, or a list of items (messages, function
/// calls, function call outputs).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<serde_json::Value>),
}

/// Most choices (`n`) one request may ask for.
pub const MAX_N: usize = 16;
/// Most prompts in one `/v1/completions` request.
pub const MAX_PROMPTS: usize = 64;

/// Validated sampling and length settings.
pub struct Validated {
    pub params: crate::sampling::SamplingParams,
    /// Choices per prompt.
    pub n: usize,
    /// Structured output: the grammar and the request field that gave it.
    pub grammar: Option<(&'static str, crate::constraint::GrammarSpec)>,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Checks the parameters both endpoints share; `vocab_size` bounds `logit_bias` ids.
pub fn validate_common(c: &CommonParams, vocab_size: usize) -> Result<Validated, ApiError> {
    let bad = |param: &str, msg: String| Err(ApiError::invalid(param, msg));
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_N as i64).contains(&n) {
        return bad("n", format!("n must be between 1 and {MAX_N}, got {n}"));
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if let Some(v) = v {
            if !(-2.0..=2.0).contains(&v) {
                return bad(name, format!("{name} must be between -2 and 2, got {v}"));
            }
        }
    }
    let repetition_penalty = c.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 2.0) {
        return bad(
            "repetition_penalty",
            format!("repetition_penalty must be in (0, 2], got {repetition_penalty}"),
        );
    }
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return bad(
            "min_p",
            format!("min_p must be between 0 and 1, got {min_p}"),
        );
    }
    let mut logit_bias = Vec::new();
    for (k, &b) in c.logit_bias.iter().flatten() {
        let Ok(id) = k.parse::<u32>() else {
            return bad(
                "logit_bias",
                format!("logit_bias keys must be token ids, got '{k}'"),
            );
        };
        if id as usize >= vocab_size {
            return bad(
                "logit_bias",
                format!("logit_bias token id {id} is out of the vocabulary (size {vocab_size})"),
            );
        }
        if !(-100.0..=100.0).contains(&b) {
            return bad(
                "logit_bias",
                format!("logit_bias values must be between -100 and 100, got {b} for token {id}"),
            );
        }
        logit_bias.push((id, b));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) || temperature.is_nan() {
        return bad(
            "temperature",
            format!("temperature must be between 0 and 2, got {temperature}"),
        );
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad("top_p", format!("top_p must be in (0, 1], got {top_p}"));
    }
    let top_k = c.top_k.unwrap_or(0);
    if top_k < -1 {
        return bad(
            "top_k",
            format!("top_k must be -1, 0 (off) or positive, got {top_k}"),
        );
    }
    let max_tokens = c.max_completion_tokens.or(c.max_tokens);
    if let Some(m) = max_tokens {
        if m < 1 {
            return bad(
                "max_tokens",
                format!("max_tokens must be at least 1, got {m}"),
            );
        }
    }
    let stop = c.stop.as_ref().map(|s| match s {
        StringOrVec::One(x) => vec![x.clone()],
        StringOrVec::Many(v) => v.clone(),
    });
    let stop: Vec<String> = stop
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    if stop.len() > 4 {
        return bad(
            "stop",
            format!("at most 4 stop strings are allowed, got {}", stop.len()),
        );
    }
    Ok(Validated {
        params: crate::sampling::SamplingParams {
            temperature,
            top_p,
            top_k: top_k.max(0) as usize,
            seed: c.seed,
            min_p,
            presence_penalty: c.presence_penalty.unwrap_or(0.0),
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
            repetition_penalty,
            logit_bias,
        },
        n: n as usize,
        grammar: grammar_of(c)?,
        max_tokens: max_tokens.map(|m| m as usize),
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: c.ignore_eos,
    })
}

/// The structured-output grammar a request asks for (at most one of its fields).
fn grammar_of(
    c: &CommonParams,
) -> Result<Option<(&'static str, crate::constraint::GrammarSpec)>, ApiError> {
    use crate::constraint::{GrammarSpec, JsonStyle};
    let style = match &c.guided_whitespace_pattern {
        None => JsonStyle::Compact,
        Some(p) if p.is_empty() => {
            return Err(ApiError::invalid(
                "guided_whitespace_pattern",
                "guided_whitespace_pattern must be a non-empty regular expression (e.g. \"[ \\n\\t]+\")",
            ))
        }
        Some(p) => JsonStyle::Flexible(p.clone()),
    };
    let mut found: Vec<(&'static str, GrammarSpec)> = Vec::new();
    if let Some(rf) = &c.response_format {
        let kind = rf.get("type").and_then(|t| t.as_str()).unwrap_or("");
        match kind {
            "text" => {}
            "json_object" => {
                found.push(("response_format", GrammarSpec::JsonObject(style.clone())))
            }
            "json_schema" => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .cloned()
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "response_format",
                            "response_format json_schema needs json_schema.schema",
                        )
                    })?;
                // OpenAI's strict mode: objects take only the properties they list.
                let strict = rf
                    .get("json_schema")
                    .and_then(|j| j.get("strict"))
                    .and_then(|s| s.as_bool())
                    .unwrap_or(false);
                let schema = if strict {
                    crate::constraint::closed_objects(&schema)
                } else {
                    schema
                };
                found.push((
                    "response_format",
                    GrammarSpec::JsonSchema(schema, style.clone()),
                ));
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "response_format type '{other}' is not supported (text, json_object, json_schema)"
                    ),
                ))
            }
        }
    }
    if let Some(s) = &c.guided_json {
        found.push(("guided_json", GrammarSpec::JsonSchema(s.clone(), style)));
    }
    if let Some(r) = &c.guided_regex {
        found.push(("guided_regex", GrammarSpec::Regex(r.clone())));
    }
    if let Some(g) = &c.guided_grammar {
        found.push(("guided_grammar", GrammarSpec::Lark(g.clone())));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].0,
            format!(
                "one structured-output constraint per request ({} and {} given)",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop())
}

#[derive(Debug, Serialize, Default, Clone)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Extension: draft tokens sent to verification and how many the target accepted.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    /// As OpenAI reports it: prompt tokens served from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize, Default, Clone)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// `/v1/chat/completions` answer.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageOut,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

#[derive(Debug, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// A streamed piece of a call: the first names it (`id`, `type`, `function.name`), the
/// next carries its arguments; clients concatenate by `index`.
#[derive(Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Serialize)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// One streamed `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageOut>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize, Default)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<ChatTokenLogprob>>,
}

/// `/v1/completions` answer (and, with `stream`, each chunk: same object).
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageOut>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
