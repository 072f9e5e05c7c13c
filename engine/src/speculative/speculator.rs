//! The speculation component of the step loop: it owns the drafter and its context KV cache,
//! every sequence's drafting state, the drafting gate, the live acceptance statistics and the
//! online recalibration. The step loop calls four methods on it:
//!
//! - [`Speculator::propose`]: decides who drafts ([`scheduler::plan_drafts`], draft time
//!   priced from the cost table) and runs the drafter for them only;
//! - [`Speculator::plan`]: the policy's verify lengths for the drafted blocks;
//! - [`Speculator::commit`]: a sequence's forward outcome (its hidden states, how many fed
//!   positions stay valid, the verify verdict);
//! - [`Speculator::release`]: a sequence left (finished, cancelled, preempted).
//!
//! A step in which the plan drafts nothing runs no drafter code at all (counted by
//! [`Speculator::drafter_calls`]): committed hidden-state rows wait per sequence and are
//! written into the drafter cache by the next drafting call, whose measured time includes
//! them. A backlog that grows past [`DETACH_ROWS`] (the drafter stayed off for that long) is
//! dropped and that sequence decodes plainly to its end, so memory stays bounded.

use super::clock::{priced_sps, DraftClock, StepClock};
use super::dspark::{ContextFeed, DSparkDrafter, DraftRequest, ProposeOptions};
use super::recalibrate::OnlineCalibration;
use super::scheduler::{plan_drafts, predicted_survival, probe_pays};
use super::{is_greedy, ngram, AcceptanceStats, Proposal, Speculation, VerifyPolicy};
use crate::cost::ActiveTable;
use crate::kv::KvCache;
use crate::metrics::{Metrics, ModePositionLabel, PositionLabel, StepKindLabel};
use crate::model::Model;
use crate::sampling::{Dist, SamplingParams};
use anyhow::Result;
use candle_core::Tensor;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A model drafter with its own context KV cache (fed with the target's hidden states).
pub struct Drafter {
    pub model: DSparkDrafter,
    pub kv: KvCache,
}

/// Steps in a row without drafting after which one sequence drafts anyway (a probe), so the
/// acceptance estimates keep up with the traffic. A probe drafts ONE sequence and is timed
/// and counted like any draft.
pub const DRAFT_PROBE: usize = 16;

/// A held backlog this long (rows) is written into the drafter cache by the next drafting
/// call the plan chose (not a probe) even when its sequence does not draft then
/// (piggybacked, at most [`FEED_ROWS_PER_CALL`] such rows per call).
pub const FEED_BACKLOG_ROWS: usize = 2 * DRAFT_PROBE;
/// Most piggybacked backlog rows per drafting call, so no single step pays a large feed.
pub const FEED_ROWS_PER_CALL: usize = 256;
/// A sequence whose backlog reaches this many rows loses its drafter context and decodes
/// plainly until it ends.
pub const DETACH_ROWS: usize = 1024;

/// Relative gain over plain decoding a drafting plan must promise to run.
const PLAN_MARGIN: f64 = 0.03;

/// Half-life, in verified blocks, of a sequence's own acceptance memory.
const OWN_HALF_LIFE: f64 = 8.0;
/// Weight (pseudo-blocks) of the global rates in a sequence's predicted acceptance.
const PRIOR_WEIGHT: f64 = 4.0;

/// One decoding sequence of this step, as the step loop sees it.
pub struct Candidate<'a> {
    /// The engine's id of the sequence (stable while it runs).
    pub id: u64,
    /// All its tokens; the last is the anchor (not yet in the target cache).
    pub tokens: &'a [u32],
    /// Positions in the target's cache (`tokens.len() - 1` for a decoding sequence).
    pub cached: usize,
    /// Most draft tokens it may verify this step.
    pub cap: usize,
    pub params: &'a SamplingParams,
    /// What the request's penalties read.
    pub history: &'a crate::sampling::History,
    pub rng: &'a mut ChaCha8Rng,
    /// Its grammar, when the output is constrained: the model drafter proposes only
    /// tokens it allows (the state is walked along the draft and rolled back).
    pub constraint: Option<&'a mut crate::constraint::Constraint>,
}

