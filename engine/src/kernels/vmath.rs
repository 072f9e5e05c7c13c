//! Vectorised elementwise math of the forward: `exp` (8 lanes, Cephes' polynomial, within
//! 2 ulp of `f32::exp` on the range that matters), the softmax of attention rows and the
//! SwiGLU product `silu(g) * u`. Scalar fallbacks when the CPU lacks AVX2/FMA.
//!
//! A decode step takes ~300k exponentials (softmax over the context of every head and
//! layer, SiLU over the MLP width); libm's scalar `expf` was ~6 % of a verify step.

/// Whether the AVX2/FMA paths run on this CPU (checked once).
pub fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Softmax of `x[a..b]` in place; everything outside becomes 0 (masked positions).
/// Returns the maximum and the normaliser `sum(exp(x - max))` (what merges softmaxes taken
/// over parts of a row). Requires `a < b <= x.len()`.
pub fn softmax_in(x: &mut [f32], a: usize, b: usize) -> (f32, f32) {
    x[..a].fill(0.0);
    x[b..].fill(0.0);
    let v = &mut x[a..b];
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: AVX2/FMA checked above.
        return unsafe { x86::softmax(v) };
    }
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut l = 0f32;
    for e in v.iter_mut() {
        *e = (*e - m).exp();
        l += *e;
    }
    let inv = 1.0 / l;
    v.iter_mut().for_each(|e| *e *= inv);
    (m, l)
}

