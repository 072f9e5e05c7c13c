//! The step loop: continuous batching over one model and one paged KV cache.
//!
//! Requests join and leave between steps. Each step builds ONE batched target forward from
//! the decoding sequences (one pending token each) and prefill chunks of new prompts under a
//! token budget, samples, detokenizes, applies stop conditions and streams events back.
//! A sequence whose client went away is dropped (and its KV blocks freed) at the next step.
//! When the cache runs out of blocks, the youngest sequence is preempted and recomputed later.

use crate::cost::CostTables;
use crate::kv::KvCache;
use crate::metrics::{FinishLabel, Metrics, ModePositionLabel, PositionLabel};
use crate::model::{Model, SeqBatch};
use crate::sampling::{logprobs, target_probs, Dist, SamplingParams};
use crate::spec::dspark::{ContextFeed, DSparkDrafter, DraftRequest};
use crate::spec::recalibrate::OnlineCalibration;
use crate::spec::{
    is_greedy, ngram, verify::verify, AcceptanceStats, Proposal, Speculation, VerifyPolicy,
};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use anyhow::Result;
use dspark_telemetry::TRACE_TARGET;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most tokens (B) in one target forward.
    pub max_batch_tokens: usize,
    /// Largest prefill chunk of one prompt per step.
    pub prefill_chunk: usize,
    pub max_running: usize,
    /// Admission queue bound; past it requests are refused (HTTP 429).
    pub max_waiting: usize,
    /// Drafter used for speculative decoding (`None` = plain decoding).
    pub speculation: Speculation,
    /// How many draft tokens each request verifies.
    pub policy: VerifyPolicy,
    /// Step of the online recalibration of a model drafter's confidences (0: off): see
    /// [`crate::spec::recalibrate`].
    pub online_calibration: f32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            prefill_chunk: 256,
            max_running: 64,
            max_waiting: 256,
            speculation: Speculation::None,
            policy: VerifyPolicy::Fixed { gamma: 4 },
            online_calibration: crate::spec::recalibrate::DEFAULT_STEP,
        }
    }
}

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
}

/// The HTTP side's handle on the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<GenRequest>,
    pub waiting: Arc<AtomicUsize>,
    pub running: Arc<AtomicUsize>,
    pub max_waiting: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the admission queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    Stopped,
}

