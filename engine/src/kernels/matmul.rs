//! Tiled driver: `out[m, n] = x[m, k] · W[n, k]ᵀ` for a quantized `W`.
//!
//! 1. The `m` input rows are quantised once (the format the weight type multiplies with).
//! 2. The `n` weight rows are cut into chunks sized to stay in L1/L2, which run in parallel on
//!    rayon's (persistent) global pool.
//! 3. Inside a chunk, input rows go in tiles of 4: each weight block is unpacked once per tile
//!    and multiplied with 4 activation rows held in registers. The chunk's weights come from
//!    memory once; later tiles find them in cache.

use super::dot::Kernel;
use rayon::prelude::*;

/// Instruction set used by the dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
}

impl Isa {
    /// The best one this CPU supports (AVX2 + FMA + F16C), unless `DSPARK_KERNEL_ISA=scalar`.
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            if std::env::var("DSPARK_KERNEL_ISA").as_deref() == Ok("scalar") {
                return Isa::Scalar;
            }
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
            Isa::Scalar
        })
    }
}

/// Input rows per register tile.
const TILE: usize = 4;
/// Bytes of weights per chunk: small enough that a chunk stays in L1/L2 while every input
/// tile passes over it.
const CHUNK_BYTES: usize = 24 * 1024;
/// Multiply-adds below which the call stays on the calling thread (a parallel region costs a
/// few microseconds).
const PAR_MIN_WORK: usize = 1 << 19;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the workers write disjoint elements (each output column belongs to one chunk).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[i * n + j] = sum_l x[i * k + l] * W[j, l]` with `W` given as `n * k / BLOCK` blocks.
pub fn matmul<K: Kernel>(
    w: &[K::W],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    isa: Isa,
) {
    let nb = k / K::BLOCK;
    assert!(
        k.is_multiple_of(K::BLOCK),
        "k = {k} is not a multiple of {}",
        K::BLOCK
    );
    assert_eq!(w.len(), n * nb, "weight blocks");
    assert_eq!(x.len(), m * k, "input length");
    assert_eq!(out.len(), m * n, "output length");
    if m == 0 || n == 0 {
        return;
    }
    let mut acts = vec![K::A::default(); m * nb];
    if m * k >= 1 << 16 {
        acts.par_chunks_mut(nb)
            .zip(x.par_chunks(k))
            .for_each(|(a, x)| K::quantize(x, a));
    } else {
        for (a, x) in acts.chunks_mut(nb).zip(x.chunks(k)) {
            K::quantize(x, a);
        }
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let acts = &acts[..];
    let run = |j0: usize, j1: usize| {
        let mut r0 = 0;
        while r0 < m {
            let rows = (m - r0).min(TILE);
            match rows {
                4 => tile::<K, 4>(w, nb, acts, r0, j0, j1, n, out_ptr, isa),
                3 => tile::<K, 3>(w, nb, acts, r0, j0, j1, n, out_ptr, isa),
                2 => tile::<K, 2>(w, nb, acts, r0, j0, j1, n, out_ptr, isa),
                _ => tile::<K, 1>(w, nb, acts, r0, j0, j1, n, out_ptr, isa),
            }
            r0 += rows;
        }
    };
    let threads = rayon::current_num_threads();
    if threads <= 1 || m * n * k < PAR_MIN_WORK {
        run(0, n);
        return;
    }
    let row_bytes = nb * std::mem::size_of::<K::W>();
    let fit = (CHUNK_BYTES / row_bytes).max(1);
    let rows = n.div_ceil(threads * 4).clamp(1, fit);
    let chunks = n.div_ceil(rows);
    (0..chunks).into_par_iter().for_each(|c| {
        let j0 = c * rows;
        run(j0, (j0 + rows).min(n));
    });
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile<K: Kernel, const R: usize>(
    w: &[K::W],
    nb: usize,
    acts: &[K::A],
    r0: usize,
    j0: usize,
    j1: usize,
    n: usize,
    out: OutPtr,
    isa: Isa,
) {
    let a: [&[K::A]; R] = std::array::from_fn(|i| &acts[(r0 + i) * nb..(r0 + i + 1) * nb]);
    for j in j0..j1 {
        let wr = &w[j * nb..(j + 1) * nb];
        let mut o = [0f32; R];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only chosen when the CPU has AVX2, FMA and F16C; every
            // activation row has `nb` blocks like the weight row.
            Isa::Avx2 => unsafe { K::dot_avx2::<R>(wr, &a, &mut o) },
            _ => {
                for (o, a) in o.iter_mut().zip(&a) {
                    *o = K::dot_scalar(wr, a);
                }
            }
        }
        for (r, &v) in o.iter().enumerate() {
            // SAFETY: (r0 + r) < m and j < n, so the index is inside `out`; no other worker
            // writes column j.
            unsafe { *out.0.add((r0 + r) * n + j) = v };
        }
    }
}
