//! The batch planner: which waiting sequences join, and what each running sequence feeds
//! into this step's one target forward. Pure over plain numbers (token counts, KV blocks);
//! the step loop applies the plan.
//!
//! A step feeds decoding sequences first (their pending token plus the draft tokens the
//! speculator offers), then prefill chunks of new or preempted prompts, under the token
//! budget and the free KV blocks. A sequence that does not fit waits; when nothing fits,
//! the youngest is preempted (its blocks freed, recomputed later).

use crate::speculative::speculator::StepShape;

/// What the planner needs to know about one running sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Load {
    /// Tokens not yet in the KV cache (1 while decoding).
    pub pending: usize,
    /// Positions already in the KV cache.
    pub cached: usize,
    /// KV blocks the sequence holds.
    pub blocks: usize,
}

impl Load {
    pub fn decoding(&self) -> bool {
        self.pending == 1
    }
}

/// The step's limits.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub max_batch_tokens: usize,
    pub prefill_chunk: usize,
    pub block_size: usize,
    pub free_blocks: usize,
}

impl Limits {
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// How many of the waiting sequences (oldest first, `waiting_tokens` their token counts)
/// join the `running` ones: while there is a running slot and the prompt (plus its first
/// generated token) fits in the free blocks, keeping one growth block per running sequence.
/// A lone sequence is admitted without that reserve.
pub(super) fn admit(
    waiting_tokens: impl IntoIterator<Item = usize>,
    running: usize,
    max_running: usize,
    lim: &Limits,
) -> usize {
    let mut n = 0;
    for tokens in waiting_tokens {
        let running = running + n;
        if running >= max_running {
            break;
        }
        let need = lim.blocks_for(tokens + 1);
        let reserved = running;
        if (need + reserved > lim.free_blocks && running > 0) || need > lim.free_blocks {
            break;
        }
        n += 1;
    }
    n
}

/// The step's demand before drafting.
#[derive(Debug, Clone)]
pub(super) struct Demand {
    /// Running sequences in feeding order: the decoding ones (`order[..decoding]`) first.
    pub order: Vec<usize>,
    pub decoding: usize,
    /// Batch tokens left for draft tokens after every decoding sequence's pending token.
    pub room: usize,
    /// The forward's size without drafts, for the drafting plan.
    pub shape: StepShape,
}

impl Demand {
    /// The decoding sequences (indices into the running list).
    pub fn decoding(&self) -> &[usize] {
        &self.order[..self.decoding]
    }
}

pub(super) fn demand(loads: &[Load], lim: &Limits) -> Demand {
    let mut order: Vec<usize> = (0..loads.len()).filter(|&i| loads[i].decoding()).collect();
    let decoding = order.len();
    order.extend((0..loads.len()).filter(|&i| !loads[i].decoding()));
    let prefill: usize = order[decoding..]
        .iter()
        .map(|&i| loads[i].pending.min(lim.prefill_chunk.max(1)))
        .sum();
    // Draft tokens compete with prefill for the batch; decoding goes first.
    let room = lim.max_batch_tokens.saturating_sub(decoding);
    Demand {
        order,
        decoding,
        room,
        shape: StepShape {
            base_b: decoding + prefill.min(room),
            max_b: lim.max_batch_tokens,
        },
    }
}

/// Most draft tokens a decoding sequence may verify this step: its remaining token budget
/// (the last committed token is always the target's own), the batch room and the context.
pub(super) fn draft_cap(remaining: usize, room: usize, context_left: usize) -> usize {
    remaining.saturating_sub(1).min(room).min(context_left)
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    /// Index into the running list.
    pub seq: usize,
    /// Tokens fed: a prefill chunk, or the pending token plus `draft` draft tokens.
    pub chunk: usize,
    pub draft: usize,
    /// A decoding sequence (its verify length was planned), not a prefill chunk.
    pub decoding: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Packed {
    /// Run these entries (each one's KV blocks fit the free blocks, in order).
    Run(Vec<Entry>),
    /// Nothing fits: preempt this running sequence (the youngest that did not fit).
    Preempt(usize),
}

/// Packs the step: `drafts[i]` is the draft length the speculator offers running sequence
/// `i` (0: none). First every decoding sequence's pending token (in order; one whose new
/// block does not fit is skipped this step), then the drafts within the tokens and KV blocks
/// left (cut, never at the cost of another sequence's step: the decoding sequences that run
/// are exactly those a plain step would run), then prefill chunks.
pub(super) fn pack(loads: &[Load], demand: &Demand, drafts: &[usize], lim: &Limits) -> Packed {
    let mut budget = lim.max_batch_tokens;
    let mut free = lim.free_blocks;
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    let (decoding, prefill) = demand.order.split_at(demand.decoding);
    for &i in decoding {
        if budget == 0 {
            break;
        }
        let l = loads[i];
        let extra = lim.blocks_for(l.cached + 1).saturating_sub(l.blocks);
        if extra > free {
            skipped.push(i);
            continue;
        }
        free -= extra;
        budget -= 1;
        entries.push(Entry {
            seq: i,
            chunk: 1,
            draft: 0,
            decoding: true,
        });
    }
    for e in entries.iter_mut() {
        let l = loads[e.seq];
        let held = l.blocks.max(lim.blocks_for(l.cached + 1));
        let fits = ((held + free) * lim.block_size).saturating_sub(l.cached + 1);
        let d = drafts[e.seq].min(budget).min(fits);
        if d == 0 {
            continue;
        }
        free -= lim.blocks_for(l.cached + 1 + d).saturating_sub(held);
        budget -= d;
        e.chunk += d;
        e.draft = d;
    }
    for &i in prefill {
        if budget == 0 {
            break;
        }
        let l = loads[i];
        let chunk = l.pending.min(budget).min(lim.prefill_chunk.max(1));
        let extra = lim.blocks_for(l.cached + chunk).saturating_sub(l.blocks);
        if extra > free {
            skipped.push(i);
            continue;
        }
        free -= extra;
        budget -= chunk;
        entries.push(Entry {
            seq: i,
            chunk,
            draft: 0,
            decoding: false,
        });
    }
    match skipped.iter().max() {
        Some(&youngest) if entries.is_empty() => Packed::Preempt(youngest),
        _ => Packed::Run(entries),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lim(max_batch_tokens: usize, free_blocks: usize) -> Limits {
        Limits {
            max_batch_tokens,
            prefill_chunk: 8,
            block_size: 4,
            free_blocks,
        }
    }

    fn load(pending: usize, cached: usize) -> Load {
        Load {
            pending,
            cached,
            blocks: cached.div_ceil(4),
        }
    }

    #[test]
    fn decoding_goes_before_prefill_and_drafts_fill_the_rest() {
        let loads = [load(20, 0), load(1, 7), load(1, 3)];
        let l = lim(6, 100);
        let d = demand(&loads, &l);
        assert_eq!(d.order, vec![1, 2, 0]);
        assert_eq!(d.decoding(), &[1, 2]);
        assert_eq!(d.room, 4);
        assert_eq!(d.shape.base_b, 2 + 4);
        // Sequence 1 takes 1 + 3 draft tokens, sequence 2 its pending token and what is
        // left of its offered drafts (one), the prompt nothing.
        let p = pack(&loads, &d, &[0, 3, 3], &l);
        let Packed::Run(e) = p else { panic!("{p:?}") };
        assert_eq!(
            e,
            vec![
                Entry {
                    seq: 1,
                    chunk: 4,
                    draft: 3,
                    decoding: true
                },
                Entry {
                    seq: 2,
                    chunk: 2,
                    draft: 1,
                    decoding: true
                },
            ]
        );
    }

    #[test]
    fn nothing_fits_preempts_the_youngest() {
        // Both need a new block; none is free.
        let loads = [load(1, 8), load(1, 4)];
        let p = pack(&loads, &demand(&loads, &lim(16, 0)), &[0, 0], &lim(16, 0));
        assert_eq!(p, Packed::Preempt(1));
        // One free block: the first fits, the second waits (no preemption).
        let p = pack(&loads, &demand(&loads, &lim(16, 1)), &[0, 0], &lim(16, 1));
        assert!(
            matches!(p, Packed::Run(ref e) if e.len() == 1 && e[0].seq == 0),
            "{p:?}"
        );
    }

    #[test]
    fn drafts_are_cut_to_the_free_blocks_not_the_sequence() {
        // 7 cached + 1 pending in 2 blocks of 4: one slot left in its blocks. No free block:
        // a 3-token draft does not fit, the pending token plus one draft token does.
        let loads = [load(1, 6)];
        let l = lim(16, 0);
        let p = pack(&loads, &demand(&loads, &l), &[3], &l);
        assert_eq!(
            p,
            Packed::Run(vec![Entry {
                seq: 0,
                chunk: 2,
                draft: 1,
                decoding: true,
            }])
        );
        // Its blocks full (8 cached): the pending token alone needs a new block; none free.
        let loads = [load(1, 8), load(1, 6)];
        let p = pack(&loads, &demand(&loads, &l), &[3, 3], &l);
        let Packed::Run(e) = p else { panic!("{p:?}") };
        assert_eq!((e.len(), e[0].seq, e[0].draft), (1, 1, 1), "{e:?}");
        // One free block: the first takes it with up to 3 draft tokens (9..12).
        let l = lim(16, 1);
        let p = pack(&loads, &demand(&loads, &l), &[3, 3], &l);
        let Packed::Run(e) = p else { panic!("{p:?}") };
        assert_eq!(e.iter().map(|x| x.draft).collect::<Vec<_>>(), vec![3, 1]);
    }

    #[test]
    fn admission_keeps_a_growth_block_per_running_sequence() {
        let l = lim(64, 4);
        // 7 tokens + 1 -> 2 blocks each; admission allocates nothing, it only checks that
        // the prompt plus one growth block per running sequence fits the free blocks.
        assert_eq!(admit([7, 7, 7, 7], 0, 8, &l), 3);
        assert_eq!(admit([7, 7, 7], 0, 2, &l), 2);
        // 15 + 1 tokens need the whole cache: alone it joins, next to another it waits.
        assert_eq!(admit([15], 0, 8, &l), 1);
        assert_eq!(admit([15], 1, 8, &l), 0);
        // A prompt larger than the whole cache never joins.
        assert_eq!(admit([40], 0, 8, &l), 0);
    }

    proptest! {
        /// Whatever the loads, a packed step stays within the token budget and the free
        /// blocks, feeds decoding sequences before prefill, never cuts a decoding
        /// sequence's pending token and never offers more drafts than were asked for.
        #[test]
        fn packing_respects_budget_blocks_and_order(
            seqs in proptest::collection::vec((1usize..40, 0usize..60, 0usize..8), 1..12),
            max_b in 1usize..64,
            free in 0usize..24,
        ) {
            let loads: Vec<Load> = seqs.iter().map(|&(p, c, _)| load(p, c)).collect();
            let drafts: Vec<usize> = seqs.iter().map(|s| s.2).collect();
            let l = lim(max_b, free);
            let d = demand(&loads, &l);
            match pack(&loads, &d, &drafts, &l) {
                Packed::Run(e) => {
                    let tokens: usize = e.iter().map(|x| x.chunk).sum();
                    prop_assert!(tokens <= max_b);
                    let blocks: usize = e.iter().map(|x| {
                        let ld = loads[x.seq];
                        (ld.cached + x.chunk).div_ceil(4).saturating_sub(ld.blocks)
                    }).sum();
                    prop_assert!(blocks <= free);
                    let first_prefill = e.iter().position(|x| !x.decoding).unwrap_or(e.len());
                    prop_assert!(e[first_prefill..].iter().all(|x| !x.decoding));
                    for x in &e {
                        prop_assert!(x.draft <= drafts[x.seq]);
                        prop_assert_eq!(x.decoding, loads[x.seq].decoding());
                        if x.decoding {
                            prop_assert_eq!(x.chunk, 1 + x.draft);
                        } else {
                            prop_assert!(x.chunk >= 1 && x.chunk <= loads[x.seq].pending);
                        }
                    }
                }
                Packed::Preempt(i) => prop_assert!(i < loads.len()),
            }
            // Drafts never cost a step: with no drafts offered, the same sequences run.
            let plain = pack(&loads, &d, &vec![0; loads.len()], &l);
            let with = pack(&loads, &d, &drafts, &l);
            if let (Packed::Run(a), Packed::Run(b)) = (&plain, &with) {
                let decoding = |e: &[Entry]| e.iter().filter(|x| x.decoding).map(|x| x.seq).collect::<Vec<_>>();
                prop_assert_eq!(decoding(a), decoding(b));
            } else {
                prop_assert_eq!(matches!(plain, Packed::Preempt(_)), matches!(with, Packed::Preempt(_)));
            }
        }
    }
}