impl EngineHandle {
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

struct Seq {
    req: GenRequest,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions whose keys/values are in the cache.
    cached: usize,
    blocks: Vec<u32>,
    rng: ChaCha8Rng,
    decoder: StreamDecoder,
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    queued_metric_done: bool,
    draft_tokens: usize,
    accepted_tokens: usize,
    /// Block table of this sequence in the drafter's context cache.
    draft_blocks: Vec<u32>,
    /// The drafter's context feature of the last position fed (context-input drafters).
    draft_ctx: Option<candle_core::Tensor>,
    /// Committed positions whose features are in the drafter's context cache
    /// (`draft_fed + draft_pending.rows == cached`).
    draft_fed: usize,
    draft_pending: PendingFeatures,
    /// A deterministic draft that was not verified (the policy chose length 0), kept to be
    /// checked against the tokens the target commits next: `(position of its first token,
    /// tokens)`. For a point-mass draft the chance that the target's own token matches is
    /// exactly the chance verification would have accepted it, so this keeps the live
    /// acceptance rates honest while the scheduler is not verifying.
    shadow: Option<(usize, Vec<u32>)>,
    /// The current phase's child span of the request span: queue, prefill, then decode.
    phase: tracing::Span,
}

impl Seq {
    /// Ends the current phase span and starts `name` (a no-op when tracing is off).
    fn enter_phase(&mut self, name: &'static str) {
        self.phase = tracing::info_span!(target: TRACE_TARGET, parent: &self.req.span, "phase", otel.name = name);
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

pub struct Engine {
    pub model: Arc<Model>,
    tok: Arc<TextTokenizer>,
    kv: KvCache,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    rx: Receiver<GenRequest>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    waiting_count: Arc<AtomicUsize>,
    running_count: Arc<AtomicUsize>,
    drafter: Option<Drafter>,
    /// The SPS(B) table the scheduler reads (one snapshot per step).
    costs: Arc<CostTables>,
    /// Live per-position acceptance, the confidences of drafters without a confidence head.
    acceptance: AcceptanceStats,
    /// Online scales and offsets on the model drafter's calibrated confidences (when on).
    recal: Option<OnlineCalibration>,
    /// Seconds per model-drafter call (moving average), for the drafting gate.
    draft_secs: f64,
    /// Steps in a row the gate skipped the drafter; every `DRAFT_PROBE`-th runs it anyway
    /// so the acceptance estimates keep up.
    draft_skips_in_row: usize,
}

/// See `draft_skips_in_row`.
const DRAFT_PROBE: usize = 16;

/// A model drafter with its own context KV cache (fed with the target's hidden states).
pub struct Drafter {
    pub model: DSparkDrafter,
    pub kv: KvCache,
}

impl Engine {
    pub fn new(
        model: Arc<Model>,
        tok: Arc<TextTokenizer>,
        kv: KvCache,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        costs: Arc<CostTables>,
    ) -> (Self, EngineHandle) {
        let (tx, rx) = std::sync::mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let handle = EngineHandle {
            tx,
            waiting: waiting.clone(),
            running: running.clone(),
            max_waiting: cfg.max_waiting,
        };
        (
            Self {
                model,
                tok,
                kv,
                cfg,
                metrics,
                rx,
                waiting: VecDeque::new(),
                running: Vec::new(),
                waiting_count: waiting,
                running_count: running,
                drafter: None,
                costs,
                acceptance: AcceptanceStats::new(64, 200.0),
                recal: None,
                draft_secs: 0.0,
                draft_skips_in_row: 0,
            },
            handle,
        )
    }

    /// Attaches the model drafter used by `parallel` / `dspark-*` speculation.
    pub fn with_drafter(mut self, drafter: Drafter) -> Self {
        if self.cfg.online_calibration > 0.0 {
            self.recal = Some(OnlineCalibration::new(
                drafter.model.config().block_size,
                self.cfg.online_calibration,
            ));
        }
        self.drafter = Some(drafter);
        self
    }

    /// Largest prompt + max_tokens one request may ask for.
    pub fn max_sequence_tokens(model: &Model, kv: &KvCache) -> usize {
        model.max_context().min(kv.capacity_tokens())
    }

    /// Runs until every handle is dropped and no work is left.
    pub fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(r) => self.enqueue(r),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            if let Err(e) = self.step() {
                tracing::error!("engine step failed: {e:#}");
                for s in self.running.drain(..) {
                    let _ = s
                        .req
                        .events
                        .send(Event::Error(format!("engine error: {e:#}")));
                    let mut b = s.blocks;
                    self.kv.truncate(&mut b, 0);
                }
            }
        }
    }

    fn enqueue(&mut self, req: GenRequest) {
        let seed = req.params.seed.unwrap_or_else(rand::random);
        let prompt_len = req.prompt.len();
        self.waiting.push_back(Seq {
            tokens: req.prompt.clone(),
            prompt_len,
            cached: 0,
            blocks: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            decoder: StreamDecoder::default(),
            text: String::new(),
            sent: 0,
            first_token: None,
            last_token: None,
            queued_metric_done: false,
            draft_tokens: 0,
            accepted_tokens: 0,
            draft_blocks: Vec::new(),
            draft_ctx: None,
            draft_fed: 0,
            draft_pending: PendingFeatures::default(),
            shadow: None,
            phase: tracing::info_span!(target: TRACE_TARGET, parent: &req.span, "phase", otel.name = "queue"),
            req,
        });
    }

    fn publish_counts(&self) {
        self.waiting_count
            .store(self.waiting.len(), Ordering::SeqCst);
        self.running_count
            .store(self.running.len(), Ordering::SeqCst);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.running.set(self.running.len() as i64);
        let used = self.kv.total_blocks() - self.kv.free_blocks();
        self.metrics
            .kv_usage
            .set(used as f64 / self.kv.total_blocks() as f64);
    }

    /// Writes the held features of sequences `idx` into the drafter's context cache in one
    /// batched pass. A sequence the drafter cache cannot hold keeps its backlog (and decodes
    /// without drafting until there is room).
    fn feed_drafter(&mut self, idx: &[usize]) -> Result<()> {
        let Some(d) = self.drafter.as_mut() else {
            return Ok(());
        };
        let (mut fed, mut hidden) = (Vec::new(), Vec::new());
        for &i in idx {
            let s = &mut self.running[i];
            if s.draft_pending.rows == 0 || !d.kv.ensure(&mut s.draft_blocks, s.cached) {
                continue;
            }
            hidden.push(s.draft_pending.take()?);
            fed.push(i);
        }
        if fed.is_empty() {
            return Ok(());
        }
        let feeds: Vec<ContextFeed> = fed
            .iter()
            .zip(&hidden)
            .map(|(&i, h)| {
                let s = &self.running[i];
                ContextFeed {
                    table: &s.draft_blocks,
                    start: s.draft_fed,
                    hidden: h,
                }
            })
            .collect();
        let last = d.model.append_contexts(&mut d.kv, &feeds)?;
        for (&i, c) in fed.iter().zip(last) {
            let s = &mut self.running[i];
            s.draft_fed = s.cached;
            if c.is_some() {
                s.draft_ctx = c;
            }
        }
        Ok(())
    }

