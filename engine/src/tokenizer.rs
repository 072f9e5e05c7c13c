//! Text <-> token ids: a `tokenizers` tokenizer from `tokenizer.json`, or built from GGUF
//! metadata (byte-level BPE for "gpt2" vocabularies, SentencePiece-style BPE with byte
//! fallback for "llama" vocabularies), plus incremental detokenization for streaming.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, NormalizerWrapper, Tokenizer};

pub struct TextTokenizer {
    tk: Tokenizer,
    pub bos_id: Option<u32>,
    pub bos_token: String,
    pub eos_token: String,
    /// Token ids that end generation (EOS and end-of-turn markers).
    pub stop_ids: Vec<u32>,
    /// Whether a raw (non-chat) prompt starts with BOS.
    pub add_bos: bool,
    /// Chat template from the model files, if any.
    pub chat_template: Option<String>,
    pub vocab_size: usize,
}

/// The pre-tokenizer split of Qwen2-family vocabularies (`tokenizer.ggml.pre = "qwen2"`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const END_OF_TURN: &[&str] = &["<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"];

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Option<&'a gguf_file::Value> {
    ct.metadata.get(key)
}

fn md_u32(ct: &gguf_file::Content, key: &str) -> Option<u32> {
    md(ct, key).and_then(|v| {
        v.to_u32()
            .ok()
            .or_else(|| v.to_i32().ok().map(|x| x as u32))
    })
}

fn md_strings(ct: &gguf_file::Content, key: &str) -> Result<Vec<String>> {
    let v = md(ct, key).with_context(|| format!("GGUF has no '{key}'"))?;
    v.to_vec()?
        .iter()
        .map(|x| Ok(x.to_string()?.clone()))
        .collect()
}

