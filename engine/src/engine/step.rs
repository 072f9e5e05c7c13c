//! One engine step: take in new requests, admit, plan, draft, run ONE batched target
//! forward, then verify and commit each sequence's share of it and stream the output.

use super::config::FaultSite;
use super::grammar_thread::{forward_beside_grammar, GrammarJob};
use super::output;
use super::planner::{self, Demand, Entry, Load, Packed};
use super::request::{Event, FinishReason, Usage};
use super::seq::Seq;
use super::Engine;
use crate::model::SeqBatch;
use crate::speculative::acceptance::{judge, GrammarWork, Judging};
use crate::speculative::speculator::{Candidate, Verified};
use crate::speculative::{Proposal, Speculation};
use anyhow::Result;
use candle_core::Tensor;
use dspark_telemetry::TRACE_TARGET;
use std::time::{Duration, Instant};

impl Engine {
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
        let finished = self.commit(&plan, &batch, &mut out);
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
                    if let Some(x) = &mut self.experiment {
                        x.finished(s.id);
                    }
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
    pub(super) fn intake(&mut self) {
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
        // Structured outputs' grammar masks are computed beside the forward.
        let jobs: Vec<GrammarJob> = {
            let mut by_index: Vec<Option<&mut Seq>> = self.running.iter_mut().map(Some).collect();
            (0..plan.len())
                .filter(|&k| batch[k].num_logits > 0)
                .filter_map(|k| {
                    let s = by_index[plan[k].entry.seq].take().expect("distinct");
                    s.constraint.as_mut().map(|constraint| GrammarJob {
                        k,
                        constraint,
                        proposal: plan[k].proposal.as_ref(),
                    })
                })
                .collect()
        };
        let (out, grammar) = forward_beside_grammar(
            &self.model,
            &batch,
            &mut self.kv,
            &hidden_layers,
            jobs,
            plan.len(),
        );
        let out = out?;
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
    ) -> Vec<(usize, Ending)> {
        let speculating = self.spec.kind() != Speculation::None;
        let faults = self.cfg.faults.clone();
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
            // A failure from here on (its drafter context, grammar, sampling) is this
            // sequence's own: it ends with an error, its blocks are freed when it leaves,
            // and the others go on.
            let (id, generated) = (s.id, s.generated());
            if sb.num_logits == 0 {
                s.cached += sb.tokens.len();
                let cached = s.cached;
                let r = faults
                    .check(FaultSite::Drafter, id, generated)
                    .and_then(|_| {
                        self.spec
                            .commit(id, &out.hidden, first_row, sb.tokens.len(), cached, None)
                    });
                if let Err(e) = r {
                    finished.push(failed(id, i, e));
                    continue;
                }
                self.register_blocks(i);
                continue;
            }
            let rows = &out.logits[row..row + sb.num_logits];
            row += sb.num_logits;
            let mut work = out.grammar.get_mut(k).and_then(Option::take);
            if s.constraint.is_some() {
                if let Err(e) = faults.check(FaultSite::Grammar, id, generated) {
                    work = Some(Err(e));
                }
            }
            let judged = faults
                .check(FaultSite::Sampling, id, generated)
                .and_then(|_| {
                    let judging = Judging {
                        params: &s.req.params,
                        history: &s.history,
                        rng: &mut s.rng,
                        grammar: s.constraint.as_mut(),
                    };
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        judge(judging, pl.proposal.as_ref(), rows, work)
                    }))
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("sampling panicked")))
                });
            let (commit, accepted) = match judged {
                Ok(j) => j,
                Err(e) => {
                    finished.push(failed(id, i, e));
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
            let cached = s.cached;
            let r = faults
                .check(FaultSite::Drafter, id, generated)
                .and_then(|_| {
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
                    )
                });
            if let Err(e) = r {
                finished.push(failed(id, i, e));
                continue;
            }
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
        finished
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

/// Sequence `id` (at `running[i]`) failed on its own: it ends with `e`.
fn failed(id: u64, i: usize, e: anyhow::Error) -> (usize, Ending) {
    tracing::warn!("request {id} failed: {e:#}");
    (i, Ending::Failed(format!("{e:#}")))
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