    fn release(&mut self, s: &mut Seq) {
        self.kv.truncate(&mut s.blocks, 0);
        if let Some(d) = &mut self.drafter {
            d.kv.truncate(&mut s.draft_blocks, 0);
        }
        s.draft_ctx = None;
        s.draft_fed = 0;
        s.draft_pending = PendingFeatures::default();
        s.cached = 0;
    }

    /// One engine step. Returns after at most one target forward.
    pub fn step(&mut self) -> Result<()> {
        while let Ok(r) = self.rx.try_recv() {
            self.enqueue(r);
        }
        // Clients that went away free their blocks now.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].req.events.is_closed() {
                let mut s = self.running.swap_remove(i);
                self.release(&mut s);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|s| !s.req.events.is_closed());
        // Admission: oldest first, while the prompt fits in free blocks.
        while self.running.len() < self.cfg.max_running {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = self.kv.blocks_for(front.tokens.len() + 1);
            let reserved: usize = self.running.len(); // one growth block per running sequence
            if need + reserved > self.kv.free_blocks() && !self.running.is_empty() {
                break;
            }
            if need > self.kv.free_blocks() {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            if !s.queued_metric_done {
                self.metrics
                    .queue_time
                    .observe(s.req.arrived.elapsed().as_secs_f64());
                s.queued_metric_done = true;
            }
            s.enter_phase(if s.first_token.is_none() {
                "prefill"
            } else {
                "recompute"
            });
            self.running.push(s);
        }
        self.publish_counts();
        if self.running.is_empty() {
            return Ok(());
        }

        // Plan the batch: decoding sequences first (their pending token plus a draft block
        // to verify), then prefill chunks.
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let order: Vec<usize> = {
            let mut dec: Vec<usize> = (0..self.running.len())
                .filter(|&i| self.running[i].tokens.len() - self.running[i].cached == 1)
                .collect();
            let pre: Vec<usize> = (0..self.running.len())
                .filter(|&i| self.running[i].tokens.len() - self.running[i].cached > 1)
                .collect();
            dec.extend(pre);
            dec
        };
        let max_ctx = self.model.max_context();
        let decoding: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| self.running[i].tokens.len() - self.running[i].cached == 1)
            .collect();
        let prefill_demand: usize = order[decoding.len()..]
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                (s.tokens.len() - s.cached).min(self.cfg.prefill_chunk.max(1))
            })
            .sum();
        // Draft tokens compete with prefill for the batch; decoding goes first.
        let room = budget.saturating_sub(decoding.len());
        let mut proposals = self.draft_with_model(room + 1, max_ctx)?;
        for &i in &decoding {
            if let std::collections::hash_map::Entry::Vacant(v) = proposals.entry(i) {
                if let Some(p) = self.propose(i, room, max_ctx) {
                    v.insert(p);
                }
            }
        }
        let mut proposals = self.plan_verify(&decoding, proposals, room, prefill_demand, max_ctx);
        let mut preempt = Vec::new();
        for i in order {
            if budget == 0 {
                break;
            }
            let decoding = self.running[i].tokens.len() - self.running[i].cached == 1;
            let proposal = if decoding {
                proposals.remove(&i).map(|p| p.truncated(budget - 1))
            } else {
                None
            }
            .filter(|p| !p.tokens.is_empty());
            let s = &mut self.running[i];
            let pending = s.tokens.len() - s.cached;
            let draft_len = proposal.as_ref().map_or(0, |p| p.tokens.len());
            let chunk = if decoding {
                1 + draft_len
            } else {
                pending.min(budget).min(self.cfg.prefill_chunk.max(1))
            };
            if !self.kv.ensure(&mut s.blocks, s.cached + chunk) {
                preempt.push(i);
                continue;
            }
            budget -= chunk;
            plan.push(Planned {
                seq: i,
                chunk,
                proposal,
                decoding,
            });
        }
        if plan.is_empty() && !preempt.is_empty() {
            // Nothing fits: recompute the youngest sequence later.
            let i = *preempt.iter().max().expect("non-empty");
            let mut s = self.running.remove(i);
            self.release(&mut s);
            self.metrics.preemptions.inc();
            self.waiting.push_front(s);
            return Ok(());
        }
        let batch: Vec<SeqBatch> = plan
            .iter()
            .map(|pl| {
                let s = &self.running[pl.seq];
                let mut tokens = s.tokens[s.cached..].to_vec();
                tokens.truncate(pl.chunk);
                if let Some(p) = &pl.proposal {
                    tokens.extend_from_slice(&p.tokens);
                }
                let ends = s.cached + tokens.len() >= s.tokens.len();
                SeqBatch {
                    num_logits: if ends {
                        1 + pl.proposal.as_ref().map_or(0, |p| p.tokens.len())
                    } else {
                        0
                    },
                    tokens,
                    start_pos: s.cached,
                    block_table: s.blocks.clone(),
                }
            })
            .collect();
        let b: usize = batch.iter().map(|s| s.tokens.len()).sum();
        self.metrics.batch_tokens.observe(b as f64);
        self.metrics.steps.inc();
        let hidden_layers: Vec<usize> = self
            .drafter
            .as_ref()
            .map(|d| d.model.target_layers().to_vec())
            .unwrap_or_default();
        let out = self.model.forward(&batch, &mut self.kv, &hidden_layers)?;
        let logits = if out.logits.dim(0)? > 0 {
            out.logits.to_vec2::<f32>()?
        } else {
            vec![]
        };
        let mut row = 0;
        let mut hidden_row = 0;
        let mut finished = Vec::new();
        for (pl, sb) in plan.iter().zip(&batch) {
            let i = pl.seq;
            let s = &mut self.running[i];
            let first_row = hidden_row;
            hidden_row += sb.tokens.len();
            if s.cached < s.prompt_len {
                let prompt_part = sb.tokens.len().min(s.prompt_len - s.cached);
                self.metrics.prompt_tokens.inc_by(prompt_part as u64);
            }
            if sb.num_logits == 0 {
                if self.drafter.is_some() {
                    s.draft_pending
                        .push(&out.hidden, first_row, sb.tokens.len())?;
                }
                s.cached += sb.tokens.len();
                continue;
            }
            let rows = &logits[row..row + sb.num_logits];
            row += sb.num_logits;
            let (commit, accepted) = match &pl.proposal {
                None => {
                    let tok = target_probs(&rows[0], &s.req.params).sample(&mut s.rng);
                    (vec![tok], 0)
                }
                Some(p) => {
                    let dists: Vec<Dist> = rows
                        .iter()
                        .map(|r| target_probs(r, &s.req.params))
                        .collect();
                    let v = verify(&p.tokens, &p.q, &dists, &mut s.rng);
                    (v.tokens, v.accepted)
                }
            };
            // Keys/values are valid for the fed tokens up to the last accepted draft;
            // rejected positions are rolled back.
            let drafted = pl.proposal.as_ref().map_or(0, |p| p.tokens.len());
            let valid = sb.tokens.len() - drafted + accepted;
            if self.drafter.is_some() {
                s.draft_pending.push(&out.hidden, first_row, valid)?;
            }
            s.cached += valid;
            if let Some(d) = &mut self.drafter {
                d.kv.truncate(&mut s.draft_blocks, s.cached);
            }
            self.kv.truncate(&mut s.blocks, s.cached);
            if pl.decoding && self.cfg.speculation != Speculation::None {
                self.metrics.committed_tokens.inc_by(commit.len() as u64);
            }
            if drafted > 0 {
                s.draft_tokens += drafted;
                s.accepted_tokens += accepted;
                self.metrics.spec_drafts.inc();
                self.metrics.spec_draft_tokens.inc_by(drafted as u64);
                self.metrics.spec_accepted_tokens.inc_by(accepted as u64);
                for pos in 0..accepted {
                    self.metrics
                        .spec_accepted_per_pos
                        .get_or_create(&PositionLabel {
                            position: pos as u32,
                        })
                        .inc();
                }
            }
            if let (Some(oc), Some(p)) = (&mut self.recal, &pl.proposal) {
                let greedy = is_greedy(&p.q);
                oc.record(greedy, &p.confidence, accepted);
                let mode = if greedy { "greedy" } else { "sampled" };
                let params = oc.offsets(greedy).iter().zip(oc.scales(greedy));
                for (k, (&off, &scale)) in params.enumerate().take(accepted + 1) {
                    let label = ModePositionLabel {
                        mode: mode.into(),
                        position: k as u32,
                    };
                    let m = &self.metrics;
                    m.calibration_offset.get_or_create(&label).set(off as f64);
                    m.calibration_scale.get_or_create(&label).set(scale as f64);
                }
            }
            if drafted > 0 {
                self.record_acceptance(drafted, accepted);
            }
            let s = &mut self.running[i];
            if pl.decoding && self.cfg.speculation != Speculation::None {
                tracing::info!(
                    target: TRACE_TARGET,
                    parent: &s.phase,
                    verify_len = drafted,
                    accepted,
                    committed = commit.len(),
                    batch_tokens = b,
                    "speculation cycle"
                );
            }
            let gap = s
                .last_token
                .map(|t| t.elapsed().as_secs_f64() / commit.len() as f64);
            for (j, &tok) in commit.iter().enumerate() {
                if let Some(reason) = self.accept_token(i, tok, &rows[j], gap) {
                    finished.push((i, reason));
                    break;
                }
            }
            self.resolve_shadow(i);
        }
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let mut s = self.running.swap_remove(i);
            self.finish(&mut s, reason);
        }
        // Long backlogs (prefill chunks, or decoding while the gate keeps the drafter off)
        // go into the drafter cache now, so held features stay small.
        let backlog: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].draft_pending.rows >= FEED_BACKLOG_ROWS)
            .collect();
        self.feed_drafter(&backlog)?;
        self.publish_counts();
        Ok(())
    }

    /// Most draft tokens sequence `i` may verify this step: its remaining token budget
    /// (the last committed token is always the target's own), the batch room and the
    /// context.
    fn draft_cap(&self, i: usize, room: usize, max_ctx: usize) -> usize {
        let s = &self.running[i];
        let remaining = s.req.max_tokens.saturating_sub(s.generated());
        remaining
            .saturating_sub(1)
            .min(room)
            .min(max_ctx.saturating_sub(s.tokens.len() + 1))
    }

    /// One batched drafter forward for every decoding sequence (model drafters only).
    fn draft_with_model(
        &mut self,
        room: usize,
        max_ctx: usize,
    ) -> Result<HashMap<usize, Proposal>> {
        let mut out = HashMap::new();
        if self.drafter.is_none() {
            return Ok(out);
        }
        let block = self
            .drafter
            .as_ref()
            .map_or(0, |d| d.model.config().block_size);
        let gamma = self.cfg.policy.gamma().min(block);
        let mut who = Vec::new();
        for i in 0..self.running.len() {
            let s = &self.running[i];
            if s.tokens.len() - s.cached != 1 {
                continue;
            }
            let g = gamma.min(self.draft_cap(i, room.saturating_sub(1), max_ctx));
            if g > 0 {
                who.push((i, g));
            }
        }
        if matches!(self.cfg.policy, VerifyPolicy::Dspark { .. }) && !who.is_empty() {
            // The dspark policy's objective with the drafter's own time: skip the drafter
            // while its live acceptance cannot pay for it (plain decoding, still lossless).
            let rates: Vec<f32> = (0..gamma).map(|k| self.acceptance.rate(k)).collect();
            let table = self.costs.current();
            let pays = crate::spec::scheduler::drafting_pays(
                &rates,
                who.len(),
                gamma,
                self.draft_secs,
                &|b| table.sps(b),
            );
            if !pays && self.draft_skips_in_row + 1 < DRAFT_PROBE {
                self.draft_skips_in_row += 1;
                self.metrics.draft_skips.inc();
                return Ok(out);
            }
            self.draft_skips_in_row = 0;
        }
        let d = self.drafter.as_mut().expect("checked");
        // Blocks must cover the draft positions; a sequence the drafter cache cannot hold
        // just decodes without drafting this step.
        who.retain(|&(i, g)| {
            let s = &mut self.running[i];
            d.kv.ensure(&mut s.draft_blocks, s.cached + g)
        });
        if who.is_empty() {
            return Ok(out);
        }
        // The drafter's context must reach the anchor: feed the held features first, timed
        // with the drafting itself (the gate charges both to drafting).
        let t0 = std::time::Instant::now();
        let idx: Vec<usize> = who.iter().map(|w| w.0).collect();
        self.feed_drafter(&idx)?;
        who.retain(|&(i, _)| self.running[i].draft_fed == self.running[i].cached);
        let d = self.drafter.as_mut().expect("checked");
        let idx: Vec<usize> = who.iter().map(|w| w.0).collect();
        let mut seqs: Vec<&mut Seq> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| idx.contains(i))
            .map(|(_, s)| s)
            .collect();
        let mut reqs: Vec<DraftRequest> = seqs
            .iter_mut()
            .zip(&who)
            .map(|(s, &(_, g))| DraftRequest {
                anchor: *s.tokens.last().expect("decoding sequences have tokens"),
                anchor_pos: s.cached,
                block_table: &s.draft_blocks,
                gamma: g,
                params: &s.req.params,
                rng: &mut s.rng,
                last_context: s.draft_ctx.as_ref(),
            })
            .collect();
        let blocks = d.model.propose(&mut d.kv, &self.model, &mut reqs)?;
        let dt = t0.elapsed().as_secs_f64();
        self.draft_secs = if self.draft_secs == 0.0 {
            dt
        } else {
            0.9 * self.draft_secs + 0.1 * dt
        };
        for ((i, _), mut b) in who.into_iter().zip(blocks) {
            if let Some(oc) = &self.recal {
                oc.adjust(is_greedy(&b.q), &mut b.confidence);
            }
            out.insert(
                i,
                Proposal {
                    tokens: b.tokens,
                    q: b.q,
                    confidence: b.confidence,
                },
            );
        }
        Ok(out)
    }

    /// Chooses every decoding request's verify length with the policy (the scheduler sees
    /// all of them at once, the step's prefill tokens and the cost table in force) and cuts
    /// the proposals to those lengths.
    fn plan_verify(
        &mut self,
        decoding: &[usize],
        mut proposals: HashMap<usize, Proposal>,
        room: usize,
        prefill_demand: usize,
        max_ctx: usize,
    ) -> HashMap<usize, Proposal> {
        if self.cfg.speculation == Speculation::None || decoding.is_empty() {
            return HashMap::new();
        }
        let caps: Vec<usize> = decoding
            .iter()
            .map(|&i| self.draft_cap(i, room, max_ctx))
            .collect();
        let props: Vec<Option<&Proposal>> = decoding.iter().map(|i| proposals.get(i)).collect();
        let base_b = decoding.len() + prefill_demand.min(room);
        let table = self.costs.current();
        let vp = self
            .cfg
            .policy
            .plan(&props, &caps, base_b, self.cfg.max_batch_tokens, &|b| {
                table.sps(b)
            });
        self.metrics.expected_tokens.inc_by(vp.expected_tau);
        if let Some(t) = vp.theta {
            self.metrics.theta.set(t);
        }
        let mut out = HashMap::new();
        for (&i, &l) in decoding.iter().zip(&vp.lens) {
            self.metrics.verify_len.observe(l as f64);
            if let Some(p) = proposals.remove(&i) {
                if l > 0 {
                    out.insert(i, p.truncated(l));
                } else if self.cfg.speculation == Speculation::Ngram {
                    let s = &mut self.running[i];
                    if s.shadow.is_none() {
                        s.shadow = Some((s.tokens.len(), p.tokens));
                    }
                }
            }
        }
        out
    }

    /// Scores a pending shadow draft of sequence `i` once the committed tokens decide it.
    fn resolve_shadow(&mut self, i: usize) {
        let s = &mut self.running[i];
        let Some((start, draft)) = &s.shadow else {
            return;
        };
        let known = s.tokens.len().saturating_sub(*start);
        let matched = draft
            .iter()
            .zip(&s.tokens[(*start).min(s.tokens.len())..])
            .take_while(|(a, b)| a == b)
            .count();
        if matched < known.min(draft.len()) {
            // First mismatch at `matched`: positions 0..=matched were decided.
            s.shadow = None;
            self.record_acceptance(matched + 1, matched);
        } else if matched == draft.len() {
            let n = draft.len();
            s.shadow = None;
            self.record_acceptance(n, n);
        }
    }

    /// Updates the live per-position acceptance rates and their gauges.
    fn record_acceptance(&mut self, verified: usize, accepted: usize) {
        self.acceptance.record(verified, accepted);
        for k in 0..verified.min(accepted + 1).min(16) {
            self.metrics
                .live_acceptance
                .get_or_create(&PositionLabel { position: k as u32 })
                .set(self.acceptance.rate(k) as f64);
        }
    }

    /// A draft block for decoding sequence `i` from a training-free drafter, within `room`
    /// extra batch tokens and the sequence's remaining token budget. Its confidences are the
    /// live per-position acceptance rates.
    fn propose(&mut self, i: usize, room: usize, max_ctx: usize) -> Option<Proposal> {
        let cap = self.draft_cap(i, room, max_ctx);
        let s = &self.running[i];
        let gamma = self.cfg.policy.gamma().min(cap);
        if gamma == 0 {
            return None;
        }
        match self.cfg.speculation {
            Speculation::Ngram => {
                let tokens = ngram::propose(&s.tokens, gamma, 1, 3);
                (!tokens.is_empty()).then(|| Proposal {
                    q: tokens.iter().map(|&t| Dist::Greedy(t)).collect(),
                    confidence: (0..tokens.len()).map(|k| self.acceptance.rate(k)).collect(),
                    tokens,
                })
            }
            // Model drafters propose in one batch (draft_with_model); a sequence they
            // skipped this step decodes plainly.
            Speculation::None
            | Speculation::Parallel
            | Speculation::DSparkMarkov
            | Speculation::DSparkRnn => None,
        }
    }

    /// Appends a sampled token, streams what became final, and says whether the sequence
    /// is done.
    fn accept_token(
        &mut self,
        i: usize,
        tok: u32,
        logits: &[f32],
        gap: Option<f64>,
    ) -> Option<FinishReason> {
        let now = Instant::now();
        let tokz = self.tok.clone();
        let s = &mut self.running[i];
        match gap {
            None if s.last_token.is_none() => {
                let t = (now - s.req.arrived).as_secs_f64();
                self.metrics.ttft.observe(t);
                let g = &self.metrics.genai;
                g.ttft.record(t, &g.attrs(s.req.operation));
                s.enter_phase("decode");
            }
            None => {}
            Some(g) => self.metrics.itl.observe(g),
        }
        if s.first_token.is_none() {
            s.first_token = Some(now);
        }
        s.last_token = Some(now);
        self.metrics.generation_tokens.inc();
        s.tokens.push(tok);
        let mut lps = Vec::new();
        if let Some(k) = s.req.logprobs {
            let (lp, top) = logprobs(logits, tok, k);
            lps.push(TokenLogprob {
                id: tok,
                text: tokz.token_text(tok),
                logprob: lp,
                top: top
                    .into_iter()
                    .map(|(id, l)| (tokz.token_text(id), l))
                    .collect(),
            });
        }
        let is_eos = !s.req.ignore_eos && tokz.stop_ids.contains(&tok);
        let mut reason = None;
        if is_eos {
            reason = Some(FinishReason::Stop);
        } else {
            let gen_start = s.prompt_len;
            let delta = s.decoder.step(&tokz, &s.tokens[gen_start..]);
            let search_from = s.text.len().saturating_sub(max_len(&s.req.stop));
            s.text.push_str(&delta);
            if let Some(cut) = find_stop(&s.text, &s.req.stop, search_from) {
                s.text.truncate(cut);
                reason = Some(FinishReason::Stop);
            } else if s.generated() >= s.req.max_tokens {
                reason = Some(FinishReason::Length);
            }
        }
        let safe = if reason.is_some() {
            s.text.len()
        } else {
            s.text.len() - holdback(&s.text, &s.req.stop)
        };
        let text = if safe > s.sent {
            let t = s.text[s.sent..safe].to_string();
            s.sent = safe;
            t
        } else {
            String::new()
        };
        if !text.is_empty() || !lps.is_empty() {
            let _ = s.req.events.send(Event::Delta {
                text,
                logprobs: lps,
            });
        }
        reason
    }

    fn finish(&mut self, s: &mut Seq, reason: FinishReason) {
        self.release(s);
        let e2e = s.req.arrived.elapsed().as_secs_f64();
        self.metrics.e2e.observe(e2e);
        let g = &self.metrics.genai;
        let attrs = g.attrs(s.req.operation);
        g.request_duration.record(e2e, &attrs);
        if let (Some(first), Some(last)) = (s.first_token, s.last_token) {
            if s.generated() > 1 {
                let per = (last - first).as_secs_f64() / (s.generated() - 1) as f64;
                g.time_per_output_token.record(per, &attrs);
            }
        }
        for (kind, n) in [("input", s.prompt_len), ("output", s.generated())] {
            let mut a = attrs.to_vec();
            a.push(opentelemetry::KeyValue::new("gen_ai.token.type", kind));
            g.token_usage.record(n as u64, &a);
        }
        let span = &s.req.span;
        span.record("gen_ai.usage.input_tokens", s.prompt_len as u64);
        span.record("gen_ai.usage.output_tokens", s.generated() as u64);
        span.record("gen_ai.response.finish_reasons", reason.as_str());
        span.record("dspark.draft_tokens", s.draft_tokens as u64);
        span.record("dspark.accepted_draft_tokens", s.accepted_tokens as u64);
        // With tracing on, one log line per request that carries its trace id.
        if let Some(trace_id) = dspark_telemetry::trace_id(span) {
            tracing::info!(
                trace_id,
                operation = s.req.operation,
                prompt_tokens = s.prompt_len,
                completion_tokens = s.generated(),
                accepted_draft_tokens = s.accepted_tokens,
                finish_reason = reason.as_str(),
                e2e_s = e2e,
                "request finished"
            );
        }
        s.phase = tracing::Span::none();
        self.metrics
            .request_success
            .get_or_create(&FinishLabel {
                finished_reason: reason.as_str().into(),
            })
            .inc();
        let _ = s.req.events.send(Event::Finished {
            reason,
            usage: Usage {
                prompt_tokens: s.prompt_len,
                completion_tokens: s.generated(),
                draft_tokens: s.draft_tokens,
                accepted_draft_tokens: s.accepted_tokens,
            },
        });
    }
}

