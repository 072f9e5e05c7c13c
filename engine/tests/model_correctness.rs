//! The model against llama.cpp on the same GGUF (teacher-forced top-1 agreement), batched
//! against unbatched forwards, and clear errors for bad model files.

mod common;

use candle_core::Device;
use dspark_engine::kv::KvCache;
use dspark_engine::model::{argmax, Model, SeqBatch};
use dspark_engine::tokenizer::TextTokenizer;
use std::path::Path;

fn load(path: &Path) -> (Model, KvCache) {
    dspark_engine::runtime::init_threads(None);
    let m = Model::load(path, &Device::Cpu, &|_, _| {}).expect("model loads");
    let kv = KvCache::new(m.cfg.num_layers, m.cfg.kv_dim(), 256 << 20, 16, &Device::Cpu).unwrap();
    (m, kv)
}

/// Teacher-forces every reference sequence and counts top-1 agreement with llama.cpp.
fn agreement(path: &Path) -> (usize, usize, usize) {
    let (m, mut kv) = load(path);
    let reference = common::reference(path);
    let (mut agree, mut total, mut near_tie) = (0, 0, 0);
    for seq in reference["sequences"].as_array().unwrap() {
        let tokens: Vec<u32> = seq["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let top1: Vec<u32> = seq["top1"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let logits = m.logits_for(&tokens, &mut kv).unwrap();
        for (i, row) in logits.iter().enumerate().take(top1.len()) {
            total += 1;
            let ours = argmax(row);
            if ours == top1[i] {
                agree += 1;
            } else {
                // Count disagreements where llama.cpp's own top-2 gap is tiny.
                let mut sorted = row.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if (sorted[0] - sorted[1]).abs() < 0.05 {
                    near_tie += 1;
                }
            }
        }
    }
    (agree, total, near_tie)
}

#[test]
fn smollm2_top1_agrees_with_llama_cpp() {
    let (agree, total, near_tie) = agreement(&common::smollm2());
    let rate = agree as f64 / total as f64;
    println!("SmolLM2: top-1 agreement {agree}/{total} = {:.4} ({near_tie} of the misses are near-ties)", rate);
    assert!(total >= 2000, "reference has only {total} positions");
    assert!(rate >= 0.99, "top-1 agreement {rate:.4} < 0.99");
}

#[test]
fn gemma3_top1_agrees_with_llama_cpp() {
    let (agree, total, near_tie) = agreement(&common::gemma3());
    let rate = agree as f64 / total as f64;
    println!("Gemma 3: top-1 agreement {agree}/{total} = {:.4} ({near_tie} of the misses are near-ties)", rate);
    assert!(total >= 2000, "reference has only {total} positions");
    assert!(rate >= 0.99, "top-1 agreement {rate:.4} < 0.99");
}

#[test]
fn tokenizer_matches_llama_cpp_tokenization() {
    for path in [common::smollm2(), common::gemma3()] {
        let (_, ct) = dspark_engine::model::weights::open_gguf(&path).unwrap();
        let tok = TextTokenizer::from_gguf(&ct).unwrap();
        let reference = common::reference(&path);
        let add_bos = reference["add_bos"].as_bool().unwrap_or(false);
        let (mut same, mut n) = (0, 0);
        for seq in reference["sequences"].as_array().unwrap() {
            let text = seq["text"].as_str().unwrap();
            let expect: Vec<u32> = seq["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
            let ours = tok.encode(text, add_bos).unwrap();
            n += 1;
            // References may be truncated; compare the common prefix length.
            let k = expect.len().min(ours.len());
            if ours[..k] == expect[..k] {
                same += 1;
            } else {
                println!("{}: tokenization differs for {:?}", path.display(), &text[..text.len().min(60)]);
            }
        }
        println!("{}: {same}/{n} texts tokenized identically", path.display());
        assert!(same * 100 >= n * 95, "{}: only {same}/{n} texts tokenize like llama.cpp", path.display());
    }
}

#[test]
fn batched_and_unbatched_forwards_agree() {
    let (m, mut kv) = load(&common::smollm2());
    let (_, ct) = dspark_engine::model::weights::open_gguf(&common::smollm2()).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let texts = [
        "def fibonacci(n):\n    if n < 2:\n        return n",
        "The capital of France is",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
        "Hi",
    ];
    let seqs: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, false).unwrap()).collect();
    let solo: Vec<Vec<Vec<f32>>> = seqs.iter().map(|s| m.logits_for(s, &mut kv).unwrap()).collect();
    // Batched: each sequence split into two chunks; the second chunks run together, the
    // first chunks too, so every step mixes sequences of different lengths.
    let mut tables: Vec<Vec<u32>> = vec![vec![]; seqs.len()];
    for (t, s) in tables.iter_mut().zip(&seqs) {
        assert!(kv.ensure(t, s.len()));
    }
    let cut: Vec<usize> = seqs.iter().map(|s| s.len() / 2).collect();
    let first: Vec<SeqBatch> = seqs
        .iter()
        .zip(&tables)
        .zip(&cut)
        .map(|((s, t), &c)| SeqBatch { tokens: s[..c].to_vec(), start_pos: 0, block_table: t.clone(), num_logits: c })
        .collect();
    let out1 = m.forward(&first, &mut kv, &[]).unwrap().logits.to_vec2::<f32>().unwrap();
    let second: Vec<SeqBatch> = seqs
        .iter()
        .zip(&tables)
        .zip(&cut)
        .map(|((s, t), &c)| SeqBatch { tokens: s[c..].to_vec(), start_pos: c, block_table: t.clone(), num_logits: s.len() - c })
        .collect();
    let out2 = m.forward(&second, &mut kv, &[]).unwrap().logits.to_vec2::<f32>().unwrap();
    let mut rows = out1.iter();
    let mut batched: Vec<Vec<Vec<f32>>> = seqs.iter().map(|_| vec![]).collect();
    for (i, &c) in cut.iter().enumerate() {
        for _ in 0..c {
            batched[i].push(rows.next().unwrap().clone());
        }
    }
    let mut rows = out2.iter();
    for (i, s) in seqs.iter().enumerate() {
        for _ in cut[i]..s.len() {
            batched[i].push(rows.next().unwrap().clone());
        }
    }
    let mut max_diff = 0f32;
    for (a, b) in solo.iter().zip(&batched) {
        assert_eq!(a.len(), b.len());
        for (ra, rb) in a.iter().zip(b) {
            assert_eq!(argmax(ra), argmax(rb), "greedy token differs between batched and solo");
            for (x, y) in ra.iter().zip(rb) {
                max_diff = max_diff.max((x - y).abs());
            }
        }
    }
    println!("max |logit diff| batched vs solo: {max_diff}");
    assert!(max_diff < 0.05, "batched and solo logits differ by {max_diff}");
}

