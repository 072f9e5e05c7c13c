//! Tiled driver: `out[m, n] = x[m, k] · W[n, k]ᵀ` for a quantized `W`.
//!
//! 1. The `m` input rows are quantised once (the format the weight type multiplies with).
//! 2. The `n` weight rows are cut into chunks sized to stay in L1/L2, which run in parallel on
//!    the kernel pool ([`super::pool`], not rayon: a step has ~150 short parallel regions).
//! 3. Inside a chunk, input rows go in tiles of 4: each weight block is unpacked once per tile
//!    and multiplied with 4 activation rows held in registers. The chunk's weights come from
//!    memory once; later tiles find them in cache.

use super::dot::Kernel;
use super::pool;

/// Instruction set used by the dot products.
/// Ordered: each one includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C (packed Q4_0 / Q4_1 / Q8_0 weights use [`super::packed`]).
    Avx2,
    /// Avx2 plus AVX-512 F/BW/VL/VNNI (wider packed kernels, [`super::packed`]).
    Avx512Vnni,
}

impl Isa {
    /// The best one this CPU supports.
    pub fn supported() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return if super::packed::avx512_available() {
                    Isa::Avx512Vnni
                } else {
                    Isa::Avx2
                };
            }
            Isa::Scalar
        })
    }

    /// The one to use: [`Isa::supported`], lowered by `DSPARK_KERNEL_ISA=scalar|avx2`.
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let cap = match std::env::var("DSPARK_KERNEL_ISA").as_deref() {
                Ok("scalar") => Isa::Scalar,
                Ok("avx2") => Isa::Avx2,
                _ => Isa::Avx512Vnni,
            };
            Isa::supported().min(cap)
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

/// Where a chunk writes: row `i` of the output starts at `ptr + i * n`; the workers write
/// disjoint elements (each output column belongs to one chunk).
pub type OutPtr = pool::SharedMut<f32>;

/// Quantises the `m` rows of `x` (`k` each) for kernel `K`.
pub fn quantize_rows<K: Kernel>(x: &[f32], m: usize, k: usize) -> Vec<K::A> {
    assert!(
        k.is_multiple_of(K::BLOCK),
        "k = {k} is not a multiple of {}",
        K::BLOCK
    );
    assert_eq!(x.len(), m * k, "input length");
    let nb = k / K::BLOCK;
    let mut acts = vec![K::A::default(); m * nb];
    let ptr = pool::SharedMut::new(&mut acts);
    pool::for_rows(m, pool::PAR_ROWS, 1, &|r0, r1| {
        // SAFETY: this range writes only rows r0..r1's blocks.
        let a = unsafe { ptr.slice(r0 * nb, (r1 - r0) * nb) };
        for (a, x) in a.chunks_mut(nb).zip(x[r0 * k..r1 * k].chunks(k)) {
            K::quantize(x, a);
        }
    });
    acts
}

/// Output columns `j0..j1` of all `m` rows: `out[i * n + j] = dot(W[j], acts[i])`.
///
/// # Safety
/// `out` must point to an `m * n` buffer in which no one else writes columns `j0..j1`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn run_rows<K: Kernel>(
    w: &[K::W],
    n: usize,
    acts: &[K::A],
    m: usize,
    j0: usize,
    j1: usize,
    out: OutPtr,
    isa: Isa,
) {
    let nb = acts.len() / m;
    assert!(w.len() >= j1 * nb && j1 <= n, "weight rows");
    let mut r0 = 0;
    while r0 < m {
        let rows = (m - r0).min(TILE);
        match rows {
            4 => tile::<K, 4>(w, nb, acts, r0, j0, j1, n, out, isa),
            3 => tile::<K, 3>(w, nb, acts, r0, j0, j1, n, out, isa),
            2 => tile::<K, 2>(w, nb, acts, r0, j0, j1, n, out, isa),
            _ => tile::<K, 1>(w, nb, acts, r0, j0, j1, n, out, isa),
        }
        r0 += rows;
    }
}

/// Cuts the rows of each matrix (`(n, row_bytes, align)`) into chunks for the pool: small
/// enough to stay in cache, at least 4 per thread over all matrices, chunk boundaries on
/// multiples of `align` (which divides `n`). Returns `(matrix, j0, j1)` jobs, or one job per
/// matrix when the work is too small to share.
pub fn plan(shapes: &[(usize, usize, usize)], work: usize) -> Vec<(usize, usize, usize)> {
    let threads = pool::global().size();
    let serial = threads <= 1 || work < PAR_MIN_WORK;
    let total: usize = shapes.iter().map(|s| s.0).sum();
    let mut jobs = Vec::new();
    for (i, &(n, row_bytes, align)) in shapes.iter().enumerate() {
        let rows = if serial {
            n.max(1)
        } else {
            let fit = (CHUNK_BYTES / row_bytes.max(1)).max(1);
            // This matrix's share of threads * 4 chunks.
            let want = (threads * 4 * n).div_ceil(total.max(1)).max(1);
            n.div_ceil(want).clamp(1, fit)
        };
        let rows = rows.next_multiple_of(align.max(1));
        let mut j0 = 0;
        while j0 < n {
            jobs.push((i, j0, (j0 + rows).min(n)));
            j0 += rows;
        }
    }
    jobs
}

/// Runs `job` for every planned chunk, on the pool when there is more than one.
pub fn execute(jobs: &[(usize, usize, usize)], job: impl Fn(usize, usize, usize) + Sync) {
    pool::run(jobs.len(), &|t| {
        let (i, j0, j1) = jobs[t];
        job(i, j0, j1)
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
            // SAFETY: `Isa::Avx2` and above are only chosen when the CPU has AVX2, FMA and F16C; every
            // activation row has `nb` blocks like the weight row.
            Isa::Avx2 | Isa::Avx512Vnni => unsafe { K::dot_avx2::<R>(wr, &a, &mut o) },
            _ => {
                for (o, a) in o.iter_mut().zip(&a) {
                    *o = K::dot_scalar(wr, a);
                }
            }
        }
        for (r, &v) in o.iter().enumerate() {
            // SAFETY: (r0 + r) < m and j < n, so the index is inside `out`; no other worker
            // writes column j.
            unsafe { *out.ptr().add((r0 + r) * n + j) = v };
        }
    }
}