/// Target hidden-state rows of committed positions `draft_fed..cached` not yet written into
/// the drafter's context cache. Feeding waits for the step that drafts (one batched pass
/// over every drafting sequence), so while the gate keeps a drafter off it costs these
/// copies only, and plain decoding keeps its speed.
#[derive(Default)]
struct PendingFeatures {
    /// Per target layer, chunks of `[rows, hidden]` in position order.
    layers: Vec<Vec<candle_core::Tensor>>,
    rows: usize,
}

impl PendingFeatures {
    /// Keeps rows `first_row..first_row + n` of this step's hidden states (copied, so the
    /// step's whole batch is not held).
    fn push(&mut self, hidden: &[candle_core::Tensor], first_row: usize, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if self.layers.is_empty() {
            self.layers = vec![Vec::new(); hidden.len()];
        }
        for (chunks, h) in self.layers.iter_mut().zip(hidden) {
            chunks.push(h.narrow(0, first_row, n)?.force_contiguous()?);
        }
        self.rows += n;
        Ok(())
    }

    /// All held rows, one `[rows, hidden]` tensor per target layer; empties the backlog.
    fn take(&mut self) -> Result<Vec<candle_core::Tensor>> {
        let out = self
            .layers
            .iter()
            .map(|c| candle_core::Tensor::cat(c, 0))
            .collect::<candle_core::Result<_>>()?;
        *self = Self::default();
        Ok(out)
    }
}

