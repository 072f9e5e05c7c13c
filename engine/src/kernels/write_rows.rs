//! Rows written into a KV cache tensor in place: the CPU path of `KvCache::write`, without
//! candle's per-element index tensor or an f16 copy of the rows.

use super::pool::PAR_ROWS;
use candle_core::{CpuStorage, Layout, Result};

/// Writes row `i` of `src` (`[rows, width]`, f32) into row `slots[i]` of a cache tensor
/// (`[slots, width]`, f32 or f16) in place: the CPU path of `KvCache::write`, without
/// candle's per-element index tensor or an f16 copy of the rows.
pub struct WriteRows<'a> {
    pub slots: &'a [u32],
}

impl candle_core::InplaceOp2 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "write-rows"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let (Some((d0, d1)), Some((s0, s1))) = (dl.contiguous_offsets(), sl.contiguous_offsets())
        else {
            candle_core::bail!("write-rows: non-contiguous tensors");
        };
        let CpuStorage::F32(src) = src else {
            candle_core::bail!("write-rows: rows must be f32");
        };
        let src = &src[s0..s1];
        let width = *dl.shape().dims().last().unwrap_or(&0);
        if width == 0 || src.len() != self.slots.len() * width {
            candle_core::bail!(
                "write-rows: {} values for {} rows of {width}",
                src.len(),
                self.slots.len()
            );
        }
        let cap = (d1 - d0) / width;
        if let Some(&bad) = self.slots.iter().find(|&&s| s as usize >= cap) {
            candle_core::bail!("write-rows: slot {bad} outside a cache of {cap}");
        }
        let n = self.slots.len();
        // Each range writes its own rows' slots; distinct rows name distinct slots (a step
        // writes each slot once), and a repeated slot is written by one range only.
        let par = 4 * PAR_ROWS;
        let distinct = n >= 2 * par && {
            let mut s = self.slots.to_vec();
            s.sort_unstable();
            s.windows(2).all(|w| w[0] != w[1])
        };
        let min = if distinct { par } else { usize::MAX / 2 };
        // Row r of `src` into slot `slots[r]`, by row ranges on the kernel pool.
        fn put<T>(
            d: &mut [T],
            at: usize,
            slots: &[u32],
            width: usize,
            src: &[f32],
            min: usize,
            f: impl Fn(&mut [T], &[f32]) + Sync,
        ) {
            let d = crate::kernels::pool::SharedMut::new(d);
            crate::kernels::pool::for_rows(slots.len(), min, 1, &|r0, r1| {
                let rows = src[r0 * width..r1 * width].chunks_exact(width);
                for (&s, r) in slots[r0..r1].iter().zip(rows) {
                    // SAFETY: slots are distinct (or one range writes all) and inside the
                    // cache (checked above).
                    f(unsafe { d.slice(at + s as usize * width, width) }, r);
                }
            });
        }
        match dst {
            CpuStorage::F32(d) => put(d, d0, self.slots, width, src, min, |d, r| {
                d.copy_from_slice(r)
            }),
            CpuStorage::F16(d) => {
                use half::slice::HalfFloatSliceExt;
                put(d, d0, self.slots, width, src, min, |d, r| {
                    d.convert_from_f32_slice(r)
                })
            }
            _ => candle_core::bail!("write-rows: the cache must be f32 or f16"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Rows land in their slots (f32 exactly, f16 rounded), other slots are untouched, and a
    /// slot past the cache is refused.
    #[test]
    fn write_rows_fills_exactly_the_given_slots() {
        // 3 rows: one thread; 70 distinct: ranges on the kernel pool; 70 with a repeat:
        // one thread again (the later row wins, as in a serial loop).
        write_rows_case(&[5u32, 0, 9], 10);
        let many: Vec<u32> = (0..70u32).map(|i| (7 * i) % 101).collect();
        write_rows_case(&many, 101);
        let mut repeated = many.clone();
        repeated[50] = repeated[3];
        write_rows_case(&repeated, 101);
    }

    fn write_rows_case(slots: &[u32], cap: usize) {
        let dev = Device::Cpu;
        let rows = Tensor::randn(0f32, 1.0, (slots.len(), 8), &dev).unwrap();
        for dt in [candle_core::DType::F32, candle_core::DType::F16] {
            let cache = Tensor::full(7f32, (cap, 8), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            cache.inplace_op2(&rows, &WriteRows { slots }).unwrap();
            let got = cache
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let want = rows
                .to_dtype(dt)
                .unwrap()
                .to_dtype(candle_core::DType::F32)
                .unwrap();
            let want = want.to_vec2::<f32>().unwrap();
            for (slot, row) in got.iter().enumerate() {
                match slots.iter().rposition(|&s| s as usize == slot) {
                    Some(i) => assert_eq!(row, &want[i], "{dt:?} slot {slot}"),
                    None => assert!(row.iter().all(|&v| v == 7.0), "{dt:?} slot {slot}"),
                }
            }
            let mut bad = slots.to_vec();
            bad[1] = cap as u32;
            let err = cache.inplace_op2(&rows, &WriteRows { slots: &bad });
            assert!(err.is_err(), "{dt:?}: slot {cap} of {cap} accepted");
        }
    }
}
