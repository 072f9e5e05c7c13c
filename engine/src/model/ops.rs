//! Small per-token ops of the forward with a CPU path that stays on the calling thread or
//! the kernel pool ([`crate::kernels::pool`]).
//!
//! candle-nn's CPU versions hand calls to rayon (`par_chunks` over the batch dimension,
//! which is 1 here, for RoPE; over rows once there are more than 32 for RMSNorm), copy their
//! inputs, and sum each row of squares as one chain of dependent adds, row after row. These
//! borrow the tensors' storage, run the chains of 8 rows side by side and fuse the residual
//! add into the norm that follows it, so a step's ~5 small ops per layer cost microseconds,
//! not tens (a quarter of a verify step ran on one core in them). The arithmetic is
//! candle-nn's, bit for bit (tests): this model family is sensitive enough that a different
//! summation order changes greedy outputs and, measured, the shipped drafter's acceptance
//! (19.7 % -> 17.6 % at a fixed block of 4 over the 40 peer prompts). Other devices use
//! candle-nn.

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};

/// Calls `f` with `t`'s values as one contiguous f32 slice: borrowed from a contiguous CPU
/// f32 tensor, copied otherwise.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    {
        let (st, l) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) = (&*st, l.contiguous_offsets()) {
            return f(&v[a..b]);
        }
    }
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    f(&v)
}

/// Rotary embedding, half-split layout (candle-nn's `rope_thd`): `x` is `[t, heads, hd]`,
/// `cos`/`sin` are `[t, hd / 2]`.
pub fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?
            .squeeze(0);
    }
    let (t, h, d) = x.dims3()?;
    let half = d / 2;
    let mut dst = vec![0f32; t * h * d];
    with_f32(x, |xs| {
        with_f32(cos, |cs| {
            with_f32(sin, |ss| {
                if cs.len() < t * half || ss.len() < t * half {
                    candle_core::bail!("rope: cos/sin tables shorter than {t} positions");
                }
                if xs.len() != t * h * d {
                    candle_core::bail!("rope: {} values for [{t}, {h}, {d}]", xs.len());
                }
                let out = crate::kernels::pool::SharedMut::new(&mut dst);
                crate::kernels::pool::for_rows(t, PAR_ROWS, 1, &|t0, t1| {
                    // SAFETY: this range writes only rows t0..t1 of `dst`.
                    let dst = unsafe { out.slice(t0 * h * d, (t1 - t0) * h * d) };
                    let src = &xs[t0 * h * d..t1 * h * d];
                    for (i, (src, out)) in
                        src.chunks_exact(d).zip(dst.chunks_exact_mut(d)).enumerate()
                    {
                        let i_t = t0 + i / h;
                        let (c, s) = (&cs[i_t * half..][..half], &ss[i_t * half..][..half]);
                        let (x1, x2) = src.split_at(half);
                        let (o1, o2) = out.split_at_mut(half);
                        for j in 0..half {
                            o1[j] = x1[j] * c[j] - x2[j] * s[j];
                            o2[j] = x1[j] * s[j] + x2[j] * c[j];
                        }
                    }
                });
                Ok(())
            })
        })
    })?;
    Tensor::from_vec(dst, (t, h, d), &Device::Cpu)
}

pub use crate::kernels::pool::PAR_ROWS;

/// RMSNorm over the last dimension (candle-nn's `rms_norm`): `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if !cpu_f32(x) {
        return candle_nn::ops::rms_norm(x, w, eps);
    }
    let mut dst = Vec::new();
    with_f32(x, |xs| {
        with_f32(w, |alpha| {
            dst = vec![0f32; xs.len()];
            norm_rows(xs, alpha, eps, &mut dst)
        })
    })?;
    Tensor::from_vec(dst, x.dims(), &Device::Cpu)
}

/// `(x + y, rms_norm(x + y, w))`: a residual add and the norm that reads it, in one pass.
pub fn add_rms_norm(x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if !cpu_f32(x) || !cpu_f32(y) || x.dims() != y.dims() {
        let s = (x + y)?;
        let n = rms_norm(&s, w, eps)?;
        return Ok((s, n));
    }
    let (mut sum, mut dst) = (Vec::new(), Vec::new());
    with_f32(x, |xs| {
        with_f32(y, |ys| {
            with_f32(w, |alpha| {
                sum = vec![0f32; xs.len()];
                dst = vec![0f32; xs.len()];
                add_norm_rows(xs, ys, alpha, eps, &mut sum, &mut dst)
            })
        })
    })?;
    Ok((
        Tensor::from_vec(sum, x.dims(), &Device::Cpu)?,
        Tensor::from_vec(dst, x.dims(), &Device::Cpu)?,
    ))
}

