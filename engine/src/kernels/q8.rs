//! Activation quantisation, done once per input row and shared by every output row.
//!
//! The arithmetic follows ggml's x86 path so that results match llama.cpp's:
//! - [`Q8Block`] (for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights) is ggml's `block_q8_0`/`block_q8_1`:
//!   `d = amax / 127` rounded to f16, `q = round_half_even(x * 127 / amax)`, and for the
//!   weight types with a min, `s = f16(d * sum(q))`. Scales are stored already widened to f32.
//! - [`Q8KBlock`] (for K-quants) is ggml's `block_q8_K` (`quantize_row_q8_K_ref`): the scale
//!   comes from the signed value of largest magnitude, `d` stays f32, and `bsums` holds the
//!   sums of each 16 quants.

use super::blocks::{QK, QK_K};
use half::f16;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    /// `sum(qs)`, exact (the packed kernels remove weight offsets with it).
    pub isum: i32,
    pub qs: [i8; QK],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

#[inline(always)]
fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Quantises `x` (a multiple of 32 long) into `out` (`x.len() / 32` blocks), with AVX2
/// when the CPU has it (bit-identical to [`quantize_q8_scalar`]).
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::detect() >= super::Isa::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { quantize_q8_avx2(x, out) };
    }
    quantize_q8_scalar(x, out)
}

/// `x * 127 / amax` rounded half to even, per 32-block (the same IEEE operations as the
/// scalar version, 8 lanes at a time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_avx2(x: &[f32], out: &mut [Q8Block]) {
    // SAFETY: AVX2/FMA/F16C are enabled on this function (its callers checked the CPU);
    // every load reads 8 floats inside a 32-float chunk of `x` and every store writes the
    // 32 bytes of one block's `qs`.
    unsafe {
        use std::arch::x86_64::*;
        debug_assert_eq!(x.len(), out.len() * QK);
        let sign = _mm256_set1_ps(-0.0);
        for (xb, y) in x.chunks_exact(QK).zip(out.iter_mut()) {
            let p = xb.as_ptr();
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[i], id),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                ))
            });
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01)));
            // i32 -> i16 -> i8 with packs (values are within -127..=127); packs interleave the
            // 128-bit lanes, the permute restores the order.
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let b = _mm256_packs_epi16(w01, w23);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(y.qs.as_mut_ptr() as *mut __m256i, b);
            y.d = round_f16(d);
            y.s = round_f16(d * sum as f32);
            y.isum = sum;
        }
    }
}

/// The portable version of [`quantize_q8`].
pub fn quantize_q8_scalar(x: &[f32], out: &mut [Q8Block]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (xb, y) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        y.d = round_f16(d);
        y.s = round_f16(d * sum as f32);
        y.isum = sum;
    }
}

/// Quantises `x` (a multiple of 256 long) into `out` (`x.len() / 256` blocks).
pub fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = Q8KBlock::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        y.d = 1.0 / iscale;
    }
}
