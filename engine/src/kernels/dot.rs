//! Block dot products: one weight row against R activation rows (R = 1..=4), so that each
//! weight block is loaded and unpacked once per R rows.
//!
//! Every weight type has a portable scalar version (exact integer sums per block, then
//! `d_w * d_a * sum` in f32, as ggml's reference code) and an AVX2/FMA version with ggml's x86
//! arithmetic (`maddubs`/`madd` integer sums, f32 lane accumulators). Both compute the same
//! integer block sums; they differ only in the order of the f32 additions.

#![allow(clippy::needless_range_loop)]

use super::blocks::*;
use super::q8::{quantize_q8, quantize_q8k, Q8Block, Q8KBlock};

/// A weight type together with the activation format it multiplies.
pub trait Kernel: Sync + 'static {
    type W: Copy + Sync + Dequant;
    type A: Copy + Default + Send + Sync;
    /// Weights per block (32 or 256); the activation block has the same length.
    const BLOCK: usize = <Self::W as Dequant>::BLOCK;
    fn quantize(x: &[f32], out: &mut [Self::A]);
    fn dot_scalar(w: &[Self::W], a: &[Self::A]) -> f32;
    /// `out[r] = dot(w, a[r])` for R activation rows.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and every `a[r]` must be as long as `w`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self::W], a: &[&[Self::A]; R], out: &mut [f32; R]);
}

pub struct Q4_0;
pub struct Q4_1;
pub struct Q5_0;
pub struct Q5_1;
pub struct Q8_0;
pub struct Q4K;
pub struct Q6K;

#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [u8; 32] {
    let mut v = [0u8; 32];
    for j in 0..16 {
        v[j] = qs[j] & 0xF;
        v[j + 16] = qs[j] >> 4;
    }
    v
}

#[inline(always)]
fn q5(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let h = u32::from_le_bytes(*qh);
    let mut v = nibbles(qs);
    for (j, x) in v.iter_mut().enumerate() {
        *x |= (((h >> j) & 1) as u8) << 4;
    }
    v
}

#[inline(always)]
fn isum(q: &[u8; 32], off: i32, y: &[i8; 32]) -> i32 {
    q.iter()
        .zip(y)
        .map(|(&q, &y)| (q as i32 - off) * y as i32)
        .sum()
}

impl Kernel for Q4_0 {
    type W = BlockQ4_0;
    type A = Q8Block;
    fn quantize(x: &[f32], out: &mut [Q8Block]) {
        quantize_q8(x, out)
    }
    fn dot_scalar(w: &[BlockQ4_0], a: &[Q8Block]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            s += (f16_to_f32(b.d) * y.d) * isum(&nibbles(&b.qs), 8, &y.qs) as f32;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ4_0], a: &[&[Q8Block]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q4_0(w, a, out) }
    }
}

impl Kernel for Q4_1 {
    type W = BlockQ4_1;
    type A = Q8Block;
    fn quantize(x: &[f32], out: &mut [Q8Block]) {
        quantize_q8(x, out)
    }
    fn dot_scalar(w: &[BlockQ4_1], a: &[Q8Block]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            s += (f16_to_f32(b.d) * y.d) * isum(&nibbles(&b.qs), 0, &y.qs) as f32
                + f16_to_f32(b.m) * y.s;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ4_1], a: &[&[Q8Block]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q4_1(w, a, out) }
    }
}

impl Kernel for Q5_0 {
    type W = BlockQ5_0;
    type A = Q8Block;
    fn quantize(x: &[f32], out: &mut [Q8Block]) {
        quantize_q8(x, out)
    }
    fn dot_scalar(w: &[BlockQ5_0], a: &[Q8Block]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            s += (f16_to_f32(b.d) * y.d) * isum(&q5(&b.qh, &b.qs), 16, &y.qs) as f32;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ5_0], a: &[&[Q8Block]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q5_0(w, a, out) }
    }
}

