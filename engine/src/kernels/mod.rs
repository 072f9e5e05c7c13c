//! CPU quantized matmul: `y[m, n] = x[m, k] · W[n, k]ᵀ` straight from ggml weight blocks.
//!
//! Unlike a row-by-row GEMV, the activations are quantised ONCE per call (Q8_0/Q8_1 for the
//! 32-blocks, Q8_K for K-quants, with ggml's rounding so results match llama.cpp) and each
//! weight block is read once for a tile of 4 input rows, so a verify batch of several tokens
//! costs little more than one token. Output rows are split over the forward's own thread pool
//! ([`pool`]).
//!
//! - [`blocks`]: weight block layouts (ggml's) and their dequantisation (the test reference).
//! - [`q8`]: activation quantisation.
//! - [`dot`]: scalar and AVX2/FMA block dot products, R = 1..=4 input rows per weight row.
//! - [`matmul`]: the tiled, parallel driver.
//! - [`pool`]: the spinning thread pool the forward's parallel regions run on.
//! - [`packed`]: kernels on weights repacked one row per 32-bit lane (Q4_0, Q4_1, Q8_0; 8
//!   rows per vector for AVX2, 16 for AVX-512 VNNI; Q4_K and Q6_K, 16 rows for AVX-512
//!   VNNI), used when the caller supplies the packed copy for the ISA in use.
//! - [`vmath`]: vectorised exp, softmax and SwiGLU for the rest of the forward.
//! - [`write_rows`]: rows written into a KV cache tensor in place.
//!
//! Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K. Anything else stays with candle's
//! `QMatMul` (see `model::linear`).

pub mod blocks;
pub mod dot;
pub mod matmul;
pub mod packed;
pub mod pool;
pub mod q8;
pub mod vmath;
pub mod write_rows;

use candle_core::quantized::GgmlDType;
pub use matmul::Isa;
use matmul::OutPtr;

/// Weight types with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl QType {
    pub const ALL: [QType; 7] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q6K,
    ];

    pub fn from_ggml(t: GgmlDType) -> Option<Self> {
        Some(match t {
            GgmlDType::Q4_0 => QType::Q4_0,
            GgmlDType::Q4_1 => QType::Q4_1,
            GgmlDType::Q5_0 => QType::Q5_0,
            GgmlDType::Q5_1 => QType::Q5_1,
            GgmlDType::Q8_0 => QType::Q8_0,
            GgmlDType::Q4K => QType::Q4K,
            GgmlDType::Q6K => QType::Q6K,
            _ => return None,
        })
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            QType::Q4_0 => GgmlDType::Q4_0,
            QType::Q4_1 => GgmlDType::Q4_1,
            QType::Q5_0 => GgmlDType::Q5_0,
            QType::Q5_1 => GgmlDType::Q5_1,
            QType::Q8_0 => GgmlDType::Q8_0,
            QType::Q4K => GgmlDType::Q4K,
            QType::Q6K => GgmlDType::Q6K,
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            QType::Q4K | QType::Q6K => blocks::QK_K,
            _ => blocks::QK,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use std::mem::size_of;
        match self {
            QType::Q4_0 => size_of::<blocks::BlockQ4_0>(),
            QType::Q4_1 => size_of::<blocks::BlockQ4_1>(),
            QType::Q5_0 => size_of::<blocks::BlockQ5_0>(),
            QType::Q5_1 => size_of::<blocks::BlockQ5_1>(),
            QType::Q8_0 => size_of::<blocks::BlockQ8_0>(),
            QType::Q4K => size_of::<blocks::BlockQ4K>(),
            QType::Q6K => size_of::<blocks::BlockQ6K>(),
        }
    }
}

/// A borrowed `[n, k]` weight matrix in ggml blocks, row-major (row j = output column j).
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: QType,
    pub n: usize,
    pub k: usize,
    data: &'a [u8],
    packed: Option<&'a packed::Packed>,
}

