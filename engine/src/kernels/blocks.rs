//! ggml block layouts of the weight types the kernels read, and their dequantisation (the
//! f32 reference the tests compare against).
//!
//! The structs mirror ggml's `block_*` definitions byte for byte (`repr(C)`, f16 scales stored
//! as raw `u16`), so a QTensor's bytes can be viewed as a slice of them. candle keeps its own
//! copies of these structs crate-private, hence the mirror.

use half::f16;

pub const QK: usize = 32;
pub const QK_K: usize = 256;

#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    f16::from_bits(h).to_f32()
}

/// `(q - 8) * d`, 32 weights; `qs[j]` holds element `j` (low nibble) and `j + 16` (high).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_0 {
    pub d: u16,
    pub qs: [u8; QK / 2],
}

/// `q * d + m`, same nibble order as Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; QK / 2],
}

/// `(q - 16) * d`, 5-bit: nibbles as Q4_0, bit `j` of `qh` is the fifth bit of element `j`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_0 {
    pub d: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// `q * d + m`, 5-bit, layout as Q5_0 plus the min.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_1 {
    pub d: u16,
    pub m: u16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// `q * d`, signed bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; QK],
}

/// Super-block of 256: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Super-block of 256: 16 sub-blocks of 16 with i8 scales, 6-bit quants (4 low + 2 high bits).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: u16,
}

const _: () = {
    assert!(std::mem::size_of::<BlockQ4_0>() == 18);
    assert!(std::mem::size_of::<BlockQ4_1>() == 20);
    assert!(std::mem::size_of::<BlockQ5_0>() == 22);
    assert!(std::mem::size_of::<BlockQ5_1>() == 24);
    assert!(std::mem::size_of::<BlockQ8_0>() == 34);
    assert!(std::mem::size_of::<BlockQ4K>() == 144);
    assert!(std::mem::size_of::<BlockQ6K>() == 210);
};

/// 6-bit scale and min of sub-block `j` (0..8) of a Q4_K super-block (ggml's
/// `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantisation of one block into `out` (its block length), the reference for tests.
pub trait Dequant {
    const BLOCK: usize;
    fn dequant(&self, out: &mut [f32]);
}

impl Dequant for BlockQ4_0 {
    const BLOCK: usize = QK;
    fn dequant(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for j in 0..16 {
            out[j] = ((self.qs[j] & 0xF) as i32 - 8) as f32 * d;
            out[j + 16] = ((self.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl Dequant for BlockQ4_1 {
    const BLOCK: usize = QK;
    fn dequant(&self, out: &mut [f32]) {
        let (d, m) = (f16_to_f32(self.d), f16_to_f32(self.m));
        for j in 0..16 {
            out[j] = (self.qs[j] & 0xF) as f32 * d + m;
            out[j + 16] = (self.qs[j] >> 4) as f32 * d + m;
        }
    }
}

#[inline(always)]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let h = u32::from_le_bytes(*qh);
    let mut v = [0u8; 32];
    for j in 0..16 {
        v[j] = (qs[j] & 0xF) | ((((h >> j) & 1) as u8) << 4);
        v[j + 16] = (qs[j] >> 4) | ((((h >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

impl Dequant for BlockQ5_0 {
    const BLOCK: usize = QK;
    fn dequant(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for (o, q) in out.iter_mut().zip(q5_values(&self.qh, &self.qs)) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

impl Dequant for BlockQ5_1 {
    const BLOCK: usize = QK;
    fn dequant(&self, out: &mut [f32]) {
        let (d, m) = (f16_to_f32(self.d), f16_to_f32(self.m));
        for (o, q) in out.iter_mut().zip(q5_values(&self.qh, &self.qs)) {
            *o = q as f32 * d + m;
        }
    }
}

impl Dequant for BlockQ8_0 {
    const BLOCK: usize = QK;
    fn dequant(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

impl Dequant for BlockQ4K {
    const BLOCK: usize = QK_K;
    fn dequant(&self, out: &mut [f32]) {
        let (d, dmin) = (f16_to_f32(self.d), f16_to_f32(self.dmin));
        for c in 0..4 {
            let q = &self.qs[32 * c..32 * c + 32];
            let (s1, m1) = scale_min_k4(2 * c, &self.scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, &self.scales);
            let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
            for l in 0..32 {
                out[64 * c + l] = d1 * (q[l] & 0xF) as f32 - m1;
                out[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// The centred 6-bit quants of Q6_K at `l`, `l + 32`, `l + 64` and `l + 96` of a half
/// block (`ql`: its 64 low-nibble bytes, `qh`: its 32 high-bit bytes).
#[inline(always)]
pub(crate) fn q6k_quants(ql: &[u8], qh: &[u8], l: usize) -> [i32; 4] {
    [
        ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32,
        ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32,
        ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32,
        ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32,
    ]
}

impl Dequant for BlockQ6K {
    const BLOCK: usize = QK_K;
    fn dequant(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for h in 0..2 {
            let ql = &self.ql[64 * h..64 * h + 64];
            let qh = &self.qh[32 * h..32 * h + 32];
            let sc = &self.scales[8 * h..8 * h + 8];
            let y = &mut out[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let [q1, q2, q3, q4] = q6k_quants(ql, qh, l);
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}
