//! The CPU kernel against the generic path (causal, bidirectional, sliding window; f32 and
//! f16 caches), the work cut, and a row's independence from its batch.

use super::work::Work;
use super::*;
use crate::testutil::causal_attention;
use candle_core::{Device, Tensor};

/// `hd` 16: scalar loops; 64: the SIMD ones (3 query heads per kv head).
fn check(causal: bool, window: Option<usize>) {
    check_shape(causal, window, 4, 2, 16);
    check_shape(causal, window, 6, 2, 64);
}

fn check_shape(causal: bool, window: Option<usize>, nh: usize, nkv: usize, hd: usize) {
    let dev = Device::Cpu;
    let bs = 4;
    let slots = 64;
    let kc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
    let vc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
    let seqs = vec![
        AttnSeq {
            q_start: 0,
            q_len: 3,
            q_pos0: 5,
            kv_len: 8,
            block_table: vec![7, 2],
        },
        AttnSeq {
            q_start: 3,
            q_len: 1,
            q_pos0: 0,
            kv_len: 1,
            block_table: vec![4],
        },
        AttnSeq {
            q_start: 4,
            q_len: 5,
            q_pos0: 6,
            kv_len: 11,
            block_table: vec![9, 1, 15],
        },
        // More rows than one chunk holds (prefill-like).
        AttnSeq {
            q_start: 9,
            q_len: 11,
            q_pos0: 2,
            kv_len: 13,
            block_table: vec![3, 5, 6, 8],
        },
    ];
    // Decode rows of sequences of different lengths (batched into padded groups).
    let seqs: Vec<AttnSeq> = seqs
        .into_iter()
        .chain((0..6).map(|i| AttnSeq {
            q_start: 20 + i,
            q_len: 1,
            q_pos0: 2 + 2 * i,
            kv_len: 3 + 2 * i,
            block_table: vec![(i as u32 + 3) % 16, 12, 0, 14],
        }))
        .collect();
    let q = Tensor::randn(0f32, 1.0, (26, nh, hd), &dev).unwrap();
    let op_with = |batch: AttnBatch| PagedAttention {
        seqs: std::sync::Arc::new(batch),
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        scale: 0.25,
        window,
        causal,
    };
    // Groups bounded so tightly that most sequences are alone: the same result.
    let small = op_with(AttnBatch::with_group_cells(seqs.clone(), 30));
    let op = op_with(AttnBatch::new(seqs));
    let maxdiff = |a: Tensor, b: Tensor| crate::testutil::max_abs_diff(&a, &b);
    let a = op.forward(&q, &kc, &vc).unwrap();
    let b = op.forward_generic(&q, &kc, &vc).unwrap();
    let d = maxdiff(a.clone(), b);
    assert!(d < 1e-4, "kernel and reference differ by {d}");
    let groups = |op: &PagedAttention| op.seqs.plan(op, &dev).unwrap().groups.len();
    assert_eq!(groups(&op), 1, "up to 16 query rows each: one padded group");
    assert!(groups(&small) >= 5, "tight bounds split the batch");
    let c = maxdiff(a.clone(), small.forward_generic(&q, &kc, &vc).unwrap());
    assert!(c < 1e-4, "kernel and small-group reference differ by {c}");
    // f16 caches: the kernel widens rows as it reads them; the reference gathers and
    // converts. Same inputs (the f16-rounded caches), so only f32 rounding differs.
    let (k16, v16) = (
        kc.to_dtype(candle_core::DType::F16).unwrap(),
        vc.to_dtype(candle_core::DType::F16).unwrap(),
    );
    let a16 = op.forward(&q, &k16, &v16).unwrap();
    let b16 = op.forward_generic(&q, &k16, &v16).unwrap();
    let d16 = maxdiff(a16.clone(), b16);
    assert!(d16 < 1e-4, "f16 kernel and reference differ by {d16}");
    // ...and the f16 cache changes the result only by its rounding.
    let dq = maxdiff(a16, a);
    assert!(dq > 0.0 && dq < 1e-2, "f16 vs f32 cache: {dq}");
}

/// A verify block over a long context (several passes of the value loop, many key
/// groups, a partial last one) with f16 and f32 caches: kernel = reference.
#[test]
fn long_context_verify_block_matches_reference() {
    let dev = Device::Cpu;
    let (nh, nkv, hd, bs) = (6, 2, 64, 16);
    let kc = Tensor::randn(0f32, 1.0, (128, nkv * hd), &dev).unwrap();
    let vc = Tensor::randn(0f32, 1.0, (128, nkv * hd), &dev).unwrap();
    let seqs = vec![
        AttnSeq {
            q_start: 0,
            q_len: 4,
            q_pos0: 97,
            kv_len: 101,
            block_table: vec![3, 0, 5, 1, 7, 2, 6],
        },
        AttnSeq {
            q_start: 4,
            q_len: 1,
            q_pos0: 40,
            kv_len: 41,
            block_table: vec![4, 7, 1],
        },
    ];
    let q = Tensor::randn(0f32, 1.0, (5, nh, hd), &dev).unwrap();
    let op = causal_attention(seqs, nh, nkv, hd, bs);
    for dt in [candle_core::DType::F32, candle_core::DType::F16] {
        let (k, v) = (kc.to_dtype(dt).unwrap(), vc.to_dtype(dt).unwrap());
        let a = op.forward(&q, &k, &v).unwrap();
        let b = op.forward_generic(&q, &k, &v).unwrap();
        let d = crate::testutil::max_abs_diff(&a, &b);
        assert!(d < 1e-4, "{dt:?}: kernel and reference differ by {d}");
    }
}

