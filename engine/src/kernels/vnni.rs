//! AVX-512 VNNI kernels on repacked weights (Q4_0, Q4_1, Q8_0): 16 output rows at a time,
//! one 32-bit lane per row.
//!
//! The ggml layout keeps each row's blocks together, so an x86 dot product reduces 32 lanes
//! of one block to one number per block, per input row (`maddubs`, `madd`, a float convert,
//! a horizontal sum). Here the weights are repacked once at load so that a 64-byte vector
//! holds 4 consecutive quants of the same block of 16 different rows; `vpdpbusd` multiplies
//! them with the input row's 4 matching activation bytes (broadcast) and accumulates in the
//! row's own lane. A block of 16 rows then costs 8 `vpdpbusd`, one convert and one FMA per
//! input row, with no reduction at all, and the unpacked weights stay in registers for up to
//! 4 input rows.
//!
//! Packed layout, per group of 16 rows, block after block (`nb` blocks per row):
//! - Q4_0 / Q4_1: 4 x 64 bytes of quants (chunk `c`, lane `l` = bytes `4c..4c + 4` of row
//!   `l`'s ggml `qs`: low nibbles are elements `4c..4c + 4`, high nibbles `16 + 4c..`), then
//!   16 f16 scales `d`, then (Q4_1) 16 f16 mins `m`. Same bytes as ggml's blocks, reordered.
//! - Q8_0: 8 x 64 bytes (chunk `c`, lane `l` = elements `4c..4c + 4` of row `l`, stored as
//!   `q + 128` so that they are unsigned), then 16 f16 scales.
//!
//! The integer block sums are exactly those of ggml's kernels (the offsets of Q4_0 and of
//! the biased Q8_0 quants are removed with the activation block's integer sum); the float
//! arithmetic per block is `d_w * d_a * sum (+ m_w * s_a)` as ggml's, summed in a different
//! order.

#![allow(clippy::needless_range_loop)]

use super::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use super::q8::Q8Block;
use super::QType;

/// Rows per packed group (one per 32-bit lane of a 512-bit vector).
pub const LANES: usize = 16;

/// A weight matrix repacked for [`matmul_rows`].
pub struct Packed {
    pub ty: QType,
    pub n: usize,
    pub k: usize,
    data: Vec<u8>,
}

/// Bytes of quants per packed block of 16 rows.
fn quant_bytes(ty: QType) -> usize {
    match ty {
        QType::Q8_0 => 8 * 64,
        _ => 4 * 64,
    }
}

/// Bytes per packed block of 16 rows (quants, scales, mins).
fn block_bytes(ty: QType) -> usize {
    quant_bytes(ty) + 2 * LANES * if ty == QType::Q4_1 { 2 } else { 1 }
}

impl Packed {
    /// Whether matrices of this type and shape can be packed.
    pub fn supports(ty: QType, n: usize, k: usize) -> bool {
        matches!(ty, QType::Q4_0 | QType::Q4_1 | QType::Q8_0)
            && n.is_multiple_of(LANES)
            && n > 0
            && k.is_multiple_of(QK)
    }

    /// Repacks a ggml `[n, k]` matrix (`data` as in [`super::QMatrix`]).
    pub fn new(ty: QType, n: usize, k: usize, data: &[u8]) -> Result<Self, String> {
        if !Self::supports(ty, n, k) {
            return Err(format!("{ty:?} [{n}, {k}] cannot be packed"));
        }
        let m = super::QMatrix::new(ty, n, k, data)?;
        let nb = k / QK;
        let bb = block_bytes(ty);
        let mut out = vec![0u8; n * nb * bb / LANES];
        for g in 0..n / LANES {
            for b in 0..nb {
                let dst = &mut out[(g * nb + b) * bb..(g * nb + b + 1) * bb];
                let qb = quant_bytes(ty);
                for l in 0..LANES {
                    let row = g * LANES + l;
                    let (d, mn, qs): (u16, u16, Vec<u8>) = match ty {
                        QType::Q4_0 => {
                            let x = super::cast::<BlockQ4_0>(m.data)[row * nb + b];
                            (x.d, 0, x.qs.to_vec())
                        }
                        QType::Q4_1 => {
                            let x = super::cast::<BlockQ4_1>(m.data)[row * nb + b];
                            (x.d, x.m, x.qs.to_vec())
                        }
                        _ => {
                            let x = super::cast::<BlockQ8_0>(m.data)[row * nb + b];
                            (x.d, 0, x.qs.iter().map(|&q| (q as u8) ^ 0x80).collect())
                        }
                    };
                    for c in 0..qs.len() / 4 {
                        dst[c * 64 + l * 4..c * 64 + l * 4 + 4]
                            .copy_from_slice(&qs[4 * c..4 * c + 4]);
                    }
                    dst[qb + 2 * l..qb + 2 * l + 2].copy_from_slice(&d.to_le_bytes());
                    if ty == QType::Q4_1 {
                        let o = qb + 2 * LANES + 2 * l;
                        dst[o..o + 2].copy_from_slice(&mn.to_le_bytes());
                    }
                }
            }
        }
        Ok(Self {
            ty,
            n,
            k,
            data: out,
        })
    }

