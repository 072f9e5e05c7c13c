//! SmolLM2-135M's attention over distinct f16 caches (keys and values stream from memory as
//! in a step): one sequence with 256 or 512 cached positions and 1 to 8 query rows (a verify
//! block) over 30 layers, then a loaded server's 64 decode rows and 16 verify blocks of 4 (256
//! positions each, in their own blocks) over 8. Microseconds per layer.
//! `cargo bench -p dspark-engine --bench attention`.

use candle_core::{Device, Tensor};
use dspark_engine::model::attention::{AttnSeq, PagedAttention};
use dspark_engine::testutil::causal_attention;

/// Median seconds per layer of `op` over `reps` passes through all `caches`.
fn per_layer(op: &PagedAttention, q: &Tensor, caches: &[(Tensor, Tensor)], reps: usize) -> f64 {
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            for (k, v) in caches {
                op.forward(q, k, v).unwrap();
            }
            t.elapsed().as_secs_f64() / caches.len() as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// `layers` distinct f16 key and value caches of `slots` rows (9 query heads, 3 kv heads
/// of 64: SmolLM2-135M's attention).
fn f16_caches(layers: usize, slots: usize) -> Vec<(Tensor, Tensor)> {
    let f16 = |t: Tensor| t.to_dtype(candle_core::DType::F16).unwrap();
    (0..layers)
        .map(|_| {
            let k = Tensor::randn(0f32, 1.0, (slots, 3 * 64), &Device::Cpu).unwrap();
            let v = Tensor::randn(0f32, 1.0, (slots, 3 * 64), &Device::Cpu).unwrap();
            (f16(k), f16(v))
        })
        .collect()
}

fn main() {
    let caches = f16_caches(30, 1024);
    for rows in [1usize, 2, 4, 8] {
        for ctx in [256usize, 512] {
            let seq = AttnSeq {
                q_start: 0,
                q_len: rows,
                q_pos0: ctx,
                kv_len: ctx + rows,
                block_table: (0..64u32).rev().collect(),
            };
            let q = Tensor::randn(0f32, 1.0, (rows, 9, 64), &Device::Cpu).unwrap();
            let t = per_layer(&causal_attention(vec![seq], 9, 3, 64, 16), &q, &caches, 40);
            println!(
                "attention rows={rows} ctx={ctx}: {:.1} us per layer",
                t * 1e6
            );
        }
    }
    let ctx = 256;
    let caches = f16_caches(8, 64 * (ctx + 16));
    for (n, rows) in [(64usize, 1usize), (16, 4)] {
        let seqs: Vec<AttnSeq> = (0..n)
            .map(|i| AttnSeq {
                q_start: i * rows,
                q_len: rows,
                q_pos0: ctx,
                kv_len: ctx + rows,
                block_table: (0..(ctx + 16) as u32 / 16)
                    .map(|b| b * 64 + i as u32)
                    .collect(),
            })
            .collect();
        let q = Tensor::randn(0f32, 1.0, (n * rows, 9, 64), &Device::Cpu).unwrap();
        let t = per_layer(&causal_attention(seqs, 9, 3, 64, 16), &q, &caches, 10);
        println!(
            "attention {n} sequences x {rows} rows, ctx={ctx}: {:.1} us per layer, {:.2} us per sequence",
            t * 1e6,
            t * 1e6 / n as f64
        );
    }
}
