//! K-quants (Q4_K, Q6_K) packed 16 rows per group for the AVX-512 VNNI kernels.
//!
//! A K-quant super-block holds 256 weights with per-sub-block scales (Q4_K: 8 sub-blocks of
//! 32 with a 6-bit scale and min each; Q6_K: 16 sub-blocks of 16 with an i8 scale). As for
//! the 32-blocks in [`super`], one 64-byte vector holds 4 consecutive quants of 16 different
//! rows, so a sub-block's integer dot product lands in each row's own 32-bit lane
//! (`vpdpbusd` against the broadcast activation bytes) with no horizontal sum. The sub-block
//! sums are scaled in integers (`sum_j sc_j * isum_j`, exactly ggml's integer sums), and one
//! float FMA per super-block and input row applies `d_w * d_a`. Packed super-blocks keep the
//! bytes of the ggml blocks (the same bits, reordered; scales widened to bytes), so a decode
//! step that streams the weights reads no more than llama.cpp does.
//!
//! Q4_K, per super-block of 16 rows (2368 bytes):
//! - quants, 4 chunks of 8 vectors: vector `(c, v)`, lane `l` = bytes `32c + 4v .. + 4` of
//!   row `l`'s `qs` (low nibbles: elements `64c + 4v ..` of sub-block `2c`; high nibbles:
//!   elements `64c + 32 + 4v ..` of sub-block `2c + 1`);
//! - 8 x 16 scales (`[sub-block][lane]`, u8), 4 x 16 x 2 mins (`[pair][lane][2]`, u8, so one
//!   zero-extension gives the i16 pairs `vpdpwssd` multiplies with the activation's pair of
//!   32-sums), 16 f16 `d`, 16 f16 `dmin`.
//!
//! Q6_K, per super-block of 16 rows (3360 bytes, padded to 3392): 4 quads of 12 vectors (sub-blocks
//! `4q .. 4q + 4`): 4 vectors of low nibbles for sub-blocks `4q` (low) and `4q + 1` (high),
//! 4 for `4q + 2` / `4q + 3`, then 4 vectors of high bit pairs (bits `2t, 2t + 1` of a byte
//! for sub-block `4q + t`); vector `v`, lane `l`, byte `i` is element `4v + i` of its
//! sub-block in row `l`. Then 16 x 16 i8 scales (`[sub-block][lane]`) and 16 f16 `d`.

use super::super::blocks::{scale_min_k4, BlockQ4K, BlockQ6K, QK_K};
use super::super::q8::Q8KBlock;
use super::super::QType;

/// Rows per group.
pub(super) const LANES: usize = 16;

const Q4K_SCALES: usize = 2048;
const Q4K_MINS: usize = Q4K_SCALES + 8 * LANES;
const Q4K_D: usize = Q4K_MINS + 8 * LANES;
const Q4K_DMIN: usize = Q4K_D + 2 * LANES;
const Q4K_BYTES: usize = Q4K_DMIN + 2 * LANES;

const Q6K_QUAD: usize = 12 * 64;
const Q6K_SCALES: usize = 4 * Q6K_QUAD;
const Q6K_D: usize = Q6K_SCALES + 16 * LANES;
/// 3,360 bytes of data padded to a whole number of cache lines (+1 %), so that every
/// 64-byte quant vector of every super-block is line-aligned (Q4_K's 2,368 already are).
const Q6K_BYTES: usize = (Q6K_D + 2 * LANES).next_multiple_of(64);

/// Bytes per packed super-block of 16 rows.
pub(super) fn block_bytes(ty: QType) -> usize {
    match ty {
        QType::Q4K => Q4K_BYTES,
        _ => Q6K_BYTES,
    }
}

