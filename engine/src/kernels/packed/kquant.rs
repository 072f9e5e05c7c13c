//! K-quants (Q4_K, Q6_K) packed `L` rows per group: 16 for the AVX-512 VNNI kernels
//! ([`avx512`]), 8 for the AVX2 ones ([`avx2`]).
//!
//! A K-quant super-block holds 256 weights with per-sub-block scales (Q4_K: 8 sub-blocks of
//! 32 with a 6-bit scale and min each; Q6_K: 16 sub-blocks of 16 with an i8 scale). As for
//! the 32-blocks in [`super`], one vector of `V = 4 * L` bytes holds 4 consecutive quants of
//! `L` different rows, so a sub-block's integer dot product lands in each row's own 32-bit
//! lane (`vpdpbusd`, or AVX2's `maddubs` + `madd`, against the broadcast activation bytes)
//! with no horizontal sum. The sub-block sums are scaled in integers (`sum_j sc_j * isum_j`,
//! exactly ggml's integer sums, so both ISAs give the same bits), and one float FMA per
//! super-block and input row applies `d_w * d_a`. Packed super-blocks keep the bytes of the
//! ggml blocks (the same bits, reordered; scales widened to bytes), so a decode step that
//! streams the weights reads no more than llama.cpp does.
//!
//! Q4_K, per super-block of `L` rows (`148 * L` bytes: 2368 for 16, 1184 for 8):
//! - quants, 4 chunks of 8 vectors: vector `(c, v)`, lane `l` = bytes `32c + 4v .. + 4` of
//!   row `l`'s `qs` (low nibbles: elements `64c + 4v ..` of sub-block `2c`; high nibbles:
//!   elements `64c + 32 + 4v ..` of sub-block `2c + 1`);
//! - 8 x L scales (`[sub-block][lane]`, u8), 4 x L x 2 mins (`[pair][lane][2]`, u8, so one
//!   zero-extension gives the i16 pairs `vpdpwssd` / `madd` multiply with the activation's
//!   pair of 32-sums), L f16 `d`, L f16 `dmin`.
//!
//! Q6_K, per super-block of `L` rows (`210 * L` bytes padded to a whole number of vectors:
//! 3392 for 16, 1696 for 8): 4 quads of 12 vectors (sub-blocks `4q .. 4q + 4`): 4 vectors
//! of low nibbles for sub-blocks `4q` (low) and `4q + 1` (high), 4 for `4q + 2` / `4q + 3`,
//! then 4 vectors of high bit pairs (bits `2t, 2t + 1` of a byte for sub-block `4q + t`);
//! vector `v`, lane `l`, byte `i` is element `4v + i` of its sub-block in row `l`. Then
//! 16 x L i8 scales (`[sub-block][lane]`) and L f16 `d`.

use super::super::blocks::{scale_min_k4, BlockQ4K, BlockQ6K};
use super::super::q8::Q8KBlock;
use super::super::QType;

/// Byte offsets inside one packed super-block of `L` rows.
#[derive(Clone, Copy)]
struct Layout {
    /// Rows per group.
    lanes: usize,
    /// Bytes per vector (`4 * lanes`).
    v: usize,
}

impl Layout {
    const fn new(lanes: usize) -> Self {
        Self {
            lanes,
            v: 4 * lanes,
        }
    }
    const fn q4k_scales(self) -> usize {
        32 * self.v
    }
    const fn q4k_mins(self) -> usize {
        self.q4k_scales() + 8 * self.lanes
    }
    const fn q4k_d(self) -> usize {
        self.q4k_mins() + 8 * self.lanes
    }
    const fn q4k_dmin(self) -> usize {
        self.q4k_d() + 2 * self.lanes
    }
    const fn q4k_bytes(self) -> usize {
        self.q4k_dmin() + 2 * self.lanes
    }
    const fn q6k_quad(self) -> usize {
        12 * self.v
    }
    const fn q6k_scales(self) -> usize {
        4 * self.q6k_quad()
    }
    const fn q6k_d(self) -> usize {
        self.q6k_scales() + 16 * self.lanes
    }
    /// Padded to a whole number of vectors, so that every quant vector of every super-block
    /// is aligned (Q4_K's already are).
    const fn q6k_bytes(self) -> usize {
        (self.q6k_d() + 2 * self.lanes).next_multiple_of(self.v)
    }
}

