//! `POST /v1/chat/completions`: messages rendered by the model's chat template, then the
//! shared generation path.

use super::error::ApiError;
use super::generate::{self, Finished, Render};
use super::openai::*;
use super::{check_model, gen_id, now_secs, request_span, AppState};
use crate::chat::ChatMessage;
use crate::engine::TokenLogprob;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use std::sync::Arc;

pub(super) async fn chat_completions(
    State(st): State<Arc<AppState>>,
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
    let prompt = generate::check_length(&st, prompt, v.max_tokens)?;
    let render = ChatRender {
        id: gen_id("chatcmpl"),
        created: now_secs(),
        model: st.model_id.clone(),
        logprobs: logprobs.is_some(),
    };
    let span = request_span(&st, "chat", &headers);
    generate::respond(&st, vec![prompt], v, logprobs, span, "chat", render).await
}

struct ChatRender {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
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
}

impl Render for ChatRender {
    type Chunk = ChatChunk;
    type Answer = ChatCompletion;

    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: Option<Vec<TokenLogprob>>,
        first: bool,
    ) -> ChatChunk {
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta {
                role: first.then_some("assistant"),
                content: Some(text),
            },
            logprobs: logprobs.map(|l| chat_logprobs(&l)),
            finish_reason: None,
        };
        self.chunk(vec![choice], None)
    }

    fn finish(&mut self, index: usize, reason: &'static str) -> ChatChunk {
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(reason),
        };
        self.chunk(vec![choice], None)
    }

    fn usage(&mut self, usage: UsageOut) -> ChatChunk {
        self.chunk(vec![], Some(usage))
    }

    fn answer(self, choices: Vec<Finished>, usage: UsageOut) -> ChatCompletion {
        ChatCompletion {
            choices: choices
                .into_iter()
                .map(|c| ChatChoice {
                    index: c.index,
                    message: AssistantMessage {
                        role: "assistant",
                        content: c.text,
                    },
                    logprobs: self.logprobs.then(|| chat_logprobs(&c.logprobs)),
                    finish_reason: c.reason,
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
