//! The self-distilled training set: the target regenerates (greedily) a response to every
//! prompt with the engine's own batched forward, and the cache keeps per sequence
//! - the token ids (prompt + response, plus the final token that was sampled but not fed);
//! - the outputs of the drafter's target layers at every fed position (f16, concatenated
//!   in ascending layer order: `[n, L * hidden]`);
//! - the target's next-token distribution at temperature 1 at every position from the last
//!   prompt token on, as its top-k (ids + f16 probabilities, default k = 20; the mass outside
//!   the top-k is dropped, i.e. counted as 0 by the loss).
//!
//! On disk: a folder with `meta.json` ([`DatasetMeta`]) and `data.safetensors` (tensors
//! `{i}.tokens`, `{i}.feats`, `{i}.topk_ids`, `{i}.topk_p`). It lives in a cache folder
//! outside the repository (default `~/.cache/dspark/train/<model-id>/dataset`).

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use dspark_engine::chat::{ChatMessage, ChatTemplate};
use dspark_engine::kv::KvCache;
use dspark_engine::model::{Model, SeqBatch};
use dspark_engine::tokenizer::TextTokenizer;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const META: &str = "meta.json";
const DATA: &str = "data.safetensors";
pub const FORMAT: u32 = 1;

/// One prompt of a prompt file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Prompt {
    pub id: String,
    pub domain: String,
    /// The user message (chat prompts) or the raw text.
    pub prompt: String,
    /// Rendered with the model's chat template (default) or fed raw.
    #[serde(default = "yes")]
    pub chat: bool,
    /// Teacher-forced text (`"forced": true`, raw): nothing is generated; the whole text is
    /// fed and the target's distribution kept at every position, so real text (source
    /// code, prose) trains the drafter at the cost of a prefill.
    #[serde(default)]
    pub forced: bool,
}

fn yes() -> bool {
    true
}

/// Reads a JSONL prompt file: lines with `prompt` and optional `id`, `domain`, `chat`.
/// HumanEval lines (`task_id` + `prompt`) become chat prompts of domain `code` asking to
/// complete the function.
pub fn read_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read prompt file {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let prompt = s("prompt")
            .with_context(|| format!("{}:{}: no \"prompt\" field", path.display(), i + 1))?;
        if let Some(task) = s("task_id") {
            out.push(Prompt {
                id: task,
                domain: "code".into(),
                prompt: format!("Complete this Python function.\n\n```python\n{prompt}```"),
                chat: true,
                forced: false,
            });
            continue;
        }
        out.push(Prompt {
            id: s("id").unwrap_or_else(|| format!("{i}")),
            domain: s("domain").unwrap_or_else(|| "other".into()),
            forced: v.get("forced").and_then(|x| x.as_bool()).unwrap_or(false),
            chat: v.get("chat").and_then(|x| x.as_bool()).unwrap_or(true)
                && !v.get("forced").and_then(|x| x.as_bool()).unwrap_or(false),
            prompt,
        });
    }
    ensure!(!out.is_empty(), "{} has no prompts", path.display());
    Ok(out)
}

