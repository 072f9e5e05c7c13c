//! The step loop: continuous batching over one model and one paged KV cache.
//!
//! Requests join and leave between steps. Each step builds ONE batched target forward from
//! the decoding sequences (one pending token each, plus the draft tokens the speculator
//! plans) and prefill chunks of new prompts under a token budget, then verifies, commits and
//! streams. [`Engine::step`] is the orchestration; the parts live by role:
//! - [`request`]: the contract with the HTTP server (requests in, events out);
//! - [`planner`]: pure admission and batch packing (token budget, KV blocks, preemption);
//! - [`crate::speculative::speculator`]: who drafts, how long, and what the drafter learns;
//! - [`output`]: detokenizing, stop strings, holdback;
//! - [`observe`]: gauges, latency metrics, request spans, the policy experiment's clock.
//!
//! A sequence whose client went away is dropped (and its KV blocks freed) at the next step.
//! When the cache runs out of blocks, the youngest sequence is preempted and recomputed later.

mod config;
mod observe;
mod output;
mod planner;
mod request;
mod seq;

pub use config::{EngineConfig, Faults};
pub use request::{
    EngineHandle, Event, FinishReason, GenRequest, SubmitError, TokenLogprob, Usage,
};

use crate::cost::CostTables;
use crate::experiment::Experiment;
use crate::kv::KvCache;
use crate::metrics::Metrics;
use crate::model::{Model, SeqBatch};
use crate::sampling::{block_dists_masked, target_dist_masked};
pub use crate::speculative::speculator::Drafter;
use crate::speculative::speculator::{Candidate, Speculator, Verified};
use crate::speculative::{verify::verify, Proposal, Speculation};
use crate::tokenizer::TextTokenizer;
use anyhow::Result;
use candle_core::Tensor;
use dspark_telemetry::TRACE_TARGET;
use planner::{Demand, Entry, Limits, Load, Packed};
use seq::Seq;
use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Shared with the handles: set when the thread dies.
    failed: Arc<std::sync::OnceLock<String>>,
    /// Shared with the handles: when the loop last went round.
    beat: Arc<request::Heartbeat>,
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
        let failed = Arc::new(std::sync::OnceLock::new());
        let beat = Arc::new(request::Heartbeat::new());
        let handle = EngineHandle {
            tx,
            waiting: waiting.clone(),
            running: running.clone(),
            max_waiting: cfg.max_waiting,
            failed: failed.clone(),
            beat: beat.clone(),
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
            failed,
            beat,
        };
        if engine.cfg.prefix_cache {
            engine.kv.enable_prefix_cache("target");
        }
        if let Some((arms, window)) = engine.cfg.experiment.clone() {
            engine.experiment = Some(Experiment::new(arms, window, Instant::now()));
            engine.apply_arm();
        }
        (engine, handle)
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
        if self.cfg.prefix_cache {
            self.spec.enable_prefix_cache();
        }
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

    /// Runs until every handle is dropped and no work is left. A panic in a step ends the
    /// thread cleanly instead of silently: the handles report the failure (`/health` and
    /// `/ready` fail), every queued and running request gets an error event, and dropping
    /// the engine closes the queue (later submissions fail).
    pub fn run(mut self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve()));
        let Err(payload) = r else { return };
        let why = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        let why = format!("the engine thread panicked: {why}");
        tracing::error!("{why}; failing every request (the pod must be restarted)");
        let _ = self.failed.set(why.clone());
        while let Ok(r) = self.rx.try_recv() {
            self.enqueue(r);
        }
        for s in self.running.drain(..).chain(self.waiting.drain(..)) {
            let _ = s
                .req
                .events
                .send(Event::Error(format!("engine failure: {why}")));
        }
        self.running_count
            .store(0, std::sync::atomic::Ordering::SeqCst);
        self.waiting_count
            .store(0, std::sync::atomic::Ordering::SeqCst);
    }

    fn serve(&mut self) {
        loop {
            self.beat.beat();
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
        self.next_id += 1;
        self.waiting.push_back(Seq::new(self.next_id, req));
    }

    fn release(&mut self, s: &mut Seq) {
        self.kv.truncate(&mut s.blocks, 0);
        self.spec.release(s.id);
        s.cached = 0;
        s.chain = Default::default();
    }

    /// Starts an admitted sequence on the cached blocks its tokens begin with (automatic
    /// prefix caching), as far as the drafter's context cache holds them too, so that
    /// speculation after a hit is the same as without one.
    fn attach_prefix(&mut self, s: &mut Seq) {
        if s.cached > 0 || !self.kv.prefix_cache() {
            return;
        }
        let hits = self.kv.lookup_prefix(&s.tokens);
        let keys: Vec<u64> = hits.iter().map(|h| h.0).collect();
        let n = self.spec.shared_prefix(&keys);
        let blocks: Vec<u32> = hits[..n].iter().map(|h| h.1).collect();
        s.blocks = self.kv.share(&blocks);
        s.cached = n * self.kv.block_size;
        s.chain = crate::kv::Chain {
            blocks: n,
            hash: keys[..n].last().copied().unwrap_or(0),
        };
        self.spec.attach_prefix(s.id, &keys[..n]);
        let st = self.kv.prefix_stats_mut();
        st.queried_tokens += s.tokens.len() as u64;
        st.hit_tokens += s.cached as u64;
        self.metrics.prefix_queries.inc_by(s.tokens.len() as u64);
        self.metrics.prefix_hits.inc_by(s.cached as u64);
        if s.cached_prompt.is_none() {
            s.cached_prompt = Some(s.cached.min(s.prompt_len));
        }
    }

    /// Whether `s` should wait because a running sequence is still prefilling full blocks
    /// that `s` starts with too: once they are computed, `s` starts on them from the prefix
    /// cache instead of computing them again (the `n` choices of one prompt, requests with
    /// one system prompt arriving together).
    fn waits_for_shared_prefill<'a>(
        &'a self,
        s: &Seq,
        ahead: impl Iterator<Item = &'a Seq>,
    ) -> bool {
        let bs = self.kv.block_size;
        if !self.kv.prefix_cache() || s.cached > 0 || s.tokens.len() <= bs {
            return false;
        }
        self.running.iter().chain(ahead).any(|r| {
            if r.cached >= r.prompt_len || r.tokens.len() <= bs || r.tokens[..bs] != s.tokens[..bs]
            {
                return false;
            }
            let common = r
                .tokens
                .iter()
                .zip(&s.tokens[..s.tokens.len() - 1])
                .take_while(|(a, b)| a == b)
                .count();
            r.cached < common / bs * bs
        })
    }

    /// Registers the sequence's newly committed full blocks in the prefix cache (the
    /// drafter's cache follows with the same keys).
    fn register_blocks(&mut self, i: usize) {
        let s = &mut self.running[i];
        // A sequence that stopped inside an accepted block has fewer tokens than positions.
        let committed = s.cached.min(s.tokens.len());
        let keys = self
            .kv
            .register(&s.blocks, &s.tokens, committed, &mut s.chain);
        if !keys.is_empty() {
            self.spec.note_prefix_keys(s.id, &keys);
        }
    }

    /// One engine step: take in new requests, admit, plan, draft, run ONE target forward,
    /// verify and commit, stream the output. Returns after at most one target forward.
    pub fn step(&mut self) -> Result<()> {
        self.intake();
        self.admit();
        self.publish_counts();
        if self.running.is_empty() {
            return Ok(());
        }
        if self.cfg.faults.take_panic() {
            panic!("injected fault (test only): the step panics");
        }
        while self.cfg.faults.stalled() {
            // Injected fault (test only): the step hangs until the test lets it go.
            std::thread::sleep(Duration::from_millis(5));
        }
        let loads: Vec<Load> = self
            .running
            .iter()
            .map(|s| Load {
                pending: s.pending(),
                cached: s.cached,
                blocks: s.blocks.len(),
            })
            .collect();
        let limits = self.limits();
        let demand = planner::demand(&loads, &limits);
        // The drafter failing costs this step its drafts, not the requests their answers
        // (verification never depends on how a draft was made).
        let mut proposals = self.draft(&demand).unwrap_or_else(|e| {
            tracing::warn!("drafting failed, this step decodes without drafts: {e:#}");
            vec![None; self.running.len()]
        });
        let drafts: Vec<usize> = proposals
            .iter()
            .map(|p| p.as_ref().map_or(0, |p| p.tokens.len()))
            .collect();
        let entries = match planner::pack(&loads, &demand, &drafts, &limits) {
            Packed::Run(e) => e,
            Packed::Preempt(i) => {
                let mut s = self.running.remove(i);
                self.release(&mut s);
                self.metrics.preemptions.inc();
                self.waiting.push_front(s);
                return Ok(());
            }
        };
        if entries.is_empty() {
            return Ok(());
        }
        let plan: Vec<Planned> = entries
            .into_iter()
            .map(|e| {
                let s = &mut self.running[e.seq];
                let fits = self.kv.ensure(&mut s.blocks, s.cached + e.chunk);
                debug_assert!(fits, "the planner counted the free blocks");
                let proposal = proposals[e.seq]
                    .take()
                    .map(|p| p.truncated(e.draft))
                    .filter(|p| !p.tokens.is_empty());
                Planned { entry: e, proposal }
            })
            .collect();
        let started = Instant::now();
        let (batch, mut out) = self.forward(&plan)?;
        let finished = self.commit(&plan, &batch, &mut out)?;
        if plan.iter().all(|p| p.entry.decoding) {
            let verified = plan.iter().any(|p| p.proposal.is_some());
            let secs = started.elapsed().as_secs_f64();
            let table = self.costs.current();
            self.spec
                .record_step(&table, out.batch_tokens, secs, verified);
        }
        for (i, end) in finished {
            let mut s = self.running.swap_remove(i);
            match end {
                Ending::Done(reason) => self.finish(&mut s, reason),
                Ending::Failed(e) => {
                    self.release(&mut s);
                    let _ = s
                        .req
                        .events
                        .send(Event::Error(format!("request failed: {e}")));
                }
            }
        }
        self.publish_counts();
        Ok(())
    }

    /// Takes in new requests, advances the experiment clock and frees the blocks of
    /// sequences whose clients went away.
    fn intake(&mut self) {
        while let Ok(r) = self.rx.try_recv() {
            self.enqueue(r);
        }
        self.experiment_tick();
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
    }

    fn limits(&self) -> Limits {
        Limits {
            max_batch_tokens: self.cfg.max_batch_tokens,
            prefill_chunk: self.cfg.prefill_chunk,
            block_size: self.kv.block_size,
            free_blocks: self.kv.free_blocks(),
        }
    }

    /// Moves the sequences the planner admits from the queue to the running list.
    fn admit(&mut self) {
        // Sequences waiting for another's prefill of their shared prefix stay queued (the
        // other running, or admitted before them now).
        let mut eligible: Vec<usize> = Vec::new();
        for i in 0..self.waiting.len() {
            let s = &self.waiting[i];
            let ahead = eligible.iter().map(|&j| &self.waiting[j]);
            if !self.waits_for_shared_prefill(s, ahead) {
                eligible.push(i);
            }
        }
        let n = planner::admit(
            eligible.iter().map(|&i| self.waiting[i].tokens.len()),
            self.running.len(),
            self.cfg.max_running,
            &self.limits(),
        );
        let mut admitted: Vec<Seq> = Vec::with_capacity(n);
        for &i in eligible[..n].iter().rev() {
            admitted.push(self.waiting.remove(i).expect("eligible index"));
        }
        admitted.reverse();
        for mut s in admitted {
            self.attach_prefix(&mut s);
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
    }

    /// The speculator's draft blocks for the decoding sequences (indexed like `running`),
    /// after its plan decided who verifies how many.
    fn draft(&mut self, demand: &Demand) -> Result<Vec<Option<Proposal>>> {
        let mut proposals: Vec<Option<Proposal>> = self.running.iter().map(|_| None).collect();
        let decoding = demand.decoding();
        if self.spec.kind() == Speculation::None || decoding.is_empty() {
            return Ok(proposals);
        }
        let table = self.costs.current();
        let max_ctx = self.model.max_context();
        let caps: Vec<(u64, usize, usize)> = decoding
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                let remaining = s.req.max_tokens.saturating_sub(s.generated());
                let context_left = max_ctx.saturating_sub(s.tokens.len() + 1);
                let cap = planner::draft_cap(remaining, demand.room, context_left);
                (s.id, cap, s.tokens.len())
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
                history: &s.history,
                rng: &mut s.rng,
                constraint: s.constraint.as_mut(),
            });
        }
        let drafted = self
            .spec
            .propose(&mut cands, &self.model, demand.shape, &table)?;
        drop(cands);
        let planned = self.spec.plan(&caps, drafted, demand.shape, &table);
        for (&i, p) in decoding.iter().zip(planned) {
            proposals[i] = p;
        }
        Ok(proposals)
    }

    /// Builds the batch of the plan and runs the target forward over it.
    fn forward(&mut self, plan: &[Planned]) -> Result<(Vec<SeqBatch>, ForwardOut)> {
        let batch: Vec<SeqBatch> = plan
            .iter()
            .map(|pl| {
                let s = &self.running[pl.entry.seq];
                let mut tokens = s.tokens[s.cached..].to_vec();
                tokens.truncate(pl.entry.chunk);
                if let Some(p) = &pl.proposal {
                    tokens.extend_from_slice(&p.tokens);
                }
                let ends = s.cached + tokens.len() >= s.tokens.len();
                SeqBatch {
                    num_logits: if ends { 1 + pl.drafted() } else { 0 },
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
        // The grammar masks of the constrained sequences that sample or verify this step
        // depend only on their state and drafts, not on the logits: they are computed on a
        // thread of their own while the target runs, off the step's critical path.
        let mut grammar: Vec<Option<Result<GrammarWork>>> = plan.iter().map(|_| None).collect();
        let constrained: Vec<usize> = (0..plan.len())
            .filter(|&k| {
                batch[k].num_logits > 0 && self.running[plan[k].entry.seq].constraint.is_some()
            })
            .collect();
        let (model, kv, running) = (&self.model, &mut self.kv, &mut self.running);
        let out = if constrained.is_empty() {
            model.forward(&batch, kv, &hidden_layers)?
        } else {
            let mut by_index: Vec<Option<&mut Seq>> = running.iter_mut().map(Some).collect();
            let mut work: Vec<(usize, &mut Seq)> = constrained
                .iter()
                .map(|&k| (k, by_index[plan[k].entry.seq].take().expect("distinct")))
                .collect();
            let (out, done) = std::thread::scope(|sc| {
                let masks = sc.spawn(|| {
                    work.iter_mut()
                        .map(|(k, s)| {
                            let c = s.constraint.as_mut().expect("constrained");
                            (*k, grammar_work(c, plan[*k].proposal.as_ref()))
                        })
                        .collect::<Vec<_>>()
                });
                let out = model.forward(&batch, kv, &hidden_layers);
                (out, masks.join())
            });
            for (k, r) in done.map_err(|_| anyhow::anyhow!("the grammar thread panicked"))? {
                grammar[k] = Some(r);
            }
            out?
        };
        let logits = if out.logits.dim(0)? > 0 {
            out.logits.to_vec2::<f32>()?
        } else {
            vec![]
        };
        Ok((
            batch,
            ForwardOut {
                logits,
                hidden: out.hidden,
                batch_tokens: b,
                grammar,
            },
        ))
    }

    /// Verifies and commits each sequence's share of the forward: samples (or verifies the
    /// draft block against the target), rolls the KV cache back past rejected drafts, feeds
    /// the speculator and streams the committed tokens. Returns the sequences that finished
    /// (highest index first, for `swap_remove`).
    fn commit(
        &mut self,
        plan: &[Planned],
        batch: &[SeqBatch],
        out: &mut ForwardOut,
    ) -> Result<Vec<(usize, Ending)>> {
        let speculating = self.spec.kind() != Speculation::None;
        let mut row = 0;
        let mut hidden_row = 0;
        let mut finished = Vec::new();
        for (k, (pl, sb)) in plan.iter().zip(batch).enumerate() {
            let i = pl.entry.seq;
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
                self.register_blocks(i);
                continue;
            }
            let rows = &out.logits[row..row + sb.num_logits];
            row += sb.num_logits;
            // A failure here (the request's grammar) is the request's own: it ends with an
            // error and the others go on.
            let work = out.grammar.get_mut(k).and_then(Option::take);
            let (commit, accepted) = match judge(s, pl.proposal.as_ref(), rows, work) {
                Ok(j) => j,
                Err(e) => {
                    tracing::warn!("request {} failed: {e:#}", s.id);
                    finished.push((i, Ending::Failed(format!("{e:#}"))));
                    continue;
                }
            };
            // Keys/values are valid for the fed tokens up to the last accepted draft;
            // rejected positions are rolled back.
            let drafted = pl.drafted();
            let valid = sb.tokens.len() - drafted + accepted;
            s.cached += valid;
            self.kv.truncate(&mut s.blocks, s.cached);
            if pl.entry.decoding && speculating {
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
            if pl.entry.decoding && speculating {
                tracing::info!(
                    target: TRACE_TARGET,
                    parent: &s.phase,
                    verify_len = drafted,
                    accepted,
                    committed = commit.len(),
                    batch_tokens = out.batch_tokens,
                    "speculation cycle"
                );
            }
            let gap = s
                .last_token
                .map(|t| t.elapsed().as_secs_f64() / commit.len() as f64);
            for (j, &tok) in commit.iter().enumerate() {
                self.observe_token(i, gap);
                let s = &mut self.running[i];
                if let Some(reason) = output::emit_token(s, tok, &rows[j], &self.tok) {
                    finished.push((i, Ending::Done(reason)));
                    break;
                }
            }
            let done = finished.last().is_some_and(|f: &(usize, Ending)| f.0 == i);
            let s = &mut self.running[i];
            if !done && s.constraint.as_ref().is_some_and(|c| c.is_stopped()) {
                // The grammar is complete: nothing but the end may follow.
                output::flush(s);
                finished.push((i, Ending::Done(FinishReason::Stop)));
            }
            // The accepted drafts are in `tokens` now: register the committed blocks.
            self.register_blocks(i);
            let s = &self.running[i];
            self.spec.observe(s.id, &s.tokens);
        }
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        Ok(finished)
    }

    fn finish(&mut self, s: &mut Seq, reason: FinishReason) {
        self.release(s);
        if let Some(e) = &mut self.experiment {
            e.finished(s.id);
        }
        self.observe_finish(s, reason);
        let _ = s.req.events.send(Event::Finished {
            reason,
            usage: Usage {
                prompt_tokens: s.prompt_len,
                completion_tokens: s.generated(),
                draft_tokens: s.draft_tokens,
                accepted_draft_tokens: s.accepted_tokens,
                cached_tokens: s.cached_prompt.unwrap_or(0),
            },
        });
    }
}

/// The tokens a sequence commits from its logits `rows` (and how many drafts it accepted):
/// a sampled token, or the verdict on its draft block. Under a grammar the block is judged
/// up to its first forbidden token, which stays in (target probability 0: rejected for
/// certain, the residual sampled, as lossless rejection sampling needs); each position is
/// judged after the drafts before it, and the grammar advances past what is committed.
fn judge(
    s: &mut Seq,
    proposal: Option<&Proposal>,
    rows: &[Vec<f32>],
    work: Option<Result<GrammarWork>>,
) -> Result<(Vec<u32>, usize)> {
    let work = match (work, s.constraint.as_mut()) {
        (Some(w), _) => Some(w?),
        (None, Some(c)) => Some(grammar_work(c, proposal)?),
        (None, None) => None,
    };
    let (commit, accepted) = match proposal {
        None => {
            let mask = match work {
                Some(GrammarWork::Sample(m)) => Some(m),
                _ => None,
            };
            let tok = target_dist_masked(&rows[0], &s.req.params, &s.history, mask.as_ref())
                .sample(&mut s.rng);
            (vec![tok], 0)
        }
        Some(p) => {
            let (masks, allowed) = match work {
                Some(GrammarWork::Block(m, k)) => (Some(m), k),
                _ => (None, p.tokens.len()),
            };
            let mut dists = block_dists_masked(
                &rows[..=allowed],
                &s.req.params,
                &s.history,
                &p.tokens[..allowed],
                masks.as_deref(),
            );
            let judged = if allowed < p.tokens.len() {
                // Never read: the forbidden token before it is rejected.
                dists.push(dists[allowed].clone());
                allowed + 1
            } else {
                allowed
            };
            let v = verify(&p.tokens[..judged], &p.q[..judged], &dists, &mut s.rng);
            if let Some(c) = s.constraint.as_mut() {
                c.rollback(allowed - v.accepted)?;
            }
            (v.tokens, v.accepted)
        }
    };
    if let Some(c) = s.constraint.as_mut() {
        // The final token (sampled or the verify's correction / bonus). A grammar the
        // accepted drafts completed allows only the end token, which it cannot
        // consume; the sequence finishes on it below.
        if !c.is_stopped() {
            c.consume(*commit.last().expect("one token at least"))?;
        }
    }
    Ok((commit, accepted))
}

/// How a sequence's step ended it.
enum Ending {
    Done(FinishReason),
    /// Its own failure (e.g. its grammar); the batch goes on without it.
    Failed(String),
}

/// A planned entry with its (cut) draft block.
struct Planned {
    entry: Entry,
    proposal: Option<Proposal>,
}

impl Planned {
    fn drafted(&self) -> usize {
        self.proposal.as_ref().map_or(0, |p| p.tokens.len())
    }
}

/// The target forward's output, as the commit reads it.
struct ForwardOut {
    /// One row per requested logit position, in batch order.
    logits: Vec<Vec<f32>>,
    /// The hidden states the drafter reads (the speculator's layers).
    hidden: Vec<Tensor>,
    batch_tokens: usize,
    /// Per plan entry: the grammar work of a constrained sequence with logits.
    grammar: Vec<Option<Result<GrammarWork>>>,
}

/// The grammar masks a constrained sequence's logits need this step.
enum GrammarWork {
    /// No draft: the mask of the token it samples.
    Sample(crate::constraint::Mask),
    /// A draft block, walked (see [`crate::constraint::Constraint::walk`]): the masks of
    /// its positions and how many drafts the grammar allows in a row (consumed).
    Block(Vec<crate::constraint::Mask>, usize),
}

fn grammar_work(
    c: &mut crate::constraint::Constraint,
    proposal: Option<&Proposal>,
) -> Result<GrammarWork> {
    Ok(match proposal {
        None => GrammarWork::Sample(c.mask()?),
        Some(p) => {
            let (m, k) = c.walk(&p.tokens)?;
            GrammarWork::Block(m, k)
        }
    })
}