fn cast<W>(data: &[u8]) -> &[W] {
    assert_eq!(
        data.as_ptr() as usize % std::mem::align_of::<W>(),
        0,
        "misaligned weight blocks"
    );
    // SAFETY: the block structs are plain old data (integers only, repr(C)), any bit pattern is
    // valid; length and alignment are checked.
    unsafe {
        std::slice::from_raw_parts(
            data.as_ptr() as *const W,
            data.len() / std::mem::size_of::<W>(),
        )
    }
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `n * k` weights of type `ty`.
    pub fn new(ty: QType, n: usize, k: usize, data: &'a [u8]) -> Result<Self, String> {
        if !k.is_multiple_of(ty.block_size()) {
            return Err(format!(
                "{ty:?} rows of {k} are not a whole number of blocks"
            ));
        }
        let want = n * (k / ty.block_size()) * ty.type_size();
        if data.len() != want {
            return Err(format!(
                "{ty:?} [{n}, {k}] needs {want} bytes, got {}",
                data.len()
            ));
        }
        if !(data.as_ptr() as usize).is_multiple_of(2) {
            return Err("weight blocks are not 2-byte aligned".into());
        }
        Ok(Self {
            ty,
            n,
            k,
            data,
            packed: None,
        })
    }

    /// Also use `p` (the same matrix repacked) when a call runs on `p.isa`.
    pub fn with_packed(mut self, p: Option<&'a packed::Packed>) -> Self {
        if let Some(p) = p {
            assert!(
                p.ty == self.ty && p.n == self.n && p.k == self.k,
                "packed copy of another matrix"
            );
        }
        self.packed = p;
        self
    }

    /// The packed copy, when this call will use it: for every row count alike, so a row's
    /// arithmetic never depends on how many rows share its call (a verify step's rows equal
    /// one-at-a-time decoding, bit for bit; `packed_rows_do_not_depend_on_their_batch`).
    fn packed_for(&self, isa: Isa) -> Option<&'a packed::Packed> {
        self.packed.filter(|p| p.isa == isa)
    }

    /// `out[m, n] = x[m, k] · Wᵀ` with the best instruction set of this CPU.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_isa(x, m, out, Isa::detect())
    }

    /// As [`Self::matmul`] with a chosen instruction set (tests compare them).
    /// `Isa::Avx2` on a CPU without it falls back to scalar.
    pub fn matmul_isa(&self, x: &[f32], m: usize, out: &mut [f32], isa: Isa) {
        matmul_many_isa(&[*self], x, m, &mut [out], isa)
    }

    fn row_bytes(&self) -> usize {
        self.k / self.ty.block_size() * self.ty.type_size()
    }

    /// Output columns `j0..j1` for all `m` rows.
    ///
    /// # Safety
    /// `out` points to an `m * n` buffer where no one else writes columns `j0..j1`; `acts`
    /// holds the formats this type needs.
    unsafe fn run(&self, acts: &Acts, m: usize, j0: usize, j1: usize, out: OutPtr, isa: Isa) {
        use matmul::run_rows;
        // SAFETY: this function's contract is the kernels' (`out` is an `m * n` buffer whose
        // columns `j0..j1` are ours, `acts` holds the formats `self.ty` needs, `isa` was
        // detected on this CPU); `self.data` holds `n` rows of `self.ty` blocks.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if let Some(p) = self.packed_for(isa) {
                return if p.is_kquant() {
                    p.run_k(&acts.q8k, &acts.q8k_pairs, m, j0, j1, out.ptr())
                } else {
                    p.run(&acts.q8, m, j0, j1, out.ptr())
                };
            }
            let (n, d) = (self.n, self.data);
            match self.ty {
                QType::Q4_0 => run_rows::<dot::Q4_0>(cast(d), n, &acts.q8, m, j0, j1, out, isa),
                QType::Q4_1 => run_rows::<dot::Q4_1>(cast(d), n, &acts.q8, m, j0, j1, out, isa),
                QType::Q5_0 => run_rows::<dot::Q5_0>(cast(d), n, &acts.q8, m, j0, j1, out, isa),
                QType::Q5_1 => run_rows::<dot::Q5_1>(cast(d), n, &acts.q8, m, j0, j1, out, isa),
                QType::Q8_0 => run_rows::<dot::Q8_0>(cast(d), n, &acts.q8, m, j0, j1, out, isa),
                QType::Q4K => run_rows::<dot::Q4K>(cast(d), n, &acts.q8k, m, j0, j1, out, isa),
                QType::Q6K => run_rows::<dot::Q6K>(cast(d), n, &acts.q8k, m, j0, j1, out, isa),
            }
        }
    }

    /// The weights as f32 `[n, k]` (the reference for tests).
    pub fn dequantize(&self) -> Vec<f32> {
        fn go<W: blocks::Dequant>(d: &[u8], len: usize) -> Vec<f32> {
            let mut out = vec![0f32; len];
            for (b, o) in cast::<W>(d).iter().zip(out.chunks_mut(W::BLOCK)) {
                b.dequant(o);
            }
            out
        }
        let (d, len) = (self.data, self.n * self.k);
        match self.ty {
            QType::Q4_0 => go::<blocks::BlockQ4_0>(d, len),
            QType::Q4_1 => go::<blocks::BlockQ4_1>(d, len),
            QType::Q5_0 => go::<blocks::BlockQ5_0>(d, len),
            QType::Q5_1 => go::<blocks::BlockQ5_1>(d, len),
            QType::Q8_0 => go::<blocks::BlockQ8_0>(d, len),
            QType::Q4K => go::<blocks::BlockQ4K>(d, len),
            QType::Q6K => go::<blocks::BlockQ6K>(d, len),
        }
    }
}

