//! Attention over the paged KV cache for many sequences of different lengths in one call.
//!
//! On CPU a custom kernel reads keys and values straight from the cache slots (no gather
//! copies); on other devices the same semantics are built from tensor ops. Tests check the two
//! against each other.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// One sequence's part of a batched attention call.
#[derive(Debug, Clone)]
pub struct AttnSeq {
    /// First row of this sequence's queries in the flat batch.
    pub q_start: usize,
    pub q_len: usize,
    /// Absolute position of the first query.
    pub q_pos0: usize,
    /// Number of cached positions visible (0..kv_len), including the ones written this step.
    pub kv_len: usize,
    pub block_table: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct PagedAttention {
    pub seqs: std::sync::Arc<AttnBatch>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// Sliding window: a query at position p sees positions > p - window.
    pub window: Option<usize>,
    /// Causal: a query at position p sees positions <= p. Non-causal: all `kv_len` positions.
    pub causal: bool,
}

impl PagedAttention {
    fn visible(&self, s: &AttnSeq, qi: usize) -> (usize, usize) {
        let p = s.q_pos0 + qi;
        let hi = if self.causal {
            (p + 1).min(s.kv_len)
        } else {
            s.kv_len
        };
        let lo = match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        (lo.min(hi), hi)
    }

    /// `q`: `[T, num_heads, head_dim]`; caches: `[slots, num_kv_heads * head_dim]`.
    /// Returns `[T, num_heads * head_dim]`.
    pub fn forward(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        if q.device().is_cpu() {
            q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, self)
        } else {
            self.forward_generic(q, k_cache, v_cache)
        }
    }

    /// Device-independent path built from tensor ops (gather, batched matmul, mask, softmax):
    /// what runs on CUDA, and the CPU kernel's reference in tests. Sequences are padded into
    /// groups of similar lengths (bounded in query rows x keys), so a
    /// layer costs a fixed number of kernel launches per group, not per sequence; the gather
    /// indices and masks go to the device once per forward ([`AttnBatch`] keeps them for all
    /// layers), never once per sequence and layer.
    pub fn forward_generic(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Tensor> {
        let (t, nh, hd) = q.dims3()?;
        let plan = self.seqs.plan(self, q.device())?;
        let (nkv, group) = (self.num_kv_heads, self.num_heads / self.num_kv_heads);
        let gather = |cache: &Tensor, g: &Group| -> Result<Tensor> {
            cache
                .index_select(&g.slots, 0)?
                .to_dtype(candle_core::DType::F32)?
                .reshape((g.n, g.lmax, nkv, hd))?
                .transpose(1, 2)?
                .contiguous() // [n, nkv, L, hd]
        };
        let mut outs = Vec::with_capacity(plan.groups.len());
        for g in &plan.groups {
            let (n, qm, lm) = (g.n, g.qmax, g.lmax);
            // [n * qmax, nh, hd] -> [n, nkv, group * qmax, hd]: the query heads sharing a kv
            // head attend to its keys in one product.
            let qs = q
                .index_select(&g.rows, 0)?
                .reshape((n, qm, nkv, group, hd))?
                .permute((0, 2, 3, 1, 4))?
                .contiguous()?
                .reshape((n, nkv, group * qm, hd))?;
            let k = gather(k_cache, g)?;
            let v = gather(v_cache, g)?;
            let scores = (qs.matmul(&k.t()?)? * self.scale as f64)?
                .reshape((n, nkv, group, qm, lm))?
                .broadcast_add(&g.mask)?;
            let probs =
                candle_nn::ops::softmax_last_dim(&scores)?.reshape((n, nkv, group * qm, lm))?;
            let o = probs
                .matmul(&v)? // [n, nkv, group * qmax, hd]
                .reshape((n, nkv, group, qm, hd))?
                .permute((0, 3, 1, 2, 4))?
                .contiguous()?
                .reshape((n * qm, nh * hd))?;
            outs.push(o);
        }
        let out = Tensor::cat(&outs, 0)?.index_select(&plan.unpad, 0)?;
        debug_assert_eq!(out.dim(0)?, t);
        Ok(out)
    }
}

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
    fn plan(&self, op: &PagedAttention, dev: &candle_core::Device) -> Result<std::sync::Arc<Plan>> {
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
struct Group {
    n: usize,
    qmax: usize,
    lmax: usize,
    /// `[n * qmax]` query rows of the flat batch (padding repeats a real row).
    rows: Tensor,
    /// `[n * lmax]` cache slots (padding repeats the sequence's first slot).
    slots: Tensor,
    /// `[n, 1, 1, qmax, lmax]`: 0 where visible, -inf elsewhere (padding rows see key 0).
    mask: Tensor,
}

#[derive(Debug)]
struct Plan {
    groups: Vec<Group>,
    /// `[T]`: each query row's row in the groups' concatenated outputs.
    unpad: Tensor,
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

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    s
}

#[inline(always)]
fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = w.mul_add(*v, *o);
    }
}

