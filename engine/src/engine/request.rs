//! The request contract between the HTTP server and the engine thread: what a request
//! carries in ([`GenRequest`]), what streams back ([`Event`]) and how it is submitted
//! ([`EngineHandle`]).

use crate::sampling::SamplingParams;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Draft tokens sent to verification and how many of them the target accepted.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    /// Prompt tokens served from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

#[derive(Debug)]
pub enum Event {
    /// New text (possibly empty while a stop string is undecided) and the tokens behind it.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Error(String),
}

pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// `Some(k)`: report each token's logprob and the k most likely alternatives.
    pub logprobs: Option<usize>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    /// The request's trace span (`{operation} {model}`); the engine adds the queue,
    /// prefill and decode phases as children and one event per speculation cycle.
    pub span: tracing::Span,
    /// GenAI operation name: `chat` or `text_completion`.
    pub operation: &'static str,
    /// Structured output: the grammar the output must follow.
    pub constraint: Option<crate::constraint::Constraint>,
}

impl GenRequest {
    /// A plain text completion of `prompt` arriving now, events to `events`: the default
    /// sampling, no stop strings, logprobs or constraint, ending at end-of-sequence; no
    /// trace span. Set the rest with struct update syntax.
    pub fn new(prompt: Vec<u32>, max_tokens: usize, events: UnboundedSender<Event>) -> Self {
        GenRequest {
            prompt,
            params: SamplingParams::default(),
            max_tokens,
            stop: vec![],
            logprobs: None,
            ignore_eos: false,
            events,
            arrived: Instant::now(),
            span: tracing::Span::none(),
            operation: "text_completion",
            constraint: None,
        }
    }
}

/// The HTTP side's handle on the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: Sender<GenRequest>,
    pub waiting: Arc<AtomicUsize>,
    pub running: Arc<AtomicUsize>,
    pub max_waiting: usize,
    /// Set once when the engine thread dies (a panic in a step): why.
    pub(super) failed: Arc<std::sync::OnceLock<String>>,
    /// When the engine loop last went round.
    pub(super) beat: Arc<Heartbeat>,
}

/// When the engine loop last went round (it does at least every 50 ms when idle, once per
/// step when busy).
pub(super) struct Heartbeat {
    epoch: Instant,
    last_ms: std::sync::atomic::AtomicU64,
}

impl Heartbeat {
    pub(super) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub(super) fn beat(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::SeqCst);
    }

    fn since(&self) -> std::time::Duration {
        let last = std::time::Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
        self.epoch.elapsed().saturating_sub(last)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the admission queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    Stopped,
}

impl EngineHandle {
    /// Why the engine thread died, once it has (the server then fails `/health`, `/ready`
    /// and new requests).
    pub fn failure(&self) -> Option<String> {
        self.failed.get().cloned()
    }

    /// How long the engine has made no progress, when that is longer than `after` while
    /// requests are queued or running (the server then fails `/health` and `/ready`).
    pub fn stalled(&self, after: std::time::Duration) -> Option<std::time::Duration> {
        let busy = self.waiting.load(Ordering::SeqCst) + self.running.load(Ordering::SeqCst) > 0;
        let since = self.beat.since();
        (busy && since > after).then_some(since)
    }

    pub fn submit(&self, req: GenRequest) -> Result<(), SubmitError> {
        let w = self.waiting.fetch_add(1, Ordering::SeqCst);
        if w >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(w));
        }
        self.tx.send(req).map_err(|_| {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }
}