/// `g[i] = silu(g[i]) * u[i]` (SwiGLU).
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "silu_mul: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: AVX2/FMA checked above; equal lengths asserted.
        unsafe { x86::silu_mul(g, u) };
        return;
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `sum(x)` over 16 independent lanes (a sequential sum is one dependent add per value,
/// ~4 cycles each; this vectorises). The order differs from a left fold, so the last bits
/// can too.
pub fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `x[i] = exp(x[i])` (the same polynomial as the SIMD softmax and SiLU; for tests).
pub fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: AVX2/FMA checked above.
        unsafe { x86::exp_in_place(x) };
        return;
    }
    x.iter_mut().for_each(|v| *v = v.exp());
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `exp(x)` for 8 lanes: `2^n * p(r)` with `x = n ln2 + r`, |r| <= ln2 / 2, and
    /// Cephes' degree-5 polynomial; inputs clamped to +-88.376 (so no inf/NaN).
    #[inline(always)]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: register-only AVX2/FMA arithmetic; callers run with AVX2 and FMA enabled.
        unsafe {
            let x = _mm256_min_ps(x, _mm256_set1_ps(88.376_26));
            let x = _mm256_max_ps(x, _mm256_set1_ps(-88.376_26));
            let fx = _mm256_floor_ps(_mm256_fmadd_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
                _mm256_set1_ps(0.5),
            ));
            // r = x - n ln2 in two steps (ln2 = C1 + C2, C1 exact in few bits).
            let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
            let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
            let mut y = _mm256_set1_ps(1.987_569_1e-4);
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
            }
            let z = _mm256_mul_ps(r, r);
            let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
            let n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
            let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(n));
            _mm256_mul_ps(y, pow2n)
        }
    }

    /// `fn $name(v) -> f32`: the 8 lanes of `v` folded with `$ps` (halves, then pairs) and
    /// `$ss` (the last two).
    macro_rules! horizontal {
        ($name:ident, $ps:ident, $ss:ident) => {
            #[inline(always)]
            unsafe fn $name(v: __m256) -> f32 {
                // SAFETY: register-only SSE/AVX arithmetic; callers run with AVX2 enabled.
                unsafe {
                    let s = $ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                    let s = $ps(s, _mm_movehl_ps(s, s));
                    let s = $ss(s, _mm_movehdup_ps(s));
                    _mm_cvtss_f32(s)
                }
            }
        };
    }

    horizontal!(hsum, _mm_add_ps, _mm_add_ss);
    horizontal!(hmax, _mm_max_ps, _mm_max_ss);

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        // SAFETY: each load and store covers one 8-value chunk of `x` (`chunks_exact_mut`);
        // the features `exp8` needs are enabled on this function.
        unsafe {
            let mut c = x.chunks_exact_mut(8);
            for v in &mut c {
                _mm256_storeu_ps(v.as_mut_ptr(), exp8(_mm256_loadu_ps(v.as_ptr())));
            }
            tail(c.into_remainder(), |v| exp8(v));
        }
    }

    /// Applies `f` to a slice shorter than 8 through a padded vector.
    #[inline(always)]
    unsafe fn tail(x: &mut [f32], f: impl Fn(__m256) -> __m256) {
        // SAFETY: loads and stores touch only the local 8-value buffer; AVX is enabled in
        // callers.
        unsafe {
            if x.is_empty() {
                return;
            }
            let mut buf = [0f32; 8];
            buf[..x.len()].copy_from_slice(x);
            _mm256_storeu_ps(buf.as_mut_ptr(), f(_mm256_loadu_ps(buf.as_ptr())));
            let n = x.len();
            x.copy_from_slice(&buf[..n]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(v: &mut [f32]) -> (f32, f32) {
        // SAFETY: `i + 8 <= n8 <= v.len()` for every load and store through `p`; the
        // features `exp8` needs are enabled on this function.
        unsafe {
            let n8 = v.len() / 8 * 8;
            let p = v.as_mut_ptr();
            let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in (0..n8).step_by(8) {
                mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
            }
            let m = v[n8..].iter().fold(hmax(mv), |a, &b| a.max(b));
            let mb = _mm256_set1_ps(m);
            let mut sv = _mm256_setzero_ps();
            for i in (0..n8).step_by(8) {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mb));
                _mm256_storeu_ps(p.add(i), e);
                sv = _mm256_add_ps(sv, e);
            }
            let rest = &mut v[n8..];
            tail(rest, |x| exp8(_mm256_sub_ps(x, mb)));
            let l = rest.iter().fold(hsum(sv), |a, &b| a + b);
            let inv = _mm256_set1_ps(1.0 / l);
            for i in (0..n8).step_by(8) {
                _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
            }
            v[n8..].iter_mut().for_each(|e| *e /= l);
            (m, l)
        }
    }

    #[inline(always)]
    unsafe fn silu8(g: __m256, u: __m256) -> __m256 {
        // SAFETY: register-only AVX2/FMA arithmetic; callers run with both enabled.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let den = _mm256_add_ps(_mm256_set1_ps(1.0), e);
            _mm256_mul_ps(_mm256_div_ps(g, den), u)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        // SAFETY: the caller asserted `u.len() == g.len()`, so `i + 8 <= n8` keeps every load
        // and store inside `g` and `u`; AVX2/FMA are enabled on this function.
        unsafe {
            let n8 = g.len() / 8 * 8;
            let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
            for i in (0..n8).step_by(8) {
                _mm256_storeu_ps(
                    gp.add(i),
                    silu8(_mm256_loadu_ps(gp.add(i)), _mm256_loadu_ps(up.add(i))),
                );
            }
            for i in n8..g.len() {
                g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f32) -> f32 {
        (a - b).abs() / b.abs().max(1e-30)
    }

    #[test]
    fn exp_matches_libm_within_2_ulp_scale() {
        let xs: Vec<f32> = (0..20_000)
            .map(|i| -87.0 + i as f32 * (175.0 / 20_000.0))
            .collect();
        let mut y = xs.clone();
        exp_in_place(&mut y);
        for (&x, &e) in xs.iter().zip(&y) {
            assert!(rel(e, x.exp()) < 3e-7, "exp({x}) = {e}, libm {}", x.exp());
        }
        // Clamped, finite extremes; odd tail lengths.
        let mut ext = vec![-1e4f32, 1e4, 0.0, -0.0, 1e-8];
        exp_in_place(&mut ext);
        assert!(ext[0] >= 0.0 && ext[0] < 1e-37 && ext[1].is_finite() && ext[1] > 1e38);
        assert_eq!(ext[2], 1.0);
        assert_eq!(ext[3], 1.0);
        assert!(rel(ext[4], 1.0) < 1e-7);
    }

    #[test]
    fn softmax_matches_the_scalar_definition_and_masks() {
        for len in [1usize, 7, 8, 9, 31, 256, 1000] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.3)
                .collect();
            let (a, b) = (len / 5, len - len / 7);
            let mut y = x.clone();
            let (got_m, got_l) = softmax_in(&mut y, a, b);
            let m = x[a..b].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let l: f64 = x[a..b].iter().map(|v| ((v - m) as f64).exp()).sum();
            assert_eq!(got_m, m);
            assert!(
                ((got_l as f64 - l) / l).abs() < 1e-5,
                "normaliser {got_l} vs {l}"
            );
            for i in 0..len {
                let want = if (a..b).contains(&i) {
                    (((x[i] - m) as f64).exp() / l) as f32
                } else {
                    0.0
                };
                assert!(
                    (y[i] - want).abs() < 1e-6,
                    "len {len} i {i}: {} vs {want}",
                    y[i]
                );
            }
        }
    }

    #[test]
    fn silu_mul_matches_the_scalar_definition() {
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.05).collect();
        let u: Vec<f32> = (0..1003).map(|i| 1.0 + (i % 13) as f32 * 0.25).collect();
        let mut y = g.clone();
        silu_mul(&mut y, &u);
        for i in 0..g.len() {
            let want = g[i] as f64 / (1.0 + (-g[i] as f64).exp()) * u[i] as f64;
            assert!(
                (y[i] as f64 - want).abs() < 1e-6 * want.abs().max(1.0),
                "{} vs {want}",
                y[i]
            );
        }
        // Large negative gates saturate to -0, never NaN.
        let mut big = vec![-200f32; 9];
        silu_mul(&mut big, &[1.0; 9]);
        assert!(big.iter().all(|v| v.abs() < 1e-30 && !v.is_nan()));
    }
}
