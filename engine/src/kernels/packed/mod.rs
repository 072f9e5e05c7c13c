//! Weights repacked for SIMD kernels that keep one output row per 32-bit lane (Q4_0, Q4_1,
//! Q8_0 and, in [`kquant`], the K-quants Q4_K and Q6_K: 8 rows per group for AVX2, 16 for
//! AVX-512 VNNI).
//!
//! The ggml layout keeps each row's blocks together, so an x86 dot product reduces 32 lanes
//! of one block to one number per block, per input row (`maddubs`, `madd`, a float convert,
//! a scalar scale, a horizontal sum at the end): about eight instructions per weight row,
//! block and input row, which makes even single-token decoding compute-bound on two cores
//! and each extra verify row as dear as the first. Here the weights are repacked once at
//! load so that one vector holds 4 consecutive quants of the same block of `lanes` different
//! rows; the input row's 4 matching activation bytes are broadcast and multiplied in (one
//! `vpdpbusd`, or `maddubs` with an `i16` accumulator), and the block's sum lands in the
//! row's own lane. The scales of `lanes` rows are one vector, so a block costs one convert
//! and one FMA per input row for all of them, with no horizontal reduction at all; the
//! unpacked weights stay in registers for up to [`max_rows`] input rows.
//!
//! Packed layout, per group of `lanes` rows, block after block (`nb` blocks per row), with
//! `V = 4 * lanes` bytes per vector:
//! - Q4_0 / Q4_1: 4 vectors of quants (vector `c`, lane `l` = bytes `4c..4c + 4` of row
//!   `l`'s ggml `qs`: low nibbles are elements `4c..4c + 4`, high nibbles `16 + 4c..`), then
//!   `lanes` f16 scales `d`, then (Q4_1) `lanes` f16 mins `m`. Same bytes as ggml's blocks,
//!   reordered.
//! - Q8_0: 8 vectors (vector `c`, lane `l` = elements `4c..4c + 4` of row `l`), then `lanes`
//!   f16 scales. AVX-512 stores `q + 128` (unsigned, for `vpdpbusd`); AVX2 keeps `q` signed
//!   (its `maddubs` would saturate on unsigned bytes up to 255; the sign moves to the
//!   activations instead, as in ggml).
//!
//! The integer block sums are exactly those of ggml's kernels (the offsets of Q4_0 and of
//! the biased Q8_0 quants are removed with the activation block's integer sum); the float
//! arithmetic per block is `d_w * d_a * sum (+ m_w * s_a)` as ggml's, summed in a different
//! order.
//!
//! - [`avx2`]: 8 lanes, AVX2 + FMA + F16C.
//! - [`avx512`]: 16 lanes, AVX-512 F/BW/VL/VNNI.
//! - [`kquant`]: Q4_K / Q6_K super-blocks, 16 lanes for AVX-512 F/BW/VL/VNNI, 8 for AVX2.

#![allow(clippy::needless_range_loop)]

use super::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK, QK_K};
use super::q8::{Q8Block, Q8KBlock};
use super::{Isa, QType};

