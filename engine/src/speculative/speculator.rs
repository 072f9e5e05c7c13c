//! The speculation component of the step loop: it owns the proposer (by role: n-gram or a
//! model drafter, [`super::proposer`]), the model drafter's context ([`DrafterContext`]),
//! every sequence's acceptance memory, the drafting gate's counters ([`super::gate`]), the
//! live acceptance statistics and the online recalibration (the per-sequence memory in
//! [`super::memory`]). The step loop calls four
//! methods on it:
//!
//! - [`Speculator::propose`]: the gate decides who drafts (draft time priced from the cost
//!   table) and the proposer runs for them only;
//! - [`Speculator::plan`]: the policy's verify lengths for the drafted blocks;
//! - [`Speculator::commit`]: a sequence's forward outcome (its hidden states, how many fed
//!   positions stay valid, the verify verdict);
//! - [`Speculator::release`]: a sequence left (finished, cancelled, preempted).
//!
//! A step in which the plan drafts nothing runs no drafter code at all (counted by
//! [`Speculator::drafter_calls`]): committed hidden-state rows wait in the context and are
//! written into the drafter cache by the next drafting call, whose measured time includes
//! them.

use super::clock::{priced_sps, DraftClock, StepClock};
use super::context::DrafterContext;
pub use super::context::{Drafter, DETACH_ROWS};
pub use super::gate::DRAFT_PROBE;
use super::gate::{decide, GateInput, Verdict};
use super::lookup::LookupAssist;
use super::memory::{predicted_rates, SeqState, Shadow};
use super::ngram::NgramProposer;
use super::proposer::{DraftInput, ModelProposer, Proposer};
pub use super::proposer::{FEED_BACKLOG_ROWS, FEED_ROWS_PER_CALL};
use super::recalibrate::OnlineCalibration;
use super::scheduler::predicted_survival;
use super::{is_greedy, AcceptanceStats, Proposal, Speculation, VerifyPolicy};
use crate::cost::ActiveTable;
use crate::metrics::{Metrics, ModePositionLabel, PositionLabel, StepKindLabel};
use crate::model::Model;
use crate::sampling::SamplingParams;
use anyhow::Result;
use candle_core::Tensor;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

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
    /// Who drafts: the n-gram lookup or the model drafter (`None`: plain decoding).
    proposer: Option<Box<dyn Proposer>>,
    /// The model drafter and every sequence's context in it.
    context: Option<DrafterContext>,
    /// Prompt lookup beside the model drafter (`--prompt-lookup`).
    lookup: Option<LookupAssist>,
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
    /// `online_calibration`: SGD step of the recalibration (0: off), model drafters only;
    /// `prompt_lookup`: lookup blocks beside a model drafter ([`super::lookup`]).
    pub fn new(
        kind: Speculation,
        policy: VerifyPolicy,
        online_calibration: f32,
        prompt_lookup: bool,
        drafter: Option<Drafter>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let recal = drafter
            .as_ref()
            .filter(|_| online_calibration > 0.0)
            .map(|d| OnlineCalibration::new(d.model.config().block_size, online_calibration));
        metrics.verify_cost_factor.set(1.0);
        let proposer: Option<Box<dyn Proposer>> = match kind {
            Speculation::None => None,
            Speculation::Ngram => Some(Box::new(NgramProposer)),
            Speculation::Parallel | Speculation::DSparkMarkov | Speculation::DSparkRnn => {
                Some(Box::new(ModelProposer))
            }
        };
        let lookup = (prompt_lookup && drafter.is_some()).then(LookupAssist::default);
        Self {
            kind,
            policy,
            proposer,
            context: drafter.map(DrafterContext::new),
            lookup,
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
            for st in self.seqs.values_mut() {
                st.shadow = None;
            }
            if let Some(c) = self.context.as_mut() {
                c.detach_all();
            }
        }
        self.skips_in_row = 0;
    }

    fn block(&self) -> usize {
        self.context
            .as_ref()
            .map_or(self.policy.gamma(), DrafterContext::block_size)
    }

    /// Target layers whose hidden states the drafter reads (empty: none needed).
    pub fn hidden_layers(&self) -> Vec<usize> {
        if self.off {
            return Vec::new();
        }
        self.context
            .as_ref()
            .map(|c| c.drafter.model.target_layers().to_vec())
            .unwrap_or_default()
    }

    /// Calls into drafter code so far (context feeds and drafts), as the drafter counts them.
    pub fn drafter_calls(&self) -> u64 {
        self.context.as_ref().map_or(0, |c| c.drafter.model.calls())
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

    /// The model drafter's context (tests: what it holds).
    pub fn context(&self) -> Option<&DrafterContext> {
        self.context.as_ref()
    }

    /// Draft blocks for this step's decoding sequences (`None`: it decodes plainly). Model
    /// drafters run once, batched, for the sequences the gate picks; the n-gram drafter
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
        match self.kind {
            Speculation::None => Ok((0..cands.len()).map(|_| None).collect()),
            Speculation::Ngram => {
                let gamma: Vec<usize> = cands
                    .iter()
                    .map(|c| self.policy.gamma().min(c.cap))
                    .collect();
                let Some(p) = self.proposer.as_mut() else {
                    return Ok((0..cands.len()).map(|_| None).collect());
                };
                let acceptance = &self.acceptance;
                let input = DraftInput {
                    target,
                    context: None,
                    rate: &|k: usize| acceptance.rate(k),
                    min_survival: 0.0,
                    calibration: None,
                    probe: false,
                };
                Ok(p.propose(cands, &gamma, input)?.blocks)
            }
            Speculation::Parallel | Speculation::DSparkMarkov | Speculation::DSparkRnn => {
                let res = self.propose_with_model(cands, target, shape, table);
                self.publish_calls();
                res
            }
        }
    }

    /// Predicted conditional acceptance of sequence `id`'s positions
    /// ([`predicted_rates`]: its own outcomes, the global rates as prior).
    fn predicted_rates(&self, id: u64, gamma: usize) -> Vec<f32> {
        let own = self.seqs.get(&id).map(|s| &s.own);
        predicted_rates(&self.acceptance, own, gamma)
    }

    /// Prompt lookup where it is worth more than the model drafter ([`super::lookup`]),
    /// then the gate and the model proposer for the other sequences.
    fn propose_with_model(
        &mut self,
        cands: &mut [Candidate<'_>],
        target: &Model,
        shape: StepShape,
        table: &ActiveTable,
    ) -> Result<Vec<Option<Proposal>>> {
        let lookups = self.choose_lookups(cands, shape, table);
        let mut blocks = self.propose_model(cands, target, shape, table, &lookups)?;
        for (b, l) in blocks.iter_mut().zip(lookups) {
            if l.is_some() {
                *b = l;
            }
        }
        Ok(blocks)
    }

    /// The model drafter's cap for a sequence: 0 when its context is detached.
    fn model_cap(&self, c: &Candidate<'_>) -> usize {
        match &self.context {
            Some(ctx) if !ctx.detached(c.id) => {
                self.policy.gamma().min(ctx.block_size()).min(c.cap)
            }
            _ => 0,
        }
    }

    /// Per candidate, its lookup block when lookup is on, finds a continuation and promises
    /// more tokens per second than the model drafter (it then does not draft with the model
    /// this step). Constrained outputs keep the model drafter (it proposes only what the
    /// grammar allows). Every candidate's choice is noted for [`Speculator::commit`].
    fn choose_lookups(
        &mut self,
        cands: &[Candidate<'_>],
        shape: StepShape,
        table: &ActiveTable,
    ) -> Vec<Option<Proposal>> {
        let mut out: Vec<Option<Proposal>> = (0..cands.len()).map(|_| None).collect();
        let Some(assist) = self.lookup.as_ref() else {
            return out;
        };
        let sps = self.priced(table, shape);
        let clock = &self.clock;
        let t_draft = |l: usize| clock.predict(table, 1, l);
        let mut chosen = Vec::new();
        for (i, c) in cands.iter().enumerate() {
            if c.constraint.is_some() {
                continue;
            }
            let Some(b) = assist.find(c.tokens, self.policy.gamma().min(c.cap)) else {
                continue;
            };
            let rates = assist.rates(b.bucket, b.tokens.len());
            let cap = self.model_cap(c);
            let model = predicted_survival(&self.predicted_rates(c.id, cap), cap);
            if LookupAssist::prefer(&rates, &model, shape.base_b, &sps, &t_draft) {
                chosen.push((c.id, b.bucket));
                out[i] = Some(assist.proposal(b));
            }
        }
        let block = self.block();
        for st in self.seqs.values_mut() {
            st.lookup = None;
        }
        for (id, bucket) in chosen {
            let st = self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
            st.lookup = Some(bucket);
        }
        out
    }

    /// The gate, then the model proposer for the sequences it picked (none of those that
    /// verify a lookup block this step).
    fn propose_model(
        &mut self,
        cands: &mut [Candidate<'_>],
        target: &Model,
        shape: StepShape,
        table: &ActiveTable,
        lookups: &[Option<Proposal>],
    ) -> Result<Vec<Option<Proposal>>> {
        let n = cands.len();
        let none = || -> Vec<Option<Proposal>> { (0..n).map(|_| None).collect() };
        let Some(ctx) = self.context.as_ref() else {
            return Ok(none());
        };
        // Who may draft and how long.
        let caps: Vec<usize> = cands
            .iter()
            .zip(lookups)
            .map(|(c, l)| if l.is_some() { 0 } else { self.model_cap(c) })
            .collect();
        if caps.iter().all(|&c| c == 0) {
            return Ok(none());
        }
        let mut gamma: Vec<usize> = caps.clone();
        let mut min_survival = 0.0f32;
        if matches!(self.policy, VerifyPolicy::Dspark { .. }) {
            let predicted: Vec<Vec<f64>> = cands
                .iter()
                .zip(&caps)
                .map(|(c, &cap)| predicted_survival(&self.predicted_rates(c.id, cap), cap))
                .collect();
            let probe_key: Vec<(usize, u64, u64)> = cands
                .iter()
                .map(|c| {
                    let last = self.seqs.get(&c.id).map_or(0, |s| s.last_drafted);
                    (ctx.backlog(c.id), last, c.id)
                })
                .collect();
            let clock = self.clock.clone();
            let sps = self.priced(table, shape);
            let d = decide(&GateInput {
                caps: &caps,
                predicted: &predicted,
                base_b: shape.base_b,
                max_b: shape.max_b,
                sps: &sps,
                t_draft: &|n: usize, l: usize| clock.predict(table, n, l),
                skips_in_row: self.skips_in_row,
                probe_key: &probe_key,
            });
            if d.verdict != Verdict::Draft {
                self.skips_in_row += 1;
                self.metrics.draft_skips.inc();
            }
            match d.verdict {
                Verdict::Skip | Verdict::SkipNoCandidate => return Ok(none()),
                Verdict::SkipUnpaidProbe => {
                    self.metrics.draft_skipped_probes.inc();
                    return Ok(none());
                }
                Verdict::Probe => self.last.probe = true,
                Verdict::Draft => {}
            }
            self.skips_in_row = 0;
            gamma = d.gamma;
            min_survival = d.min_survival;
        }
        let Some(p) = self.proposer.as_mut() else {
            return Ok(none());
        };
        let t0 = Instant::now();
        let acceptance = &self.acceptance;
        let input = DraftInput {
            target,
            context: self.context.as_mut(),
            rate: &|k: usize| acceptance.rate(k),
            min_survival,
            calibration: self.recal.as_ref(),
            probe: self.last.probe,
        };
        let run = p.propose(cands, &gamma, input)?;
        if run.called {
            self.metrics.draft_steps.inc();
        }
        if run.ran.is_empty() {
            return Ok(run.blocks);
        }
        let secs = t0.elapsed().as_secs_f64();
        let l_run = run.ran.iter().map(|&i| gamma[i]).max().unwrap_or(0);
        self.clock.record(table, run.ran.len(), l_run, secs);
        self.last.drafted = run.ran.len();
        let block = self.block();
        for &i in &run.ran {
            let st = self
                .seqs
                .entry(cands[i].id)
                .or_insert_with(|| SeqState::new(block));
            st.last_drafted = self.steps;
        }
        Ok(run.blocks)
    }

    /// Turns prefix caching on in the drafter's context cache (keyed by the target's keys).
    pub fn enable_prefix_cache(&mut self) {
        if let Some(c) = self.context.as_mut() {
            c.enable_prefix_cache();
        }
    }

    /// How many of the leading target prefix-cache `keys` a new sequence may start on: all of
    /// them without a model drafter, else as many as the drafter's context cache holds too
    /// (the target computes the rest, so the drafter's context is the same as without a hit).
    pub fn shared_prefix(&self, keys: &[u64]) -> usize {
        match &self.context {
            Some(c) if self.kind.uses_model_drafter() => c.shared_prefix(keys),
            _ => keys.len(),
        }
    }

    /// A sequence starts on the first `keys.len()` cached blocks: its drafter context
    /// shares the drafter blocks registered under the same keys.
    pub fn attach_prefix(&mut self, id: u64, keys: &[u64]) {
        match self.context.as_mut() {
            Some(c) if self.kind.uses_model_drafter() => c.attach_prefix(id, keys),
            _ => {}
        }
    }

    /// The target registered more of sequence `id`'s blocks under `keys`.
    pub fn note_prefix_keys(&mut self, id: u64, keys: &[u64]) {
        match self.context.as_mut() {
            Some(c) if self.kind.uses_model_drafter() => c.note_prefix_keys(id, keys),
            _ => {}
        }
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
            let st = self.seqs.get_mut(&id);
            let bucket = st.as_ref().and_then(|st| st.lookup);
            if l > 0 {
                *p = Some(prop.truncated(l));
            } else if self.kind == Speculation::Ngram || bucket.is_some() {
                let st = match st {
                    Some(st) => st,
                    None => self.seqs.entry(id).or_insert_with(|| SeqState::new(block)),
                };
                st.lookup = None;
                if st.shadow.is_none() {
                    st.shadow = Some(Shadow {
                        start: n_tokens,
                        tokens: prop.tokens,
                        bucket,
                    });
                }
            }
        }
        proposals
    }

    /// One sequence's share of the forward: rows `first_row..first_row + valid` of `hidden`
    /// are its positions that stay in the target cache (now `cached` positions), and, when it
    /// verified a block, the verdict. An error is this sequence's own (its drafter context
    /// could not follow): the caller fails it alone.
    pub fn commit(
        &mut self,
        id: u64,
        hidden: &[Tensor],
        first_row: usize,
        valid: usize,
        cached: usize,
        verified: Option<Verified<'_>>,
    ) -> Result<()> {
        if let Some(c) = self.context.as_mut() {
            let block = c.block_size();
            self.seqs.entry(id).or_insert_with(|| SeqState::new(block));
            c.commit(id, hidden, first_row, valid, cached)?;
        }
        let lookup = self.seqs.get_mut(&id).and_then(|st| st.lookup.take());
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
            if let Some(bucket) = lookup {
                // A lookup block: its own rates learn, not the model drafter's.
                self.metrics.lookup_drafts.inc();
                self.metrics.lookup_accepted_tokens.inc_by(accepted as u64);
                if let Some(a) = self.lookup.as_mut() {
                    a.record(bucket, drafted, accepted);
                }
                return Ok(());
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
        let Some(sh) = &st.shadow else {
            return;
        };
        let Some((verified, accepted)) = sh.score(tokens) else {
            return;
        };
        let bucket = sh.bucket;
        st.shadow = None;
        match (bucket, self.lookup.as_mut()) {
            (Some(b), Some(a)) => a.record(b, verified, accepted),
            _ => self.record_acceptance(None, verified, accepted),
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
        self.seqs.remove(&id);
        if let Some(c) = self.context.as_mut() {
            c.release(id);
        }
    }
}
