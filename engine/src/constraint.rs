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
    /// Bytes of the longest ordinary (not special) token: no token adds more output text.
    max_token_bytes: usize,
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
        })
    }

    /// A lower bound on the tokens any output of `spec` takes: its shortest text in bytes
    /// ([`min_output_bytes`]) over the longest token's bytes, rounded up. A request whose
    /// `max_tokens` is below it could only stop on the length limit, never complete.
    pub fn min_tokens(&self, spec: &GrammarSpec) -> usize {
        min_output_bytes(spec).div_ceil(self.max_token_bytes)
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

/// A lower bound on the length in bytes of any text `spec` accepts (0 where none is known):
/// the JSON forms from the schema (compact JSON, no whitespace), a regular expression from
/// its syntax tree (`regex-syntax`, whose parser llguidance's regex engine shares). Lark
/// grammars get 0. Every rule only ever under-estimates, so a request is never refused for a
/// grammar it could complete.
pub fn min_output_bytes(spec: &GrammarSpec) -> usize {
    match spec {
        GrammarSpec::JsonObject => 2,
        GrammarSpec::JsonSchema(s) => json::schema(s, s, 0),
        GrammarSpec::Regex(r) => regex_syntax::parse(r)
            .ok()
            .and_then(|h| h.properties().minimum_len())
            .unwrap_or(0),
        GrammarSpec::Lark(_) => 0,
    }
}

/// Shortest compact JSON text per schema. The keywords of one schema all constrain the same
/// instance, so the bound is the largest of theirs; unknown keywords, formats, patterns and
/// numeric ranges add nothing.
mod json {
    use serde_json::Value;

    /// Past this `$ref` depth (recursive schemas) the bound stops growing.
    const MAX_DEPTH: usize = 32;
    /// Counts larger than this (`minItems: 1e18`) are taken as this many.
    const MAX_COUNT: u64 = 1 << 20;

    pub(super) fn schema(s: &Value, root: &Value, depth: usize) -> usize {
        let o = match s {
            Value::Object(o) if depth <= MAX_DEPTH => o,
            // `true`, `false` (no instance: llguidance refuses it) and anything past the depth.
            _ => return 0,
        };
        let mut bound = match o.get("type") {
            Some(Value::String(t)) => of_type(t, o, root, depth),
            Some(Value::Array(ts)) => ts
                .iter()
                .filter_map(Value::as_str)
                .map(|t| of_type(t, o, root, depth))
                .min()
                .unwrap_or(0),
            _ => 0,
        };
        if let Some(v) = o.get("const") {
            bound = bound.max(value(v));
        }
        if let Some(Value::Array(vs)) = o.get("enum") {
            bound = bound.max(vs.iter().map(value).min().unwrap_or(0));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(b)) = o.get(key) {
                let m = b.iter().map(|x| schema(x, root, depth + 1)).min();
                bound = bound.max(m.unwrap_or(0));
            }
        }
        if let Some(Value::Array(b)) = o.get("allOf") {
            for x in b {
                bound = bound.max(schema(x, root, depth + 1));
            }
        }
        if let Some(target) = o
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix('#'))
            .and_then(|p| root.pointer(p))
        {
            bound = bound.max(schema(target, root, depth + 1));
        }
        bound
    }

    fn count(o: &serde_json::Map<String, Value>, key: &str) -> usize {
        o.get(key)
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(MAX_COUNT) as usize
    }

    fn of_type(t: &str, o: &serde_json::Map<String, Value>, root: &Value, depth: usize) -> usize {
        match t {
            "null" | "boolean" => 4,
            "integer" | "number" => 1,
            // Each character is at least one byte.
            "string" => 2 + count(o, "minLength"),
            "array" => {
                let n = count(o, "minItems");
                let prefix = o.get("prefixItems").and_then(Value::as_array);
                let items = (0..n)
                    .map(|i| match prefix.and_then(|p| p.get(i)) {
                        Some(p) => schema(p, root, depth + 1),
                        None => o
                            .get("items")
                            .map_or(1, |x| schema(x, root, depth + 1).max(1)),
                    })
                    .fold(0usize, usize::saturating_add);
                2 + items + n.saturating_sub(1)
            }
            "object" => {
                let props = o.get("properties").and_then(Value::as_object);
                let required: Vec<&str> = o
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                // `"name":value` per required property.
                let named = required
                    .iter()
                    .map(|k| {
                        let v = props
                            .and_then(|p| p.get(*k))
                            .map_or(1, |x| schema(x, root, depth + 1).max(1));
                        key(k) + 1 + v
                    })
                    .fold(0usize, usize::saturating_add);
                // Further properties `minProperties` asks for: `"":0` at least.
                let n = count(o, "minProperties").max(required.len());
                let more = (n - required.len()).saturating_mul(4);
                2usize
                    .saturating_add(named)
                    .saturating_add(more)
                    .saturating_add(n.saturating_sub(1))
            }
            _ => 0,
        }
    }

    /// A property name as compact JSON.
    fn key(k: &str) -> usize {
        serde_json::to_string(k).map_or(2, |s| s.len())
    }

    /// Shortest compact JSON text of the value `v` (a number may be written shorter than
    /// serde writes it, so numbers count one byte).
    fn value(v: &Value) -> usize {
        match v {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(_) => 1,
            Value::String(s) => key(s),
            Value::Array(a) => 2 + a.iter().map(value).sum::<usize>() + a.len().saturating_sub(1),
            Value::Object(o) => {
                2 + o.iter().map(|(k, v)| key(k) + 1 + value(v)).sum::<usize>()
                    + o.len().saturating_sub(1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema(s: serde_json::Value) -> usize {
        min_output_bytes(&GrammarSpec::JsonSchema(s))
    }

    #[test]
    fn the_shortest_json_is_what_the_schema_requires() {
        // {"name":"abc","age":0}
        let person = json!({"type": "object",
            "properties": {"name": {"type": "string", "minLength": 3}, "age": {"type": "integer"}},
            "required": ["name", "age"]});
        assert_eq!(schema(person.clone()), r#"{"name":"abc","age":0}"#.len());
        // Optional properties add nothing; minProperties asks for `"":0` each.
        let optional = json!({"type": "object", "properties": {"x": {"type": "string"}}});
        assert_eq!(schema(optional), 2);
        assert_eq!(
            schema(json!({"type": "object", "minProperties": 2})),
            r#"{"":0,"":0}"#.len()
        );
        // [0,0,0]; prefixItems first.
        let arr = json!({"type": "array", "items": {"type": "integer"}, "minItems": 3});
        assert_eq!(schema(arr), 7);
        let tuple = json!({"type": "array", "minItems": 2,
            "prefixItems": [{"type": "boolean"}, {"const": "ab"}]});
        assert_eq!(schema(tuple), r#"[true,"ab"]"#.len());
        // The shortest alternative; every conjunct.
        assert_eq!(schema(json!({"enum": ["yes", "no", "maybe"]})), 4);
        assert_eq!(
            schema(json!({"anyOf": [{"type": "null"}, {"type": "integer"}]})),
            1
        );
        assert_eq!(
            schema(json!({"allOf": [{"type": "string", "minLength": 1}, {"minLength": 9}]})),
            3
        );
        assert_eq!(
            schema(json!({"type": ["string", "boolean"], "minLength": 8})),
            4
        );
        // References resolve; a recursive one stops at the depth limit.
        let refd = json!({"$defs": {"p": person}, "$ref": "#/$defs/p"});
        assert_eq!(schema(refd), 22);
        let chain = json!({"$defs": {"n": {"type": "object",
            "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
            "$ref": "#/$defs/n"});
        let n = schema(chain);
        assert!(n > 8 && n < 1000, "{n}");
        // Absurd counts do not overflow.
        assert!(schema(json!({"type": "array", "minItems": u64::MAX})) >= 1 << 20);
    }

    #[test]
    fn regexes_use_their_syntax_tree_and_lark_gets_no_bound() {
        let re = |r: &str| min_output_bytes(&GrammarSpec::Regex(r.into()));
        assert_eq!(re(r"[a-z]{5}@x\.com"), 11);
        assert_eq!(re(r"(yes|no)!?"), 2);
        assert_eq!(re(r"\d*"), 0);
        // An unparsable regex gets no bound here (llguidance reports the error).
        assert_eq!(re(r"(unclosed"), 0);
        assert_eq!(
            min_output_bytes(&GrammarSpec::Lark("start: \"a\" \"b\"".into())),
            0
        );
        assert_eq!(min_output_bytes(&GrammarSpec::JsonObject), 2);
    }
}