/// Bytes per packed super-block of `lanes` rows.
pub(super) fn block_bytes(ty: QType, lanes: usize) -> usize {
    let l = Layout::new(lanes);
    match ty {
        QType::Q4K => l.q4k_bytes(),
        _ => l.q6k_bytes(),
    }
}

/// Packs super-block `b` of rows `g * lanes ..` of a ggml matrix with `nb` super-blocks per
/// row into `dst` (`block_bytes(ty, lanes)` long).
pub(super) fn pack_block(
    ty: QType,
    lanes: usize,
    data: &[u8],
    nb: usize,
    g: usize,
    b: usize,
    dst: &mut [u8],
) {
    let lay = Layout::new(lanes);
    let vb = lay.v;
    for l in 0..lanes {
        let row = g * lanes + l;
        match ty {
            QType::Q4K => {
                let x = &super::super::cast::<BlockQ4K>(data)[row * nb + b];
                for c in 0..4 {
                    for v in 0..8 {
                        let o = 8 * vb * c + vb * v + 4 * l;
                        dst[o..o + 4].copy_from_slice(&x.qs[32 * c + 4 * v..32 * c + 4 * v + 4]);
                    }
                }
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, &x.scales);
                    dst[lay.q4k_scales() + lanes * j + l] = sc;
                    dst[lay.q4k_mins() + 2 * lanes * (j / 2) + 2 * l + j % 2] = m;
                }
                let d = lay.q4k_d() + 2 * l;
                dst[d..d + 2].copy_from_slice(&x.d.to_le_bytes());
                let dm = lay.q4k_dmin() + 2 * l;
                dst[dm..dm + 2].copy_from_slice(&x.dmin.to_le_bytes());
            }
            _ => {
                let x = &super::super::cast::<BlockQ6K>(data)[row * nb + b];
                for q in 0..4 {
                    for v in 0..4 {
                        for i in 0..4 {
                            let e = |t: usize| q6(x, 16 * (4 * q + t) + 4 * v + i);
                            let at = lay.q6k_quad() * q + vb * v + 4 * l + i;
                            dst[at] = (e(0) & 15) | (e(1) & 15) << 4;
                            dst[at + 4 * vb] = (e(2) & 15) | (e(3) & 15) << 4;
                            dst[at + 8 * vb] =
                                e(0) >> 4 | (e(1) >> 4) << 2 | (e(2) >> 4) << 4 | (e(3) >> 4) << 6;
                        }
                    }
                }
                for j in 0..16 {
                    dst[lay.q6k_scales() + lanes * j + l] = x.scales[j] as u8;
                }
                let d = lay.q6k_d() + 2 * l;
                dst[d..d + 2].copy_from_slice(&x.d.to_le_bytes());
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
    use super::super::avx512::bcast4;
    use super::*;
    use std::arch::x86_64::*;

    const LANES: usize = 16;
    const LAY: Layout = Layout::new(LANES);
    const Q4K_BYTES: usize = LAY.q4k_bytes();
    const Q4K_SCALES: usize = LAY.q4k_scales();
    const Q4K_MINS: usize = LAY.q4k_mins();
    const Q4K_D: usize = LAY.q4k_d();
    const Q4K_DMIN: usize = LAY.q4k_dmin();
    const Q6K_BYTES: usize = LAY.q6k_bytes();
    const Q6K_QUAD: usize = LAY.q6k_quad();
    const Q6K_SCALES: usize = LAY.q6k_scales();
    const Q6K_D: usize = LAY.q6k_d();

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

/// The AVX2 kernels (8 rows per group). `maddubs` multiplies the unsigned quants with the
/// broadcast signed activation bytes into `i16` pairs; a sub-block's pairs are summed in
/// `i16` where they cannot overflow (Q4_K: 8 vectors, at most 16 * 15 * 127 = 30,480 per
/// lane half; Q6_K: 2 vectors, at most 4 * 63 * 127 = 32,004), then one `madd` with the
/// sub-block's scale (widened to an `i16` pair per lane) gives the scaled `i32` sum in the
/// row's lane, exactly the integers of the AVX-512 kernels.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::avx2::bcast4;
    use super::*;
    use std::arch::x86_64::*;

    const LANES: usize = 8;
    const LAY: Layout = Layout::new(LANES);
    const V: usize = LAY.v;
    const Q4K_BYTES: usize = LAY.q4k_bytes();
    const Q6K_BYTES: usize = LAY.q6k_bytes();

    /// The 8 bytes at `p` (one per lane) widened to 32-bit lanes (`i8` when `SIGNED`,
    /// `u8` otherwise).
    #[inline(always)]
    unsafe fn widen<const SIGNED: bool>(p: *const u8) -> __m256i {
        // SAFETY: callers pass a pointer with 8 readable bytes; AVX2 is enabled in callers.
        unsafe {
            let b = _mm_loadl_epi64(p as *const __m128i);
            if SIGNED {
                _mm256_cvtepi8_epi32(b)
            } else {
                _mm256_cvtepu8_epi32(b)
            }
        }
    }

    /// `lo`'s low `i16` in each 32-bit lane's low half, `hi`'s in its high half: the `i16`
    /// pair a `madd` multiplies a lane's two `i16` sums with.
    #[inline(always)]
    unsafe fn pair(lo: __m256i, hi: __m256i) -> __m256i {
        // SAFETY: register-only AVX2 operations; AVX2 is enabled in callers.
        unsafe { _mm256_blend_epi16::<0xAA>(lo, _mm256_slli_epi32::<16>(hi)) }
    }

    /// Sub-block `j`'s i8 scales of a packed Q6_K super-block at `blk`, one per 32-bit lane
    /// (a plain function, not a closure: a closure does not inherit the kernel's target
    /// features, and its intrinsics would not inline).
    #[inline(always)]
    unsafe fn q6k_scale(blk: *const u8, j: usize) -> __m256i {
        // SAFETY: `blk` is a packed Q6_K super-block (the caller's), `j < 16`.
        unsafe { widen::<true>(blk.add(LAY.q6k_scales() + LANES * j)) }
    }

    /// One group of 8 Q4_K rows against R input rows (`a[r * nb + b]`, their min pairs
    /// `mp[r * nb + b]`), written to `out + r * n`.
    #[target_feature(enable = "avx2,fma,f16c")]
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
        // Q4K_BYTES, `a` and `mp` hold `R * nb` entries, and `out + r * n .. + 8` is ours
        // for every `r < R`; every load reads inside `w` or an activation block.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            let low = _mm256_set1_epi8(0x0F);
            let p = w.as_ptr();
            for b in 0..nb {
                let blk = p.add(b * Q4K_BYTES);
                super::super::prefetch(blk, Q4K_BYTES, pf);
                let mut t = [_mm256_setzero_si256(); R];
                for j in 0..8 {
                    let (c, half) = (j / 2, j % 2);
                    let s32 = widen::<false>(blk.add(LAY.q4k_scales() + LANES * j));
                    let sc = pair(s32, s32);
                    let mut wq = [_mm256_setzero_si256(); 8];
                    for (v, x) in wq.iter_mut().enumerate() {
                        let raw = _mm256_loadu_si256(blk.add(8 * V * c + V * v) as *const _);
                        *x = if half == 0 {
                            _mm256_and_si256(raw, low)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
                        };
                    }
                    for r in 0..R {
                        let y = a.get_unchecked(r * nb + b);
                        let at = 64 * c + 32 * half;
                        let mut s = _mm256_maddubs_epi16(wq[0], bcast4(&y.qs, at));
                        for v in 1..8 {
                            let pv = _mm256_maddubs_epi16(wq[v], bcast4(&y.qs, at + 4 * v));
                            s = _mm256_add_epi16(s, pv);
                        }
                        t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(s, sc));
                    }
                }
                let mut mins = [_mm256_setzero_si256(); 4];
                for (q, m) in mins.iter_mut().enumerate() {
                    *m = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                        blk.add(LAY.q4k_mins() + 2 * LANES * q) as *const __m128i,
                    ));
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(LAY.q4k_d()) as *const _));
                let dm = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(LAY.q4k_dmin()) as *const _));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let pairs = mp.get_unchecked(r * nb + b);
                    let mut ms = _mm256_setzero_si256();
                    for (q, m) in mins.iter().enumerate() {
                        let pm = _mm256_madd_epi16(*m, _mm256_set1_epi32(pairs[q]));
                        ms = _mm256_add_epi32(ms, pm);
                    }
                    let da = _mm256_set1_ps(y.d);
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]), _mm256_mul_ps(dw, da), acc[r]);
                    acc[r] =
                        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dm, da), acc[r]);
                }
            }
            for (r, v) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(r * n), *v);
            }
        }
    }

    /// One group of 8 Q6_K rows against R input rows (`a[r * nb + b]`), written to
    /// `out + r * n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn group_q6k<const R: usize>(
        w: &[u8],
        nb: usize,
        a: &[Q8KBlock],
        out: *mut f32,
        n: usize,
        pf: usize,
    ) {
        // SAFETY: the caller guarantees `w` is one packed group of `nb` super-blocks of
        // Q6K_BYTES, `a` holds `R * nb` blocks, and `out + r * n .. + 8` is ours for every
        // `r < R`; every load reads inside `w` or an activation block.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            let low = _mm256_set1_epi8(0x0F);
            let high = _mm256_set1_epi8(0x30);
            let p = w.as_ptr();
            for b in 0..nb {
                let blk = p.add(b * Q6K_BYTES);
                super::super::prefetch(blk, Q6K_BYTES, pf);
                let mut t = [_mm256_setzero_si256(); R];
                for q in 0..4 {
                    let quad = blk.add(LAY.q6k_quad() * q);
                    let mut hv = [_mm256_setzero_si256(); 4];
                    for (v, x) in hv.iter_mut().enumerate() {
                        *x = _mm256_loadu_si256(quad.add(8 * V + V * v) as *const _);
                    }
                    for tt in 0..4 {
                        let j = 4 * q + tt;
                        let s32 = q6k_scale(blk, j);
                        let sc = pair(s32, s32);
                        let mut wq = [_mm256_setzero_si256(); 4];
                        for (v, x) in wq.iter_mut().enumerate() {
                            let raw =
                                _mm256_loadu_si256(quad.add(4 * V * (tt / 2) + V * v) as *const _);
                            let nib = if tt % 2 == 0 {
                                _mm256_and_si256(raw, low)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
                            };
                            // Bits 2tt, 2tt + 1 of the high byte moved to bits 4, 5.
                            let h = match tt {
                                0 => _mm256_slli_epi16::<4>(hv[v]),
                                1 => _mm256_slli_epi16::<2>(hv[v]),
                                2 => hv[v],
                                _ => _mm256_srli_epi16::<2>(hv[v]),
                            };
                            *x = _mm256_or_si256(nib, _mm256_and_si256(h, high));
                        }
                        for r in 0..R {
                            let y = a.get_unchecked(r * nb + b);
                            let at = 16 * j;
                            let s01 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(wq[0], bcast4(&y.qs, at)),
                                _mm256_maddubs_epi16(wq[1], bcast4(&y.qs, at + 4)),
                            );
                            let s23 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(wq[2], bcast4(&y.qs, at + 8)),
                                _mm256_maddubs_epi16(wq[3], bcast4(&y.qs, at + 12)),
                            );
                            let s = _mm256_add_epi32(
                                _mm256_madd_epi16(s01, sc),
                                _mm256_madd_epi16(s23, sc),
                            );
                            t[r] = _mm256_add_epi32(t[r], s);
                        }
                    }
                }
                // The quants are stored + 32: subtract 32 * sum_j sc_j * bsum_j, two
                // sub-blocks per `madd` (the activation's bsums are the i16 pairs).
                let mut scp = [_mm256_setzero_si256(); 8];
                for (pp, x) in scp.iter_mut().enumerate() {
                    *x = pair(q6k_scale(blk, 2 * pp), q6k_scale(blk, 2 * pp + 1));
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(LAY.q6k_d()) as *const _));
                for r in 0..R {
                    let y = a.get_unchecked(r * nb + b);
                    let bs = y.bsums.as_ptr() as *const i32;
                    let mut off = _mm256_setzero_si256();
                    for (pp, x) in scp.iter().enumerate() {
                        let bp = _mm256_set1_epi32(std::ptr::read_unaligned(bs.add(pp)));
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(*x, bp));
                    }
                    let ti = _mm256_sub_epi32(t[r], _mm256_slli_epi32::<5>(off));
                    let da = _mm256_set1_ps(y.d);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ti), _mm256_mul_ps(dw, da), acc[r]);
                }
            }
            for (r, v) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(r * n), *v);
            }
        }
    }
}
