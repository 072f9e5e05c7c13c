//! The sequences of one batched forward and their device-side gather plans: sequences
//! grouped by similar lengths and padded, so the generic path costs a fixed number of kernel
//! launches per group.

use super::{AttnSeq, PagedAttention};
use candle_core::{Result, Tensor};

/// The sequences of one batched forward, shared by all its layers' attention calls, with the
/// device-side gather plans of [`PagedAttention::forward_generic`] built on first use.
#[derive(Debug)]
pub struct AttnBatch {
    seqs: Vec<AttnSeq>,
    /// Padded query rows x keys one group may hold (its scores are that times the heads).
    cells: usize,
    plans: std::sync::Mutex<Vec<(PlanKey, std::sync::Arc<Plan>)>>,
}

impl AttnBatch {
    pub fn new(seqs: Vec<AttnSeq>) -> Self {
        Self::with_group_cells(seqs, 1 << 21)
    }

    pub fn with_group_cells(seqs: Vec<AttnSeq>, cells: usize) -> Self {
        Self {
            seqs,
            cells,
            plans: Default::default(),
        }
    }

    /// The plan for `op`'s block size and mask, built once per (block size, window, causal).
    pub(super) fn plan(
        &self,
        op: &PagedAttention,
        dev: &candle_core::Device,
    ) -> Result<std::sync::Arc<Plan>> {
        let key = (op.block_size, op.window, op.causal);
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = plans.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let p = std::sync::Arc::new(Plan::new(op, dev, self.cells)?);
        plans.push((key, p.clone()));
        Ok(p)
    }
}

impl std::ops::Deref for AttnBatch {
    type Target = [AttnSeq];
    fn deref(&self) -> &[AttnSeq] {
        &self.seqs
    }
}

type PlanKey = (usize, Option<usize>, bool);

/// Sequences padded to a common query and key length, attended in one batched product.
#[derive(Debug)]
pub(super) struct Group {
    pub(super) n: usize,
    pub(super) qmax: usize,
    pub(super) lmax: usize,
    /// `[n * qmax]` query rows of the flat batch (padding repeats a real row).
    pub(super) rows: Tensor,
    /// `[n * lmax]` cache slots (padding repeats the sequence's first slot).
    pub(super) slots: Tensor,
    /// `[n, 1, 1, qmax, lmax]`: 0 where visible, -inf elsewhere (padding rows see key 0).
    pub(super) mask: Tensor,
}

#[derive(Debug)]
pub(super) struct Plan {
    pub(super) groups: Vec<Group>,
    /// `[T]`: each query row's row in the groups' concatenated outputs.
    pub(super) unpad: Tensor,
}

impl Plan {
    /// Sequences sorted by (query rows, keys) and cut into groups whose padded cells stay
    /// within `cells` (a sequence larger than that is a group alone).
    fn new(op: &PagedAttention, dev: &candle_core::Device, cells: usize) -> Result<Self> {
        let seqs = &op.seqs;
        let mut order: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].q_len > 0).collect();
        order.sort_by_key(|&i| (seqs[i].q_len, seqs[i].kv_len));
        let t: usize = seqs.iter().map(|s| s.q_len).sum();
        let mut unpad = vec![0u32; t];
        let mut groups = Vec::new();
        let (mut at, mut base) = (0, 0);
        while at < order.len() {
            // Members in sort order, so the last one has the most query rows; one bucket of
            // query lengths per group (decode and verify rows together, prefill chunks apart).
            let bucket = |q: usize| q.max(16).next_power_of_two();
            let first = &seqs[order[at]];
            let (mut end, mut lmax) = (at + 1, first.kv_len.max(1));
            while end < order.len() {
                let s = &seqs[order[end]];
                let l = lmax.max(s.kv_len);
                if bucket(s.q_len) != bucket(first.q_len) || (end + 1 - at) * s.q_len * l > cells {
                    break;
                }
                (end, lmax) = (end + 1, l);
            }
            let members = &order[at..end];
            let (n, qmax) = (
                members.len(),
                seqs[*members.last().expect("a group has a member")].q_len,
            );
            let mut rows = Vec::with_capacity(n * qmax);
            let mut slots = Vec::with_capacity(n * lmax);
            let mut mask = vec![f32::NEG_INFINITY; n * qmax * lmax];
            for (j, &si) in members.iter().enumerate() {
                let s = &seqs[si];
                for r in 0..qmax {
                    let real = r < s.q_len;
                    rows.push((s.q_start + if real { r } else { 0 }) as u32);
                    let m = &mut mask[(j * qmax + r) * lmax..(j * qmax + r + 1) * lmax];
                    if real {
                        unpad[s.q_start + r] = (base + j * qmax + r) as u32;
                        let (lo, hi) = op.visible(s, r);
                        m[lo..hi].fill(0.0);
                    } else {
                        m[0] = 0.0;
                    }
                }
                let first = s
                    .block_table
                    .first()
                    .map_or(0, |&b| b as usize * op.block_size);
                op.for_slots(s, 0, s.kv_len, |_, slot| slots.push(slot as u32));
                slots.extend(std::iter::repeat_n(first as u32, lmax - s.kv_len));
            }
            groups.push(Group {
                n,
                qmax,
                lmax,
                rows: Tensor::new(rows.as_slice(), dev)?,
                slots: Tensor::new(slots.as_slice(), dev)?,
                mask: Tensor::from_vec(mask, (n, 1, 1, qmax, lmax), dev)?,
            });
            base += n * qmax;
            at = end;
        }
        Ok(Self {
            groups,
            unpad: Tensor::new(unpad.as_slice(), dev)?,
        })
    }
}
