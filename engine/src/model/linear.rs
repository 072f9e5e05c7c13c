//! `Linear`: the model's weight matrices, `y[.., n] = x[.., k] · Wᵀ`.
//!
//! On CPU, quantized weights of a type with a kernel in [`crate::kernels`] (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0, Q4_K, Q6_K) go through it, reading the QTensor's blocks in place (no copy).
//! Everything else (other GGUF types, dense F32/F16/BF16 checkpoints, non-CPU devices) uses
//! candle's `QMatMul`; the CPU fallback for a quantized type is logged once per type. Dense
//! weights in bf16/f16 (kept so on GPUs) multiply in their own type; activations stay f32.
//!
//! `Linear` derefs to the wrapped `QMatMul`, so code that wants candle's type (e.g. to slice
//! rows of the LM head) still can.

use super::config::Activation;
use crate::kernels::{matmul_many, packed::Packed, Isa, QMatrix, QType};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{
    CpuStorage, CustomOp1, DType, Device, Layout, Module, Result, Shape, Storage, Tensor,
};
use std::sync::Arc;

pub struct Linear {
    inner: QMatMul,
    kernel: Option<KernelOp>,
}

/// The kernel path as a candle custom op (gets the input's CPU storage without copies).
struct KernelOp {
    w: Arc<QTensor>,
    ty: QType,
    n: usize,
    k: usize,
    /// The same weights repacked for the SIMD kernels of this CPU (AVX2 or AVX-512 VNNI; a
    /// second copy of this matrix in memory).
    packed: Option<Packed>,
}

impl KernelOp {
    fn new(w: Arc<QTensor>, ty: QType, n: usize, k: usize) -> Self {
        let isa = Isa::detect();
        let packed = if packing() && Packed::supports(ty, n, k, isa) {
            w.data()
                .ok()
                .and_then(|d| Packed::new(ty, n, k, &d, isa).ok())
        } else {
            None
        };
        Self {
            w,
            ty,
            n,
            k,
            packed,
        }
    }

    fn matrix<'a>(&'a self, data: &'a [u8]) -> Result<QMatrix<'a>> {
        Ok(QMatrix::new(self.ty, self.n, self.k, data)
            .map_err(candle_core::Error::msg)?
            .with_packed(self.packed.as_ref()))
    }
}

/// Whether weights are repacked for the SIMD kernels: yes unless `DSPARK_KERNEL_PACKING=off`
/// (an A/B switch for benchmarks; the ggml-layout kernels then run, with half the memory).
fn packing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSPARK_KERNEL_PACKING").as_deref() != Ok("off"))
}

fn log_fallback(dtype: GgmlDType) {
    static SEEN: std::sync::Mutex<Vec<GgmlDType>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.contains(&dtype) {
        seen.push(dtype);
        tracing::info!("no CPU kernel for {dtype:?} weights; those matmuls use candle's QMatMul");
    }
}

impl Linear {
    pub fn from_qmatmul(inner: QMatMul) -> Self {
        let kernel = match &inner {
            QMatMul::QTensor(q) if q.device().is_cpu() => {
                let dt = q.dtype();
                match (QType::from_ggml(dt), q.shape().dims2()) {
                    (Some(ty), Ok((n, k))) if k.is_multiple_of(ty.block_size()) => {
                        Some(KernelOp::new(q.clone(), ty, n, k))
                    }
                    _ => {
                        log_fallback(dt);
                        None
                    }
                }
            }
            _ => None,
        };
        Self { inner, kernel }
    }

    pub fn from_qtensor(q: QTensor) -> Result<Self> {
        Ok(Self::from_qmatmul(QMatMul::from_qtensor(q)?))
    }

    pub fn from_arc(q: Arc<QTensor>) -> Result<Self> {
        Ok(Self::from_qmatmul(QMatMul::from_arc(q)?))
    }