#[test]
fn work_is_cut_until_every_thread_has_tasks() {
    let seq = |q_start, q_len, kv_len| AttnSeq {
        q_start,
        q_len,
        q_pos0: kv_len - q_len,
        kv_len,
        block_table: vec![0; 128],
    };
    let op = |seqs| causal_attention(seqs, 9, 3, 64, 16);
    let shape = |w: &Work| {
        w.chunks
            .iter()
            .map(|c| (c.r0, c.nr, c.parts))
            .collect::<Vec<_>>()
    };
    // One verify block of 4 rows, short context, 2 threads: 2 chunks of 2 rows, one
    // task per kv head (6 tasks).
    let w = op(vec![seq(0, 4, 14)]).work(2);
    assert_eq!(shape(&w), vec![(0, 2, 1), (2, 2, 1)]);
    assert_eq!(w.tasks.len(), 6);
    // Enough work with split heads: chunks of 8 rows, the last one shorter.
    let w = op(vec![seq(0, 20, 30)]).work(2);
    assert_eq!(shape(&w), vec![(0, 8, 1), (8, 8, 1), (16, 4, 1)]);
    assert_eq!(w.tasks.len(), 9);
    // One decode row over 1,100 positions: 3 windows, heads split to fill 4 threads.
    let w = op(vec![seq(0, 1, 1100)]).work(4);
    assert_eq!(shape(&w), vec![(0, 1, 3)]);
    assert_eq!(w.tasks.len(), 9);
    assert_eq!(w.scratch, 3 * 9 * 66);
    // Decode rows of many sequences: one task each, every head.
    let decode: Vec<AttnSeq> = (0..8).map(|i| seq(i, 1, 40)).collect();
    let w = op(decode).work(2);
    assert_eq!((w.chunks.len(), w.tasks.len()), (8, 8));
}

/// A row's result does not depend on which other rows share the call (so a sequence's
/// greedy tokens do not either): one decode row over 1,100 positions alone (3 windows,
/// split heads) and beside a verify block and other rows (all heads per task), bit for
/// bit, and equal to the reference.
#[test]
fn a_rows_result_does_not_depend_on_its_batch() {
    let dev = Device::Cpu;
    let (nh, nkv, hd, bs) = (6, 2, 64, 16);
    let slots = 128 * bs;
    let kc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
    let vc = Tensor::randn(0f32, 1.0, (slots, nkv * hd), &dev).unwrap();
    let table = |first: u32, n: u32| (first..first + n).rev().collect::<Vec<u32>>();
    let row = |q_start| AttnSeq {
        q_start,
        q_len: 1,
        q_pos0: 1099,
        kv_len: 1100,
        block_table: table(0, 69),
    };
    let op = |seqs| causal_attention(seqs, nh, nkv, hd, bs);
    let q = Tensor::randn(0f32, 1.0, (12, nh, hd), &dev).unwrap();
    for dt in [candle_core::DType::F32, candle_core::DType::F16] {
        let (k, v) = (kc.to_dtype(dt).unwrap(), vc.to_dtype(dt).unwrap());
        let alone = op(vec![row(0)]);
        let a = alone.forward(&q.narrow(0, 0, 1).unwrap(), &k, &v).unwrap();
        let b = alone
            .forward_generic(&q.narrow(0, 0, 1).unwrap(), &k, &v)
            .unwrap();
        let d = crate::testutil::max_abs_diff(&a, &b);
        assert!(d < 1e-4, "{dt:?}: windows merged vs reference: {d}");
        let mut seqs = vec![row(0)];
        seqs.push(AttnSeq {
            q_start: 1,
            q_len: 5,
            q_pos0: 250,
            kv_len: 255,
            block_table: table(70, 16),
        });
        seqs.extend((6..12).map(|i| AttnSeq {
            q_start: i,
            q_len: 1,
            q_pos0: 10 * i,
            kv_len: 10 * i + 1,
            block_table: table(90, 8),
        }));
        let crowd = op(seqs);
        let c = crowd.forward(&q, &k, &v).unwrap();
        let mine = |t: &Tensor| t.get(0).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(mine(&c), mine(&a), "{dt:?}: the row changed with its batch");
        let r = crowd.forward_generic(&q, &k, &v).unwrap();
        let d = crate::testutil::max_abs_diff(&c, &r);
        assert!(d < 1e-4, "{dt:?}: crowded call vs reference: {d}");
    }
}

#[test]
fn kernel_matches_reference_causal() {
    check(true, None);
}
#[test]
fn kernel_matches_reference_bidirectional() {
    check(false, None);
}
#[test]
fn kernel_matches_reference_sliding_window() {
    check(true, Some(3));
}