/// Prompt token ids as the server would build them.
pub fn encode_prompt(tok: &TextTokenizer, model: &Model, p: &Prompt) -> Result<Vec<u32>> {
    if !p.chat {
        return tok.encode(&p.prompt, tok.add_bos);
    }
    let tmpl = ChatTemplate::new(
        tok.chat_template.as_deref(),
        model.cfg.arch,
        &tok.bos_token,
        &tok.eos_token,
    )?;
    let text = tmpl.render(&[ChatMessage::text("user", p.prompt.clone())], true)?;
    tok.encode(&text, false)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SeqMeta {
    pub id: String,
    pub domain: String,
    pub prompt_len: usize,
    /// Fed positions (rows of `feats`); `tokens` has one more.
    pub fed: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetMeta {
    pub format: u32,
    pub model_id: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub target_layers: Vec<usize>,
    pub topk: usize,
    pub max_new_tokens: usize,
    pub generation: String,
    pub prompts: String,
    pub seqs: Vec<SeqMeta>,
    pub total_tokens: usize,
    pub seconds: f64,
}

/// One sequence in memory.
pub struct Sequence {
    pub meta: SeqMeta,
    pub tokens: Vec<u32>,
    /// `[fed, L * hidden]` f16.
    pub feats: Tensor,
    /// Row `t - (prompt_len - 1)` holds the target's top-k at position `t`.
    pub topk_ids: Vec<u32>,
    pub topk_p: Vec<f32>,
}

impl Sequence {
    /// Top-k `(ids, probs)` of the target at position `t` (`t >= prompt_len - 1`).
    pub fn topk(&self, t: usize, k: usize) -> (&[u32], &[f32]) {
        let r = t + 1 - self.meta.prompt_len;
        (
            &self.topk_ids[r * k..(r + 1) * k],
            &self.topk_p[r * k..(r + 1) * k],
        )
    }

    /// Anchors with a full block of `gamma` targets in the response region.
    pub fn anchor_range(&self, gamma: usize) -> Option<std::ops::RangeInclusive<usize>> {
        let lo = self.meta.prompt_len.saturating_sub(1).max(1);
        let hi = self.meta.fed.checked_sub(gamma)?;
        (hi >= lo).then_some(lo..=hi)
    }
}

pub struct Dataset {
    pub meta: DatasetMeta,
    pub seqs: Vec<Sequence>,
    /// Sequences per source folder, in order (one part unless [`Dataset::load_all`] joined
    /// several): each part is split into train and held-out on its own, so adding a dataset
    /// never moves an existing sequence across the split.
    pub parts: Vec<usize>,
}

/// Default cache folder of a model's dataset.
pub fn default_dir(model_id: &str) -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache/dspark/train")
        .join(model_id)
        .join("dataset")
}

/// Top-k of `softmax(logits)`, largest first.
pub fn topk_probs(logits: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    let p = idx
        .iter()
        .map(|&i| (logits[i as usize] - max).exp() / sum)
        .collect();
    (idx, p)
}

pub struct GenOptions {
    pub max_new_tokens: usize,
    pub batch: usize,
    pub topk: usize,
    pub target_layers: Vec<usize>,
}

struct Gen {
    tokens: Vec<u32>,
    prompt_len: usize,
    table: Vec<u32>,
    cached: usize,
    feats: Vec<Tensor>,
    topk_ids: Vec<u32>,
    topk_p: Vec<f32>,
    done: bool,
}

/// A KV cache (f32, blocks of 16) for `seqs` sequences of up to `len` tokens each.
fn gen_cache(model: &Model, seqs: usize, len: usize) -> Result<KvCache> {
    let bytes =
        seqs * (len + 32) * KvCache::bytes_per_token(model.cfg.num_layers, model.cfg.kv_dim());
    model.kv_cache(bytes, 16)
}

/// Rows fed per forward of a teacher-forced text (its logits are `rows x vocab` floats).
const FORCED_CHUNK: usize = 128;

/// A teacher-forced text ([`Prompt::forced`]): fed in chunks of [`FORCED_CHUNK`] with the
/// target's hidden states and top-k at every position. The sequence's "prompt" is its first
/// token, so every later position can anchor a block; its last token is the target's greedy
/// continuation (fed by nobody, as in generated sequences).
fn teacher_force(
    model: &Model,
    tok: &TextTokenizer,
    p: &Prompt,
    opts: &GenOptions,
    max_len: usize,
) -> Result<Sequence> {
    let mut tokens = encode_prompt(tok, model, p)?;
    tokens.truncate(max_len.min(model.max_context() - 1));
    ensure!(tokens.len() >= 2, "{}: text of fewer than 2 tokens", p.id);
    let n = tokens.len();
    let mut kv = gen_cache(model, 1, n)?;
    let mut table = Vec::new();
    ensure!(
        kv.ensure(&mut table, n),
        "teacher-forcing KV cache too small"
    );
    let (mut feats, mut topk_ids, mut topk_p) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = 0;
    for start in (0..n).step_by(FORCED_CHUNK) {
        let end = (start + FORCED_CHUNK).min(n);
        let fwd = model.forward(
            &[SeqBatch {
                tokens: tokens[start..end].to_vec(),
                start_pos: start,
                block_table: table.clone(),
                num_logits: end - start,
            }],
            &mut kv,
            &opts.target_layers,
        )?;
        feats.push(Tensor::cat(&fwd.hidden, 1)?.to_dtype(DType::F16)?);
        for l in fwd.logits.to_vec2::<f32>()? {
            let (ids, pr) = topk_probs(&l, opts.topk);
            topk_ids.extend_from_slice(&ids);
            topk_p.extend_from_slice(&pr);
            last = dspark_engine::model::argmax(&l);
        }
    }
    tokens.push(last);
    Ok(Sequence {
        meta: SeqMeta {
            id: p.id.clone(),
            domain: p.domain.clone(),
            prompt_len: 1,
            fed: n,
        },
        tokens,
        feats: Tensor::cat(&feats, 0)?,
        topk_ids,
        topk_p,
    })
}

/// Greedy generation of `prompts` with their hidden states and top-k distributions,
/// `batch` sequences per forward (teacher-forced texts one at a time, up to
/// `max_new_tokens * 4` tokens each). `progress(done_tokens)` is called after every step.
pub fn generate(
    model: &Model,
    tok: &TextTokenizer,
    prompts: &[Prompt],
    opts: &GenOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<Sequence>> {
    let layers = &opts.target_layers;
    ensure!(
        layers.windows(2).all(|w| w[0] < w[1]) && layers.iter().all(|&l| l < model.cfg.num_layers),
        "target layers {layers:?} must be ascending and below {}",
        model.cfg.num_layers
    );
    let mut out = Vec::with_capacity(prompts.len());
    let mut produced = 0;
    let (forced, prompts): (Vec<&Prompt>, Vec<&Prompt>) = prompts.iter().partition(|p| p.forced);
    let prompts: Vec<Prompt> = prompts.into_iter().cloned().collect();
    for p in forced {
        let s = teacher_force(model, tok, p, opts, opts.max_new_tokens * 4)?;
        produced += s.meta.fed;
        out.push(s);
        progress(produced);
    }
    // Continuous batching: up to `batch` sequences decode together, and a finished one's
    // place goes to the next prompt at once (its prefill joins the next forward), so the
    // forward stays full until the last prompts drain (with fixed chunks, the long answers
    // of each chunk ran nearly alone).
    let encoded = prompts
        .iter()
        .map(|p| encode_prompt(tok, model, p))
        .collect::<Result<Vec<_>>>()?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0) + opts.max_new_tokens + 1;
    ensure!(
        longest <= model.max_context(),
        "a prompt of {} tokens plus {} new tokens exceeds the context",
        longest - opts.max_new_tokens - 1,
        opts.max_new_tokens
    );
    let width = opts.batch.max(1).min(prompts.len().max(1));
    let mut kv = gen_cache(model, width, longest)?;
    let mut waiting = encoded.into_iter().enumerate();
    let mut live: Vec<(usize, Gen)> = Vec::with_capacity(width);
    let mut finished: Vec<Option<Sequence>> = (0..prompts.len()).map(|_| None).collect();
    loop {
        while live.len() < width {
            let Some((i, t)) = waiting.next() else { break };
            live.push((
                i,
                Gen {
                    prompt_len: t.len(),
                    tokens: t,
                    table: Vec::new(),
                    cached: 0,
                    feats: Vec::new(),
                    topk_ids: Vec::new(),
                    topk_p: Vec::new(),
                    done: false,
                },
            ));
        }
        if live.is_empty() {
            break;
        }
        let mut batch = Vec::with_capacity(live.len());
        for (_, g) in live.iter_mut() {
            let n = g.tokens.len();
            ensure!(kv.ensure(&mut g.table, n), "generation KV cache too small");
            batch.push(SeqBatch {
                tokens: g.tokens[g.cached..].to_vec(),
                start_pos: g.cached,
                block_table: g.table.clone(),
                num_logits: 1,
            });
        }
        let fwd = model.forward(&batch, &mut kv, layers)?;
        let logits = fwd.logits.to_vec2::<f32>()?;
        let mut row = 0;
        for (bi, (_, g)) in live.iter_mut().enumerate() {
            let n = batch[bi].tokens.len();
            let rows: Vec<Tensor> = fwd
                .hidden
                .iter()
                .map(|h| h.narrow(0, row, n))
                .collect::<candle_core::Result<_>>()?;
            g.feats.push(Tensor::cat(&rows, 1)?.to_dtype(DType::F16)?);
            row += n;
            g.cached += n;
            let l = &logits[bi];
            let (ids, p) = topk_probs(l, opts.topk);
            g.topk_ids.extend_from_slice(&ids);
            g.topk_p.extend_from_slice(&p);
            let next = dspark_engine::model::argmax(l);
            g.tokens.push(next);
            produced += 1;
            if tok.stop_ids.contains(&next) || g.tokens.len() - g.prompt_len >= opts.max_new_tokens
            {
                g.done = true;
                kv.truncate(&mut g.table, 0);
            }
        }
        progress(produced);
        for (i, g) in std::mem::take(&mut live) {
            if !g.done {
                live.push((i, g));
                continue;
            }
            let p = &prompts[i];
            finished[i] = Some(Sequence {
                meta: SeqMeta {
                    id: p.id.clone(),
                    domain: p.domain.clone(),
                    prompt_len: g.prompt_len,
                    fed: g.cached,
                },
                tokens: g.tokens,
                feats: Tensor::cat(&g.feats, 0)?,
                topk_ids: g.topk_ids,
                topk_p: g.topk_p,
            });
        }
    }
    out.extend(finished.into_iter().flatten());
    Ok(out)
}

impl Dataset {
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let dev = candle_core::Device::Cpu;
        let mut t = HashMap::new();
        for (i, s) in self.seqs.iter().enumerate() {
            let k = self.meta.topk;
            let rows = s.topk_ids.len() / k;
            t.insert(
                format!("{i}.tokens"),
                Tensor::new(s.tokens.as_slice(), &dev)?,
            );
            t.insert(format!("{i}.feats"), s.feats.clone());
            t.insert(
                format!("{i}.topk_ids"),
                Tensor::from_vec(s.topk_ids.clone(), (rows, k), &dev)?,
            );
            t.insert(
                format!("{i}.topk_p"),
                Tensor::from_vec(s.topk_p.clone(), (rows, k), &dev)?.to_dtype(DType::F16)?,
            );
        }
        candle_core::safetensors::save(&t, dir.join(DATA))
            .with_context(|| format!("cannot write {}", dir.join(DATA).display()))?;
        std::fs::write(dir.join(META), serde_json::to_string_pretty(&self.meta)?)?;
        Ok(())
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let mp = dir.join(META);
        let meta: DatasetMeta =
            serde_json::from_str(&std::fs::read_to_string(&mp).with_context(|| {
                format!(
                    "no dataset at {} (run `dspark-train train --generate-only`)",
                    dir.display()
                )
            })?)
            .with_context(|| format!("{} is not a dataset description", mp.display()))?;
        ensure!(
            meta.format == FORMAT,
            "{}: dataset format {} (this build reads {FORMAT}); regenerate it",
            mp.display(),
            meta.format
        );
        let dev = candle_core::Device::Cpu;
        let mut t = candle_core::safetensors::load(dir.join(DATA), &dev)
            .with_context(|| format!("cannot read {}", dir.join(DATA).display()))?;
        let mut seqs = Vec::with_capacity(meta.seqs.len());
        for (i, m) in meta.seqs.iter().enumerate() {
            let mut take = |k: &str| {
                t.remove(&format!("{i}.{k}"))
                    .with_context(|| format!("{}: missing tensor {i}.{k}", dir.display()))
            };
            let tokens: Vec<u32> = take("tokens")?.to_vec1()?;
            let feats = take("feats")?;
            let topk_ids: Vec<u32> = take("topk_ids")?.flatten_all()?.to_vec1()?;
            let topk_p: Vec<f32> = take("topk_p")?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            let width = meta.target_layers.len() * meta.hidden_size;
            if tokens.len() != m.fed + 1
                || feats.dims() != [m.fed, width]
                || topk_ids.len() != (m.fed + 1 - m.prompt_len) * meta.topk
            {
                bail!(
                    "{}: sequence {i} is inconsistent with meta.json",
                    dir.display()
                );
            }
            seqs.push(Sequence {
                meta: m.clone(),
                tokens,
                feats,
                topk_ids,
                topk_p,
            });
        }
        let parts = vec![seqs.len()];
        Ok(Self { meta, seqs, parts })
    }

    /// The datasets at `dirs` as one (they must come from the same target, layers and top-k).
    pub fn load_all(dirs: &[PathBuf]) -> Result<Self> {
        let (first, rest) = dirs.split_first().context("no dataset folder given")?;
        let mut all = Self::load(first)?;
        for dir in rest {
            let d = Self::load(dir)?;
            let (a, b) = (&all.meta, &d.meta);
            if (
                a.vocab_size,
                a.hidden_size,
                a.num_layers,
                &a.target_layers,
                a.topk,
            ) != (
                b.vocab_size,
                b.hidden_size,
                b.num_layers,
                &b.target_layers,
                b.topk,
            ) {
                bail!(
                    "datasets {} and {} do not fit together: {} (vocab {}, hidden {}, {} layers, target layers {:?}, top-{}) vs {} (vocab {}, hidden {}, {} layers, target layers {:?}, top-{})",
                    first.display(), dir.display(),
                    a.model_id, a.vocab_size, a.hidden_size, a.num_layers, a.target_layers, a.topk,
                    b.model_id, b.vocab_size, b.hidden_size, b.num_layers, b.target_layers, b.topk
                );
            }
            all.meta.prompts = format!("{},{}", all.meta.prompts, d.meta.prompts);
            all.meta.seqs.extend(d.meta.seqs);
            all.meta.total_tokens += d.meta.total_tokens;
            all.meta.seconds += d.meta.seconds;
            all.meta.max_new_tokens = all.meta.max_new_tokens.max(d.meta.max_new_tokens);
            all.parts.push(d.seqs.len());
            all.seqs.extend(d.seqs);
        }
        Ok(all)
    }

    /// Errors unless this dataset was made by `model` for a drafter reading `layers`.
    pub fn check_fits(&self, model: &Model, layers: &[usize]) -> Result<()> {
        let m = &self.meta;
        let c = &model.cfg;
        if m.vocab_size != c.vocab_size
            || m.hidden_size != c.hidden_size
            || m.num_layers != c.num_layers
        {
            bail!(
                "the dataset was generated by {} (vocab {}, hidden {}, {} layers); the target {} has vocab {}, hidden {}, {} layers",
                m.model_id, m.vocab_size, m.hidden_size, m.num_layers,
                model.id, c.vocab_size, c.hidden_size, c.num_layers
            );
        }
        if m.target_layers != layers {
            bail!(
                "the dataset stores target layers {:?}, the drafter reads {:?}; regenerate the dataset or use its layers",
                m.target_layers,
                layers
            );
        }
        if m.model_id != model.id {
            tracing::warn!(
                "dataset made by {}, training for {} (same shapes)",
                m.model_id,
                model.id
            );
        }
        Ok(())
    }

    /// Sequence indices `(train, held_out)`: per part, a seeded shuffle with the last `frac`
    /// held out.
    pub fn split(&self, frac: f64) -> (Vec<usize>, Vec<usize>) {
        let (mut train, mut heldout) = (Vec::new(), Vec::new());
        let mut start = 0;
        for &n in &self.parts {
            let mut idx: Vec<usize> = (start..start + n).collect();
            idx.shuffle(&mut ChaCha8Rng::seed_from_u64(0x5eed));
            let held = ((n as f64 * frac).round() as usize).min(n);
            train.extend_from_slice(&idx[..n - held]);
            heldout.extend_from_slice(&idx[n - held..]);
            start += n;
        }
        (train, heldout)
    }

    /// The `size` most frequent target ids (response tokens count twice, prompt tokens and
    /// top-k candidates weighted by probability once), filled up with the lowest ids.
    pub fn draft_vocab(&self, size: usize) -> Vec<u32> {
        let v = self.meta.vocab_size;
        let size = size.min(v);
        let mut count = vec![0f64; v];
        for s in &self.seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                count[t as usize] += if i >= s.meta.prompt_len { 2.0 } else { 1.0 };
            }
            for (&id, &p) in s.topk_ids.iter().zip(&s.topk_p) {
                count[id as usize] += p as f64;
            }
        }
        let mut ids: Vec<u32> = (0..v as u32).collect();
        ids.sort_by(|&a, &b| {
            count[b as usize]
                .total_cmp(&count[a as usize])
                .then(a.cmp(&b))
        });
        ids.truncate(size);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_is_sorted_and_normalised() {
        let (ids, p) = topk_probs(&[0.0, 2.0, 1.0, 2.0], 3);
        assert_eq!(ids, vec![1, 3, 2]);
        let z = 1.0 + 2.0 * 2f32.exp() + 1f32.exp();
        assert!((p[0] - 2f32.exp() / z).abs() < 1e-6);
        assert!((p[2] - 1f32.exp() / z).abs() < 1e-6);
    }
}
