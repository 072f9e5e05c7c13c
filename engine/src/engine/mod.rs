//! The step loop: continuous batching over one model and one paged KV cache.
//!
//! Requests join and leave between steps. Each step builds ONE batched target forward from
//! the decoding sequences (one pending token each, plus the draft tokens the speculator
//! plans) and prefill chunks of new prompts under a token budget, then verifies, commits and
//! streams. [`Engine::step`] is the orchestration; the parts live by role:
//! - [`request`]: the contract with the HTTP server (requests in, events out);
//! - [`step`]: one step (intake, plan, draft, forward, commit);
//! - [`admission`]: who leaves the queue, and on which cached prefix blocks it starts;
//! - [`planner`]: pure admission and batch packing (token budget, KV blocks, preemption);
//! - [`grammar_thread`]: structured outputs' grammar masks, computed beside the forward;
//! - [`crate::speculative::acceptance`]: what a sequence commits from its logits (`judge`);
//! - [`crate::speculative::speculator`]: who drafts, how long, and what the drafter learns;
//! - [`output`]: detokenizing, stop strings, holdback;
//! - [`observe`]: gauges, latency metrics, request spans, the policy experiment's clock.
//!
//! A sequence whose client went away is dropped (and its KV blocks freed) at the next step.
//! When the cache runs out of blocks, the youngest sequence is preempted and recomputed later.

mod admission;
mod config;
mod grammar_thread;
mod observe;
mod output;
mod planner;
mod request;
mod seq;
mod step;
#[cfg(test)]
mod tests;

pub use config::{EngineConfig, FaultSite, Faults};
pub use request::{
    EngineHandle, Event, FinishReason, GenRequest, SubmitError, TokenLogprob, Usage,
};

use crate::cost::CostTables;
use crate::experiment::Experiment;
use crate::kv::KvCache;
use crate::metrics::Metrics;
use crate::model::Model;
pub use crate::speculative::speculator::Drafter;
use crate::speculative::speculator::Speculator;
use crate::tokenizer::TextTokenizer;
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
                cfg.prompt_lookup,
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
            self.cfg.prompt_lookup,
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
                    if let Some(x) = &mut self.experiment {
                        x.finished(s.id);
                    }
                }
                self.publish_counts();
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
}
