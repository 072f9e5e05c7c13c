//! How one CPU attention call is cut into pool tasks: chunks of a sequence's query rows,
//! fixed windows of positions, groups of kv heads.

use super::PagedAttention;

impl PagedAttention {
    /// How one call's work is cut into pool tasks (see [`Work`]).
    pub(super) fn work(&self, threads: usize) -> Work {
        let want = 2 * threads;
        let mut rc = 8;
        let (mut chunks, mut units);
        loop {
            chunks = Vec::new();
            for (si, s) in self.seqs.iter().enumerate() {
                let mut r = 0;
                while r < s.q_len {
                    let nr = rc.min(s.q_len - r);
                    let (lo, hi) = (r..r + nr).fold((usize::MAX, 0), |(lo, hi), q| {
                        let (a, b) = self.visible(s, q);
                        if a < b {
                            (lo.min(a), hi.max(b))
                        } else {
                            (lo, hi)
                        }
                    });
                    let parts = if lo < hi {
                        (lo / PART..(hi - 1) / PART + 1).len()
                    } else {
                        0
                    };
                    chunks.push(Chunk {
                        seq: si,
                        r0: r,
                        nr,
                        lo: lo.min(hi),
                        hi,
                        parts,
                        scratch: 0,
                    });
                    r += nr;
                }
            }
            units = chunks.iter().map(|c| c.parts).sum::<usize>();
            if rc == 1 || units * self.num_kv_heads >= want {
                break;
            }
            rc /= 2;
        }
        // All kv heads in one task read each cache row whole (a row holds every head);
        // the heads are split (before the rows are) only when there would be too few tasks.
        let head_groups = if units >= want { 1 } else { self.num_kv_heads };
        let (nh, hd) = (self.num_heads, self.head_dim);
        let mut scratch = 0;
        let mut tasks = Vec::new();
        for (ci, c) in chunks.iter_mut().enumerate() {
            if c.parts > 1 {
                c.scratch = scratch;
                scratch += c.parts * c.nr * nh * (hd + 2);
            }
            for p in 0..c.parts {
                for g in 0..head_groups {
                    tasks.push((ci, p, g));
                }
            }
        }
        Work {
            chunks,
            tasks,
            head_groups,
            scratch,
        }
    }
}

/// Positions per part of a context: each part is attended by its own task(s) and the parts'
/// softmaxes merge by their maxima and normalisers. Parts are fixed windows of absolute
/// positions, so a row's arithmetic never depends on the other rows of the batch (greedy
/// output stays the same whatever else is running).
pub(super) const PART: usize = 512;

/// Query rows of one sequence attended together (each key and value row is read once for all
/// of them and all query heads sharing its kv head).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Chunk {
    pub(super) seq: usize,
    pub(super) r0: usize,
    pub(super) nr: usize,
    /// Union of the rows' visible positions.
    pub(super) lo: usize,
    pub(super) hi: usize,
    /// `PART` windows `[lo, hi)` touches (0 when nothing is visible).
    pub(super) parts: usize,
    /// Start of this chunk's partial results in the scratch buffer (when `parts > 1`): per
    /// part, `nr * heads` output vectors, then their `(max, normaliser)` pairs.
    pub(super) scratch: usize,
}

/// The tasks of one call: `(chunk, part, head group)`.
pub(super) struct Work {
    pub(super) chunks: Vec<Chunk>,
    pub(super) tasks: Vec<(usize, usize, usize)>,
    /// Groups the kv heads are split into (1: every task covers all of them).
    pub(super) head_groups: usize,
    pub(super) scratch: usize,
}
