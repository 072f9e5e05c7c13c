//! One sequence's state while it is in the engine.

use super::request::GenRequest;
use crate::kv::Chain;
use crate::sampling::History;
use crate::tokenizer::StreamDecoder;
use dspark_telemetry::TRACE_TARGET;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

pub(super) struct Seq {
    pub req: GenRequest,
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions whose keys/values are in the cache.
    pub cached: usize,
    pub blocks: Vec<u32>,
    /// How far its blocks are registered in the prefix cache.
    pub chain: Chain,
    /// Prompt tokens the prefix cache served at its first admission.
    pub cached_prompt: Option<usize>,
    pub rng: ChaCha8Rng,
    /// What the request's penalties read (the generated tokens, the prompt's when needed).
    pub history: History,
    /// The grammar state of a structured output.
    pub constraint: Option<crate::constraint::Constraint>,
    pub decoder: StreamDecoder,
    /// Generated text so far (cut at a stop string).
    pub text: String,
    /// Bytes of `text` already sent.
    pub sent: usize,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub queued_metric_done: bool,
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    /// Stable id while the sequence is in the engine (the speculator's key).
    pub id: u64,
    /// The current phase's child span of the request span: queue, prefill, then decode.
    pub phase: tracing::Span,
}

impl Seq {
    /// A queued sequence for `req` (its sampler seeded from the request or at random).
    pub fn new(id: u64, mut req: GenRequest) -> Self {
        let constraint = req.constraint.take();
        let seed = req.params.seed.unwrap_or_else(rand::random);
        Seq {
            id,
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            cached: 0,
            blocks: Vec::new(),
            chain: Chain::default(),
            cached_prompt: None,
            rng: ChaCha8Rng::seed_from_u64(seed),
            history: History::new(&req.prompt, &req.params),
            constraint,
            decoder: StreamDecoder::default(),
            text: String::new(),
            sent: 0,
            first_token: None,
            last_token: None,
            queued_metric_done: false,
            draft_tokens: 0,
            accepted_tokens: 0,
            phase: tracing::info_span!(target: TRACE_TARGET, parent: &req.span, "phase", otel.name = "queue"),
            req,
        }
    }

    /// Ends the current phase span and starts `name` (a no-op when tracing is off).
    pub fn enter_phase(&mut self, name: &'static str) {
        self.phase = tracing::info_span!(target: TRACE_TARGET, parent: &self.req.span, "phase", otel.name = name);
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens not yet in the KV cache: 1 for a decoding sequence (its last sampled token),
    /// more while a prompt (or a preempted sequence) is prefilled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.cached
    }
}