impl PagedAttention {
    /// Calls `f(p, slot)` for positions `lo..hi` in order, walking the block table.
    #[inline(always)]
    fn for_slots(&self, s: &AttnSeq, lo: usize, hi: usize, mut f: impl FnMut(usize, usize)) {
        let bs = self.block_size;
        let mut p = lo;
        while p < hi {
            let base = s.block_table[p / bs] as usize * bs;
            let end = ((p / bs + 1) * bs).min(hi);
            for pp in p..end {
                f(pp, base + pp % bs);
            }
            p = end;
        }
    }

    /// How one call's work is cut into pool tasks (see [`Work`]).
    fn work(&self, threads: usize) -> Work {
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
const PART: usize = 512;

/// Query rows of one sequence attended together (each key and value row is read once for all
/// of them and all query heads sharing its kv head).
#[derive(Debug, Clone, PartialEq)]
struct Chunk {
    seq: usize,
    r0: usize,
    nr: usize,
    /// Union of the rows' visible positions.
    lo: usize,
    hi: usize,
    /// `PART` windows `[lo, hi)` touches (0 when nothing is visible).
    parts: usize,
    /// Start of this chunk's partial results in the scratch buffer (when `parts > 1`): per
    /// part, `nr * heads` output vectors, then their `(max, normaliser)` pairs.
    scratch: usize,
}

/// The tasks of one call: `(chunk, part, head group)`.
struct Work {
    chunks: Vec<Chunk>,
    tasks: Vec<(usize, usize, usize)>,
    /// Groups the kv heads are split into (1: every task covers all of them).
    head_groups: usize,
    scratch: usize,
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    /// One task per (chunk of a sequence's query rows, window of positions, kv heads): each
    /// cached key and value row is read once for all the chunk's rows and query heads (a
    /// verify block's queries share their context). Chunks shrink, and a long context is
    /// cut into windows, until there are enough tasks for the pool; windows merge after.
    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((q0, _)), Some((k0, _)), Some((v0, _))) = (
            ql.contiguous_offsets(),
            kl.contiguous_offsets(),
            vl.contiguous_offsets(),
        ) else {
            candle_core::bail!("paged attention expects contiguous tensors");
        };
        let CpuStorage::F32(q) = qs else {
            candle_core::bail!("paged attention expects f32 queries");
        };
        let (kc, vc) = match (ks, vs) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => {
                (CacheRows::F32(&k[k0..]), CacheRows::F32(&v[v0..]))
            }
            (CpuStorage::F16(k), CpuStorage::F16(v)) => {
                (CacheRows::F16(&k[k0..]), CacheRows::F16(&v[v0..]))
            }
            _ => candle_core::bail!("paged attention expects f32 or f16 key/value caches"),
        };
        let q = &q[q0..];
        let (t, nh, hd) = ql.shape().dims3()?;
        let nkv = self.num_kv_heads;
        let group = nh / nkv;
        let mut out = vec![0f32; t * nh * hd];
        let work = self.work(crate::kernels::pool::global().size());
        let mut scratch = vec![0f32; work.scratch];
        let optr = crate::kernels::pool::SharedMut::new(&mut out);
        let sptr = crate::kernels::pool::SharedMut::new(&mut scratch);
        // Kv heads `kv0..kv1` of a chunk's rows in one window of positions: every key and
        // value row is read once, whole (all those heads side by side), for all of them.
        let attend = |c: &Chunk, part: usize, kv0: usize, kv1: usize| {
            let s = &self.seqs[c.seq];
            let (r0, nr) = (c.r0, c.nr);
            let w0 = (c.lo / PART + part) * PART;
            let (lo, hi) = (c.lo.max(w0), c.hi.min(w0 + PART));
            if lo >= hi {
                return;
            }
            let len = hi - lo;
            let (h0, heads) = (kv0 * group, (kv1 - kv0) * group);
            // Each row's visible positions inside this window (empty ones give no weight).
            let ranges: Vec<(usize, usize)> = (r0..r0 + nr)
                .map(|r| {
                    let (a, b) = self.visible(s, r);
                    (a.max(lo), b.min(hi))
                })
                .collect();
            // Query vectors, row-major over (row, head), and where each one's kv head sits
            // in the part of a cache row this task reads.
            let qv: Vec<&[f32]> = (r0..r0 + nr)
                .flat_map(|r| {
                    let base = ((s.q_start + r) * nh + h0) * hd;
                    (0..heads).map(move |g| &q[base + g * hd..base + (g + 1) * hd])
                })
                .collect();
            let hoff: Vec<usize> = (0..qv.len()).map(|j| (j % heads) / group * hd).collect();
            // Offsets of heads kv0.. in the key/value rows of positions lo..hi.
            let mut offs = Vec::with_capacity(len);
            self.for_slots(s, lo, hi, |_, slot| offs.push(slot * nkv * hd + kv0 * hd));
            let width = (kv1 - kv0) * hd;
            // scores[j * len + i]: query vector j, position lo + i.
            let mut scores = vec![0f32; qv.len() * len];
            let simd = simd::available() && hd.is_multiple_of(32);
            // The SIMD loops read f16 caches in place (widened in registers); the scalar
            // fallback reads f32 copies of the rows.
            let (mut buf, mut local) = (Vec::new(), Vec::new());
            if simd {
                // SAFETY: AVX2/FMA/F16C present; offsets plus head offsets index whole head
                // vectors of the caches.
                unsafe {
                    match kc {
                        CacheRows::F32(k) => {
                            simd::scores(&qv, &hoff, k, &offs, width, self.scale, &mut scores)
                        }
                        CacheRows::F16(k) => {
                            simd::scores(&qv, &hoff, k, &offs, width, self.scale, &mut scores)
                        }
                    }
                };
            } else {
                let (kc, koffs) = kc.rows(&offs, width, &mut buf, &mut local);
                for (i, &off) in koffs.iter().enumerate() {
                    for (j, qj) in qv.iter().enumerate() {
                        let k = &kc[off + hoff[j]..off + hoff[j] + hd];
                        scores[j * len + i] = dot(qj, k) * self.scale;
                    }
                }
            }
            let mut stats = Vec::with_capacity(qv.len());
            for (j, sc) in scores.chunks_mut(len).enumerate() {
                let (a, b) = ranges[j / heads];
                stats.push(if a < b {
                    crate::kernels::vmath::softmax_in(sc, a - lo, b - lo)
                } else {
                    sc.fill(0.0);
                    (f32::NEG_INFINITY, 0.0)
                });
            }
            // Where this task's output vectors go: the output itself for a single window,
            // else this window's slot of the chunk's partial results.
            let split = c.parts > 1;
            let pbase = c.scratch + part * nr * nh * (hd + 2);
            // SAFETY: rows r0..r0 + nr, heads h0..h0 + heads (of this window, when split)
            // are written by this task only; the ranges lie inside their buffers.
            let mut o: Vec<&mut [f32]> = (0..nr)
                .flat_map(|r| {
                    // SAFETY: see above.
                    let row = unsafe {
                        if split {
                            sptr.slice(pbase + (r * nh + h0) * hd, heads * hd)
                        } else {
                            optr.slice(((s.q_start + r0 + r) * nh + h0) * hd, heads * hd)
                        }
                    };
                    row.chunks_mut(hd)
                })
                .collect();
            if simd {
                // SAFETY: as above.
                unsafe {
                    match vc {
                        CacheRows::F32(v) => {
                            simd::weighted_sum(&scores, &hoff, v, &offs, width, &mut o)
                        }
                        CacheRows::F16(v) => {
                            simd::weighted_sum(&scores, &hoff, v, &offs, width, &mut o)
                        }
                    }
                };
            } else {
                let (vc, voffs) = vc.rows(&offs, width, &mut buf, &mut local);
                for (i, &off) in voffs.iter().enumerate() {
                    for (j, oj) in o.iter_mut().enumerate() {
                        let v = &vc[off + hoff[j]..off + hoff[j] + hd];
                        axpy(oj, scores[j * len + i], v);
                    }
                }
            }
            if split {
                for (j, &(m, l)) in stats.iter().enumerate() {
                    let (r, g) = (j / heads, j % heads);
                    let at = pbase + nr * nh * hd + 2 * (r * nh + h0 + g);
                    // SAFETY: this task's (row, head) pairs, as above.
                    unsafe { sptr.slice(at, 2) }.copy_from_slice(&[m, l]);
                }
            }
        };
        let tasks = &work.tasks;
        crate::kernels::pool::run(tasks.len(), &|ti| {
            let (ci, part, g) = tasks[ti];
            let per = nkv.div_ceil(work.head_groups);
            let (kv0, kv1) = (g * per, ((g + 1) * per).min(nkv));
            if kv0 < kv1 {
                attend(&work.chunks[ci], part, kv0, kv1);
            }
        });
        for c in work.chunks.iter().filter(|c| c.parts > 1) {
            merge_windows(c, &scratch, &mut out, &self.seqs[c.seq], nh, hd);
        }
        Ok((CpuStorage::F32(out), Shape::from((t, nh * hd))))
    }
}