impl Kernel for Q5_1 {
    type W = BlockQ5_1;
    type A = Q8Block;
    fn quantize(x: &[f32], out: &mut [Q8Block]) {
        quantize_q8(x, out)
    }
    fn dot_scalar(w: &[BlockQ5_1], a: &[Q8Block]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            s += (f16_to_f32(b.d) * y.d) * isum(&q5(&b.qh, &b.qs), 0, &y.qs) as f32
                + f16_to_f32(b.m) * y.s;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ5_1], a: &[&[Q8Block]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q5_1(w, a, out) }
    }
}

impl Kernel for Q8_0 {
    type W = BlockQ8_0;
    type A = Q8Block;
    fn quantize(x: &[f32], out: &mut [Q8Block]) {
        quantize_q8(x, out)
    }
    fn dot_scalar(w: &[BlockQ8_0], a: &[Q8Block]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            let i: i32 =
                b.qs.iter()
                    .zip(&y.qs)
                    .map(|(&x, &y)| x as i32 * y as i32)
                    .sum();
            s += (f16_to_f32(b.d) * y.d) * i as f32;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ8_0], a: &[&[Q8Block]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q8_0(w, a, out) }
    }
}

/// The 8 scales and 8 mins of a Q4_K super-block.
#[inline(always)]
fn q4k_scales(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = scale_min_k4(j, s);
    }
    (sc, mn)
}

impl Kernel for Q4K {
    type W = BlockQ4K;
    type A = Q8KBlock;
    fn quantize(x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8k(x, out)
    }
    fn dot_scalar(w: &[BlockQ4K], a: &[Q8KBlock]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            let (sc, mn) = q4k_scales(&b.scales);
            let mut mins = 0i32;
            for j in 0..16 {
                mins += y.bsums[j] as i32 * mn[j / 2] as i32;
            }
            let mut sumi = 0i32;
            for c in 0..4 {
                let q = &b.qs[32 * c..32 * c + 32];
                let (mut lo, mut hi) = (0i32, 0i32);
                for l in 0..32 {
                    lo += (q[l] & 0xF) as i32 * y.qs[64 * c + l] as i32;
                    hi += (q[l] >> 4) as i32 * y.qs[64 * c + 32 + l] as i32;
                }
                sumi += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
            }
            s += y.d * f16_to_f32(b.d) * sumi as f32 - y.d * f16_to_f32(b.dmin) * mins as f32;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ4K], a: &[&[Q8KBlock]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q4k(w, a, out) }
    }
}

