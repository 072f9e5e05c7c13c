//! `POST /tokenize` and `POST /detokenize` (vLLM's extension endpoints): the served model's
//! tokenizer, for clients that count tokens or build `logit_bias` maps.

use super::error::ApiError;
use super::{check_model, AppState};
use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: String,
    /// Add the model's beginning-of-sequence token as `/v1/completions` does (default true).
    pub add_special_tokens: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub(super) async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let Json(req) = body?;
    if let Some(m) = &req.model {
        check_model(&st, m)?;
    }
    let bos = req.add_special_tokens.unwrap_or(true) && st.tok.add_bos;
    let st2 = st.clone();
    let tokens = tokio::task::spawn_blocking(move || st2.tok.encode(&req.prompt, bos))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: st.max_seq,
        tokens,
    }))
}

pub(super) async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Json<DetokenizeRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let Json(req) = body?;
    if let Some(m) = &req.model {
        check_model(&st, m)?;
    }
    let vocab = st.tok.vocab_size;
    let ids = super::generate::token_ids(&req.tokens, vocab, "tokens", "")?;
    // Off the async runtime: a body of a million ids takes a while to decode.
    let st2 = st.clone();
    let prompt = tokio::task::spawn_blocking(move || st2.tok.decode(&ids, false))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(DetokenizeResponse { prompt }))
}
