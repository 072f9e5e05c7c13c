//! Structured outputs' grammar masks, computed on a thread of their own while the target
//! forward runs: they depend only on each constrained sequence's grammar state and draft,
//! not on the logits, so they stay off the step's critical path. A failure (or a panic) in
//! one sequence's grammar is that sequence's own: it comes back as its error.

use crate::constraint::Constraint;
use crate::kv::KvCache;
use crate::model::{ForwardOutput, Model, SeqBatch};
use crate::speculative::acceptance::{grammar_work, GrammarWork};
use crate::speculative::Proposal;
use anyhow::{anyhow, Result};

/// One constrained sequence's share: its plan index, grammar and draft block.
pub(super) struct GrammarJob<'a> {
    pub k: usize,
    pub constraint: &'a mut Constraint,
    pub proposal: Option<&'a Proposal>,
}

/// Runs `model.forward` over `batch` and, beside it, the grammar work of `jobs`: returns the
/// forward's result and, per plan entry (`entries` of them), the grammar work of each job.
pub(super) fn forward_beside_grammar(
    model: &Model,
    batch: &[SeqBatch],
    kv: &mut KvCache,
    hidden_layers: &[usize],
    jobs: Vec<GrammarJob<'_>>,
    entries: usize,
) -> (Result<ForwardOutput>, Vec<Option<Result<GrammarWork>>>) {
    let mut grammar: Vec<Option<Result<GrammarWork>>> = (0..entries).map(|_| None).collect();
    if jobs.is_empty() {
        return (model.forward(batch, kv, hidden_layers), grammar);
    }
    let (out, done) = std::thread::scope(|sc| {
        let masks = sc.spawn(move || {
            jobs.into_iter()
                .map(|j| {
                    let (c, p) = (j.constraint, j.proposal);
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        grammar_work(c, p)
                    }))
                    .unwrap_or_else(|_| Err(anyhow!("the grammar code panicked")));
                    (j.k, r)
                })
                .collect::<Vec<_>>()
        });
        let out = model.forward(batch, kv, hidden_layers);
        (out, masks.join())
    });
    match done {
        Ok(done) => {
            for (k, r) in done {
                grammar[k] = Some(r);
            }
        }
        // Not reached (each job catches its own panic); should it be, every constrained
        // sequence of the step fails on its own, the rest go on.
        Err(_) => {
            for g in grammar.iter_mut() {
                *g = Some(Err(anyhow!("the grammar thread panicked")));
            }
        }
    }
    (out, grammar)
}