impl Kernel for Q6K {
    type W = BlockQ6K;
    type A = Q8KBlock;
    fn quantize(x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8k(x, out)
    }
    fn dot_scalar(w: &[BlockQ6K], a: &[Q8KBlock]) -> f32 {
        let mut s = 0f32;
        for (b, y) in w.iter().zip(a) {
            let mut sumi = 0i32;
            for h in 0..2 {
                let ql = &b.ql[64 * h..64 * h + 64];
                let qh = &b.qh[32 * h..32 * h + 32];
                let q8 = &y.qs[128 * h..128 * h + 128];
                let sc = &b.scales[8 * h..8 * h + 8];
                let mut g = [0i32; 8];
                for l in 0..32 {
                    let is = l / 16;
                    let [q1, q2, q3, q4] = q6k_quants(ql, qh, l);
                    g[is] += q1 * q8[l] as i32;
                    g[is + 2] += q2 * q8[l + 32] as i32;
                    g[is + 4] += q3 * q8[l + 64] as i32;
                    g[is + 6] += q4 * q8[l + 96] as i32;
                }
                for (gi, &si) in g.iter().zip(sc) {
                    sumi += gi * si as i32;
                }
            }
            s += y.d * f16_to_f32(b.d) * sumi as f32;
        }
        s
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[BlockQ6K], a: &[&[Q8KBlock]; R], out: &mut [f32; R]) {
        // SAFETY: the trait's contract (AVX2, FMA and F16C present; every `a[r]` as long as
        // `w`) is the AVX2 kernel's.
        unsafe { avx2::q6k(w, a, out) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register-only SSE/AVX arithmetic; callers run with AVX2 enabled.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// 16 bytes of nibbles -> 32 bytes 0..15: low nibbles first, then high nibbles.
    #[inline(always)]
    unsafe fn nibbles32(p: *const u8) -> __m256i {
        // SAFETY: callers pass a block's 16 packed nibble bytes; AVX2 is enabled in them.
        unsafe {
            let t = _mm_loadu_si128(p as *const __m128i);
            let b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
            _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
        }
    }

    /// Byte i is 0xFF where bit i of the 32-bit word is set.
    #[inline(always)]
    unsafe fn bits32(p: *const u8) -> __m256i {
        // SAFETY: callers pass a block's 4 `qh` bytes; AVX2 is enabled in them.
        unsafe {
            let x = u32::from_le_bytes(*(p as *const [u8; 4]));
            let shuf = _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0x0000000000000000,
            );
            let b = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
            let b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
            _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1))
        }
    }

    /// Sums of unsigned x signed byte products, as 8 f32 lanes.
    #[inline(always)]
    unsafe fn us8(ux: __m256i, sy: __m256i) -> __m256 {
        // SAFETY: register-only AVX2 arithmetic; callers run with AVX2 enabled.
        unsafe {
            let p = _mm256_maddubs_epi16(ux, sy);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn load(p: &[i8; 32]) -> __m256i {
        // SAFETY: reads exactly the 32 bytes of `p`; callers run with AVX2 enabled.
        unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
    }

    /// One weight block against R activation rows. Signed quants (Q4_0, Q5_0, Q8_0, with a
    /// Q8_0 partner): `ax = |x|` once per weight block, the sign moves to each activation row.
    /// Unsigned quants with a min (Q4_1, Q5_1, Q8_1 partner): `d * sum + m * s`.
    #[inline(always)]
    unsafe fn step<const R: usize, const SIGNED: bool>(
        (qx, d, m): (__m256i, f32, f32),
        i: usize,
        a: &[&[Q8Block]; R],
        acc: &mut [__m256; R],
        mins: &mut [f32; R],
    ) {
        // SAFETY: `i` indexes a block every `a[r]` holds (the kernels' contract: each
        // activation row is as long as the weight row); AVX2/FMA are enabled in callers.
        unsafe {
            let ax = if SIGNED { _mm256_sign_epi8(qx, qx) } else { qx };
            for r in 0..R {
                let y = a[r].get_unchecked(i);
                let sy = if SIGNED {
                    _mm256_sign_epi8(load(&y.qs), qx)
                } else {
                    load(&y.qs)
                };
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), us8(ax, sy), acc[r]);
                if !SIGNED {
                    mins[r] += m * y.s;
                }
            }
        }
    }

    /// The loop over a row of 32-blocks, two blocks per iteration into two sets of
    /// accumulators (breaks the FMA dependency chain when R is small).
    #[inline(always)]
    unsafe fn drive32<W, const R: usize, const SIGNED: bool>(
        w: &[W],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
        decode: impl Fn(&W) -> (__m256i, f32, f32),
    ) {
        // SAFETY: `i` and `i + 1` stay below `w.len()` (pairs, then the odd tail), and every
        // `a[r]` is as long as `w` (the kernels' contract), as `step` needs.
        unsafe {
            let mut acc0 = [_mm256_setzero_ps(); R];
            let mut acc1 = [_mm256_setzero_ps(); R];
            let mut min0 = [0f32; R];
            let mut min1 = [0f32; R];
            let pairs = w.len() / 2;
            for p in 0..pairs {
                let i = 2 * p;
                step::<R, SIGNED>(decode(w.get_unchecked(i)), i, a, &mut acc0, &mut min0);
                step::<R, SIGNED>(
                    decode(w.get_unchecked(i + 1)),
                    i + 1,
                    a,
                    &mut acc1,
                    &mut min1,
                );
            }
            if w.len() % 2 == 1 {
                let i = w.len() - 1;
                step::<R, SIGNED>(decode(w.get_unchecked(i)), i, a, &mut acc0, &mut min0);
            }
            for r in 0..R {
                out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + (min0[r] + min1[r]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q4_0<const R: usize>(
        w: &[BlockQ4_0],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: the caller guarantees every `a[r]` is as long as `w`; the target features
        // `drive32` and its helpers need are enabled on this function.
        unsafe {
            drive32::<_, R, true>(w, a, out, |b| {
                let qx = _mm256_sub_epi8(nibbles32(b.qs.as_ptr()), _mm256_set1_epi8(8));
                (qx, f16_to_f32(b.d), 0.0)
            })
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q8_0<const R: usize>(
        w: &[BlockQ8_0],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: as in `q4_0`: rows as long as `w`, target features enabled here.
        unsafe { drive32::<_, R, true>(w, a, out, |b| (load(&b.qs), f16_to_f32(b.d), 0.0)) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q5_0<const R: usize>(
        w: &[BlockQ5_0],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: as in `q4_0`: rows as long as `w`, target features enabled here.
        unsafe {
            drive32::<_, R, true>(w, a, out, |b| {
                let hi = _mm256_andnot_si256(bits32(b.qh.as_ptr()), _mm256_set1_epi8(0xF0u8 as i8));
                let qx = _mm256_or_si256(nibbles32(b.qs.as_ptr()), hi);
                (qx, f16_to_f32(b.d), 0.0)
            })
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q4_1<const R: usize>(
        w: &[BlockQ4_1],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: as in `q4_0`: rows as long as `w`, target features enabled here.
        unsafe {
            drive32::<_, R, false>(w, a, out, |b| {
                (nibbles32(b.qs.as_ptr()), f16_to_f32(b.d), f16_to_f32(b.m))
            })
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q5_1<const R: usize>(
        w: &[BlockQ5_1],
        a: &[&[Q8Block]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: as in `q4_0`: rows as long as `w`, target features enabled here.
        unsafe {
            drive32::<_, R, false>(w, a, out, |b| {
                let hi = _mm256_and_si256(bits32(b.qh.as_ptr()), _mm256_set1_epi8(0x10));
                let qx = _mm256_or_si256(nibbles32(b.qs.as_ptr()), hi);
                (qx, f16_to_f32(b.d), f16_to_f32(b.m))
            })
        }
    }

    /// Sums of 16 i16 bsums pairwise -> the 8 per-32 sums as i16 in a 128-bit vector.
    #[inline(always)]
    unsafe fn bsums32(y: &Q8KBlock) -> __m128i {
        // SAFETY: reads the 16 `i16` block sums of `y` (32 bytes); AVX2 is enabled in callers.
        unsafe {
            let s = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
            _mm_hadd_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q4k<const R: usize>(
        w: &[BlockQ4K],
        a: &[&[Q8KBlock]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: every `a[r]` is as long as `w` (the caller's contract), so `get_unchecked(i)`
        // is in bounds; loads read inside one 256-weight block (`qs` 128 bytes, the
        // activation's 256 `qs`), the scale copy is the block's 12 bytes; features enabled here.
        unsafe {
            const KM1: u32 = 0x3f3f3f3f;
            const KM2: u32 = 0x0f0f0f0f;
            const KM3: u32 = 0x03030303;
            let m4 = _mm256_set1_epi8(0xF);
            let mut acc = [_mm256_setzero_ps(); R];
            let mut acc_m = [_mm_setzero_ps(); R];
            for (i, b) in w.iter().enumerate() {
                let mut u = [0u32; 4];
                std::ptr::copy_nonoverlapping(b.scales.as_ptr(), u.as_mut_ptr() as *mut u8, 12);
                u[3] = ((u[2] >> 4) & KM2) | (((u[1] >> 6) & KM3) << 4);
                let aux = u[1] & KM1;
                u[1] = (u[2] & KM2) | (((u[0] >> 6) & KM3) << 4);
                u[2] = aux;
                u[0] &= KM1;
                let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(
                    u[3] as i32,
                    u[2] as i32,
                    u[1] as i32,
                    u[0] as i32,
                ));
                let mins = _mm256_extracti128_si256(ms, 1);
                let sc128 = _mm256_castsi256_si128(ms);
                let scales = _mm256_set_m128i(sc128, sc128);
                let (dw, dminw) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
                let mut sumi = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let prod = _mm_madd_epi16(mins, bsums32(y));
                    acc_m[r] =
                        _mm_fmadd_ps(_mm_set1_ps(-y.d * dminw), _mm_cvtepi32_ps(prod), acc_m[r]);
                }
                for j in 0..4 {
                    let sl = _mm256_shuffle_epi8(
                        scales,
                        _mm256_set1_epi16(0x0100 + 0x0202 * (2 * j as i16)),
                    );
                    let sh = _mm256_shuffle_epi8(
                        scales,
                        _mm256_set1_epi16(0x0100 + 0x0202 * (2 * j as i16 + 1)),
                    );
                    let q4 = _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i);
                    let q4l = _mm256_and_si256(q4, m4);
                    let q4h = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr().add(64 * j);
                        let q8l = _mm256_loadu_si256(q8 as *const __m256i);
                        let q8h = _mm256_loadu_si256(q8.add(32) as *const __m256i);
                        let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(q4l, q8l));
                        let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(q4h, q8h));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                    }
                }
                for r in 0..R {
                    let d = a[r].get_unchecked(i).d * dw;
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
                }
            }
            for r in 0..R {
                let m = acc_m[r];
                let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                out[r] = hsum(acc[r]) + _mm_cvtss_f32(m);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q6k<const R: usize>(
        w: &[BlockQ6K],
        a: &[&[Q8KBlock]; R],
        out: &mut [f32; R],
    ) {
        // SAFETY: every `a[r]` is as long as `w` (the caller's contract), so `get_unchecked(i)`
        // is in bounds; loads read inside one block (`ql` 128, `qh` 64, `scales` 16 bytes,
        // the activation's `qs` and `bsums`); features enabled here.
        unsafe {
            let m4 = _mm256_set1_epi8(0xF);
            let m2 = _mm256_set1_epi8(3);
            let mut acc = [_mm256_setzero_ps(); R];
            for (i, b) in w.iter().enumerate() {
                let sc8 = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
                // 32 * sum over 16-groups of scale * bsum: the "- 32" of every quant.
                let sc16 = _mm256_cvtepi8_epi16(sc8);
                let mut sumi = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                    sumi[r] = _mm256_sub_epi32(
                        sumi[r],
                        _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5),
                    );
                }
                for h in 0..2 {
                    let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h) as *const __m256i);
                    let ql2 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h) as *const __m256i);
                    let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4);
                    let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4);
                    let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4);
                    let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4);
                    let q = [
                        _mm256_or_si256(_mm256_and_si256(ql1, m4), h0),
                        _mm256_or_si256(_mm256_and_si256(ql2, m4), h1),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h2),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql2, 4), m4), h3),
                    ];
                    let mut s = [_mm256_setzero_si256(); 4];
                    for (c, sc) in s.iter_mut().enumerate() {
                        // scales[8h + 2c] for the first 16 quants, [8h + 2c + 1] for the next 16.
                        let k = (8 * h + 2 * c) as i8;
                        let shuf = _mm_set_epi8(
                            k + 1,
                            k + 1,
                            k + 1,
                            k + 1,
                            k + 1,
                            k + 1,
                            k + 1,
                            k + 1,
                            k,
                            k,
                            k,
                            k,
                            k,
                            k,
                            k,
                            k,
                        );
                        *sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf));
                    }
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr().add(128 * h);
                        let mut t = _mm256_setzero_si256();
                        for c in 0..4 {
                            let y = _mm256_loadu_si256(q8.add(32 * c) as *const __m256i);
                            let p = _mm256_madd_epi16(s[c], _mm256_maddubs_epi16(q[c], y));
                            t = _mm256_add_epi32(t, p);
                        }
                        sumi[r] = _mm256_add_epi32(sumi[r], t);
                    }
                }
                for r in 0..R {
                    let d = a[r].get_unchecked(i).d * f16_to_f32(b.d);
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
                }
            }
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
        }
    }
}
