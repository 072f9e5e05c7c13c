//! The quantised matmul kernels on SmolLM2-135M's shapes: throughput with cache-resident
//! weights (`shapes`), one decode step's matmuls over model-sized weights streaming from
//! memory (`stream`), and the machine's read bandwidth with all cores (`bandwidth`: the
//! ceiling of a one-row decode step, which reads every weight once).
//! `cargo bench -p dspark-engine --bench matmul [-- shapes|stream|bandwidth]` (all three
//! without an argument).

use dspark_engine::kernels::{matmul_many, packed, Isa, QMatrix, QType};
use dspark_engine::testutil::{quantized, random_with_outliers};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() {
    let which: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let want = |name: &str| which.is_empty() || which.iter().any(|w| w == name);
    if want("shapes") {
        bench_shapes();
    }
    if want("stream") {
        bench_stream();
    }
    if want("bandwidth") {
        bench_bandwidth();
    }
}

/// Read bandwidth of a 1 GiB buffer (far past the caches, about a 1.5B Q4_K_M model), cut
/// into one contiguous share per core as the matmul chunks are, 10 passes: the best and the
/// median GB/s, and what they make of a one-row decode step of `bytes` of weights.
fn bench_bandwidth() {
    let len = 1usize << 30;
    let buf: Vec<u64> = (0..len / 8).map(|i| i as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = buf.len().div_ceil(threads);
    let mut gbs = Vec::new();
    for _ in 0..10 {
        let t = std::time::Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(share)
                .map(|c| {
                    s.spawn(move || {
                        // Eight independent lanes, so the loop is bound by loads, not by
                        // one addition chain.
                        let mut acc = [0u64; 8];
                        for w in c.chunks_exact(8) {
                            for (a, &x) in acc.iter_mut().zip(w) {
                                *a = a.wrapping_add(x);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("reader thread"))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        gbs.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    gbs.sort_by(f64::total_cmp);
    let (best, med) = (gbs[gbs.len() - 1], gbs[gbs.len() / 2]);
    println!(
        "read bandwidth, {threads} threads, 1 GiB x 10: best {best:.1} GB/s, median {med:.1} GB/s"
    );
    for (name, bytes) in [
        ("SmolLM2-135M Q4_1", 98.4e6),
        ("Qwen2.5-Coder-1.5B Q4_K_M", 1.117e9),
    ] {
        println!(
            "  {name} ({:.0} MB): one-row step >= {:.1} ms, <= {:.1} steps/s at the median",
            bytes / 1e6,
            bytes / med / 1e6,
            med * 1e9 / bytes
        );
    }
}

/// Throughput of the shapes of SmolLM2-135M, weights cache-resident.
fn bench_shapes() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let reps = 200;
    for &(ty, n, k) in &[
        (QType::Q4_1, 1536, 576),
        (QType::Q4_1, 576, 1536),
        (QType::Q4_1, 192, 576),
        (QType::Q8_0, 49152, 576),
        (QType::Q4K, 1536, 1024),
        (QType::Q6K, 1536, 1024),
        (QType::Q5_0, 1536, 1024),
    ] {
        let qt = quantized(ty, n, k, &mut rng);
        let data = qt.data().unwrap();
        let isa = Isa::detect();
        let packed = packed::Packed::supports(ty, n, k, isa)
            .then(|| packed::Packed::new(ty, n, k, &data, isa).unwrap());
        let plain = QMatrix::new(ty, n, k, &data).unwrap();
        let mut layouts = vec![("ggml", plain)];
        if let Some(p) = &packed {
            layouts.push(("packed", plain.with_packed(Some(p))));
        }
        for m in [1, 2, 3, 4, 8, 16, 64] {
            let x = random_with_outliers(m * k, &mut rng);
            let mut y = vec![0f32; m * n];
            let reps = if n > 10000 { reps / 10 } else { reps } / m.max(1) + 1;
            for (name, w) in &layouts {
                w.matmul(&x, m, &mut y);
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    w.matmul(&x, m, &mut y);
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "{isa:?} {name:6} {ty:?} n={n} k={k} m={m}: {:.1} us, {:.2} GB/s weights, {:.1} GMAC/s",
                    s * 1e6,
                    data.len() as f64 / s / 1e9,
                    (m * n * k) as f64 / s / 1e9
                );
            }
        }
    }
}

/// Raw ggml blocks of random quants with a fixed valid scale (1/64 as f16), for benches
/// that need model-sized weights fast.
fn raw_blocks(ty: QType, n: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let bs = ty.type_size();
    let mut out = vec![0u8; n * k / ty.block_size() * bs];
    rng.fill(&mut out[..]);
    for b in out.chunks_mut(bs) {
        b[0..2].copy_from_slice(&0x2400u16.to_le_bytes());
        if ty == QType::Q4_1 {
            b[2..4].copy_from_slice(&0xa400u16.to_le_bytes());
        }
    }
    out
}

/// The matmuls of one SmolLM2-135M decode step over distinct, model-sized weights (30
/// layers of Q4_1 q/k/v, o, gate/up, down, then the Q8_0 LM head: 96 MB, far past the
/// caches), at m = 1..8 rows: what a verify step's extra rows cost when the weights stream
/// from memory (the cache-resident `bench_shapes` cannot show it).
fn bench_stream() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let isa = Isa::detect();
    let mk = |ty: QType, n: usize, k: usize, rng: &mut ChaCha8Rng| {
        let d = raw_blocks(ty, n, k, rng);
        let p = packed::Packed::supports(ty, n, k, isa)
            .then(|| packed::Packed::new(ty, n, k, &d, isa).unwrap());
        (ty, n, k, d, p)
    };
    type M = (QType, usize, usize, Vec<u8>, Option<packed::Packed>);
    fn qm(w: &M) -> QMatrix<'_> {
        QMatrix::new(w.0, w.1, w.2, &w.3)
            .unwrap()
            .with_packed(w.4.as_ref())
    }
    let mut layers: Vec<[M; 7]> = Vec::new();
    for _ in 0..30 {
        layers.push([
            mk(QType::Q4_1, 576, 576, &mut rng),
            mk(QType::Q4_1, 192, 576, &mut rng),
            mk(QType::Q4_1, 192, 576, &mut rng),
            mk(QType::Q4_1, 576, 576, &mut rng),
            mk(QType::Q4_1, 1536, 576, &mut rng),
            mk(QType::Q4_1, 1536, 576, &mut rng),
            mk(QType::Q4_1, 576, 1536, &mut rng),
        ]);
    }
    let head = mk(QType::Q8_0, 49152, 576, &mut rng);
    let bytes: usize = layers.iter().flatten().map(|w| w.3.len()).sum::<usize>() + head.3.len();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); 9];
    let ms = [1usize, 2, 3, 4, 8];
    for round in 0..12 {
        for &m in &ms {
            let x = random_with_outliers(m * 1536, &mut rng);
            let mut o = vec![vec![0f32; m * 1536]; 3];
            let t = std::time::Instant::now();
            let mut sec = [0f64; 5];
            let mut ts = std::time::Instant::now();
            let mut lap = |i: usize| {
                let n = std::time::Instant::now();
                sec[i] += (n - ts).as_secs_f64();
                ts = n;
            };
            for l in &layers {
                let [a, b, c] = &mut o[..] else {
                    unreachable!()
                };
                matmul_many(
                    &[qm(&l[0]), qm(&l[1]), qm(&l[2])],
                    &x[..m * 576],
                    m,
                    &mut [&mut a[..m * 576], &mut b[..m * 192], &mut c[..m * 192]],
                );
                lap(0);
                qm(&l[3]).matmul(&x[..m * 576], m, &mut a[..m * 576]);
                lap(1);
                let [a, b, _] = &mut o[..] else {
                    unreachable!()
                };
                matmul_many(
                    &[qm(&l[4]), qm(&l[5])],
                    &x[..m * 576],
                    m,
                    &mut [&mut a[..m * 1536], &mut b[..m * 1536]],
                );
                lap(2);
                qm(&l[6]).matmul(&x[..m * 1536], m, &mut a[..m * 576]);
                lap(3);
            }
            let mut y = vec![0f32; m * 49152];
            qm(&head).matmul(&x[..m * 576], m, &mut y);
            lap(4);
            if round == 11 {
                let us: Vec<String> = sec.iter().map(|s| format!("{:.0}", s * 1e6)).collect();
                println!(
                    "m={m}, last round, us: q/k/v, o, gate/up, down, head = {}",
                    us.join(", ")
                );
            }
            if round > 1 {
                times[m].push(t.elapsed().as_secs_f64());
            }
        }
    }
    for &m in &ms {
        let mut v = times[m].clone();
        v.sort_by(f64::total_cmp);
        let med = v[v.len() / 2];
        let one = {
            let mut u = times[1].clone();
            u.sort_by(f64::total_cmp);
            u[u.len() / 2]
        };
        println!(
            "{isa:?} stream m={m}: {:.3} ms, {:.1} GB/s, x{:.3} of m=1, +{:.3} ms per extra row",
            med * 1e3,
            bytes as f64 / med / 1e9,
            med / one,
            if m > 1 {
                (med - one) * 1e3 / (m - 1) as f64
            } else {
                0.0
            }
        );
    }
}