    /// Bytes of one group of 16 rows.
    pub fn group_bytes(&self) -> usize {
        self.k / QK * block_bytes(self.ty)
    }

    /// Output columns `j0..j1` (multiples of 16) for all `m` rows of `acts` (`m * k / 32`
    /// Q8 blocks; Q8_0-style scales, and `s` for Q4_1).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `out` points to an `m * n` buffer in which no
    /// one else writes columns `j0..j1`.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn run(&self, acts: &[Q8Block], m: usize, j0: usize, j1: usize, out: *mut f32) {
        debug_assert!(j0.is_multiple_of(LANES) && j1.is_multiple_of(LANES) && j1 <= self.n);
        let nb = self.k / QK;
        assert_eq!(acts.len(), m * nb, "activation blocks");
        let mut r0 = 0;
        while r0 < m {
            let rows = (m - r0).min(4);
            for g in j0 / LANES..j1 / LANES {
                let w = &self.data[g * self.group_bytes()..(g + 1) * self.group_bytes()];
                let o = out.add(r0 * self.n + g * LANES);
                let a = &acts[r0 * nb..];
                match (self.ty, rows) {
                    (QType::Q4_1, 4) => imp::group::<4, 1>(w, nb, a, o, self.n),
                    (QType::Q4_1, 3) => imp::group::<3, 1>(w, nb, a, o, self.n),
                    (QType::Q4_1, 2) => imp::group::<2, 1>(w, nb, a, o, self.n),
                    (QType::Q4_1, _) => imp::group::<1, 1>(w, nb, a, o, self.n),
                    (QType::Q4_0, 4) => imp::group::<4, 0>(w, nb, a, o, self.n),
                    (QType::Q4_0, 3) => imp::group::<3, 0>(w, nb, a, o, self.n),
                    (QType::Q4_0, 2) => imp::group::<2, 0>(w, nb, a, o, self.n),
                    (QType::Q4_0, _) => imp::group::<1, 0>(w, nb, a, o, self.n),
                    (_, 4) => imp::group::<4, 8>(w, nb, a, o, self.n),
                    (_, 3) => imp::group::<3, 8>(w, nb, a, o, self.n),
                    (_, 2) => imp::group::<2, 8>(w, nb, a, o, self.n),
                    (_, _) => imp::group::<1, 8>(w, nb, a, o, self.n),
                }
            }
            r0 += rows;
        }
    }
}

/// Whether this CPU runs the packed kernels.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn bcast4(q: &[i8; QK], at: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32))
    }

    /// One group of 16 weight rows against R input rows (`a[r * nb + b]`), written to
    /// `out + r * n`. `KIND`: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,f16c")]
    pub(super) unsafe fn group<const R: usize, const KIND: u8>(
        w: &[u8],
        nb: usize,
        a: &[Q8Block],
        out: *mut f32,
        n: usize,
    ) {
        let bb = block_bytes(match KIND {
            0 => QType::Q4_0,
            1 => QType::Q4_1,
            _ => QType::Q8_0,
        });
        let mut acc = [_mm512_setzero_ps(); R];
        let low = _mm512_set1_epi8(0x0F);
        let p = w.as_ptr();
        for b in 0..nb {
            let blk = p.add(b * bb);
            if KIND == 8 {
                let mut wq = [_mm512_setzero_si512(); 8];
                for (c, v) in wq.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(blk.add(64 * c) as *const _);
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(512) as *const __m256i));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_setzero_si512();
                    for c in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, wq[2 * c], bcast4(&y.qs, 8 * c));
                        s1 = _mm512_dpbusd_epi32(s1, wq[2 * c + 1], bcast4(&y.qs, 8 * c + 4));
                    }
                    let s =
                        _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * y.isum));
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
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_setzero_si512();
                    for c in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, lo[c], bcast4(&y.qs, 4 * c));
                        s1 = _mm512_dpbusd_epi32(s1, hi[c], bcast4(&y.qs, 16 + 4 * c));
                    }
                    let mut s = _mm512_add_epi32(s0, s1);
                    if KIND == 0 {
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * y.isum));
                    }
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