/// Dispatches `$m::group::<R, KIND>(args)` over the runtime row count and weight kind: 1..=4
/// rows for AVX2 (16 vector registers), 1..=8 for AVX-512 (32).
macro_rules! dispatch {
    ($m:ident, $kind:expr, $rows:expr, $($arg:expr),*) => {
        match $kind {
            1 => dispatch!(@rows $m, 1, $rows, ($($arg),*)),
            0 => dispatch!(@rows $m, 0, $rows, ($($arg),*)),
            _ => dispatch!(@rows $m, 8, $rows, ($($arg),*)),
        }
    };
    (@rows avx2, $k:literal, $rows:expr, $args:tt) => {
        dispatch!(@each avx2, $k, $rows, $args, [4 3 2])
    };
    (@rows avx512, $k:literal, $rows:expr, $args:tt) => {
        dispatch!(@each avx512, $k, $rows, $args, [8 7 6 5 4 3 2])
    };
    (@each $m:ident, $k:literal, $rows:expr, $args:tt, [$($r:literal)*]) => {
        match $rows {
            $($r => dispatch!(@call $m, $r, $k, $args),)*
            _ => dispatch!(@call $m, 1, $k, $args),
        }
    };
    (@call $m:ident, $r:literal, $k:literal, ($($arg:expr),*)) => {
        $m::group::<$r, $k>($($arg),*)
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod kquant;

/// A weight matrix repacked for one instruction set's kernels.
pub struct Packed {
    pub ty: QType,
    pub n: usize,
    pub k: usize,
    /// The kernels these bytes are laid out for (`Avx2` or `Avx512Vnni`).
    pub isa: Isa,
    data: Aligned,
}

/// Bytes whose start is aligned to a cache line (64 bytes), so the kernels' 64-byte vector
/// loads of line-sized blocks never straddle two lines. Matrices of 4 MiB and more start on
/// a 2 MiB boundary and are marked for transparent huge pages (`madvise`) before they are
/// first written: a decode step streams every weight once, and with 4 KiB pages that is a
/// TLB miss and a page walk every 4 KiB (about 270,000 per step for a 1.1 GB model).
struct Aligned {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

const HUGE: usize = 2 << 20;

impl Aligned {
    fn zeroed(len: usize) -> Self {
        let align = if len >= 2 * HUGE { HUGE } else { 64 };
        // Capacity first, zeros after the advice: the pages are faulted in by the writes.
        let mut buf: Vec<u8> = Vec::with_capacity(len + align - 1);
        let off = buf.as_ptr().align_offset(align);
        #[cfg(target_os = "linux")]
        if align == HUGE {
            // SAFETY: the range lies inside `buf`'s allocation (off + len <= capacity) and
            // starts on a page boundary; MADV_HUGEPAGE only changes how the kernel backs it
            // (failure, e.g. THP off, leaves ordinary pages).
            unsafe {
                libc::madvise(
                    buf.as_mut_ptr().add(off) as *mut libc::c_void,
                    len / HUGE * HUGE,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
        buf.resize(len + align - 1, 0);
        Self { buf, off, len }
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// Rows per group (one per 32-bit lane of the ISA's vectors); `None` where nothing is packed.
pub fn lanes(isa: Isa) -> Option<usize> {
    match isa {
        Isa::Scalar => None,
        Isa::Avx2 => Some(8),
        Isa::Avx512Vnni => Some(16),
    }
}

/// Bytes of quants per packed block of `lanes` rows.
fn quant_bytes(ty: QType, lanes: usize) -> usize {
    match ty {
        QType::Q8_0 => 8 * 4 * lanes,
        _ => 4 * 4 * lanes,
    }
}

/// Bytes per packed block of `lanes` rows (quants, scales, mins).
fn block_bytes(ty: QType, lanes: usize) -> usize {
    quant_bytes(ty, lanes) + 2 * lanes * if ty == QType::Q4_1 { 2 } else { 1 }
}

/// The weight kinds the kernels are specialised for: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0.
fn kind(ty: QType) -> u8 {
    match ty {
        QType::Q4_0 => 0,
        QType::Q4_1 => 1,
        _ => 8,
    }
}

impl Packed {
    /// Whether matrices of this type and shape can be packed for `isa`.
    pub fn supports(ty: QType, n: usize, k: usize, isa: Isa) -> bool {
        let Some(lanes) = lanes(isa) else {
            return false;
        };
        let kquant = matches!(ty, QType::Q4K | QType::Q6K);
        (matches!(ty, QType::Q4_0 | QType::Q4_1 | QType::Q8_0)
            || (kquant && k.is_multiple_of(QK_K)))
            && n.is_multiple_of(lanes)
            && n > 0
            && k.is_multiple_of(QK)
            && isa <= Isa::supported()
    }

    /// Repacks a ggml `[n, k]` matrix (`data` as in [`super::QMatrix`]) for `isa`.
    pub fn new(ty: QType, n: usize, k: usize, data: &[u8], isa: Isa) -> Result<Self, String> {
        if !Self::supports(ty, n, k, isa) {
            return Err(format!("{ty:?} [{n}, {k}] cannot be packed for {isa:?}"));
        }
        let lanes = lanes(isa).expect("supported ISAs pack");
        let m = super::QMatrix::new(ty, n, k, data)?;
        if matches!(ty, QType::Q4K | QType::Q6K) {
            let nb = k / QK_K;
            let bb = kquant::block_bytes(ty, lanes);
            let mut out = Aligned::zeroed(n / lanes * nb * bb);
            for (i, dst) in out.chunks_mut(bb).enumerate() {
                kquant::pack_block(ty, lanes, m.data, nb, i / nb, i % nb, dst);
            }
            return Ok(Self {
                ty,
                n,
                k,
                isa,
                data: out,
            });
        }
        let nb = k / QK;
        let bb = block_bytes(ty, lanes);
        let qb = quant_bytes(ty, lanes);
        let v = 4 * lanes;
        let mut out = Aligned::zeroed(n * nb * bb / lanes);
        for g in 0..n / lanes {
            for b in 0..nb {
                let dst = &mut out[(g * nb + b) * bb..(g * nb + b + 1) * bb];
                for l in 0..lanes {
                    let row = g * lanes + l;
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
                            let bias = if isa == Isa::Avx512Vnni { 0x80 } else { 0 };
                            (x.d, 0, x.qs.iter().map(|&q| (q as u8) ^ bias).collect())
                        }
                    };
                    for c in 0..qs.len() / 4 {
                        dst[c * v + l * 4..c * v + l * 4 + 4]
                            .copy_from_slice(&qs[4 * c..4 * c + 4]);
                    }
                    dst[qb + 2 * l..qb + 2 * l + 2].copy_from_slice(&d.to_le_bytes());
                    if ty == QType::Q4_1 {
                        let o = qb + 2 * lanes + 2 * l;
                        dst[o..o + 2].copy_from_slice(&mn.to_le_bytes());
                    }
                }
            }
        }
        Ok(Self {
            ty,
            n,
            k,
            isa,
            data: out,
        })
    }

    /// Rows per group.
    pub fn lanes(&self) -> usize {
        lanes(self.isa).expect("packed for a SIMD ISA")
    }

    /// Bytes of one group of `lanes` rows.
    fn group_bytes(&self) -> usize {
        match self.ty {
            QType::Q4K | QType::Q6K => self.k / QK_K * kquant::block_bytes(self.ty, self.lanes()),
            _ => self.k / QK * block_bytes(self.ty, self.lanes()),
        }
    }

    /// Whether the kernels take Q8_K activations ([`Self::run_k`]) rather than Q8_0 ones.
    pub fn is_kquant(&self) -> bool {
        matches!(self.ty, QType::Q4K | QType::Q6K)
    }

    /// [`Self::run`] for the K-quants: `acts` holds `m * k / 256` Q8_K blocks.
    ///
    /// # Safety
    /// As [`Self::run`].
    #[cfg(target_arch = "x86_64")]
    /// `mp` holds [`kquant::min_pairs`] of `acts` (computed once per call of the matmul, not
    /// per chunk; only Q4_K reads it).
    pub unsafe fn run_k(
        &self,
        acts: &[Q8KBlock],
        mp: &[[i32; 4]],
        m: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        // SAFETY: as in `run`: the ISA runs here, columns `j0..j1` of `out` are ours, `acts`
        // (and `mp`, one entry per block) hold `m * nb` blocks, and each kernel call reads
        // `rows` activation rows and one packed group and writes `rows` output rows of
        // `lanes` columns inside that range.
        unsafe {
            debug_assert!(self.is_kquant());
            let lanes = self.lanes();
            let nb = self.k / QK_K;
            assert_eq!(acts.len(), m * nb, "activation blocks");
            assert!(self.ty != QType::Q4K || mp.len() == m * nb, "min pairs");
            let gb = self.group_bytes();
            let pf = kquant_prefetch_distance(self.isa);
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(max_rows(self.isa));
                let a = &acts[r0 * nb..];
                let mpr = if mp.is_empty() { mp } else { &mp[r0 * nb..] };
                for g in j0 / lanes..j1 / lanes {
                    let w = &self.data[g * gb..(g + 1) * gb];
                    let o = out.add(r0 * self.n + g * lanes);
                    macro_rules! go {
                        ($r:literal) => {
                            match (self.isa, self.ty) {
                                (Isa::Avx512Vnni, QType::Q4K) => {
                                    kquant::avx512::group_q4k::<$r>(w, nb, a, mpr, o, self.n, pf)
                                }
                                (Isa::Avx512Vnni, _) => {
                                    kquant::avx512::group_q6k::<$r>(w, nb, a, o, self.n, pf)
                                }
                                (_, QType::Q4K) => {
                                    kquant::avx2::group_q4k::<$r>(w, nb, a, mpr, o, self.n, pf)
                                }
                                _ => kquant::avx2::group_q6k::<$r>(w, nb, a, o, self.n, pf),
                            }
                        };
                    }
                    match rows {
                        8 => go!(8),
                        7 => go!(7),
                        6 => go!(6),
                        5 => go!(5),
                        4 => go!(4),
                        3 => go!(3),
                        2 => go!(2),
                        _ => go!(1),
                    }
                }
                r0 += rows;
            }
        }
    }

    /// Output columns `j0..j1` (multiples of the lane count) for all `m` rows of `acts`
    /// (`m * k / 32` Q8 blocks; Q8_0-style scales, and `s` for Q4_1).
    ///
    /// # Safety
    /// The CPU must support `self.isa`; `out` points to an `m * n` buffer in which no one
    /// else writes columns `j0..j1`.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn run(&self, acts: &[Q8Block], m: usize, j0: usize, j1: usize, out: *mut f32) {
        // SAFETY: the caller guarantees `self.isa` runs here and that columns `j0..j1` of the
        // `m * n` buffer at `out` are ours; `acts` holds `m * nb` blocks (asserted), so the
        // kernels read `rows <= max_rows(isa)` activation rows of `nb` blocks from `a` and
        // one packed group `w`, and write `rows` output rows of `lanes` columns at `o`,
        // inside that range.
        unsafe {
            let lanes = self.lanes();
            debug_assert!(j0.is_multiple_of(lanes) && j1.is_multiple_of(lanes) && j1 <= self.n);
            let nb = self.k / QK;
            assert_eq!(acts.len(), m * nb, "activation blocks");
            let gb = self.group_bytes();
            let bb = gb / nb;
            let kind = kind(self.ty);
            let pf = prefetch_distance();
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(max_rows(self.isa));
                let a = &acts[r0 * nb..];
                for g in j0 / lanes..j1 / lanes {
                    let w = &self.data[g * gb..(g + 1) * gb];
                    let o = out.add(r0 * self.n + g * lanes);
                    if self.isa == Isa::Avx512Vnni {
                        dispatch!(avx512, kind, rows, w, nb, bb, a, o, self.n, pf);
                    } else {
                        dispatch!(avx2, kind, rows, w, nb, bb, a, o, self.n, pf);
                    }
                }
                r0 += rows;
            }
        }
    }
}

/// Input rows one pass of the kernels keeps in registers, each with its accumulator, while
/// the unpacked weight block stays in registers too: 4 with AVX2's 16 vector registers, 8
/// with AVX-512's 32 (a verify step of 8 rows unpacks every weight block once, not twice).
pub fn max_rows(isa: Isa) -> usize {
    if isa >= Isa::Avx512Vnni {
        8
    } else {
        4
    }
}

/// Bytes ahead of the block being multiplied that the 32-block kernels prefetch: 2 KiB by
/// default, `DSPARK_KERNEL_PREFETCH=BYTES` to change it (0: none; K-quants: see
/// [`kquant_prefetch_distance`]).
///
/// A decode step streams the whole model once; the hardware prefetchers stop at every 4 KiB
/// page and restart only after a few misses, and each chunk of a matmul starts a new stream,
/// so without help a core waits on memory, then computes, instead of both at once (the
/// distance and what it gains are measured in docs/benchmarks.md).
pub const PREFETCH_DEFAULT: usize = 2048;

fn prefetch_distance() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| env_bytes("DSPARK_KERNEL_PREFETCH", PREFETCH_DEFAULT))
}

/// The K-quant kernels' prefetch distance: [`KQUANT_PREFETCH_AVX512`] or
/// [`KQUANT_PREFETCH_AVX2`] by the kernels' ISA, `DSPARK_KQUANT_PREFETCH=BYTES` to change it.
fn kquant_prefetch_distance(isa: Isa) -> usize {
    static PF: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let set = *PF.get_or_init(|| env_bytes_opt("DSPARK_KQUANT_PREFETCH"));
    set.unwrap_or(if isa >= Isa::Avx512Vnni {
        KQUANT_PREFETCH_AVX512
    } else {
        KQUANT_PREFETCH_AVX2
    })
}

/// The AVX-512 K-quant kernels prefetch nothing: a packed K-quant group is one contiguous
/// run of super-blocks (14-83 KB on Qwen2.5-1.5B) on 2 MiB pages, which the hardware
/// prefetchers of the Zen 4 it was measured on follow by themselves (on the 1.5B's one-row
/// decode step, 2 KiB of software prefetch ran 18.7 steps/s and none 20.5; docs/benchmarks.md,
/// session 37).
pub const KQUANT_PREFETCH_AVX512: usize = 0;

/// The AVX2 K-quant kernels prefetch 4 KiB ahead: on the AVX2-only Zen 3 they were measured
/// on, the 1.5B's steps wait on memory without it (medians of 3 runs, 1 / 5 rows: none 11.4 /
/// 6.2 steps/s, 4 KiB 14.9 / 8.8, 8 KiB 14.0 / 8.6; docs/benchmarks.md, session 39).
pub const KQUANT_PREFETCH_AVX2: usize = 4096;

fn env_bytes(name: &str, default: usize) -> usize {
    env_bytes_opt(name).unwrap_or(default)
}

fn env_bytes_opt(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Prefetches the `len` bytes `dist` bytes after `at` into L1 (nothing when `dist` is 0).
/// Addresses past the end of the weights are harmless: a prefetch never faults.
///
/// # Safety
/// The CPU must have SSE (every x86-64 CPU does).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch(at: *const u8, len: usize, dist: usize) {
    // SAFETY: a prefetch never faults, whatever the address (`wrapping_add`); SSE is
    // baseline on x86-64.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        if dist == 0 {
            return;
        }
        let mut o = 0;
        while o < len {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(dist + o) as *const i8);
            o += 64;
        }
    }
}

/// Whether this CPU runs the AVX-512 VNNI kernels.
pub fn avx512_available() -> bool {
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