/// Combines a chunk's per-window softmax outputs into the output rows: window p's vector
/// counts with weight `l_p * exp(m_p - M) / sum_q l_q * exp(m_q - M)` (M the largest
/// window maximum). One visible window gives weight exactly 1, so the vector is copied
/// unchanged; windows are summed in position order.
fn merge_windows(c: &Chunk, scratch: &[f32], out: &mut [f32], s: &AttnSeq, nh: usize, hd: usize) {
    let per = c.nr * nh * (hd + 2);
    let stat = |p: usize, rh: usize| {
        let at = c.scratch + p * per + c.nr * nh * hd + 2 * rh;
        (scratch[at], scratch[at + 1])
    };
    let mut w = vec![0f32; c.parts];
    for rh in 0..c.nr * nh {
        let m = (0..c.parts)
            .map(|p| stat(p, rh))
            .filter(|&(_, l)| l > 0.0)
            .fold(f32::NEG_INFINITY, |a, (m, _)| a.max(m));
        for (p, wp) in w.iter_mut().enumerate() {
            let (mp, lp) = stat(p, rh);
            *wp = if lp > 0.0 { lp * (mp - m).exp() } else { 0.0 };
        }
        let total: f32 = w.iter().sum();
        let (r, h) = (rh / nh, rh % nh);
        let dst = &mut out[((s.q_start + c.r0 + r) * nh + h) * hd..][..hd];
        dst.fill(0.0);
        for (p, &wp) in w.iter().enumerate() {
            if wp > 0.0 {
                let src = &scratch[c.scratch + p * per + rh * hd..][..hd];
                axpy(dst, wp / total, src);
            }
        }
    }
}