    /// Dense weights `[n, k]` (kept as they are; candle's matmul).
    pub fn dense(w: Tensor) -> Self {
        Self::from_qmatmul(QMatMul::Tensor(w))
    }

    /// The element type of dense weights (None for quantized ones).
    pub fn dense_dtype(&self) -> Option<DType> {
        match &self.inner {
            QMatMul::Tensor(w) => Some(w.dtype()),
            _ => None,
        }
    }

    /// Whether calls go through [`crate::kernels`].
    pub fn uses_kernel(&self) -> bool {
        self.kernel.is_some()
    }

    /// `x [.., k]` (f32) -> `[.., n]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.kernel {
            Some(op) if x.dtype() == DType::F32 && x.device().is_cpu() => {
                if x.is_contiguous() {
                    x.apply_op1_no_bwd(op)
                } else {
                    x.contiguous()?.apply_op1_no_bwd(op)
                }
            }
            _ => match &self.inner {
                // Half-precision weights on a GPU (dense checkpoints keep their bf16/f16 there):
                // the product in the weights' type, f32 in and out.
                QMatMul::Tensor(w) if w.dtype() != x.dtype() => self
                    .inner
                    .forward(&x.to_dtype(w.dtype())?)?
                    .to_dtype(x.dtype()),
                _ => self.inner.forward(x),
            },
        }
    }
}

/// `[l.forward(x) for l in ls]` for matrices sharing their input (q/k/v, gate/up): on the
/// kernel path the input is quantised once and all of them run in one parallel region.
pub fn forward_many(ls: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
    let Some((outs, dims)) = kernel_many(ls, x)? else {
        return ls.iter().map(|l| l.forward(x)).collect();
    };
    outs.into_iter()
        .zip(ls)
        .map(|(v, l)| {
            let mut shape = dims.clone();
            *shape.last_mut().expect("rank >= 1") = l.kernel.as_ref().map_or(0, |o| o.n);
            Tensor::from_vec(v, shape, &Device::Cpu)
        })
        .collect()
}

/// The gated MLP input `act(gate(x)) * up(x)`. On the kernel path both matmuls share one
/// parallel region and the activation is applied in place (no candle elementwise ops, whose
/// spinning pool competes with ours); the formulas are candle's, so results are the same.
pub fn forward_glu(gate: &Linear, up: &Linear, x: &Tensor, act: Activation) -> Result<Tensor> {
    let Some((mut outs, dims)) = kernel_many(&[gate, up], x)? else {
        let g = gate.forward(x)?;
        let g = match act {
            Activation::Silu => g.silu()?,
            Activation::GeluTanh => g.gelu()?,
        };
        return g * up.forward(x)?;
    };
    let u = outs.pop().expect("two outputs");
    let mut g = outs.pop().expect("two outputs");
    if g.len() != u.len() {
        candle_core::bail!("gate and up have different widths");
    }
    let f = |g: &mut [f32], u: &[f32]| match act {
        Activation::Silu => crate::kernels::vmath::silu_mul(g, u),
        Activation::GeluTanh => {
            const S: f32 = 0.797_884_6; // sqrt(2 / pi), as candle
            for (g, &u) in g.iter_mut().zip(u) {
                let v = *g;
                *g = 0.5 * v * (1.0 + (S * v * (1.0 + 0.044715 * v * v)).tanh()) * u;
            }
        }
    };
    // Whole rows per range: every value goes through the same (vector or tail) path as
    // when one call did them all.
    let width = gate.kernel.as_ref().map_or(g.len(), |o| o.n).max(1);
    let rows = g.len() / width;
    // Ranges start on multiples of 8 values (the vector width of `silu_mul`).
    let align = (1..=8).find(|a| (a * width).is_multiple_of(8)).unwrap_or(8);
    let gp = crate::kernels::pool::SharedMut::new(&mut g);
    crate::kernels::pool::for_rows(
        rows,
        crate::kernels::pool::PAR_ROWS / 2,
        align,
        &|r0, r1| {
            let (a, b) = (r0 * width, r1 * width);
            // SAFETY: this range covers a..b of `g` only.
            let g = unsafe { gp.slice(a, b - a) };
            f(g, &u[a..b])
        },
    );
    let mut shape = dims;
    *shape.last_mut().expect("rank >= 1") = gate.kernel.as_ref().map_or(0, |o| o.n);
    Tensor::from_vec(g, shape, &Device::Cpu)
}