/// Packs super-block `b` of rows `g * 16 ..` of a ggml matrix with `nb` super-blocks per
/// row into `dst` (`block_bytes(ty)` long).
pub(super) fn pack_block(ty: QType, data: &[u8], nb: usize, g: usize, b: usize, dst: &mut [u8]) {
    for l in 0..LANES {
        let row = g * LANES + l;
        match ty {
            QType::Q4K => {
                let x = &super::super::cast::<BlockQ4K>(data)[row * nb + b];
                for c in 0..4 {
                    for v in 0..8 {
                        let o = 512 * c + 64 * v + 4 * l;
                        dst[o..o + 4].copy_from_slice(&x.qs[32 * c + 4 * v..32 * c + 4 * v + 4]);
                    }
                }
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, &x.scales);
                    dst[Q4K_SCALES + LANES * j + l] = sc;
                    dst[Q4K_MINS + 2 * LANES * (j / 2) + 2 * l + j % 2] = m;
                }
                dst[Q4K_D + 2 * l..Q4K_D + 2 * l + 2].copy_from_slice(&x.d.to_le_bytes());
                dst[Q4K_DMIN + 2 * l..Q4K_DMIN + 2 * l + 2].copy_from_slice(&x.dmin.to_le_bytes());
            }
            _ => {
                let x = &super::super::cast::<BlockQ6K>(data)[row * nb + b];
                for q in 0..4 {
                    for v in 0..4 {
                        for i in 0..4 {
                            let e = |t: usize| q6(x, 16 * (4 * q + t) + 4 * v + i);
                            let at = Q6K_QUAD * q + 64 * v + 4 * l + i;
                            dst[at] = (e(0) & 15) | (e(1) & 15) << 4;
                            dst[at + 256] = (e(2) & 15) | (e(3) & 15) << 4;
                            dst[at + 512] =
                                e(0) >> 4 | (e(1) >> 4) << 2 | (e(2) >> 4) << 4 | (e(3) >> 4) << 6;
                        }
                    }
                }
                for j in 0..16 {
                    dst[Q6K_SCALES + LANES * j + l] = x.scales[j] as u8;
                }
                dst[Q6K_D + 2 * l..Q6K_D + 2 * l + 2].copy_from_slice(&x.d.to_le_bytes());
            }
        }
    }
}

/// The 6-bit quant (0..64) of element `e` of a Q6_K block (ggml's layout).
fn q6(x: &BlockQ6K, e: usize) -> u8 {
    let (h, r) = (e / 128, e % 128);
    let (quarter, l) = (r / 32, r % 32);
    let ql = x.ql[64 * h + l + 32 * (quarter % 2)];
    let low = if quarter < 2 { ql & 15 } else { ql >> 4 };
    let high = (x.qh[32 * h + l] >> (2 * quarter)) & 3;
    low | high << 4
}