/// The step's shape for the planner.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// Tokens the target forward holds anyway (pending tokens plus prefill).
    pub base_b: usize,
    /// Most tokens in one forward.
    pub max_b: usize,
}

/// A sequence's verify outcome, for [`Speculator::commit`].
pub struct Verified<'a> {
    pub proposal: &'a Proposal,
    pub accepted: usize,
}

/// One sequence's speculation state.
struct SeqState {
    /// Block table in the drafter's context cache.
    draft_blocks: Vec<u32>,
    /// The drafter's context feature of the last position fed (context-input drafters).
    draft_ctx: Option<Tensor>,
    /// Committed positions whose features are in the drafter cache
    /// (`draft_fed + pending.rows` = the target's cached positions).
    draft_fed: usize,
    pending: PendingFeatures,
    /// A deterministic draft that was not verified (n-gram, verify length 0), kept to be
    /// checked against the tokens the target commits next: `(position of its first token,
    /// tokens)`. For a point-mass draft the chance that the target's own token matches is
    /// exactly the chance verification would have accepted it, so the live acceptance rates
    /// stay honest while the scheduler is not verifying.
    shadow: Option<(usize, Vec<u32>)>,
    /// Lost its drafter context (backlog over [`DETACH_ROWS`]): never drafts again.
    detached: bool,
    /// The target's prefix-cache keys of this sequence's full blocks, and how many of its
    /// drafter blocks are registered under them (a block is once all its positions are fed).
    prefix_keys: Vec<u64>,
    draft_registered: usize,
    /// This sequence's own recent acceptance.
    own: AcceptanceStats,
    /// Step counter value when it last drafted (probe order).
    last_drafted: u64,
}

impl SeqState {
    fn new(positions: usize) -> Self {
        Self {
            draft_blocks: Vec::new(),
            draft_ctx: None,
            draft_fed: 0,
            pending: PendingFeatures::default(),
            shadow: None,
            detached: false,
            prefix_keys: Vec::new(),
            draft_registered: 0,
            own: AcceptanceStats::new(positions, OWN_HALF_LIFE),
            last_drafted: 0,
        }
    }
}

/// What the last [`Speculator::propose`] decided (for tests and the trace).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LastPlan {
    /// Sequences that drafted.
    pub drafted: usize,
    /// It was a probe (the plan alone would not have drafted).
    pub probe: bool,
}

pub struct Speculator {
    kind: Speculation,
    policy: VerifyPolicy,
    drafter: Option<Drafter>,
    seqs: HashMap<u64, SeqState>,
    /// Live per-position acceptance over all sequences.
    acceptance: AcceptanceStats,
    recal: Option<OnlineCalibration>,
    clock: DraftClock,
    /// Verifying forwards against plain ones, both against the table.
    step_clock: StepClock,
    /// Steps in a row the plan drafted nobody.
    skips_in_row: usize,
    steps: u64,
    /// Drafter calls already exported.
    calls: u64,
    last: LastPlan,
    /// Speculation switched off by the experiment's `none` arm.
    off: bool,
    metrics: Arc<Metrics>,
}

impl Speculator {
    /// `online_calibration`: SGD step of the recalibration (0: off), model drafters only.
    pub fn new(
        kind: Speculation,
        policy: VerifyPolicy,
        online_calibration: f32,
        drafter: Option<Drafter>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let recal = drafter
            .as_ref()
            .filter(|_| online_calibration > 0.0)
            .map(|d| OnlineCalibration::new(d.model.config().block_size, online_calibration));
        metrics.verify_cost_factor.set(1.0);
        Self {
            kind,
            policy,
            drafter,
            seqs: HashMap::new(),
            acceptance: AcceptanceStats::new(64, 200.0),
            recal,
            clock: DraftClock::default(),
            step_clock: StepClock::default(),
            skips_in_row: 0,
            steps: 0,
            calls: 0,
            last: LastPlan::default(),
            off: false,
            metrics,
        }
    }