/// The kernel path of [`forward_many`]: the outputs as vectors and the input's dims, or None
/// when some matrix or the input cannot use it.
#[allow(clippy::type_complexity)]
fn kernel_many(ls: &[&Linear], x: &Tensor) -> Result<Option<(Vec<Vec<f32>>, Vec<usize>)>> {
    let ops: Option<Vec<&KernelOp>> = ls.iter().map(|l| l.kernel.as_ref()).collect();
    let ops = match ops {
        Some(ops)
            if !ops.is_empty()
                && x.dtype() == DType::F32
                && x.device().is_cpu()
                && ops.iter().all(|o| o.k == ops[0].k)
                && x.dims().last() == Some(&ops[0].k) =>
        {
            ops
        }
        _ => return Ok(None),
    };
    let x = x.contiguous()?;
    let k = ops[0].k;
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    let Some((o0, o1)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    let xs = &cpu.as_slice::<f32>()?[o0..o1];
    let m = xs.len() / k;
    let datas = ops.iter().map(|o| o.w.data()).collect::<Result<Vec<_>>>()?;
    let ws = ops
        .iter()
        .zip(&datas)
        .map(|(o, d)| o.matrix(d))
        .collect::<Result<Vec<_>>>()?;
    let mut outs: Vec<Vec<f32>> = ops.iter().map(|o| vec![0f32; m * o.n]).collect();
    {
        let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
        matmul_many(&ws, xs, m, &mut refs);
    }
    drop(storage);
    Ok(Some((outs, x.dims().to_vec())))
}

impl std::ops::Deref for Linear {
    type Target = QMatMul;
    fn deref(&self) -> &QMatMul {
        &self.inner
    }
}

impl CustomOp1 for KernelOp {
    fn name(&self) -> &'static str {
        "dspark-qmatmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some(off) = layout.contiguous_offsets() else {
            candle_core::bail!("dspark-qmatmul: input is not contiguous")
        };
        let x = &storage.as_slice::<f32>()?[off.0..off.1];
        let dims = layout.shape().dims();
        match dims.last() {
            Some(&k) if k == self.k => {}
            _ => candle_core::bail!(
                "dspark-qmatmul: input {:?} does not end in k = {}",
                dims,
                self.k
            ),
        }
        let m = x.len() / self.k;
        let data = self.w.data()?;
        let w = self.matrix(&data)?;
        let mut out = vec![0f32; m * self.n];
        w.matmul(x, m, &mut out);
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("rank >= 1") = self.n;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half-precision dense weights (how a bf16 checkpoint stays on a GPU) take f32 inputs and
    /// give f32 outputs: the product of the same (bf16-exact) weights up to bf16 input rounding.
    #[test]
    fn half_precision_dense_weights_take_and_give_f32() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (24, 64), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let x = Tensor::randn(0f32, 1.0, (3, 64), &dev).unwrap();
        let half = Linear::dense(w.clone());
        let full = Linear::dense(w.to_dtype(DType::F32).unwrap());
        assert_eq!(half.dense_dtype(), Some(DType::BF16));
        let (a, b) = (half.forward(&x).unwrap(), full.forward(&x).unwrap());
        assert_eq!(a.dtype(), DType::F32);
        assert_eq!(a.dims(), &[3, 24]);
        let d = crate::testutil::max_abs_diff(&a, &b);
        assert!(d > 0.0 && d < 0.5, "bf16 product vs f32: {d}");
    }
}
