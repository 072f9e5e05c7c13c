//! Who proposes draft blocks, by role (as mistral.rs and vLLM split it): a [`Proposer`]
//! turns the draft lengths the gate chose into blocks. [`super::ngram::NgramProposer`]
//! looks the continuation up in the sequence itself; [`ModelProposer`] runs a model drafter
//! (DSpark, or the DFlash-style parallel baseline) on its [`DrafterContext`], batched over
//! the sequences that draft. Verification never depends on how a draft was made.

use super::context::DrafterContext;
use super::dspark::{DraftRequest, ProposeOptions};
use super::recalibrate::OnlineCalibration;
use super::speculator::Candidate;
use super::Proposal;
use crate::model::Model;
use anyhow::Result;

/// A held backlog this long (rows) is written into the drafter cache by the next drafting
/// call the plan chose (not a probe) even when its sequence does not draft then
/// (piggybacked, at most [`FEED_ROWS_PER_CALL`] such rows per call).
pub const FEED_BACKLOG_ROWS: usize = 2 * super::gate::DRAFT_PROBE;
/// Most piggybacked backlog rows per drafting call, so no single step pays a large feed.
pub const FEED_ROWS_PER_CALL: usize = 256;

/// What a proposer may read besides the candidates.
pub struct DraftInput<'a> {
    /// The target (model drafters read its embeddings and LM head).
    pub target: &'a Model,
    /// The model drafter's context, when there is one.
    pub context: Option<&'a mut DrafterContext>,
    /// Live conditional acceptance rate of block position k (the confidences of a
    /// proposer without a confidence head).
    pub rate: &'a dyn Fn(usize) -> f32,
    /// The gate's early stop.
    pub min_survival: f32,
    /// Online recalibration of a confidence head.
    pub calibration: Option<&'a OnlineCalibration>,
    /// The step drafts as a probe (no backlog rides along).
    pub probe: bool,
}

/// What one proposing call did.
pub struct DraftRun {
    /// Per candidate, its block (`None`: it decodes plainly).
    pub blocks: Vec<Option<Proposal>>,
    /// Candidates the drafter ran for (timed and counted as drafting).
    pub ran: Vec<usize>,
    /// Drafter code ran (a context feed at least).
    pub called: bool,
}

impl DraftRun {
    /// Nobody drafted, no drafter code ran.
    pub fn none(n: usize) -> Self {
        Self {
            blocks: (0..n).map(|_| None).collect(),
            ran: Vec::new(),
            called: false,
        }
    }
}

/// A source of draft blocks.
pub trait Proposer: Send {
    /// Blocks of at most `gamma[i]` tokens for `cands[i]` (0: none).
    fn propose(
        &mut self,
        cands: &mut [Candidate<'_>],
        gamma: &[usize],
        input: DraftInput<'_>,
    ) -> Result<DraftRun>;
}

/// A model drafter (DSpark Markov / RNN, or the parallel baseline) on its context cache.
pub struct ModelProposer;

impl Proposer for ModelProposer {
    fn propose(
        &mut self,
        cands: &mut [Candidate<'_>],
        gamma: &[usize],
        input: DraftInput<'_>,
    ) -> Result<DraftRun> {
        let mut run = DraftRun::none(cands.len());
        let Some(ctx) = input.context else {
            return Ok(run);
        };
        let mut gamma = gamma.to_vec();
        // Blocks must cover the draft positions; a sequence the drafter cache cannot hold
        // decodes without drafting this step.
        for (i, c) in cands.iter().enumerate() {
            if gamma[i] == 0 {
                continue;
            }
            let rows = ctx.drafter.model.config().block_rows(gamma[i]);
            let upto = c.cached + rows;
            if upto > input.target.max_context() || !ctx.reserve(c.id, upto) {
                gamma[i] = 0;
            }
        }
        let who: Vec<usize> = (0..cands.len()).filter(|&i| gamma[i] > 0).collect();
        if who.is_empty() {
            return Ok(run);
        }
        // The drafter's context must reach each anchor: feed the held rows of the drafting
        // sequences, and (when the plan itself chose to draft, not in a probe) of long
        // backlogs of the others within the per-call bound.
        let mut feed: Vec<u64> = who.iter().map(|&i| cands[i].id).collect();
        let mut extra = if input.probe { FEED_ROWS_PER_CALL } else { 0 };
        for (rows, id) in ctx.backlogs(FEED_BACKLOG_ROWS, &feed) {
            if extra + rows > FEED_ROWS_PER_CALL {
                continue;
            }
            extra += rows;
            feed.push(id);
        }
        run.called = true;
        ctx.feed(&feed)?;
        // A context-input drafter also needs the feature of the position before the anchor:
        // a sequence that started on cached blocks right up to its anchor (prompt length one
        // past a block boundary) has none until it decodes one token plainly.
        let who: Vec<usize> = who
            .into_iter()
            .filter(|&i| ctx.ready(cands[i].id, cands[i].cached))
            .collect();
        if who.is_empty() {
            return Ok(run);
        }
        let (d, tables) = ctx.split();
        let mut reqs: Vec<DraftRequest> = Vec::with_capacity(who.len());
        let mut grammars = Vec::with_capacity(who.len());
        let picked = cands
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| who.contains(i))
            .map(|(_, c)| c);
        for (c, &i) in picked.zip(&who) {
            let (block_table, last_context) = tables.get(c.id);
            reqs.push(DraftRequest {
                anchor: *c.tokens.last().expect("decoding sequences have tokens"),
                anchor_pos: c.cached,
                block_table,
                gamma: gamma[i],
                params: c.params,
                history: Some(c.history),
                rng: &mut *c.rng,
                last_context,
            });
            grammars.push(c.constraint.as_deref_mut());
        }
        let opts = ProposeOptions {
            min_survival: input.min_survival,
            calibration: input.calibration,
        };
        let blocks =
            d.model
                .propose_under(&mut d.kv, input.target, &mut reqs, &opts, &mut grammars)?;
        for (&i, b) in who.iter().zip(blocks) {
            if !b.tokens.is_empty() {
                run.blocks[i] = Some(b);
            }
        }
        run.ran = who;
        Ok(run)
    }
}