/// Per activation super-block, Q4_K's min term needs the 32-sums of its 8 sub-blocks as i16
/// pairs (`sum_{2p} | sum_{2p+1} << 16`), one per pair of sub-blocks.
pub(in crate::kernels) fn min_pairs(acts: &[Q8KBlock]) -> Vec<[i32; 4]> {
    acts.iter()
        .map(|a| {
            std::array::from_fn(|p| {
                let s = |j: usize| (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32) as u16;
                (s(2 * p) as u32 | (s(2 * p + 1) as u32) << 16) as i32
            })
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn bcast4(q: &[i8; QK_K], at: usize) -> __m512i {
        // SAFETY: callers pass `at <= QK_K - 4`, so the 4 bytes read lie inside `q`;
        // AVX-512 is enabled in callers.
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32)) }
    }

    /// One group of 16 Q4_K rows against R input rows (`a[r * nb + b]`, their min pairs
    /// `mp[r * nb + b]`), written to `out + r * n`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,f16c")]
    pub(in super::super) unsafe fn group_q4k<const R: usize>(
        w: &[u8],
        nb: usize,
        a: &[Q8KBlock],
        mp: &[[i32; 4]],
        out: *mut f32,
        n: usize,
        pf: usize,
    ) {
        // SAFETY: the caller guarantees `w` is one packed group of `nb` super-blocks of
        // Q4K_BYTES, `a` and `mp` hold `R * nb` entries, and `out + r * n .. + 16` is ours
        // for every `r < R`; every load reads inside `w` or an activation block.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); R];
            let low = _mm512_set1_epi8(0x0F);
            let p = w.as_ptr();
            for b in 0..nb {
                let blk = p.add(b * Q4K_BYTES);
                super::super::prefetch(blk, Q4K_BYTES, pf);
                let mut t = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    let (c, half) = (j / 2, j % 2);
                    let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                        blk.add(Q4K_SCALES + LANES * j) as *const __m128i
                    ));
                    let mut wq = [_mm512_setzero_si512(); 8];
                    for (v, x) in wq.iter_mut().enumerate() {
                        let raw = _mm512_loadu_si512(blk.add(512 * c + 64 * v) as *const _);
                        *x = if half == 0 {
                            _mm512_and_si512(raw, low)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low)
                        };
                    }
                    for r in 0..R {
                        let y = a.get_unchecked(r * nb + b);
                        let mut s = _mm512_setzero_si512();
                        for (v, x) in wq.iter().enumerate() {
                            s = _mm512_dpbusd_epi32(
                                s,
                                *x,
                                bcast4(&y.qs, 64 * c + 32 * half + 4 * v),
                            );
                        }
                        t[r] = _mm512_add_epi32(t[r], _mm512_mullo_epi32(s, sc));
                    }
                }
                let mut mins = [_mm512_setzero_si512(); 4];
                for (q, m) in mins.iter_mut().enumerate() {
                    *m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        blk.add(Q4K_MINS + 2 * LANES * q) as *const __m256i,
                    ));
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_D) as *const __m256i));
                let dm = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q4K_DMIN) as *const __m256i));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let pairs = mp.get_unchecked(r * nb + b);
                    let mut ms = _mm512_setzero_si512();
                    for (q, m) in mins.iter().enumerate() {
                        ms = _mm512_dpwssd_epi32(ms, *m, _mm512_set1_epi32(pairs[q]));
                    }
                    let da = _mm512_set1_ps(y.d);
                    acc[r] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(dw, da), acc[r]);
                    acc[r] =
                        _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dm, da), acc[r]);
                }
            }
            for (r, v) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * n), *v);
            }
        }
    }

    /// One group of 16 Q6_K rows against R input rows (`a[r * nb + b]`), written to
    /// `out + r * n`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vl,f16c")]
    pub(in super::super) unsafe fn group_q6k<const R: usize>(
        w: &[u8],
        nb: usize,
        a: &[Q8KBlock],
        out: *mut f32,
        n: usize,
        pf: usize,
    ) {
        // SAFETY: the caller guarantees `w` is one packed group of `nb` super-blocks of
        // Q6K_BYTES, `a` holds `R * nb` blocks, and `out + r * n .. + 16` is ours for every
        // `r < R`; every load reads inside `w` or an activation block.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); R];
            let low = _mm512_set1_epi8(0x0F);
            let high = _mm512_set1_epi8(0x30);
            let p = w.as_ptr();
            for b in 0..nb {
                let blk = p.add(b * Q6K_BYTES);
                super::super::prefetch(blk, Q6K_BYTES, pf);
                let mut t = [_mm512_setzero_si512(); R];
                for q in 0..4 {
                    let quad = blk.add(Q6K_QUAD * q);
                    // Plain loops, not `array::from_fn`: a closure does not inherit this
                    // function's target features, and its intrinsics would not inline.
                    let mut hv = [_mm512_setzero_si512(); 4];
                    for (v, x) in hv.iter_mut().enumerate() {
                        *x = _mm512_loadu_si512(quad.add(512 + 64 * v) as *const _);
                    }
                    for tt in 0..4 {
                        let j = 4 * q + tt;
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                            blk.add(Q6K_SCALES + LANES * j) as *const __m128i,
                        ));
                        let mut wq = [_mm512_setzero_si512(); 4];
                        for (v, x) in wq.iter_mut().enumerate() {
                            let raw =
                                _mm512_loadu_si512(quad.add(256 * (tt / 2) + 64 * v) as *const _);
                            let nib = if tt % 2 == 0 {
                                _mm512_and_si512(raw, low)
                            } else {
                                _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low)
                            };
                            // Bits 2tt, 2tt + 1 of the high byte moved to bits 4, 5.
                            let h = match tt {
                                0 => _mm512_slli_epi16::<4>(hv[v]),
                                1 => _mm512_slli_epi16::<2>(hv[v]),
                                2 => hv[v],
                                _ => _mm512_srli_epi16::<2>(hv[v]),
                            };
                            // nib | (h & 0x30)
                            *x = _mm512_ternarylogic_epi32::<0xF8>(nib, h, high);
                        }
                        for r in 0..R {
                            let y = a.get_unchecked(r * nb + b);
                            // The quants are stored + 32: the chain starts at -32 * sum(a).
                            let mut s = _mm512_set1_epi32(-32 * y.bsums[j] as i32);
                            for (v, x) in wq.iter().enumerate() {
                                s = _mm512_dpbusd_epi32(s, *x, bcast4(&y.qs, 16 * j + 4 * v));
                            }
                            t[r] = _mm512_add_epi32(t[r], _mm512_mullo_epi32(s, sc));
                        }
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(Q6K_D) as *const __m256i));
                for r in 0..R {
                    let da = _mm512_set1_ps(a.get_unchecked(r * nb + b).d);
                    acc[r] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(dw, da), acc[r]);
                }
            }
            for (r, v) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * n), *v);
            }
        }
    }
}