/// A key or value cache as the kernel reads it.
#[derive(Clone, Copy)]
enum CacheRows<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl CacheRows<'_> {
    /// The `width` values at each of `offs` as f32 and their offsets: the cache itself for
    /// f32; for f16 a copy widened once into `buf` (rows back to back; `local` holds the
    /// offsets), so the cache is read at half the bytes and the kernels stay f32.
    fn rows<'b>(
        &'b self,
        offs: &'b [usize],
        width: usize,
        buf: &'b mut Vec<f32>,
        local: &'b mut Vec<usize>,
    ) -> (&'b [f32], &'b [usize]) {
        use half::slice::HalfFloatSliceExt;
        match *self {
            CacheRows::F32(c) => (c, offs),
            CacheRows::F16(c) => {
                buf.resize(offs.len() * width, 0.0);
                for (dst, &off) in buf.chunks_exact_mut(width).zip(offs) {
                    c[off..off + width].convert_to_f32_slice(dst);
                }
                *local = (0..offs.len()).map(|i| i * width).collect();
                (buf, local)
            }
        }
    }
}

/// AVX2/FMA inner loops with many independent accumulators (the scalar loops above are
/// one dependent FMA chain per dot product). Need `head_dim` to be a multiple of 32.
mod simd {
    /// AVX2, FMA and F16C (f16 caches are widened in registers).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            crate::kernels::vmath::avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn scores<E>(
        _: &[&[f32]],
        _: &[usize],
        _: &[E],
        _: &[usize],
        _: usize,
        _: f32,
        _: &mut [f32],
    ) {
        unreachable!("no SIMD attention on this architecture")
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn weighted_sum<E>(
        _: &[f32],
        _: &[usize],
        _: &[E],
        _: &[usize],
        _: usize,
        _: &mut [&mut [f32]],
    ) {
        unreachable!("no SIMD attention on this architecture")
    }

    #[cfg(target_arch = "x86_64")]
    pub use x86::*;

    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::needless_range_loop)]
    mod x86 {
        use std::arch::x86_64::*;

        /// A cache element type the loops read 8 at a time as f32 (f16 widened in registers
        /// by F16C, so an f16 cache is read at half the bytes with no copy).
        pub trait Elem: Copy {
            /// # Safety
            /// `p..p + 8` is readable; the CPU has AVX2 and F16C.
            unsafe fn load8(p: *const Self) -> __m256;
        }

        impl Elem for f32 {
            #[inline(always)]
            unsafe fn load8(p: *const f32) -> __m256 {
                // SAFETY: the caller guarantees `p..p + 8` is readable (the trait's contract).
                unsafe { _mm256_loadu_ps(p) }
            }
        }

        impl Elem for half::f16 {
            #[inline(always)]
            unsafe fn load8(p: *const half::f16) -> __m256 {
                // SAFETY: the caller guarantees `p..p + 8` is readable (16 bytes) and F16C is
                // present (the trait's contract).
                unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
            }
        }

        /// The 8 horizontal sums of `a[0..8]` as one vector (lane j = sum of `a[j]`).
        #[inline(always)]
        unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
            // SAFETY: register-only AVX arithmetic; callers run with AVX2 enabled.
            unsafe {
                let h01 = _mm256_hadd_ps(a[0], a[1]);
                let h23 = _mm256_hadd_ps(a[2], a[3]);
                let h45 = _mm256_hadd_ps(a[4], a[5]);
                let h67 = _mm256_hadd_ps(a[6], a[7]);
                // Per 128-bit half: [s0 s1 s2 s3] partial sums of rows 0-3 and of rows 4-7.
                let q0 = _mm256_hadd_ps(h01, h23);
                let q1 = _mm256_hadd_ps(h45, h67);
                let lo = _mm256_permute2f128_ps(q0, q1, 0x20);
                let hi = _mm256_permute2f128_ps(q0, q1, 0x31);
                _mm256_add_ps(lo, hi)
            }
        }

        /// `scores[j * len + i] = scale * q_j · k[offs[i] + hoff[j]..]` for every query
        /// vector `q_j` (each `hd` long; `hoff[j]` places its kv head in the `width` values
        /// read at each offset), 8 positions at a time (8 independent accumulators).
        /// Positions are the outer loop, so 8 key rows are read from memory once, whole, and
        /// from L1 for every further query vector and head.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn scores<E: Elem>(
            q: &[&[f32]],
            hoff: &[usize],
            kc: &[E],
            offs: &[usize],
            width: usize,
            scale: f32,
            scores: &mut [f32],
        ) {
            // SAFETY: the caller guarantees `offs[i] + hoff[j] + hd <= kc.len()` for every
            // position and query vector, every query vector is `hd` long with `hd` a
            // multiple of 8, and `scores` holds `q.len() * offs.len()` values; so every load
            // reads inside `kc` or `q` and every store writes inside `scores`. The features
            // `load8` needs are enabled here.
            unsafe {
                let len = offs.len();
                let kp = kc.as_ptr();
                let mut i = 0;
                while i < len {
                    let n = (len - i).min(8);
                    let rows: [*const E; 8] =
                        std::array::from_fn(|j| kp.add(offs[i + j.min(n - 1)]));
                    let ng = q.len();
                    for (g, qg) in q.iter().enumerate() {
                        // The next 8 positions' key rows, a share before each query vector.
                        let (a, b) = (g * 8 / ng, (g + 1) * 8 / ng);
                        prefetch_rows(kc, offs.iter().skip(i + 8 + a).take(b - a), width);
                        let rows = rows.map(|r| r.add(hoff[g]));
                        let mut acc = [_mm256_setzero_ps(); 8];
                        for c in (0..qg.len()).step_by(8) {
                            let qv = _mm256_loadu_ps(qg.as_ptr().add(c));
                            for j in 0..8 {
                                acc[j] = _mm256_fmadd_ps(qv, E::load8(rows[j].add(c)), acc[j]);
                            }
                        }
                        let sums = _mm256_mul_ps(hsum8(&acc), _mm256_set1_ps(scale));
                        if n == 8 {
                            _mm256_storeu_ps(scores.as_mut_ptr().add(g * len + i), sums);
                        } else {
                            let mut tmp = [0f32; 8];
                            _mm256_storeu_ps(tmp.as_mut_ptr(), sums);
                            scores[g * len + i..g * len + i + n].copy_from_slice(&tmp[..n]);
                        }
                    }
                    i += n;
                }
            }
        }

        /// Prefetches `hd` values at each of `offs` into L1: the next positions' rows,
        /// asked for while this block's are multiplied (a cache row is a few lines in a
        /// different place per position, which the hardware prefetchers follow late; ~5-8 %
        /// off a layer's attention in `bench_layer_attention`). Prefetches never fault, so
        /// the addresses are not checked.
        #[inline(always)]
        fn prefetch_rows<'a, E>(c: &[E], offs: impl Iterator<Item = &'a usize>, hd: usize) {
            let bytes = hd * std::mem::size_of::<E>();
            for &off in offs {
                let p = c.as_ptr().wrapping_add(off) as *const i8;
                for o in (0..bytes).step_by(64) {
                    // SAFETY: a prefetch reads nothing and never faults, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o)) };
                }
            }
        }

        /// Positions per pass of [`weighted_sum`]: their value rows stay in L1 while every
        /// output vector accumulates them.
        const PASS: usize = 32;

        /// `o_j += sum_i w[j * len + i] * v[offs[i] + hoff[j]..]` for every output vector
        /// `o_j` (`hoff` and `width` as in [`scores`]).
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn weighted_sum<E: Elem>(
            w: &[f32],
            hoff: &[usize],
            vc: &[E],
            offs: &[usize],
            width: usize,
            o: &mut [&mut [f32]],
        ) {
            // SAFETY: `accumulate`'s contract: every output vector is `hd` long (a multiple
            // of 32) and `offs[i] + hoff[j] + hd <= vc.len()`, which the caller guarantees;
            // `w` holds `o.len() * offs.len()` weights (checked by slicing).
            unsafe {
                let len = offs.len();
                for p in (0..len).step_by(PASS) {
                    let e = (p + PASS).min(len);
                    let nj = o.len();
                    for (j, oj) in o.iter_mut().enumerate() {
                        // The next pass's value rows, a share before each output vector
                        // (all at once stalls on the fill buffers, with nothing to overlap).
                        let (a, b) = (j * PASS / nj, (j + 1) * PASS / nj);
                        prefetch_rows(vc, offs.iter().skip(p + PASS + a).take(b - a), width);
                        let wj = &w[j * len + p..j * len + e];
                        let v = &vc[hoff[j]..];
                        let hd = oj.len();
                        if hd.is_multiple_of(64) {
                            // 8 independent accumulators (64 values) keep both FMA ports busy.
                            for c in (0..hd).step_by(64) {
                                accumulate::<8, E>(wj, v, &offs[p..e], c, oj);
                            }
                        } else {
                            for c in (0..hd).step_by(32) {
                                accumulate::<4, E>(wj, v, &offs[p..e], c, oj);
                            }
                        }
                    }
                }
            }
        }

        /// `o[c..c + 8N] += sum_i w[i] * v[offs[i] + c..]`, N vectors in registers.
        #[inline(always)]
        unsafe fn accumulate<const N: usize, E: Elem>(
            w: &[f32],
            vc: &[E],
            offs: &[usize],
            c: usize,
            o: &mut [f32],
        ) {
            // SAFETY: `c + 8N <= o.len()` and `offs[i] + c + 8N <= vc.len()` (the callers
            // step `c` through `hd` by 8N, and every row is `hd` long), so every load and
            // store stays inside `o` and `vc`.
            unsafe {
                let op = o.as_mut_ptr().add(c);
                let mut acc: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(op.add(8 * j)));
                for (&wi, &off) in w.iter().zip(offs) {
                    let wv = _mm256_set1_ps(wi);
                    let v = vc.as_ptr().add(off + c);
                    for j in 0..N {
                        acc[j] = _mm256_fmadd_ps(wv, E::load8(v.add(8 * j)), acc[j]);
                    }
                }
                for j in 0..N {
                    _mm256_storeu_ps(op.add(8 * j), acc[j]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// A causal op over `seqs` (scale 0.125, no window).
    fn causal(seqs: Vec<AttnSeq>, nh: usize, nkv: usize, hd: usize, bs: usize) -> PagedAttention {
        PagedAttention {
            seqs: std::sync::Arc::new(AttnBatch::new(seqs)),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            scale: 0.125,
            window: None,
            causal: true,
        }
    }

    /// `hd` 16: scalar loops; 64: the SIMD ones (3 query heads per kv head).
    fn check(causal: bool, window: Option<usize>) {
        check_shape(causal, window, 4, 2, 16);
        check_shape(causal, window, 6, 2, 64);
    }

    fn check_shape(causal: bool, window: Option<usize>, nh: usize, nkv: usize, hd: usize) {
        let dev = Device::Cpu;
        let bs = 4;
        let slots = 64;
        let kc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let seqs = vec![
            AttnSeq {
                q_start: 0,
                q_len: 3,
                q_pos0: 5,
                kv_len: 8,
                block_table: vec![7, 2],
            },
            AttnSeq {
                q_start: 3,
                q_len: 1,
                q_pos0: 0,
                kv_len: 1,
                block_table: vec![4],
            },
            AttnSeq {
                q_start: 4,
                q_len: 5,
                q_pos0: 6,
                kv_len: 11,
                block_table: vec![9, 1, 15],
            },
            // More rows than one chunk holds (prefill-like).
            AttnSeq {
                q_start: 9,
                q_len: 11,
                q_pos0: 2,
                kv_len: 13,
                block_table: vec![3, 5, 6, 8],
            },
        ];
        // Decode rows of sequences of different lengths (batched into padded groups).
        let seqs: Vec<AttnSeq> = seqs
            .into_iter()
            .chain((0..6).map(|i| AttnSeq {
                q_start: 20 + i,
                q_len: 1,
                q_pos0: 2 + 2 * i,
                kv_len: 3 + 2 * i,
                block_table: vec![(i as u32 + 3) % 16, 12, 0, 14],
            }))
            .collect();
        let q = Tensor::randn(0f32, 1.0, (26, nh, hd), &dev).unwrap();
        let op_with = |batch: AttnBatch| PagedAttention {
            seqs: std::sync::Arc::new(batch),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            scale: 0.25,
            window,
            causal,
        };
        // Groups bounded so tightly that most sequences are alone: the same result.
        let small = op_with(AttnBatch::with_group_cells(seqs.clone(), 30));
        let op = op_with(AttnBatch::new(seqs));
        let maxdiff = |a: Tensor, b: Tensor| crate::testutil::max_abs_diff(&a, &b);
        let a = op.forward(&q, &kc, &vc).unwrap();
        let b = op.forward_generic(&q, &kc, &vc).unwrap();
        let d = maxdiff(a.clone(), b);
        assert!(d < 1e-4, "kernel and reference differ by {d}");
        let groups = |op: &PagedAttention| op.seqs.plan(op, &dev).unwrap().groups.len();
        assert_eq!(groups(&op), 1, "up to 16 query rows each: one padded group");
        assert!(groups(&small) >= 5, "tight bounds split the batch");
        let c = maxdiff(a.clone(), small.forward_generic(&q, &kc, &vc).unwrap());
        assert!(c < 1e-4, "kernel and small-group reference differ by {c}");
        // f16 caches: the kernel widens rows as it reads them; the reference gathers and
        // converts. Same inputs (the f16-rounded caches), so only f32 rounding differs.
        let (k16, v16) = (
            kc.to_dtype(candle_core::DType::F16).unwrap(),
            vc.to_dtype(candle_core::DType::F16).unwrap(),
        );
        let a16 = op.forward(&q, &k16, &v16).unwrap();
        let b16 = op.forward_generic(&q, &k16, &v16).unwrap();
        let d16 = maxdiff(a16.clone(), b16);
        assert!(d16 < 1e-4, "f16 kernel and reference differ by {d16}");
        // ...and the f16 cache changes the result only by its rounding.
        let dq = maxdiff(a16, a);
        assert!(dq > 0.0 && dq < 1e-2, "f16 vs f32 cache: {dq}");
    }

    /// A verify block over a long context (several passes of the value loop, many key
    /// groups, a partial last one) with f16 and f32 caches: kernel = reference.
    #[test]
    fn long_context_verify_block_matches_reference() {
        let dev = Device::Cpu;
        let (nh, nkv, hd, bs) = (6, 2, 64, 16);
        let kc = Tensor::randn(0f32, 1.0, (128, nkv * hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (128, nkv * hd), &dev).unwrap();
        let seqs = vec![
            AttnSeq {
                q_start: 0,
                q_len: 4,
                q_pos0: 97,
                kv_len: 101,
                block_table: vec![3, 0, 5, 1, 7, 2, 6],
            },
            AttnSeq {
                q_start: 4,
                q_len: 1,
                q_pos0: 40,
                kv_len: 41,
                block_table: vec![4, 7, 1],
            },
        ];
        let q = Tensor::randn(0f32, 1.0, (5, nh, hd), &dev).unwrap();
        let op = causal(seqs, nh, nkv, hd, bs);
        for dt in [candle_core::DType::F32, candle_core::DType::F16] {
            let (k, v) = (kc.to_dtype(dt).unwrap(), vc.to_dtype(dt).unwrap());
            let a = op.forward(&q, &k, &v).unwrap();
            let b = op.forward_generic(&q, &k, &v).unwrap();
            let d = crate::testutil::max_abs_diff(&a, &b);
            assert!(d < 1e-4, "{dt:?}: kernel and reference differ by {d}");
        }
    }

    #[test]
    fn work_is_cut_until_every_thread_has_tasks() {
        let seq = |q_start, q_len, kv_len| AttnSeq {
            q_start,
            q_len,
            q_pos0: kv_len - q_len,
            kv_len,
            block_table: vec![0; 128],
        };
        let op = |seqs| causal(seqs, 9, 3, 64, 16);
        let shape = |w: &Work| {
            w.chunks
                .iter()
                .map(|c| (c.r0, c.nr, c.parts))
                .collect::<Vec<_>>()
        };
        // One verify block of 4 rows, short context, 2 threads: 2 chunks of 2 rows, one
        // task per kv head (6 tasks).
        let w = op(vec![seq(0, 4, 14)]).work(2);
        assert_eq!(shape(&w), vec![(0, 2, 1), (2, 2, 1)]);
        assert_eq!(w.tasks.len(), 6);
        // Enough work with split heads: chunks of 8 rows, the last one shorter.
        let w = op(vec![seq(0, 20, 30)]).work(2);
        assert_eq!(shape(&w), vec![(0, 8, 1), (8, 8, 1), (16, 4, 1)]);
        assert_eq!(w.tasks.len(), 9);
        // One decode row over 1,100 positions: 3 windows, heads split to fill 4 threads.
        let w = op(vec![seq(0, 1, 1100)]).work(4);
        assert_eq!(shape(&w), vec![(0, 1, 3)]);
        assert_eq!(w.tasks.len(), 9);
        assert_eq!(w.scratch, 3 * 9 * 66);
        // Decode rows of many sequences: one task each, every head.
        let decode: Vec<AttnSeq> = (0..8).map(|i| seq(i, 1, 40)).collect();
        let w = op(decode).work(2);
        assert_eq!((w.chunks.len(), w.tasks.len()), (8, 8));
    }

    /// A row's result does not depend on which other rows share the call (so a sequence's
    /// greedy tokens do not either): one decode row over 1,100 positions alone (3 windows,
    /// split heads) and beside a verify block and other rows (all heads per task), bit for
    /// bit, and equal to the reference.
    #[test]
    fn a_rows_result_does_not_depend_on_its_batch() {
        let dev = Device::Cpu;
        let (nh, nkv, hd, bs) = (6, 2, 64, 16);
        let slots = 128 * bs;
        let kc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
        let table = |first: u32, n: u32| (first..first + n).rev().collect::<Vec<u32>>();
        let row = |q_start| AttnSeq {
            q_start,
            q_len: 1,
            q_pos0: 1099,
            kv_len: 1100,
            block_table: table(0, 69),
        };
        let op = |seqs| causal(seqs, nh, nkv, hd, bs);
        let q = Tensor::randn(0f32, 1.0, (12, nh, hd), &dev).unwrap();
        for dt in [candle_core::DType::F32, candle_core::DType::F16] {
            let (k, v) = (kc.to_dtype(dt).unwrap(), vc.to_dtype(dt).unwrap());
            let alone = op(vec![row(0)]);
            let a = alone.forward(&q.narrow(0, 0, 1).unwrap(), &k, &v).unwrap();
            let b = alone
                .forward_generic(&q.narrow(0, 0, 1).unwrap(), &k, &v)
                .unwrap();
            let d = crate::testutil::max_abs_diff(&a, &b);
            assert!(d < 1e-4, "{dt:?}: windows merged vs reference: {d}");
            let mut seqs = vec![row(0)];
            seqs.push(AttnSeq {
                q_start: 1,
                q_len: 5,
                q_pos0: 250,
                kv_len: 255,
                block_table: table(70, 16),
            });
            seqs.extend((6..12).map(|i| AttnSeq {
                q_start: i,
                q_len: 1,
                q_pos0: 10 * i,
                kv_len: 10 * i + 1,
                block_table: table(90, 8),
            }));
            let crowd = op(seqs);
            let c = crowd.forward(&q, &k, &v).unwrap();
            let mine = |t: &Tensor| t.get(0).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(mine(&c), mine(&a), "{dt:?}: the row changed with its batch");
            let r = crowd.forward_generic(&q, &k, &v).unwrap();
            let d = crate::testutil::max_abs_diff(&c, &r);
            assert!(d < 1e-4, "{dt:?}: crowded call vs reference: {d}");
        }
    }

    #[test]
    fn kernel_matches_reference_causal() {
        check(true, None);
    }
    #[test]
    fn kernel_matches_reference_bidirectional() {
        check(false, None);
    }
    #[test]
    fn kernel_matches_reference_sliding_window() {
        check(true, Some(3));
    }

    /// Median seconds per layer of `op` over `reps` passes through all `caches`.
    fn per_layer(op: &PagedAttention, q: &Tensor, caches: &[(Tensor, Tensor)], reps: usize) -> f64 {
        let mut times: Vec<f64> = (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                for (k, v) in caches {
                    op.forward(q, k, v).unwrap();
                }
                t.elapsed().as_secs_f64() / caches.len() as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[reps / 2]
    }

    /// `layers` distinct f16 key and value caches of `slots` rows (9 query heads, 3 kv heads
    /// of 64: SmolLM2-135M's attention).
    fn f16_caches(layers: usize, slots: usize) -> Vec<(Tensor, Tensor)> {
        let f16 = |t: Tensor| t.to_dtype(candle_core::DType::F16).unwrap();
        (0..layers)
            .map(|_| {
                let k = Tensor::randn(0f32, 1.0, (slots, 3 * 64), &Device::Cpu).unwrap();
                let v = Tensor::randn(0f32, 1.0, (slots, 3 * 64), &Device::Cpu).unwrap();
                (f16(k), f16(v))
            })
            .collect()
    }

    /// SmolLM2-135M's attention over distinct f16 caches (keys and values stream from
    /// memory as in a step): one sequence with 256 or 512 cached positions and 1 to 8 query
    /// rows (a verify block) over 30 layers, then a loaded server's 64 decode rows and 16
    /// verify blocks of 4 (256 positions each, in their own blocks) over 8. Microseconds per
    /// layer. `cargo test --release -p dspark-engine --lib model::attention::tests::bench
    /// -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_layer_attention() {
        let caches = f16_caches(30, 1024);
        for rows in [1usize, 2, 4, 8] {
            for ctx in [256usize, 512] {
                let seq = AttnSeq {
                    q_start: 0,
                    q_len: rows,
                    q_pos0: ctx,
                    kv_len: ctx + rows,
                    block_table: (0..64u32).rev().collect(),
                };
                let q = Tensor::randn(0f32, 1.0, (rows, 9, 64), &Device::Cpu).unwrap();
                let t = per_layer(&causal(vec![seq], 9, 3, 64, 16), &q, &caches, 40);
                println!(
                    "attention rows={rows} ctx={ctx}: {:.1} us per layer",
                    t * 1e6
                );
            }
        }
        let ctx = 256;
        let caches = f16_caches(8, 64 * (ctx + 16));
        for (n, rows) in [(64usize, 1usize), (16, 4)] {
            let seqs: Vec<AttnSeq> = (0..n)
                .map(|i| AttnSeq {
                    q_start: i * rows,
                    q_len: rows,
                    q_pos0: ctx,
                    kv_len: ctx + rows,
                    block_table: (0..(ctx + 16) as u32 / 16)
                        .map(|b| b * 64 + i as u32)
                        .collect(),
                })
                .collect();
            let q = Tensor::randn(0f32, 1.0, (n * rows, 9, 64), &Device::Cpu).unwrap();
            let t = per_layer(&causal(seqs, 9, 3, 64, 16), &q, &caches, 10);
            println!(
                "attention {n} sequences x {rows} rows, ctx={ctx}: {:.1} us per layer, {:.2} us per sequence",
                t * 1e6,
                t * 1e6 / n as f64
            );
        }
    }
}