impl TextTokenizer {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let model = md(ct, "tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok().cloned())
            .context("GGUF has no tokenizer (tokenizer.ggml.model)")?;
        let tokens = md_strings(ct, "tokenizer.ggml.tokens")?;
        let types: Vec<u32> = match md(ct, "tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|x| x.to_i32().map(|t| t as u32).or_else(|_| x.to_u32()))
                .collect::<candle_core::Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        let vocab: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let add_space_prefix = md(ct, "tokenizer.ggml.add_space_prefix")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let mut tk = match model.as_str() {
            "gpt2" => {
                let merges: Vec<(String, String)> = md_strings(ct, "tokenizer.ggml.merges")?
                    .into_iter()
                    .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.into(), b.into())))
                    .collect();
                let bpe = BPE::builder()
                    .vocab_and_merges(bpe_vocab(&vocab), merges)
                    .build()
                    .map_err(|e| anyhow::anyhow!("cannot build BPE tokenizer: {e}"))?;
                let mut tk = Tokenizer::new(bpe);
                let pre = md(ct, "tokenizer.ggml.pre")
                    .and_then(|v| v.to_string().ok().cloned())
                    .unwrap_or_default();
                let byte_level = ByteLevel::new(false, true, true);
                if pre == "qwen2" {
                    // Qwen2/2.5/3's own split (tokenizer.json and llama.cpp's "qwen2"):
                    // single digits, letters with one leading non-letter, then byte-level
                    // mapping without GPT-2's regex.
                    let split = Split::new(
                        SplitPattern::Regex(QWEN2_SPLIT.into()),
                        SplitDelimiterBehavior::Isolated,
                        false,
                    )
                    .map_err(|e| anyhow::anyhow!("cannot build the qwen2 pre-tokenizer: {e}"))?;
                    tk.with_pre_tokenizer(Some(PreSequence::new(vec![
                        split.into(),
                        ByteLevel::new(false, false, false).into(),
                    ])));
                } else if pre == "smollm" || pre == "starcoder" || pre == "refact" {
                    tk.with_pre_tokenizer(Some(PreSequence::new(vec![
                        Digits::new(true).into(),
                        byte_level.into(),
                    ])));
                } else {
                    tk.with_pre_tokenizer(Some(byte_level));
                }
                tk.with_decoder(Some(ByteLevelDecoder::default()));
                tk
            }
            "llama" => {
                let scores: Vec<f32> = match md(ct, "tokenizer.ggml.scores") {
                    Some(v) => v
                        .to_vec()?
                        .iter()
                        .map(|x| x.to_f32())
                        .collect::<candle_core::Result<_>>()?,
                    None => (0..tokens.len()).map(|i| -(i as f32)).collect(),
                };
                let merges = merges_from_scores(&tokens, &types, &scores, &vocab);
                let unk = md_u32(ct, "tokenizer.ggml.unknown_token_id")
                    .and_then(|i| tokens.get(i as usize).cloned());
                let mut b = BPE::builder()
                    .vocab_and_merges(bpe_vocab(&vocab), merges)
                    .byte_fallback(true)
                    .fuse_unk(true);
                if let Some(u) = unk {
                    b = b.unk_token(u);
                }
                let bpe = b
                    .build()
                    .map_err(|e| anyhow::anyhow!("cannot build SentencePiece tokenizer: {e}"))?;
                let mut tk = Tokenizer::new(bpe);
                let mut norms: Vec<NormalizerWrapper> = Vec::new();
                if add_space_prefix {
                    norms.push(Prepend::new("▁".into()).into());
                }
                norms.push(
                    Replace::new(" ", "▁")
                        .map_err(|e| anyhow::anyhow!("{e}"))?
                        .into(),
                );
                tk.with_normalizer(Some(tokenizers::normalizers::Sequence::new(norms)))
                    .map_err(|e| anyhow::anyhow!("cannot set normalizer: {e}"))?;
                let decoders: Vec<DecoderWrapper> = vec![
                    Replace::new("▁", " ")
                        .map_err(|e| anyhow::anyhow!("{e}"))?
                        .into(),
                    ByteFallback::default().into(),
                    Fuse::default().into(),
                ];
                tk.with_decoder(Some(DecoderSequence::new(decoders)));
                tk
            }
            other => bail!("unsupported GGUF tokenizer model '{other}' (supported: gpt2, llama)"),
        };
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &ty)| ty == 3 || ty == 4)
            .map(|(t, _)| AddedToken::from(t.clone(), true))
            .collect();
        tk.add_special_tokens(specials)
            .map_err(|e| anyhow::anyhow!("cannot add special tokens: {e}"))?;
        let bos_id = md_u32(ct, "tokenizer.ggml.bos_token_id");
        let eos_id = md_u32(ct, "tokenizer.ggml.eos_token_id");
        let name = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        let mut stop_ids: Vec<u32> = eos_id.into_iter().collect();
        for s in END_OF_TURN {
            if let Some(&id) = vocab.get(*s) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        Ok(Self {
            tk,
            bos_id,
            bos_token: name(bos_id),
            eos_token: name(eos_id),
            stop_ids,
            add_bos: md(ct, "tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false),
            chat_template: md(ct, "tokenizer.chat_template")
                .and_then(|v| v.to_string().ok().cloned()),
            vocab_size: tokens.len(),
        })
    }

    /// From a Hugging Face folder: `tokenizer.json` and, if present, `tokenizer_config.json`
    /// (chat template, BOS/EOS) and `generation_config.json` (extra EOS ids).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let tk = Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))?;
        let cfg: serde_json::Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(serde_json::Value::Null);
        let tok_str = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
                _ => None,
            }
        };
        let bos_token = tok_str(&cfg["bos_token"]).unwrap_or_default();
        let eos_token = tok_str(&cfg["eos_token"]).unwrap_or_default();
        let bos_id = tk.token_to_id(&bos_token);
        let mut stop_ids: Vec<u32> = tk.token_to_id(&eos_token).into_iter().collect();
        if let Ok(g) = std::fs::read_to_string(dir.join("generation_config.json")) {
            if let Ok(g) = serde_json::from_str::<serde_json::Value>(&g) {
                let ids: Vec<u32> = match &g["eos_token_id"] {
                    serde_json::Value::Number(n) => {
                        n.as_u64().map(|x| x as u32).into_iter().collect()
                    }
                    serde_json::Value::Array(a) => a
                        .iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as u32)
                        .collect(),
                    _ => vec![],
                };
                for id in ids {
                    if !stop_ids.contains(&id) {
                        stop_ids.push(id);
                    }
                }
            }
        }
        for s in END_OF_TURN {
            if let Some(id) = tk.token_to_id(s) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        let chat_template = match &cfg["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let vocab_size = tk.get_vocab_size(true);
        Ok(Self {
            add_bos: cfg["add_bos_token"].as_bool().unwrap_or(false),
            tk,
            bos_id,
            bos_token,
            eos_token,
            stop_ids,
            chat_template,
            vocab_size,
        })
    }

    /// Encodes text. Special-token strings in `text` become their ids; BOS is prepended
    /// when `add_bos` and the text does not already start with it.
    /// The tokenizer in Hugging Face's `tokenizer.json` form (what llguidance reads).
    pub fn to_json(&self) -> Result<String> {
        self.tk.to_string(false).map_err(|e| anyhow::anyhow!("{e}"))
    }

    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .tk
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if add_bos {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.tk.decode(ids, skip_special).unwrap_or_default()
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.tk.token_to_id(s)
    }

    /// The text of one token as its own piece (for logprobs).
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false)
    }
}

fn bpe_vocab(v: &HashMap<String, u32>) -> tokenizers::models::bpe::Vocab {
    v.iter().map(|(k, &i)| (k.clone(), i)).collect()
}

/// SentencePiece BPE as merges: every split of a vocabulary piece into two pieces that are
/// both in the vocabulary is a merge, ranked by the merged piece's score (higher first).
fn merges_from_scores(
    tokens: &[String],
    types: &[u32],
    scores: &[f32],
    vocab: &HashMap<String, u32>,
) -> Vec<(String, String)> {
    let mut merges: Vec<(f32, u32, u32, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(1) != 1 {
            continue;
        }
        let idx: Vec<usize> = piece.char_indices().map(|(i, _)| i).skip(1).collect();
        for &cut in &idx {
            let (l, r) = piece.split_at(cut);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                merges.push((scores.get(id).copied().unwrap_or(0.0), li, ri, id));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.3.cmp(&b.3))
            .then(a.1.cmp(&b.1))
    });
    merges
        .into_iter()
        .map(|(_, l, r, _)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect()
}

/// Incremental detokenizer: turns a growing list of ids into text deltas without splitting
/// multi-byte characters or merged spaces.
#[derive(Default, Debug, Clone)]
pub struct StreamDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    /// Returns the new text made final by the ids up to `ids.len()`.
    pub fn step(&mut self, tok: &TextTokenizer, ids: &[u32]) -> String {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset], true);
        let full = tok.decode(&ids[self.prefix_offset..], true);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            delta
        } else {
            String::new()
        }
    }
}