fn cpu_f32(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// The rows of `xs` (each `alpha.len()` long) normalised into `dst`.
fn norm_rows(xs: &[f32], alpha: &[f32], eps: f32, dst: &mut [f32]) -> Result<()> {
    add_norm_rows(xs, &[], alpha, eps, &mut [], dst)
}

/// [`norm_rows`] of `xs + ys` (written to `sum`), or of `xs` when `ys` is empty, over row
/// ranges on the kernel pool: the same per-row arithmetic whatever the ranges.
fn add_norm_rows(
    xs: &[f32],
    ys: &[f32],
    alpha: &[f32],
    eps: f32,
    sum: &mut [f32],
    dst: &mut [f32],
) -> Result<()> {
    let n = alpha.len();
    if n == 0 || !xs.len().is_multiple_of(n) {
        candle_core::bail!("rms_norm: weight of {n} for {} values", xs.len());
    }
    let add = !ys.is_empty();
    if dst.len() != xs.len() || (add && (ys.len() != xs.len() || sum.len() != xs.len())) {
        candle_core::bail!("rms_norm: buffers of different lengths");
    }
    let rows = xs.len() / n;
    // Rows `src` (whole rows) normalised into `dst`, ROWS at a time: each row's sum of
    // squares is candle-nn's left fold, bit for bit, but the rows' chains run side by side.
    let run = |src: &[f32], dst: &mut [f32]| {
        let mut sums = [0f32; ROWS];
        for (src, dst) in src.chunks(ROWS * n).zip(dst.chunks_mut(ROWS * n)) {
            let k = src.len() / n;
            sums[..k].fill(0.0);
            for i in 0..n {
                for (r, s) in sums[..k].iter_mut().enumerate() {
                    let v = src[r * n + i];
                    *s += v * v;
                }
            }
            for ((s, d), &sum2) in src.chunks(n).zip(dst.chunks_mut(n)).zip(&sums) {
                let m = (sum2 / n as f32 + eps).sqrt();
                for ((d, s), a) in d.iter_mut().zip(s).zip(alpha) {
                    *d = *s / m * *a
                }
            }
        }
    };
    let (out, sums) = (
        crate::kernels::pool::SharedMut::new(dst),
        crate::kernels::pool::SharedMut::new(sum),
    );
    crate::kernels::pool::for_rows(rows, PAR_ROWS, ROWS, &|r0, r1| {
        let (a, len) = (r0 * n, (r1 - r0) * n);
        // SAFETY: this range writes only rows r0..r1 of `dst` (and of `sum`).
        let d = unsafe { out.slice(a, len) };
        if add {
            // SAFETY: as above.
            let s = unsafe { sums.slice(a, len) };
            for ((s, x), y) in s.iter_mut().zip(&xs[a..a + len]).zip(&ys[a..a + len]) {
                *s = x + y;
            }
            run(s, d);
        } else {
            run(&xs[a..a + len], d);
        }
    });
    Ok(())
}

/// Rows whose sums of squares [`norm_rows`] runs side by side.
const ROWS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_matches_candle_nn_exactly() {
        // 5 rows: one thread; 37: ranges on the kernel pool.
        for (t, pos) in [
            (5, vec![3u32, 9, 10, 11, 40]),
            (37, (0..37u32).map(|i| 3 * i % 61).collect()),
        ] {
            rope_case(t, &pos);
        }
    }

    fn rope_case(t: usize, pos: &[u32]) {
        let dev = Device::Cpu;
        let (h, d) = (3, 16);
        let x = Tensor::randn(0f32, 1.0, (t, h, d), &dev).unwrap();
        let (cos, sin) = crate::model::rope_table(10000.0, d, 64, &dev).unwrap();
        let pos = Tensor::new(pos, &dev).unwrap();
        let (c, s) = (
            cos.index_select(&pos, 0).unwrap(),
            sin.index_select(&pos, 0).unwrap(),
        );
        let mine = rope_thd(&x, &c, &s)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let theirs = candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0).unwrap(), &c, &s)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(mine, theirs);
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Few rows (candle-nn's serial path), many rows (its rayon path; ours on the kernel
    /// pool), row counts off the groups of 8 and a 3-d per-head input: candle-nn's bits.
    #[test]
    fn rms_norm_matches_candle_nn_exactly() {
        let dev = Device::Cpu;
        for shape in [
            vec![3, 64],
            vec![300, 64],
            vec![40, 9, 64],
            vec![13, 576],
            vec![1, 96],
        ] {
            let x = Tensor::randn(0f32, 1.0, shape.as_slice(), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.1, *shape.last().unwrap(), &dev).unwrap();
            let mine = rms_norm(&x, &w, 1e-5).unwrap();
            let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(mine.dims(), theirs.dims());
            assert_eq!(values(&mine), values(&theirs), "shape {shape:?}");
        }
    }

    /// The fused residual add gives the sum exactly and the norm of that sum.
    #[test]
    fn add_rms_norm_is_the_sum_and_its_norm() {
        let dev = Device::Cpu;
        // 5 rows: one thread; 45: ranges on the kernel pool.
        for rows in [5, 45] {
            let x = Tensor::randn(0f32, 1.0, (rows, 96), &dev).unwrap();
            let y = Tensor::randn(0f32, 1.0, (rows, 96), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.1, 96, &dev).unwrap();
            let (sum, normed) = add_rms_norm(&x, &y, &w, 1e-6).unwrap();
            let want_sum = (&x + &y).unwrap();
            assert_eq!(values(&sum), values(&want_sum), "{rows} rows");
            let want = candle_nn::ops::rms_norm(&want_sum, &w, 1e-6).unwrap();
            assert_eq!(values(&normed), values(&want), "{rows} rows");
        }
        let x = Tensor::randn(0f32, 1.0, (5, 96), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (5, 96), &dev).unwrap();
        // A weight that does not fit the rows is an error, not a silent misread.
        let bad = Tensor::ones(95, candle_core::DType::F32, &dev).unwrap();
        assert!(add_rms_norm(&x, &y, &bad, 1e-6).is_err());
        assert!(rms_norm(&x, &bad, 1e-6).is_err());
    }
}
