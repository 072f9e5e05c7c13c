//! Structured outputs: a request's output constrained to a JSON schema, any JSON object, a
//! regular expression or a Lark grammar, by `llguidance` (the library behind the
//! structured outputs of several engines), over the served model's own tokenizer.
//!
//! [`Grammars`] is built once per served model: llguidance's token trie comes from the
//! tokenizer's JSON form (`llguidance::token_bytes_from_tokenizer_json`) and its end tokens
//! are the model's stop tokens. [`Grammars::compile`] turns a request's [`GrammarSpec`] into
//! a [`Constraint`]: the parser state, which gives the allowed tokens at the current position
//! ([`Constraint::mask`]), consumes committed tokens and rolls back rejected draft tokens.
//! Sampling applies the mask to the target's logits (`sampling`), so a constrained sequence
//! and its speculative verification draw from the constrained distribution.

use crate::tokenizer::TextTokenizer;
use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// Allowed tokens at one position.
pub type Mask = SimpleVob;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`, `guided_json`).
    JsonSchema(serde_json::Value),
    /// A regular expression (`guided_regex`).
    Regex(String),
    /// A Lark grammar (`guided_grammar`).
    Lark(String),
}

struct Env {
    trie: TokTrie,
    tok: Arc<TextTokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tok
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// The served model's grammar compiler.
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl Grammars {
    /// For the model whose tokenizer is `tok`, with `vocab_size` logits per position.
    pub fn new(tok: Arc<TextTokenizer>, vocab_size: usize) -> Result<Self> {
        let json: serde_json::Value = serde_json::from_str(&tok.to_json()?)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        if words.len() < vocab_size {
            words.resize(vocab_size, Vec::new());
        }
        let eos = *tok
            .stop_ids
            .first()
            .ok_or_else(|| anyhow!("the tokenizer has no end-of-sequence token"))?;
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words)
            .with_eos_tokens(&tok.stop_ids);
        let env: llguidance::toktrie::TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Compiles `spec`; the error says what is wrong with the grammar or schema.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let grammar = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(grammar)?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(anyhow!(e));
        }
        Ok(Constraint { m, consumed: 0 })
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    m: Matcher,
    consumed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} tokens)", self.consumed)
    }
}

impl Constraint {
    /// A constraint in the failed state llguidance leaves a matcher in after an internal
    /// error (every call answers `msg`): what the engine must survive for one request
    /// without failing the others.
    pub fn failed(msg: &str) -> Self {
        Self {
            m: Matcher::new(Err(anyhow!("{msg}"))),
            consumed: 0,
        }
    }

    /// An independent copy of this state (the `n` choices of one request).
    pub fn fork(&self) -> Self {
        Self {
            m: self.m.deep_clone(),
            consumed: self.consumed,
        }
    }

    /// The tokens allowed next (end tokens once the grammar may stop).
    pub fn mask(&mut self) -> Result<Mask> {
        self.m.compute_mask_or_eos().map_err(|e| anyhow!(e))
    }

    /// Advances past a committed (or provisionally, a draft) token.
    pub fn consume(&mut self, tok: u32) -> Result<()> {
        self.m.consume_token(tok).map_err(|e| anyhow!(e))?;
        self.consumed += 1;
        Ok(())
    }

    /// Undoes the last `n` consumed tokens (rejected drafts).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > 0 {
            self.m.rollback(n).map_err(|e| anyhow!(e))?;
            self.consumed -= n;
        }
        Ok(())
    }

    /// The grammar is complete and allows nothing more but the end.
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }

    /// Walks a draft block: the masks of positions `0..=k` and `k`, the number of draft
    /// tokens the grammar allows in a row (those are consumed). Verification judges the
    /// block up to the first forbidden token, which it rejects; nothing after is needed.
    pub fn walk(&mut self, draft: &[u32]) -> Result<(Vec<Mask>, usize)> {
        let mut masks = Vec::with_capacity(draft.len() + 1);
        for (k, &t) in draft.iter().enumerate() {
            let m = self.mask()?;
            let ok = m.is_allowed(t) && !self.is_stopped();
            masks.push(m);
            if !ok {
                return Ok((masks, k));
            }
            self.consume(t)?;
        }
        masks.push(self.mask()?);
        Ok((masks, draft.len()))
    }
}
