//! The step loop: continuous batching over one model and one paged KV cache.
//!
//! Requests join and leave between steps. Each step builds ONE batched target forward from
//! the decoding sequences (one pending token each) and prefill chunks of new prompts under a
//! token budget, samples, detokenizes, applies stop conditions and streams events back.
//! A sequence whose client went away is dropped (and its KV blocks freed) at the next step.
//! When the cache runs out of blocks, the youngest sequence is preempted and recomputed later.

use crate::cost::CostTables;
use crate::experiment::{Arm, Experiment, Window};
use crate::kv::KvCache;
use crate::metrics::ExperimentMetrics;
use crate::metrics::{FinishLabel, Metrics};
use crate::model::{Model, SeqBatch};
use crate::sampling::{logprobs, target_probs, Dist, SamplingParams};
pub use crate::speculative::speculator::Drafter;
use crate::speculative::speculator::{Candidate, Speculator, StepShape, Verified};
use crate::speculative::{verify::verify, Proposal, Speculation, VerifyPolicy};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use anyhow::Result;
use dspark_telemetry::TRACE_TARGET;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;
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
    /// [`crate::speculative::recalibrate`].
    pub online_calibration: f32,
    /// The online policy experiment: arms alternated every window
    /// ([`crate::experiment`]); `policy` is unused then.
    pub experiment: Option<(Vec<Arm>, Duration)>,
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
            online_calibration: crate::speculative::recalibrate::DEFAULT_STEP,
            experiment: None,
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
    /// Stable id while the sequence is in the engine (the speculator's key).
    id: u64,
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
    /// Drafter, drafting plan, acceptance statistics and recalibration.
    spec: Speculator,
    /// The SPS(B) table the scheduler reads (one snapshot per step).
    costs: Arc<CostTables>,
    next_id: u64,
    experiment: Option<Experiment>,
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
        let mut engine = Self {
            model,
            tok,
            kv,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            waiting_count: waiting,
            running_count: running,
            spec: Speculator::new(
                cfg.speculation,
                cfg.policy.clone(),
                cfg.online_calibration,
                None,
                metrics.clone(),
            ),
            cfg,
            metrics,
            costs,
            next_id: 0,
            experiment: None,
        };
        if let Some((arms, window)) = engine.cfg.experiment.clone() {
            engine.experiment = Some(Experiment::new(arms, window, Instant::now()));
            engine.apply_arm();
        }
        (engine, handle)
    }

    /// Puts the experiment's current arm in force (policy, `active` gauges).
    fn apply_arm(&mut self) {
        let Some(e) = &self.experiment else {
            return;
        };
        let arm = e.arm().clone();
        for a in &e.arms {
            self.metrics
                .experiment
                .active
                .get_or_create(&ExperimentMetrics::label(&a.label))
                .set((a.label == arm.label) as i64);
        }
        self.spec.set_policy(arm.policy);
    }

    /// The experiment's finished windows (`GET /experiment`), when one runs.
    pub fn experiment_log(&self) -> Option<Arc<std::sync::Mutex<Vec<Window>>>> {
        self.experiment.as_ref().map(|e| e.log.clone())
    }

    /// Advances the experiment clock by one step and switches arms at a window's end.
    fn experiment_tick(&mut self) {
        let running = self.running.len();
        let Some(e) = &mut self.experiment else {
            return;
        };
        let before = ExperimentMetrics::label(&e.arm().label);
        let (dt, switched) = e.tick(Instant::now(), running);
        let switched = switched.is_some();
        let m = &self.metrics.experiment;
        m.seconds.get_or_create(&before).inc_by(dt);
        m.running_seconds
            .get_or_create(&before)
            .inc_by(dt * running as f64);
        if switched {
            m.windows.get_or_create(&before).inc();
            self.apply_arm();
        }
    }

    /// Attaches the model drafter used by `parallel` / `dspark-*` speculation.
    pub fn with_drafter(mut self, drafter: Drafter) -> Self {
        self.spec = Speculator::new(
            self.cfg.speculation,
            self.cfg.policy.clone(),
            self.cfg.online_calibration,
            Some(drafter),
            self.metrics.clone(),
        );
        self.apply_arm();
        self
    }

    /// The speculation component (its counters and last plan, for tests and the trace).
    pub fn speculator(&self) -> &Speculator {
        &self.spec
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
                    self.spec.release(s.id);
                }
            }
        }
    }

    fn enqueue(&mut self, req: GenRequest) {
        let seed = req.params.seed.unwrap_or_else(rand::random);
        let prompt_len = req.prompt.len();
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id: self.next_id,
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

    fn release(&mut self, s: &mut Seq) {
        self.kv.truncate(&mut s.blocks, 0);
        self.spec.release(s.id);
        s.cached = 0;
    }

    /// One engine step. Returns after at most one target forward.
    pub fn step(&mut self) -> Result<()> {
        while let Ok(r) = self.rx.try_recv() {
            self.enqueue(r);
        }
        self.experiment_tick();
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
        let shape = StepShape {
            base_b: decoding.len() + prefill_demand.min(room),
            max_b: self.cfg.max_batch_tokens,
        };
        let mut proposals = std::collections::HashMap::new();
        if self.spec.kind() != Speculation::None && !decoding.is_empty() {
            let table = self.costs.current();
            let caps: Vec<(u64, usize, usize)> = decoding
                .iter()
                .map(|&i| {
                    let s = &self.running[i];
                    (s.id, self.draft_cap(i, room, max_ctx), s.tokens.len())
                })
                .collect();
            let mut cands: Vec<Candidate> = Vec::with_capacity(decoding.len());
            let mut by_index: Vec<Option<&mut Seq>> = self.running.iter_mut().map(Some).collect();
            for (&i, c) in decoding.iter().zip(&caps) {
                let s = by_index[i].take().expect("decoding indices are distinct");
                cands.push(Candidate {
                    id: s.id,
                    cached: s.cached,
                    tokens: &s.tokens,
                    cap: c.1,
                    params: &s.req.params,
                    rng: &mut s.rng,
                });
            }
            let drafted = self.spec.propose(&mut cands, &self.model, shape, &table)?;
            drop(cands);
            let planned = self.spec.plan(&caps, drafted, shape, &table);
            for (&i, p) in decoding.iter().zip(planned) {
                if let Some(p) = p {
                    proposals.insert(i, p);
                }
            }
        }
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
        let hidden_layers = self.spec.hidden_layers();
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
                s.cached += sb.tokens.len();
                let (id, cached) = (s.id, s.cached);
                self.spec
                    .commit(id, &out.hidden, first_row, sb.tokens.len(), cached, None)?;
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
            s.cached += valid;
            self.kv.truncate(&mut s.blocks, s.cached);
            if pl.decoding && self.spec.kind() != Speculation::None {
                self.metrics.committed_tokens.inc_by(commit.len() as u64);
            }
            if drafted > 0 {
                s.draft_tokens += drafted;
                s.accepted_tokens += accepted;
            }
            let (id, cached) = (s.id, s.cached);
            self.spec.commit(
                id,
                &out.hidden,
                first_row,
                valid,
                cached,
                pl.proposal.as_ref().map(|p| Verified {
                    proposal: p,
                    accepted,
                }),
            )?;
            let s = &mut self.running[i];
            if pl.decoding && self.spec.kind() != Speculation::None {
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
            let s = &self.running[i];
            self.spec.observe(s.id, &s.tokens);
        }
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let mut s = self.running.swap_remove(i);
            self.finish(&mut s, reason);
        }
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
        let arm = self.experiment.as_mut().map(|e| {
            e.tokens(1);
            ExperimentMetrics::label(&e.arm().label)
        });
        let em = &self.metrics.experiment;
        if let Some(a) = &arm {
            em.tokens.get_or_create(a).inc();
        }
        match gap {
            None if s.last_token.is_none() => {
                let t = (now - s.req.arrived).as_secs_f64();
                self.metrics.ttft.observe(t);
                if let Some(a) = &arm {
                    em.ttft.get_or_create(a).observe(t);
                }
                let g = &self.metrics.genai;
                g.ttft.record(t, &g.attrs(s.req.operation));
                s.enter_phase("decode");
            }
            None => {}
            Some(g) => {
                self.metrics.itl.observe(g);
                if let Some(a) = &arm {
                    em.itl.get_or_create(a).observe(g);
                }
            }
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
        if let Some(e) = &mut self.experiment {
            e.finished();
        }
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
