//! Small per-token ops of the forward with a CPU path that stays on the calling thread or
//! the kernel pool ([`crate::kernels::pool`]).
//!
//! candle-nn's CPU versions hand calls to rayon (`par_chunks` over the batch dimension,
//! which is 1 here, for RoPE; over rows once there are more than 32 for RMSNorm: every
//! per-head q/k norm of a verify block, every norm of a step past 32 tokens), so each call
//! was a round trip through rayon's pool, a thread wake-up while the kernel pool's workers
//! spin, and rayon's idle workers then yield-spin on the same two cores. The arithmetic is
//! candle's, so results are identical; other devices use candle-nn.

use candle_core::{Device, Result, Tensor};

/// Rotary embedding, half-split layout (candle-nn's `rope_thd`): `x` is `[t, heads, hd]`,
/// `cos`/`sin` are `[t, hd / 2]`.
pub fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?
            .squeeze(0);
    }
    let (t, h, d) = x.dims3()?;
    let x = x.contiguous()?;
    let (xs, cs, ss) = (
        x.flatten_all()?.to_vec1::<f32>()?,
        cos.contiguous()?.flatten_all()?.to_vec1::<f32>()?,
        sin.contiguous()?.flatten_all()?.to_vec1::<f32>()?,
    );
    if cs.len() < t * d / 2 || ss.len() < t * d / 2 {
        candle_core::bail!("rope: cos/sin tables shorter than {t} positions");
    }
    let mut dst = vec![0f32; t * h * d];
    for i_t in 0..t {
        for i_d in 0..d / 2 {
            let i_cs = i_t * (d / 2) + i_d;
            let (c, s) = (cs[i_cs], ss[i_cs]);
            for i_h in 0..h {
                let i1 = i_t * h * d + i_h * d + i_d;
                let i2 = i1 + d / 2;
                dst[i1] = xs[i1] * c - xs[i2] * s;
                dst[i2] = xs[i1] * s + xs[i2] * c;
            }
        }
    }
    Tensor::from_vec(dst, (t, h, d), &Device::Cpu)
}

/// Rows of RMSNorm below which one thread does them all (a row is a few hundred values).
const NORM_PAR_ROWS: usize = 256;

/// RMSNorm over the last dimension (candle-nn's `rms_norm`): `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        return candle_nn::ops::rms_norm(x, w, eps);
    }
    let dims = x.dims().to_vec();
    let n = *dims.last().unwrap_or(&0);
    let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let alpha = w.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
    if alpha.len() != n {
        candle_core::bail!("rms_norm: weight of {} for rows of {n}", alpha.len());
    }
    let mut dst = vec![0f32; xs.len()];
    let rows = xs.len().checked_div(n).unwrap_or(0);
    let row = |src: &[f32], dst: &mut [f32]| {
        let sum2 = src.iter().map(|&v| v * v).sum::<f32>();
        let m = (sum2 / n as f32 + eps).sqrt();
        for ((d, s), a) in dst.iter_mut().zip(src).zip(&alpha) {
            *d = *s / m * *a
        }
    };
    if rows < NORM_PAR_ROWS {
        for (s, d) in xs.chunks(n.max(1)).zip(dst.chunks_mut(n.max(1))) {
            row(s, d);
        }
    } else {
        let per = NORM_PAR_ROWS / 4;
        let out = crate::kernels::pool::SharedMut::new(&mut dst);
        crate::kernels::pool::run(rows.div_ceil(per), &|t| {
            let r0 = t * per;
            let r1 = (r0 + per).min(rows);
            // SAFETY: task t writes only rows r0..r1 of `dst`.
            let d = unsafe { out.slice(r0 * n, (r1 - r0) * n) };
            for (s, d) in xs[r0 * n..r1 * n].chunks(n).zip(d.chunks_mut(n)) {
                row(s, d);
            }
        });
    }
    Tensor::from_vec(dst, dims, &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_matches_candle_nn_exactly() {
        let dev = Device::Cpu;
        let (t, h, d) = (5, 3, 16);
        let x = Tensor::randn(0f32, 1.0, (t, h, d), &dev).unwrap();
        let (cos, sin) = crate::model::rope_table(10000.0, d, 64, &dev).unwrap();
        let pos = Tensor::new(&[3u32, 9, 10, 11, 40], &dev).unwrap();
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

    /// Few rows (candle-nn's serial path), many rows (its rayon path; ours on the kernel
    /// pool) and a 3-d per-head input: the same bits as candle-nn.
    #[test]
    fn rms_norm_matches_candle_nn_exactly() {
        let dev = Device::Cpu;
        for shape in [vec![3, 64], vec![300, 64], vec![40, 9, 64]] {
            let x = Tensor::randn(0f32, 1.0, shape.as_slice(), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.1, 64, &dev).unwrap();
            let mine = rms_norm(&x, &w, 1e-5).unwrap();
            let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(mine.dims(), theirs.dims());
            let (a, b) = (
                mine.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(a, b, "shape {shape:?}");
        }
    }
}
