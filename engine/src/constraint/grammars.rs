//! The served model's grammar compiler: llguidance's token trie and parser factory over the
//! model's tokenizer, and the compilation of a request's [`GrammarSpec`] within a budget.

use super::number_bound::{Digits, JsonScan};
use super::{min_output_bytes, Constraint, GrammarSpec, OverBudget};
use crate::tokenizer::TextTokenizer;
use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

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
    /// Bytes of the longest ordinary (not special) token: no token adds more output text.
    max_token_bytes: usize,
    /// What the JSON number bound needs to know of each token.
    digits: Arc<Digits>,
}

impl Grammars {
    /// For the model whose tokenizer is `tok`, with `vocab_size` logits per position.
    pub fn new(tok: Arc<TextTokenizer>, vocab_size: usize) -> Result<Self> {
        let json: serde_json::Value = serde_json::from_str(&tok.to_json()?)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        if words.len() < vocab_size {
            words.resize(vocab_size, Vec::new());
        }
        // llguidance marks special tokens with a leading 0xFF; they add no output text.
        let max_token_bytes = words
            .iter()
            .filter(|w| w.first() != Some(&0xFF))
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .max(1);
        let digits = Arc::new(Digits::new(&words));
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
            max_token_bytes,
            digits,
        })
    }

    /// A lower bound on the tokens any output of `spec` takes: its shortest text in bytes
    /// ([`min_output_bytes`]) over the longest token's bytes, rounded up. A request whose
    /// `max_tokens` is below it could only stop on the length limit, never complete.
    pub fn min_tokens(&self, spec: &GrammarSpec, max_work: u64) -> Result<usize, OverBudget> {
        Ok(min_output_bytes(spec, max_work)?.div_ceil(self.max_token_bytes))
    }

    /// Compiles `spec` with llguidance's default limits.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        self.compile_within(spec, super::DEFAULT_MAX_GRAMMAR_WORK)
    }

    /// Compiles `spec`; the error says what is wrong with the grammar or schema. `max_work`
    /// bounds llguidance's work: the grammar's size (half of it, in symbols), the lexer's
    /// fuel for building it (all of it) and, per token mask, the lexer's fuel (a fifth) and
    /// the parser's items (a twentieth); 1,000,000 gives llguidance's defaults. The first
    /// masks are computed here, so a grammar over those limits from its start is refused
    /// now rather than failing its request in the engine's step.
    pub fn compile_within(&self, spec: &GrammarSpec, max_work: u64) -> Result<Constraint> {
        let (grammar, bound_digits) = match spec {
            GrammarSpec::JsonObject(style) => {
                let (s, b) = style.apply(&serde_json::json!({"type": "object"}));
                (TopLevelGrammar::from_json_schema(s), b)
            }
            GrammarSpec::JsonSchema(s, style) => {
                let (s, b) = style.apply(s);
                (TopLevelGrammar::from_json_schema(s), b)
            }
            GrammarSpec::Regex(r) => (TopLevelGrammar::from_regex(r), false),
            GrammarSpec::Lark(g) => (TopLevelGrammar::from_lark(g.clone()), false),
            GrammarSpec::ToolCalls(g) => (TopLevelGrammar::from_lark(g.clone()), true),
        };
        // llguidance's limits as shares of the budget; 1,000,000 (the default) gives its
        // own defaults.
        let share = |d: u64| usize::try_from(max_work / d).unwrap_or(usize::MAX).max(1);
        let mut limits = self.factory.limits().clone();
        limits.max_grammar_size = share(2);
        limits.initial_lexer_fuel = max_work.max(1);
        limits.step_lexer_fuel = (max_work / 5).max(1);
        limits.step_max_items = share(20);
        // Errors go to clients: the message, not the parser's state and grammar.
        limits.verbose_errors = false;
        let parser = self.factory.create_parser_from_init_ext(
            llguidance::api::GrammarInit::Serialized(grammar),
            llguidance::Logger::new(0, 0),
            llguidance::toktrie::InferenceCapabilities::default(),
            limits,
        )?;
        let mut m = Matcher::new(Ok(parser));
        // The first mask now (off the engine's step, on the caller's thread): a grammar whose
        // start already exceeds llguidance's limits (a recursive schema whose forced prefix
        // never ends) is refused here rather than failing the request in its first step.
        // The same on a copy past the tokens the grammar forces (what the first steps do).
        let first = m.compute_mask_or_eos();
        if let Some(e) = m.get_error() {
            return Err(anyhow!(e));
        }
        first.map_err(|e| anyhow!(e))?;
        let mut probe = m.deep_clone();
        let _ = probe.compute_ff_bytes();
        let _ = probe.consume_ff_tokens();
        let next = probe.compute_mask_or_eos();
        if let Some(e) = probe.get_error() {
            return Err(anyhow!(e));
        }
        next.map_err(|e| anyhow!(e))?;
        use llguidance::api::StopReason;
        let why = probe.stop_reason();
        if matches!(
            why,
            StopReason::LexerTooComplex | StopReason::ParserTooComplex | StopReason::InternalError
        ) {
            return Err(anyhow!("the grammar is too complex for the parser ({why})"));
        }
        let json = bound_digits.then(|| JsonScan::new(self.digits.clone()));
        Ok(Constraint {
            m,
            consumed: 0,
            json,
        })
    }
}