#[test]
fn bad_model_files_give_clear_errors() {
    let dir = std::env::temp_dir().join(format!("dspark-bad-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = |p: &Path| Model::load(p, &Device::Cpu, &|_, _| {}).err().expect("load must fail").to_string();

    let missing = dir.join("nope.gguf");
    let e = err(&missing);
    assert!(e.contains("nope.gguf") && e.contains("does not exist"), "{e}");

    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a gguf file at all").unwrap();
    let e = err(&garbage);
    assert!(e.contains("garbage.gguf") && e.contains("not a readable GGUF"), "{e}");

    let bytes = std::fs::read(common::smollm2()).unwrap();
    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&truncated);
    assert!(e.contains("truncated.gguf") && e.contains("truncated"), "{e}");

    // A real GGUF header for an architecture we do not serve.
    let other = dir.join("gptneox.gguf");
    {
        use candle_core::quantized::gguf_file::{write, Value};
        let mut f = std::fs::File::create(&other).unwrap();
        let md = [("general.architecture", &Value::String("gptneox".into()))];
        write(&mut f, &md, &[]).unwrap();
    }
    let e = err(&other);
    assert!(e.contains("gptneox.gguf") && e.contains("unsupported architecture 'gptneox'"), "{e}");

    let emptydir = dir.join("hf");
    std::fs::create_dir_all(&emptydir).unwrap();
    let e = err(&emptydir);
    assert!(e.contains("config.json"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
