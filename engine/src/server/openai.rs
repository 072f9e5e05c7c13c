//! OpenAI wire types for `/v1/chat/completions`, `/v1/completions` and `/v1/models`, and
//! their validation into engine requests.

use super::error::ApiError;
use serde::{Deserialize, Serialize};

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
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Parameters common to both endpoints.
#[derive(Debug, Deserialize)]
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
    /// Extension (as in vLLM): keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: StringOrVec,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// Validated sampling and length settings.
pub struct Validated {
    pub params: crate::sampling::SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

pub fn validate_common(c: &CommonParams) -> Result<Validated, ApiError> {
    let bad = |param: &str, msg: String| Err(ApiError::invalid(param, msg));
    if let Some(n) = c.n {
        if n != 1 {
            return bad(
                "n",
                format!("n={n} is not supported; this server returns one choice per request (n=1)"),
            );
        }
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if let Some(v) = v {
            if v != 0.0 {
                return bad(
                    name,
                    format!("{name} is not supported (got {v}); omit it or send 0"),
                );
            }
        }
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
        },
        max_tokens: max_tokens.map(|m| m as usize),
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: c.ignore_eos,
    })
}

#[derive(Debug, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
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
