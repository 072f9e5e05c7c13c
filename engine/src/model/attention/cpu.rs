//! The CPU kernel: reads keys and values straight from the cache slots (no gather copies),
//! one pool task per (chunk of query rows, window of positions, kv heads), windows merged
//! after.

use super::simd;
use super::work::{Chunk, PART};
use super::{AttnSeq, PagedAttention};
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape};

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
