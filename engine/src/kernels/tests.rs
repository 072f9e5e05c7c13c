//! Kernel tests against f32 references.
//!
//! Weights are random f32 quantised by candle (so the blocks are what a GGUF file holds).
//! Three checks per case, each error measured against `S = sum_l |x_l| |w_jl|` of its
//! output element:
//! - exact-arithmetic reference (activations quantised the same way, then dequantised, f64
//!   sums; for Q4_1/Q5_1 the min term uses Q8_1's f16 `s` as ggml does):
//!   `|y - ref| <= 1e-5 S` (f32 rounding only);
//! - scalar vs AVX2 (plain and packed) vs AVX-512 VNNI on packed weights (Q4_0/Q4_1/Q8_0
//!   with n a multiple of 8 or 16, Q4_K/Q6_K with n a multiple of 16, when the CPU has it):
//!   `|y_isa - y_scalar| <= 1e-5 S`;
//! - plain f32 reference (unquantised activations):
//!   `|y - ref| <= sum_l |x_l - q(x_l)| |w_jl| + 2e-3 S`, where `q(x_l)` is the quantised
//!   activation (|x_l - q(x_l)| <= amax(block)/254, about 0.4% of the block's largest value).

use super::blocks::{QK, QK_K};
use super::q8::{quantize_q8, quantize_q8k, Q8Block, Q8KBlock};
use super::*;
use crate::testutil::{quantized, random_with_outliers};
use candle_core::Device;
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Activations after the kernel's own quantisation, as f32, and per 32-block the rounding
/// of Q8_1's `s` (`s - d * sum(q)`).
fn quantised_acts(ty: QType, x: &[f32]) -> (Vec<f32>, Vec<f64>) {
    let mut out = vec![0f32; x.len()];
    let mut ds = Vec::new();
    if ty.block_size() == QK_K {
        let mut b = vec![Q8KBlock::default(); x.len() / QK_K];
        quantize_q8k(x, &mut b);
        for (o, b) in out.chunks_mut(QK_K).zip(&b) {
            for (o, &q) in o.iter_mut().zip(&b.qs) {
                *o = b.d * q as f32;
            }
        }
    } else {
        let mut b = vec![Q8Block::default(); x.len() / QK];
        quantize_q8(x, &mut b);
        for (o, b) in out.chunks_mut(QK).zip(&b) {
            for (o, &q) in o.iter_mut().zip(&b.qs) {
                *o = b.d * q as f32;
            }
            let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
            ds.push(b.s as f64 - b.d as f64 * sum as f64);
        }
    }
    (out, ds)
}

/// The min `m` of every block of a Q4_1/Q5_1 matrix (0 for other types).
fn block_mins(ty: QType, data: &[u8], blocks: usize) -> Vec<f64> {
    let size = ty.type_size();
    (0..blocks)
        .map(|b| match ty {
            // m is the second f16 of both layouts.
            QType::Q4_1 | QType::Q5_1 => {
                let o = b * size + 2;
                blocks::f16_to_f32(u16::from_le_bytes([data[o], data[o + 1]])) as f64
            }
            _ => 0.0,
        })
        .collect()
}

fn check(ty: QType, m: usize, n: usize, k: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let qt = quantized(ty, n, k, &mut rng);
    let data = qt.data().unwrap();
    let w = QMatrix::new(ty, n, k, &data).unwrap();
    let wf = w.dequantize();
    let x = random_with_outliers(m * k, &mut rng);
    let (xq, ds): (Vec<Vec<f32>>, Vec<Vec<f64>>) =
        x.chunks(k).map(|r| quantised_acts(ty, r)).unzip();
    let (xq, ds) = (xq.concat(), ds.concat());
    let nb = k / ty.block_size();
    let mins = block_mins(ty, &data, n * nb);
    let mut ys = vec![0f32; m * n];
    w.matmul_isa(&x, m, &mut ys, Isa::Scalar);
    for isa in [Isa::Avx2, Isa::Avx512Vnni] {
        if isa > Isa::supported() {
            continue;
        }
        // Each SIMD ISA runs on the plain ggml blocks and, where the shape packs, on its
        // packed copy.
        let packed = packed::Packed::supports(ty, n, k, isa)
            .then(|| packed::Packed::new(ty, n, k, &data, isa).unwrap());
        for p in [None, packed.as_ref()] {
            if p.is_none() && packed.is_some() && isa == Isa::Avx512Vnni {
                continue; // the same kernels as Avx2's plain path
            }
            let mut y = vec![0f32; m * n];
            w.with_packed(p).matmul_isa(&x, m, &mut y, isa);
            compare(
                ty,
                (m, n, k),
                seed,
                isa,
                (&x, &xq, &wf),
                (&ds, &mins),
                (&y, &ys),
            );
        }
    }
}