/// The input rows quantised in the formats the weight types need.
struct Acts {
    q8: Vec<q8::Q8Block>,
    q8k: Vec<q8::Q8KBlock>,
    /// The pairs of 32-sums of `q8k` that packed Q4_K's min term multiplies with.
    q8k_pairs: Vec<[i32; 4]>,
}

/// Several matrices with the same input (q/k/v, gate/up): `outs[i] = x · ws[i]ᵀ`, with the
/// input quantised once per format and ONE parallel region for all of them.
pub fn matmul_many(ws: &[QMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    matmul_many_isa(ws, x, m, outs, Isa::detect())
}

/// As [`matmul_many`] with a chosen instruction set.
pub fn matmul_many_isa(ws: &[QMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]], isa: Isa) {
    let isa = isa.min(Isa::supported());
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    let Some(k) = ws.first().map(|w| w.k) else {
        return;
    };
    assert!(ws.iter().all(|w| w.k == k), "matrices with different k");
    assert_eq!(x.len(), m * k, "input length");
    for (w, o) in ws.iter().zip(outs.iter()) {
        assert_eq!(o.len(), m * w.n, "output length");
    }
    if m == 0 {
        return;
    }
    let mut acts = Acts {
        q8: if ws.iter().any(|w| w.ty.block_size() == blocks::QK) {
            matmul::quantize_rows::<dot::Q8_0>(x, m, k)
        } else {
            Vec::new()
        },
        q8k: if ws.iter().any(|w| w.ty.block_size() == blocks::QK_K) {
            matmul::quantize_rows::<dot::Q4K>(x, m, k)
        } else {
            Vec::new()
        },
        q8k_pairs: Vec::new(),
    };
    if ws
        .iter()
        .any(|w| w.ty == QType::Q4K && w.packed_for(isa).is_some())
    {
        acts.q8k_pairs = packed::kquant::min_pairs(&acts.q8k);
    }
    let shapes: Vec<(usize, usize, usize)> = ws
        .iter()
        .map(|w| match w.packed_for(isa) {
            Some(p) => (w.n, w.row_bytes(), p.lanes()),
            None => (w.n, w.row_bytes(), 1),
        })
        .collect();
    let work = m * k * ws.iter().map(|w| w.n).sum::<usize>();
    let jobs = matmul::plan(&shapes, work);
    let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr::new(o)).collect();
    // SAFETY: each output holds m * n values and the jobs' column ranges are disjoint.
    matmul::execute(&jobs, |i, j0, j1| unsafe {
        ws[i].run(&acts, m, j0, j1, ptrs[i], isa)
    });
}

#[cfg(test)]
mod tests;
