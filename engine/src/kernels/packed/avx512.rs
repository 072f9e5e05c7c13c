//! AVX-512 VNNI kernel on weights packed 16 rows per group (layout in [`super`]): a block of
//! 16 rows costs 8 `vpdpbusd` (started from the weight offset's term, so no subtract), one
//! convert, one multiply and one FMA (two for Q4_1) per input row. Q8_0 runs its 8 in one
//! chain (no add either; 5-12 % off the LM head at 4-8 rows in `bench`); Q4 keeps two
//! (one chain was no faster there and slower at 64 rows).

use super::Q8Block;
use std::arch::x86_64::*;

/// The 4 activation bytes at `at` of a quant block (32 or 256 long) in every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn bcast4<const N: usize>(q: &[i8; N], at: usize) -> __m512i {
    // SAFETY: callers pass `at <= N - 4`, so the 4 bytes read lie inside `q`; AVX-512 is
    // enabled in callers.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32)) }
}

/// One group of 16 weight rows against R input rows (`a[r * nb + b]`), written to
/// `out + r * n`; `bb` bytes per packed block. `KIND`: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,f16c")]
pub(super) unsafe fn group<const R: usize, const KIND: u8>(
    w: &[u8],
    nb: usize,
    bb: usize,
    a: &[Q8Block],
    out: *mut f32,
    n: usize,
    pf: usize,
) {
    // SAFETY: the caller guarantees `w` is one packed group of `nb` blocks of `bb`
    // bytes, `a` holds `R * nb` activation blocks, and `out + r * n .. + 16` is ours
    // for every `r < R`; every load reads inside `w` (block `b` at `b * bb`) or an
    // activation block, every store writes those 16 outputs; the target features are
    // enabled here.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); R];
        let low = _mm512_set1_epi8(0x0F);
        let p = w.as_ptr();
        for b in 0..nb {
            let blk = p.add(b * bb);
            super::prefetch(blk, bb, pf);
            if KIND == 8 {
                let mut wq = [_mm512_setzero_si512(); 8];
                for (c, v) in wq.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(blk.add(64 * c) as *const _);
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(512) as *const __m256i));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    // One chain from the offset of the biased quants (`q + 128`), so no
                    // add or subtract per row and block (the same integer sum).
                    let mut s = _mm512_set1_epi32(-128 * y.isum);
                    for (c, w) in wq.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, *w, bcast4(&y.qs, 4 * c));
                    }
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(y.d));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[r]);
                }
            } else {
                let mut lo = [_mm512_setzero_si512(); 4];
                let mut hi = [_mm512_setzero_si512(); 4];
                for c in 0..4 {
                    let v = _mm512_loadu_si512(blk.add(64 * c) as *const _);
                    lo[c] = _mm512_and_si512(v, low);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(256) as *const __m256i));
                let mw = if KIND == 1 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(288) as *const __m256i))
                } else {
                    _mm512_setzero_ps()
                };
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    // Two chains (one did not pay here, measured); Q4_0's offset term
                    // `-8 * sum(a)` starts the first, so no subtract.
                    let mut s0 = if KIND == 0 {
                        _mm512_set1_epi32(-8 * y.isum)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let mut s1 = _mm512_setzero_si512();
                    for c in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, lo[c], bcast4(&y.qs, 4 * c));
                        s1 = _mm512_dpbusd_epi32(s1, hi[c], bcast4(&y.qs, 16 + 4 * c));
                    }
                    let s = _mm512_add_epi32(s0, s1);
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(y.d));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[r]);
                    if KIND == 1 {
                        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(y.s), acc[r]);
                    }
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * n), *v);
        }
    }
}
