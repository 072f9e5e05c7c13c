//! AVX2 kernel on weights packed 8 rows per group (layout in [`super`]).
//!
//! Q4_0 / Q4_1: per block and input row, 8 `maddubs` of unpacked nibbles against broadcast
//! activation quads summed in `i16` lanes (each product pair is at most 2 * 15 * 127, eight
//! of them fit), one `madd` to `i32`, one convert and one or two FMAs for all 8 rows.
//! Q8_0: the signed quants' sign moves to the activations (`sign`, then `maddubs` of `|w|`),
//! one `madd` per vector since those pairs fill an `i16`.

use super::Q8Block;
use std::arch::x86_64::*;

/// The 4 activation bytes at `at` of a quant block (32 or 256 long) in every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn bcast4<const N: usize>(q: &[i8; N], at: usize) -> __m256i {
    // SAFETY: callers pass `at <= N - 4`, so the 4 bytes read lie inside `q`; AVX2 is
    // enabled in callers.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32)) }
}

/// One group of 8 weight rows against R input rows (`a[r * nb + b]`), written to
/// `out + r * n`; `bb` bytes per packed block. `KIND`: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0.
#[target_feature(enable = "avx2,fma,f16c")]
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
    // bytes, `a` holds `R * nb` activation blocks, and `out + r * n .. + 8` is ours for
    // every `r < R`; every load reads inside `w` (block `b` at `b * bb`) or an activation
    // block, every store writes those 8 outputs; the target features are enabled here.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let p = w.as_ptr();
        for b in 0..nb {
            let blk = p.add(b * bb);
            super::prefetch(blk, bb, pf);
            let mut s = [_mm256_setzero_si256(); R];
            if KIND == 8 {
                for c in 0..8 {
                    let v = _mm256_loadu_si256(blk.add(32 * c) as *const __m256i);
                    let av = _mm256_sign_epi8(v, v);
                    for r in 0..R {
                        let y = a.get_unchecked(r * nb + b);
                        let sy = _mm256_sign_epi8(bcast4(&y.qs, 4 * c), v);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, sy), ones);
                        s[r] = _mm256_add_epi32(s[r], p);
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(256) as *const __m128i));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(y.d));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), d, acc[r]);
                }
            } else {
                for c in 0..4 {
                    let v = _mm256_loadu_si256(blk.add(32 * c) as *const __m256i);
                    let lo = _mm256_and_si256(v, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                    for r in 0..R {
                        let y = a.get_unchecked(r * nb + b);
                        let pl = _mm256_maddubs_epi16(lo, bcast4(&y.qs, 4 * c));
                        let ph = _mm256_maddubs_epi16(hi, bcast4(&y.qs, 16 + 4 * c));
                        s[r] = _mm256_add_epi16(s[r], _mm256_add_epi16(pl, ph));
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(128) as *const __m128i));
                let mw = if KIND == 1 {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(144) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let mut si = _mm256_madd_epi16(s[r], ones);
                    if KIND == 0 {
                        si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * y.isum));
                    }
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(y.d));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), d, acc[r]);
                    if KIND == 1 {
                        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(y.s), acc[r]);
                    }
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(r * n), *v);
        }
    }
}