#[allow(clippy::type_complexity)]
fn compare(
    ty: QType,
    (m, n, k): (usize, usize, usize),
    seed: u64,
    isa: Isa,
    (x, xq, wf): (&[f32], &[f32], &[f32]),
    (ds, mins): (&[f64], &[f64]),
    (y, ys): (&[f32], &[f32]),
) {
    let nb = k / ty.block_size();
    for i in 0..m {
        for j in 0..n {
            let (xr, xqr, wr) = (
                &x[i * k..(i + 1) * k],
                &xq[i * k..(i + 1) * k],
                &wf[j * k..(j + 1) * k],
            );
            let mut exact: f64 = xqr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            // The min term uses the activation block's stored sum `s` (f16, as ggml's
            // Q8_1): its rounding is part of the quantised arithmetic, not a kernel error.
            let mut s_rounding = 0.0;
            if ty == QType::Q4_1 || ty == QType::Q5_1 {
                for b in 0..nb {
                    exact += mins[j * nb + b] * ds[i * nb + b];
                    s_rounding += (mins[j * nb + b] * ds[i * nb + b]).abs();
                }
            }
            let plain: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let s: f64 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs() as f64).sum();
            let s = s + 1e-6;
            let qerr: f64 = xr
                .iter()
                .zip(xqr)
                .zip(wr)
                .map(|((&a, &q), &b)| ((a - q) * b).abs() as f64)
                .sum();
            let (v, vs) = (y[i * n + j] as f64, ys[i * n + j] as f64);
            let ctx = format!("{ty:?} {isa:?} m={m} n={n} k={k} seed={seed} at ({i},{j})");
            assert!(
                (v - exact).abs() <= 1e-5 * s,
                "{ctx}: {v} vs exact {exact} (S={s})"
            );
            assert!(
                (v - vs).abs() <= 1e-5 * s,
                "{ctx}: {v} vs scalar {vs} (S={s})"
            );
            assert!(
                (v - plain).abs() <= qerr + s_rounding + 2e-3 * s,
                "{ctx}: {v} vs f32 {plain} (S={s})"
            );
        }
    }
}

/// A case proptest found where the f16 rounding of Q8_1's block sum was outside the
/// tolerance against the f32 product.
#[test]
fn q5_1_with_a_large_rounded_block_sum() {
    check(QType::Q5_1, 3, 79, 32, 832);
}

