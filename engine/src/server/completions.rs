//! `POST /v1/completions`: one or several prompts (text or token ids), then the shared
//! generation path. Choice `p * n + k` answers prompt `p`; with `echo` its text begins with
//! the prompt (a token prompt decoded).

use super::error::ApiError;
use super::generate::{self, Finished, Render};
use super::openai::*;
use super::{check_model, gen_id, now_secs, request_span, AppState, Limits};
use crate::engine::TokenLogprob;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use axum::Json;
use std::sync::Arc;

pub(super) async fn completions(
    State(st): State<Arc<AppState>>,
    Extension(limits): Extension<Limits>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&st, &req.common.model)?;
    let mut v = validate_common(&req.common, st.tok.vocab_size)?;
    let echo = req.echo.unwrap_or(false);
    if echo && req.logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "echo with logprobs (the prompt's logprobs) is not supported; send echo without logprobs, or logprobs without echo",
        ));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let prompts = req.prompt.into_prompts();
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "send between 1 and {MAX_PROMPTS} prompts per request (got {})",
                prompts.len()
            ),
        ));
    }
    if prompts.len() * v.n > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n={} is more than {MAX_PROMPTS} choices in one request",
                prompts.len(),
                v.n
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
    if v.max_tokens.is_none() {
        v.max_tokens = Some(16);
    }
    let st2 = st.clone();
    type Tokenized = (Vec<Vec<u32>>, Vec<String>);
    let (ids, texts) = tokio::task::spawn_blocking(move || -> Result<Tokenized, ApiError> {
        let vocab = st2.tok.vocab_size;
        let mut texts = Vec::new();
        let ids = prompts
            .into_iter()
            .enumerate()
            .map(|(i, p)| match p {
                Prompt::Text(text) => {
                    let ids = st2
                        .tok
                        .encode(&text, st2.tok.add_bos)
                        .map_err(|e| ApiError::invalid("prompt", e.to_string()));
                    if echo {
                        texts.push(text);
                    }
                    ids
                }
                Prompt::Tokens(t) => {
                    let ids = generate::token_ids(&t, vocab, "prompt", &format!("prompt {i}: "))?;
                    if echo {
                        texts.push(st2.tok.decode(&ids, false));
                    }
                    Ok(ids)
                }
            })
            .collect::<Result<_, _>>()?;
        Ok((ids, texts))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let prompts = ids
        .into_iter()
        .map(|p| generate::check_length(&st, p, v.max_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let render = CompletionRender {
        id: gen_id("cmpl"),
        created: now_secs(),
        model: st.model_id.clone(),
        logprobs: logprobs.is_some(),
        echo: echo.then(|| {
            (0..texts.len() * v.n)
                .map(|i| texts[i / v.n].clone())
                .collect()
        }),
    };
    let span = request_span(&st, "text_completion", &headers);
    generate::respond(
        &st,
        &limits,
        prompts,
        v,
        logprobs,
        span,
        "text_completion",
        render,
    )
    .await
}

struct CompletionRender {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// `echo`: each choice's prompt text, taken when its first text is sent.
    echo: Option<Vec<String>>,
}

impl CompletionRender {
    /// Choice `index`'s prompt the first time (`echo`), else nothing.
    fn echo(&mut self, index: usize) -> String {
        self.echo
            .as_mut()
            .map(|e| std::mem::take(&mut e[index]))
            .unwrap_or_default()
    }

    fn object(&self, choices: Vec<CompletionChoice>, usage: Option<UsageOut>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

impl Render for CompletionRender {
    type Chunk = Completion;
    type Answer = Completion;

    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: Option<Vec<TokenLogprob>>,
    ) -> Vec<Completion> {
        let choice = CompletionChoice {
            index,
            text: self.echo(index) + &text,
            logprobs: logprobs.map(|l| completion_logprobs(&l)),
            finish_reason: None,
        };
        vec![self.object(vec![choice], None)]
    }

    fn finish(&mut self, index: usize, reason: &'static str) -> Vec<Completion> {
        let choice = CompletionChoice {
            index,
            text: self.echo(index),
            logprobs: None,
            finish_reason: Some(reason),
        };
        vec![self.object(vec![choice], None)]
    }

    fn usage(&mut self, usage: UsageOut) -> Completion {
        self.object(vec![], Some(usage))
    }

    fn answer(mut self, choices: Vec<Finished>, usage: UsageOut) -> Completion {
        let choices = choices
            .into_iter()
            .map(|c| CompletionChoice {
                index: c.index,
                logprobs: self.logprobs.then(|| completion_logprobs(&c.logprobs)),
                text: self.echo(c.index) + &c.text,
                finish_reason: Some(c.reason),
            })
            .collect();
        self.object(choices, Some(usage))
    }
}

fn completion_logprobs(lps: &[TokenLogprob]) -> CompletionLogprobs {
    CompletionLogprobs {
        tokens: lps.iter().map(|t| t.text.clone()).collect(),
        token_logprobs: lps.iter().map(|t| t.logprob).collect(),
        top_logprobs: lps
            .iter()
            .map(|t| t.top.iter().map(|(s, l)| (s.clone(), *l)).collect())
            .collect(),
    }
}