    /// The drafter kind, `None` while an experiment arm has speculation off.
    pub fn kind(&self) -> Speculation {
        if self.off {
            Speculation::None
        } else {
            self.kind
        }
    }

    pub fn policy(&self) -> &VerifyPolicy {
        &self.policy
    }

    /// Switches the verify policy between steps (the online experiment); `None` turns
    /// speculation off: no drafting, no verification, no hidden states requested, and
    /// every sequence's drafter context is dropped (they decode plainly to their end).
    pub fn set_policy(&mut self, policy: Option<VerifyPolicy>) {
        self.off = policy.is_none();
        if let Some(p) = policy {
            self.policy = p;
        }
        if self.off {
            let ids: Vec<u64> = self.seqs.keys().copied().collect();
            for id in ids {
                self.detach(id);
            }
        }
        self.skips_in_row = 0;
    }

    /// Sequence `id` loses its drafter context for good (it decodes plainly).
    fn detach(&mut self, id: u64) {
        let block = self.block();
        let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
        st.detached = true;
        st.pending = PendingFeatures::default();
        st.draft_ctx = None;
        st.shadow = None;
        if let Some(d) = self.drafter.as_mut() {
            d.kv.truncate(&mut st.draft_blocks, 0);
        }
    }

    fn block(&self) -> usize {
        self.drafter
            .as_ref()
            .map_or(self.policy.gamma(), |d| d.model.config().block_size)
    }

    /// Target layers whose hidden states the drafter reads (empty: none needed).
    pub fn hidden_layers(&self) -> Vec<usize> {
        if self.off {
            return Vec::new();
        }
        self.drafter
            .as_ref()
            .map(|d| d.model.target_layers().to_vec())
            .unwrap_or_default()
    }

    /// Calls into drafter code so far (context feeds and drafts), as the drafter counts them.
    pub fn drafter_calls(&self) -> u64 {
        self.drafter.as_ref().map_or(0, |d| d.model.calls())
    }

    /// Exports the drafter's call count.
    fn publish_calls(&mut self) {
        let now = self.drafter_calls();
        self.metrics.drafter_calls.inc_by(now - self.calls);
        self.calls = now;
    }

    /// What the last [`Speculator::propose`] decided.
    pub fn last_plan(&self) -> &LastPlan {
        &self.last
    }

    /// Live conditional acceptance rate of position `k`.
    pub fn acceptance_rate(&self, k: usize) -> f32 {
        self.acceptance.rate(k)
    }

