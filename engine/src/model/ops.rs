//! Small per-token ops of the forward with a CPU path that stays on the calling thread or
//! the kernel pool ([`crate::kernels::pool`]).
//!
//! candle-nn's CPU versions hand every call to rayon (`par_chunks` over the batch dimension,
//! which is 1 here), so each RoPE call was a round trip through rayon's pool: 60 per decode
//! step, each a thread wake-up, while the kernel pool's workers spin. The arithmetic is
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
}