/// A pending backlog this long is fed at the end of the step even if the sequence does not
/// draft (twice the gate's probe period, so a gated-off decode never reaches it first).
const FEED_BACKLOG_ROWS: usize = 2 * DRAFT_PROBE;

/// One sequence's share of a step.
struct Planned {
    seq: usize,
    /// Tokens fed this step: a prefill chunk, or the pending token plus the draft block.
    chunk: usize,
    proposal: Option<Proposal>,
    /// A decoding sequence (its verify length was planned), not a prefill chunk.
    decoding: bool,
}

fn max_len(stops: &[String]) -> usize {
    stops.iter().map(|s| s.len()).max().unwrap_or(0)
}

/// Byte offset where the earliest stop string starts, searching from `from` (snapped to a
/// char boundary).
fn find_stop(text: &str, stops: &[String], from: usize) -> Option<usize> {
    let mut from = from.min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from))
        .min()
}

/// Bytes at the end of `text` that might be the start of a stop string and so must not be
/// streamed yet.
fn holdback(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for s in stops {
        for k in (1..s.len().min(text.len() + 1)).rev() {
            if k <= best {
                break;
            }
            if text.is_char_boundary(text.len() - k)
                && s.is_char_boundary(k)
                && text.ends_with(&s[..k])
            {
                best = k;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_and_holdback() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(find_stop("abc\n\ndef", &stops, 0), Some(3));
        assert_eq!(find_stop("abcEN", &stops, 0), None);
        assert_eq!(holdback("abcEN", &stops), 2);
        assert_eq!(holdback("abc\n", &stops), 1);
        assert_eq!(holdback("abc", &stops), 0);
        assert_eq!(holdback("ééE", &["Eé".to_string()]), 1);
    }
}