    /// Draft blocks for this step's decoding sequences (`None`: it decodes plainly). Model
    /// drafters run once, batched, for the sequences the plan picks; the n-gram drafter
    /// proposes for every sequence (it costs nothing). Proposals are not yet cut to verify
    /// lengths (see [`Speculator::plan`]).
    pub fn propose(
        &mut self,
        cands: &mut [Candidate<'_>],
        target: &Model,
        shape: StepShape,
        table: &ActiveTable,
    ) -> Result<Vec<Option<Proposal>>> {
        self.steps += 1;
        self.last = LastPlan::default();
        let mut out: Vec<Option<Proposal>> = (0..cands.len()).map(|_| None).collect();
        match self.kind {
            Speculation::None => {}
            Speculation::Ngram => {
                let gamma = self.policy.gamma();
                for (o, c) in out.iter_mut().zip(cands.iter()) {
                    let g = gamma.min(c.cap);
                    if g == 0 {
                        continue;
                    }
                    let tokens = ngram::propose(c.tokens, g, 1, 3);
                    if !tokens.is_empty() {
                        *o = Some(Proposal {
                            q: tokens.iter().map(|&t| Dist::Greedy(t)).collect(),
                            confidence: (0..tokens.len())
                                .map(|k| self.acceptance.rate(k))
                                .collect(),
                            tokens,
                        });
                    }
                }
            }
            Speculation::Parallel | Speculation::DSparkMarkov | Speculation::DSparkRnn => {
                let res = self.propose_with_model(cands, target, shape, table, &mut out);
                self.publish_calls();
                res?;
            }
        }
        Ok(out)
    }

    /// Predicted conditional acceptance of sequence `id`'s positions: its own recent
    /// outcomes, with the global rates as a prior of [`PRIOR_WEIGHT`] blocks. A position
    /// with little evidence borrows the estimate of the position before it (acceptance
    /// rarely rises along a block), not an uninformed 1/2: deep positions are verified
    /// rarely, and an optimistic guess there would make the plan draft long blocks that
    /// do not pay.
    fn predicted_rates(&self, id: u64, gamma: usize) -> Vec<f32> {
        let own = self.seqs.get(&id).map(|s| &s.own);
        let mut out = Vec::with_capacity(gamma);
        let mut prev = 0.5f64;
        for k in 0..gamma {
            let (a, n) = self.acceptance.counts(k);
            let g = (a + 2.0 * prev) / (n + 2.0);
            let r = match own {
                Some(o) => {
                    let (a, n) = o.counts(k);
                    (a + PRIOR_WEIGHT * g) / (n + PRIOR_WEIGHT)
                }
                None => g,
            };
            out.push(r as f32);
            prev = g;
        }
        out
    }

    fn propose_with_model(
        &mut self,
        cands: &mut [Candidate<'_>],
        target: &Model,
        shape: StepShape,
        table: &ActiveTable,
        out: &mut [Option<Proposal>],
    ) -> Result<()> {
        let Some(block) = self.drafter.as_ref().map(|d| d.model.config().block_size) else {
            return Ok(());
        };
        let gamma_max = self.policy.gamma().min(block);
        // Who may draft and how long.
        let caps: Vec<usize> = cands
            .iter()
            .map(|c| {
                let detached = self.seqs.get(&c.id).is_some_and(|s| s.detached);
                if detached {
                    0
                } else {
                    gamma_max.min(c.cap)
                }
            })
            .collect();
        if caps.iter().all(|&c| c == 0) {
            return Ok(());
        }
        let mut gamma: Vec<usize> = caps.clone();
        let mut min_survival = 0.0f32;
        if matches!(self.policy, VerifyPolicy::Dspark { .. }) {
            let predicted: Vec<Vec<f64>> = cands
                .iter()
                .zip(&caps)
                .map(|(c, &cap)| predicted_survival(&self.predicted_rates(c.id, cap), cap))
                .collect();
            let clock = self.clock.clone();
            let sps = self.priced(table, shape);
            let plan = plan_drafts(&predicted, shape.base_b, shape.max_b, &sps, &|n, l| {
                clock.predict(table, n, l)
            });
            gamma = plan.gamma;
            // Predictions are estimates: a plan must beat plain decoding by a margin, or the
            // step decodes plainly (a near-tie is not worth the drafter's risk).
            if plan.rate < plan.plain_rate * (1.0 + PLAN_MARGIN) {
                gamma.iter_mut().for_each(|g| *g = 0);
            }
            if gamma.iter().all(|&g| g == 0) {
                self.skips_in_row += 1;
                self.metrics.draft_skips.inc();
                if self.skips_in_row < DRAFT_PROBE {
                    return Ok(());
                }
                // A probe is priced like any draft: where even a drafter that is never
                // wrong would not pay at this load, it cannot change the decision. The
                // count keeps growing, so the probe runs as soon as the load allows it.
                if !probe_pays(
                    &caps,
                    shape.base_b,
                    shape.max_b,
                    &sps,
                    &|n, l| clock.predict(table, n, l),
                    PLAN_MARGIN,
                ) {
                    self.metrics.draft_skipped_probes.inc();
                    return Ok(());
                }
                // Probe: the eligible sequence whose drafter context is cheapest to bring up
                // to date (smallest backlog; then the one that drafted longest ago), full
                // block. The estimates it refreshes are global.
                let pick = (0..cands.len()).filter(|&i| caps[i] > 0).min_by_key(|&i| {
                    let st = self.seqs.get(&cands[i].id);
                    (
                        st.map_or(0, |s| s.pending.rows),
                        st.map_or(0, |s| s.last_drafted),
                        cands[i].id,
                    )
                });
                let Some(p) = pick else {
                    return Ok(());
                };
                gamma[p] = caps[p];
                self.last.probe = true;
            }
            self.skips_in_row = 0;
            // The early stop: a draft token whose survival is below the cheapest marginal
            // verify cost of this step can never be taken.
            let r = cands.len() as f64;
            let mut cheapest = f64::INFINITY;
            for b in shape.base_b.max(1)..shape.max_b.max(shape.base_b.max(1) + 1) {
                cheapest = cheapest.min(sps(b) / sps(b + 1) - 1.0);
                if cheapest <= 0.0 {
                    break;
                }
            }
            min_survival = (r * cheapest.max(0.0)).min(1.0) as f32;
        }
        let d = self.drafter.as_mut().expect("checked");
        // Blocks must cover the draft positions; a sequence the drafter cache cannot hold
        // decodes without drafting this step.
        for (i, c) in cands.iter().enumerate() {
            if gamma[i] == 0 {
                continue;
            }
            let st = self
                .seqs
                .entry(c.id)
                .or_insert_with(|| SeqState::new(block));
            let rows = d.model.config().block_rows(gamma[i]);
            if c.cached + rows > target.max_context()
                || !d.kv.ensure(&mut st.draft_blocks, c.cached + rows)
            {
                gamma[i] = 0;
            }
        }
        let who: Vec<usize> = (0..cands.len()).filter(|&i| gamma[i] > 0).collect();
        if who.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        // The drafter's context must reach each anchor: feed the held rows of the drafting
        // sequences, and (when the plan itself chose to draft, not in a probe) of long
        // backlogs of the others within the per-call bound.
        let mut feed: Vec<u64> = who.iter().map(|&i| cands[i].id).collect();
        let mut extra = if self.last.probe {
            FEED_ROWS_PER_CALL
        } else {
            0
        };
        let mut backlogs: Vec<(usize, u64)> = self
            .seqs
            .iter()
            .filter(|(id, s)| {
                !s.detached && s.pending.rows >= FEED_BACKLOG_ROWS && !feed.contains(id)
            })
            .map(|(&id, s)| (s.pending.rows, id))
            .collect();
        backlogs.sort_unstable_by(|a, b| b.cmp(a));
        for (rows, id) in backlogs {
            if extra + rows > FEED_ROWS_PER_CALL {
                continue;
            }
            extra += rows;
            feed.push(id);
        }
        self.metrics.draft_steps.inc();
        self.feed(&feed)?;
        let d = self.drafter.as_mut().expect("checked");
        // A context-input drafter also needs the feature of the position before the anchor:
        // a sequence that started on cached blocks right up to its anchor (prompt length one
        // past a block boundary) has none until it decodes one token plainly.
        let needs_ctx = d.model.config().context_input;
        let who: Vec<usize> = who
            .into_iter()
            .filter(|&i| {
                self.seqs.get(&cands[i].id).is_some_and(|s| {
                    s.pending.rows == 0
                        && s.draft_fed == cands[i].cached
                        && (s.draft_ctx.is_some() || !needs_ctx)
                })
            })
            .collect();
        if who.is_empty() {
            return Ok(());
        }
        let seqs = &self.seqs;
        let mut reqs: Vec<DraftRequest> = Vec::with_capacity(who.len());
        let mut grammars = Vec::with_capacity(who.len());
        let mut picked: Vec<&mut Candidate> = cands
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| who.contains(i))
            .map(|(_, c)| c)
            .collect();
        for (c, &i) in picked.iter_mut().zip(&who) {
            let st = &seqs[&c.id];
            reqs.push(DraftRequest {
                anchor: *c.tokens.last().expect("decoding sequences have tokens"),
                anchor_pos: c.cached,
                block_table: &st.draft_blocks,
                gamma: gamma[i],
                params: c.params,
                history: Some(c.history),
                rng: &mut *c.rng,
                last_context: st.draft_ctx.as_ref(),
            });
            grammars.push(c.constraint.as_deref_mut());
        }
        let opts = ProposeOptions {
            min_survival,
            calibration: self.recal.as_ref(),
        };
        let blocks = d
            .model
            .propose_under(&mut d.kv, target, &mut reqs, &opts, &mut grammars)?;
        drop(reqs);
        drop(grammars);
        let secs = t0.elapsed().as_secs_f64();
        let l_run = who.iter().map(|&i| gamma[i]).max().unwrap_or(0);
        self.clock.record(table, who.len(), l_run, secs);
        self.last.drafted = who.len();
        for (&i, b) in who.iter().zip(blocks) {
            if let Some(st) = self.seqs.get_mut(&cands[i].id) {
                st.last_drafted = self.steps;
            }
            if !b.tokens.is_empty() {
                out[i] = Some(b);
            }
        }
        Ok(())
    }

    /// Turns prefix caching on in the drafter's context cache (keyed by the target's keys).
    pub fn enable_prefix_cache(&mut self) {
        if let Some(d) = self.drafter.as_mut() {
            d.kv.enable_prefix_cache("drafter");
        }
    }

    /// How many of the leading target prefix-cache `keys` a new sequence may start on: all of
    /// them without a model drafter, else as many as the drafter's context cache holds too
    /// (the target computes the rest, so the drafter's context is the same as without a hit).
    pub fn shared_prefix(&self, keys: &[u64]) -> usize {
        match &self.drafter {
            Some(d) if self.kind.uses_model_drafter() => d.kv.lookup_keys(keys).len(),
            _ => keys.len(),
        }
    }

    /// A sequence starts on the first `keys.len()` cached blocks: its drafter context
    /// shares the drafter blocks registered under the same keys.
    pub fn attach_prefix(&mut self, id: u64, keys: &[u64]) {
        let block = self.block();
        let Some(d) = self.drafter.as_mut() else {
            return;
        };
        if keys.is_empty() || !self.kind.uses_model_drafter() {
            return;
        }
        let blocks = d.kv.lookup_keys(keys);
        debug_assert_eq!(blocks.len(), keys.len(), "shared_prefix bounds the hit");
        let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
        st.draft_blocks = d.kv.share(&blocks);
        st.draft_fed = blocks.len() * d.kv.block_size;
        st.prefix_keys = keys[..blocks.len()].to_vec();
        st.draft_registered = blocks.len();
    }

    /// The target registered more of sequence `id`'s blocks under `keys`.
    pub fn note_prefix_keys(&mut self, id: u64, keys: &[u64]) {
        if self.drafter.is_none() || !self.kind.uses_model_drafter() {
            return;
        }
        let block = self.block();
        let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
        st.prefix_keys.extend_from_slice(keys);
        self.register_drafter_blocks(id);
    }

    /// Registers sequence `id`'s drafter blocks whose positions are all fed under the
    /// target's keys.
    fn register_drafter_blocks(&mut self, id: u64) {
        let (Some(d), Some(st)) = (self.drafter.as_mut(), self.seqs.get_mut(&id)) else {
            return;
        };
        if st.detached {
            return;
        }
        let bs = d.kv.block_size;
        while st.draft_registered < st.prefix_keys.len()
            && (st.draft_registered + 1) * bs <= st.draft_fed
            && st.draft_registered < st.draft_blocks.len()
        {
            let i = st.draft_registered;
            d.kv.register_key(&st.draft_blocks, i, st.prefix_keys[i]);
            st.draft_registered += 1;
        }
    }

    /// Writes the held rows of sequences `ids` into the drafter's context cache in one
    /// batched call. A sequence the drafter cache cannot hold keeps its backlog.
    fn feed(&mut self, ids: &[u64]) -> Result<()> {
        let Some(d) = self.drafter.as_mut() else {
            return Ok(());
        };
        let (mut fed, mut hidden) = (Vec::new(), Vec::new());
        for id in ids {
            let Some(s) = self.seqs.get_mut(id) else {
                continue;
            };
            let upto = s.draft_fed + s.pending.rows;
            if s.pending.rows == 0 || !d.kv.ensure(&mut s.draft_blocks, upto) {
                continue;
            }
            hidden.push(s.pending.take()?);
            fed.push(*id);
        }
        if fed.is_empty() {
            return Ok(());
        }
        let feeds: Vec<ContextFeed> = fed
            .iter()
            .zip(&hidden)
            .map(|(id, h)| {
                let s = &self.seqs[id];
                ContextFeed {
                    table: &s.draft_blocks,
                    start: s.draft_fed,
                    hidden: h,
                }
            })
            .collect();
        let last = d.model.append_contexts(&mut d.kv, &feeds)?;
        drop(feeds);
        for ((id, h), c) in fed.iter().zip(&hidden).zip(last) {
            let s = self.seqs.get_mut(id).expect("fed sequences exist");
            s.draft_fed += h.first().map_or(0, |t| t.dim(0).unwrap_or(0));
            if c.is_some() {
                s.draft_ctx = c;
            }
        }
        for id in &fed {
            self.register_drafter_blocks(*id);
        }
        Ok(())
    }

    /// The table's SPS as this step's plans read it: a forward that verifies drafts priced
    /// by the measured [`StepClock::verify_factor`].
    fn priced<'a>(&self, table: &'a ActiveTable, shape: StepShape) -> impl Fn(usize) -> f64 + 'a {
        priced_sps(
            move |b| table.sps(b),
            shape.base_b,
            self.step_clock.verify_factor(),
        )
    }

    /// One decode-only step (no prefill in its forward) took `secs` for its forward and
    /// commit over `batch_tokens` tokens; `verified`: some sequence verified a draft.
    pub fn record_step(
        &mut self,
        table: &ActiveTable,
        batch_tokens: usize,
        secs: f64,
        verified: bool,
    ) {
        if self.kind() == Speculation::None || batch_tokens == 0 {
            return;
        }
        self.step_clock
            .record(1.0 / table.sps(batch_tokens), secs, verified);
        let (plain, verify) = self.step_clock.ratios();
        let m = &self.metrics;
        m.step_cost_ratio
            .get_or_create(&StepKindLabel {
                kind: "plain".into(),
            })
            .set(plain);
        m.step_cost_ratio
            .get_or_create(&StepKindLabel {
                kind: "verify".into(),
            })
            .set(verify);
        m.verify_cost_factor.set(self.step_clock.verify_factor());
    }

    /// Verify lengths for this step's proposals (`caps[r]`: candidate r's most draft
    /// tokens) under the policy and the cost table, proposals cut to them. An n-gram draft
    /// the plan does not verify is kept as a shadow (see `SeqState::shadow`).
    pub fn plan(
        &mut self,
        cands: &[(u64, usize, usize)],
        mut proposals: Vec<Option<Proposal>>,
        shape: StepShape,
        table: &ActiveTable,
    ) -> Vec<Option<Proposal>> {
        if self.kind == Speculation::None || cands.is_empty() {
            return proposals.into_iter().map(|_| None).collect();
        }
        let caps: Vec<usize> = cands.iter().map(|c| c.1).collect();
        let props: Vec<Option<&Proposal>> = proposals.iter().map(Option::as_ref).collect();
        let sps = self.priced(table, shape);
        let vp = self
            .policy
            .plan(&props, &caps, shape.base_b, shape.max_b, &sps);
        self.metrics.expected_tokens.inc_by(vp.expected_tau);
        if let Some(t) = vp.theta {
            self.metrics.theta.set(t);
        }
        let block = self.block();
        for ((&(id, _, n_tokens), p), &l) in cands.iter().zip(proposals.iter_mut()).zip(&vp.lens) {
            self.metrics.verify_len.observe(l as f64);
            let Some(prop) = p.take() else {
                continue;
            };
            if l > 0 {
                *p = Some(prop.truncated(l));
            } else if self.kind == Speculation::Ngram {
                let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
                if st.shadow.is_none() {
                    st.shadow = Some((n_tokens, prop.tokens));
                }
            }
        }
        proposals
    }

    /// One sequence's share of the forward: rows `first_row..first_row + valid` of `hidden`
    /// are its positions that stay in the target cache (now `cached` positions), and, when it
    /// verified a block, the verdict.
    pub fn commit(
        &mut self,
        id: u64,
        hidden: &[Tensor],
        first_row: usize,
        valid: usize,
        cached: usize,
        verified: Option<Verified<'_>>,
    ) -> Result<()> {
        let block = self.block();
        if self.drafter.is_some() && hidden.is_empty() && valid > 0 {
            // Hidden states were not computed this step (speculation was off): the drafter
            // context cannot follow any more.
            if !self.seqs.get(&id).is_some_and(|s| s.detached) {
                self.detach(id);
            }
        } else if let Some(d) = self.drafter.as_mut() {
            let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
            if !st.detached {
                st.pending.push(hidden, first_row, valid)?;
                d.kv.truncate(&mut st.draft_blocks, cached);
                if st.pending.rows >= DETACH_ROWS {
                    st.detached = true;
                    st.pending = PendingFeatures::default();
                    st.draft_ctx = None;
                    d.kv.truncate(&mut st.draft_blocks, 0);
                }
            }
        }
        if let Some(v) = verified {
            let drafted = v.proposal.tokens.len();
            let accepted = v.accepted;
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
            if let Some(oc) = &mut self.recal {
                let greedy = is_greedy(&v.proposal.q);
                oc.record(greedy, &v.proposal.confidence, accepted);
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
            self.record_acceptance(Some(id), drafted, accepted);
        }
        Ok(())
    }

    /// Sequence `id`'s tokens after this step's commit: scores a pending shadow draft once
    /// they decide it.
    pub fn observe(&mut self, id: u64, tokens: &[u32]) {
        let Some(st) = self.seqs.get_mut(&id) else {
            return;
        };
        let Some((start, draft)) = &st.shadow else {
            return;
        };
        let known = tokens.len().saturating_sub(*start);
        let matched = draft
            .iter()
            .zip(&tokens[(*start).min(tokens.len())..])
            .take_while(|(a, b)| a == b)
            .count();
        if matched < known.min(draft.len()) {
            // First mismatch at `matched`: positions 0..=matched were decided.
            st.shadow = None;
            self.record_acceptance(None, matched + 1, matched);
        } else if matched == draft.len() {
            let n = draft.len();
            st.shadow = None;
            self.record_acceptance(None, n, n);
        }
    }

    /// Updates the live per-position acceptance rates (global, and the sequence's own) and
    /// their gauges.
    fn record_acceptance(&mut self, id: Option<u64>, verified: usize, accepted: usize) {
        self.acceptance.record(verified, accepted);
        if let Some(st) = id.and_then(|id| self.seqs.get_mut(&id)) {
            st.own.record(verified, accepted);
        }
        for k in 0..verified.min(accepted + 1).min(16) {
            self.metrics
                .live_acceptance
                .get_or_create(&PositionLabel { position: k as u32 })
                .set(self.acceptance.rate(k) as f64);
        }
    }

    /// Sequence `id` left the engine (or was preempted and starts over): frees its drafter
    /// blocks and forgets its state.
    pub fn release(&mut self, id: u64) {
        if let Some(mut st) = self.seqs.remove(&id) {
            if let Some(d) = self.drafter.as_mut() {
                d.kv.truncate(&mut st.draft_blocks, 0);
            }
        }
    }
}

/// Target hidden-state rows of committed positions not yet written into the drafter's
/// context cache. Feeding waits for the next drafting call (one batched pass over every
/// drafting sequence), so while the plan keeps the drafter off it costs these copies only.
#[derive(Default)]
struct PendingFeatures {
    /// Per target layer, chunks of `[rows, hidden]` in position order.
    layers: Vec<Vec<Tensor>>,
    rows: usize,
}

impl PendingFeatures {
    /// Keeps rows `first_row..first_row + n` of this step's hidden states (copied, so the
    /// step's whole batch is not held).
    fn push(&mut self, hidden: &[Tensor], first_row: usize, n: usize) -> Result<()> {
        if n == 0 || hidden.is_empty() {
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
    fn take(&mut self) -> Result<Vec<Tensor>> {
        let out = self
            .layers
            .iter()
            .map(|c| Tensor::cat(c, 0))
            .collect::<candle_core::Result<_>>()?;
        *self = Self::default();
        Ok(out)
    }
}