#[test]
fn dequantize_matches_candle() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for ty in QType::ALL {
        let (n, k) = (5, 512);
        let qt = quantized(ty, n, k, &mut rng);
        let data = qt.data().unwrap();
        let mine = QMatrix::new(ty, n, k, &data).unwrap().dequantize();
        let theirs: Vec<f32> = qt
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in mine.iter().zip(&theirs) {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{ty:?}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn every_type_every_batch_size() {
    for ty in QType::ALL {
        let k = if ty.block_size() == QK_K { 512 } else { 96 };
        for m in 1..=64 {
            check(ty, m, 7, k, m as u64);
            check(ty, m, 32, k, 100 + m as u64);
        }
    }
}

#[test]
fn odd_shapes_and_parallel_chunks() {
    for ty in QType::ALL {
        let bs = ty.block_size();
        for &(m, n, kb) in &[
            (1, 1, 1),
            (3, 33, 3),
            (5, 301, 2),
            (64, 65, 1),
            (9, 1000, 3),
            (5, 48, 3),
            (7, 160, 18),
            (64, 2064, 1),
        ] {
            check(ty, m, n, kb * bs, (m * n) as u64);
        }
    }
}

/// A row's result does not depend on how many rows share its call (the register tiles hold
/// 1..=8 rows; each row's arithmetic is the same in all of them): a verify step's rows equal
/// what decoding them one at a time gives, bit for bit.
#[test]
fn packed_rows_do_not_depend_on_their_batch() {
    let isa = Isa::detect();
    for ty in [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q6K,
    ] {
        let (n, k) = (64, 18 * ty.block_size());
        if !packed::Packed::supports(ty, n, k, isa) {
            eprintln!("{ty:?}: no packed kernel on {isa:?}; nothing to check");
            continue;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let qt = quantized(ty, n, k, &mut rng);
        let data = qt.data().unwrap();
        let p = packed::Packed::new(ty, n, k, &data, isa).unwrap();
        let w = QMatrix::new(ty, n, k, &data).unwrap().with_packed(Some(&p));
        let m = 19;
        let x = random_with_outliers(m * k, &mut rng);
        let mut all = vec![0f32; m * n];
        w.matmul_isa(&x, m, &mut all, isa);
        for r in 0..m {
            let mut one = vec![0f32; n];
            w.matmul_isa(&x[r * k..(r + 1) * k], 1, &mut one, isa);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&all[r * n..(r + 1) * n]), bits(&one), "{ty:?} row {r}");
        }
    }
}

#[test]
fn q8_quantisation_simd_equals_scalar() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for blocks in [1, 3, 18, 48] {
        let mut x = random_with_outliers(blocks * QK, &mut rng);
        x[5] = 0.0;
        if blocks > 2 {
            x[QK..2 * QK].fill(0.0); // an all-zero block
        }
        let mut a = vec![Q8Block::default(); blocks];
        let mut b = vec![Q8Block::default(); blocks];
        quantize_q8(&x, &mut a);
        super::q8::quantize_q8_scalar(&x, &mut b);
        for (a, b) in a.iter().zip(&b) {
            assert_eq!((a.qs, a.isum), (b.qs, b.isum));
            assert_eq!(
                (a.d.to_bits(), a.s.to_bits()),
                (b.d.to_bits(), b.s.to_bits())
            );
        }
    }
}

#[test]
fn q8_quantisation_follows_ggml() {
    // amax 127 -> d = 1, id = 1: halves round to even like _mm256_round_ps.
    let mut x = vec![0f32; 32];
    x[..5].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -3.5]);
    let mut b = [Q8Block::default()];
    quantize_q8(&x, &mut b);
    assert_eq!(&b[0].qs[..5], &[127, 0, 2, 2, -4]);
    assert_eq!((b[0].d, b[0].s), (1.0, 127.0));
    // Q8_K: the scale follows the signed extreme, which always maps to -127.
    let mut x = vec![0.5f32; 256];
    x[7] = -1.0;
    let mut b = [Q8KBlock::default()];
    quantize_q8k(&x, &mut b);
    assert_eq!(b[0].qs[7], -127);
    assert_eq!(b[0].qs[0], 64);
    assert_eq!(b[0].bsums[0], 64 * 15 - 127);
    assert!((b[0].d - 1.0 / 127.0).abs() < 1e-9);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes(t in 0usize..7, m in 1usize..24, n in 1usize..80, kb in 1usize..5, seed in 0u64..1000) {
        let ty = QType::ALL[t];
        check(ty, m, n, kb * ty.block_size(), seed);
    }

    /// Shapes whose rows pack (16 rows per group fit both ISAs' groups), K-quants included.
    #[test]
    fn random_packable_shapes(t in 0usize..5, m in 1usize..24, g in 1usize..8, kb in 1usize..12, seed in 0u64..1000) {
        let ty = [QType::Q4_0, QType::Q4_1, QType::Q8_0, QType::Q4K, QType::Q6K][t];
        check(ty, m, 16 * g, kb * ty.block_size(), seed);
    }
}
