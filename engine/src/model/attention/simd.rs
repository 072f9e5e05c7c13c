//! AVX2/FMA inner loops with many independent accumulators (the CPU kernel's scalar loops are
//! one dependent FMA chain per dot product). Need `head_dim` to be a multiple of 32.

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
                let rows: [*const E; 8] = std::array::from_fn(|j| kp.add(offs[i + j.min(n - 1)]));
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
    /// off a layer's attention in `cargo bench --bench attention`). Prefetches never fault, so
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
