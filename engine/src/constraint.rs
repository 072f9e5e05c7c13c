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

/// `serve --max-grammar-work` by default: the work units giving llguidance's own limits
/// (see [`Grammars::compile_within`]).
pub const DEFAULT_MAX_GRAMMAR_WORK: u64 = 1_000_000;

/// Allowed tokens at one position.
pub type Mask = SimpleVob;

/// Longest run of digits a JSON number may have under [`JsonStyle::Compact`] (more than any
/// 64-bit integer or double needs): without it a model can write `0.99999...` until
/// `max_tokens`, inside what a number's grammar allows.
pub const MAX_NUMBER_DIGITS: usize = 20;

/// How JSON outputs (`json_object`, `json_schema`, `guided_json`, tool calls) are written.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum JsonStyle {
    /// What OpenAI's strict mode writes: no whitespace between tokens, `,` and `:` alone,
    /// and numbers of at most [`MAX_NUMBER_DIGITS`] digits in a row; the grammar then leaves
    /// a model no room to loop, and an answer ends.
    #[default]
    Compact,
    /// Whitespace matching this regular expression allowed between tokens, numbers
    /// unbounded (the request's `guided_whitespace_pattern`).
    Flexible(String),
}

impl JsonStyle {
    /// The llguidance options (`x-guidance`) for this style.
    fn options(&self) -> serde_json::Value {
        match self {
            JsonStyle::Compact => serde_json::json!({
                "whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}),
            JsonStyle::Flexible(p) => serde_json::json!({
                "whitespace_flexible": true, "whitespace_pattern": p,
                "item_separator": ",", "key_separator": ":"}),
        }
    }

    /// `schema` with this style's options, unless it brings its own (`x-guidance`: the
    /// caller then asked for exactly those, and the number bound is off too).
    pub fn apply(&self, schema: &serde_json::Value) -> (serde_json::Value, bool) {
        let mut s = schema.clone();
        match s.as_object_mut() {
            Some(o) if !o.contains_key("x-guidance") => {
                o.insert("x-guidance".into(), self.options());
                (s, *self == JsonStyle::Compact)
            }
            _ => (s, false),
        }
    }
}

/// `schema` with `additionalProperties: false` on every object schema that lists
/// `properties` and says nothing about further ones (no `additionalProperties`,
/// `patternProperties` or `unevaluatedProperties`): what OpenAI's strict mode requires, and
/// what a forced tool call's arguments get, so a model cannot go on inventing properties
/// until `max_tokens`. Schemas combined with `allOf` (and those that hold one) stay open:
/// closing them would forbid the properties their siblings add.
pub fn closed_objects(schema: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    fn close(v: &mut Value, in_all_of: bool) {
        let Value::Object(o) = v else { return };
        let open = [
            "additionalProperties",
            "patternProperties",
            "unevaluatedProperties",
        ]
        .iter()
        .any(|k| o.contains_key(*k));
        if !in_all_of && !open && !o.contains_key("allOf") && o.contains_key("properties") {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (k, child) in o.iter_mut() {
            match k.as_str() {
                "properties" | "$defs" | "definitions" | "dependentSchemas" => {
                    if let Value::Object(m) = child {
                        m.values_mut().for_each(|c| close(c, false));
                    }
                }
                "anyOf" | "oneOf" | "prefixItems" => {
                    if let Value::Array(a) = child {
                        a.iter_mut().for_each(|c| close(c, false));
                    }
                }
                "allOf" => {
                    if let Value::Array(a) = child {
                        a.iter_mut().for_each(|c| close(c, true));
                    }
                }
                "items" | "additionalProperties" | "not" | "if" | "then" | "else" | "contains" => {
                    close(child, false)
                }
                _ => {}
            }
        }
    }
    let mut s = schema.clone();
    close(&mut s, false);
    s
}

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject(JsonStyle),
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`, `guided_json`).
    JsonSchema(serde_json::Value, JsonStyle),
    /// A regular expression (`guided_regex`).
    Regex(String),
    /// A Lark grammar (`guided_grammar`).
    Lark(String),
    /// Tool-call blocks: a Lark grammar whose `%json` parts are compact JSON
    /// ([`crate::tools::ToolSet::forced_grammar`]); numbers are bounded as in
    /// [`JsonStyle::Compact`].
    ToolCalls(String),
}

/// The analysis of a request's grammar would cost more than the budget allows
/// (`serve --max-grammar-work`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the constraint is too complex to analyse within this server's budget of {limit} work units (schema nodes visited)")]
pub struct OverBudget {
    pub limit: u64,
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
        self.compile_within(spec, DEFAULT_MAX_GRAMMAR_WORK)
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
        let json = bound_digits.then(|| JsonScan {
            digits: self.digits.clone(),
            states: vec![ScanState::default()],
        });
        Ok(Constraint {
            m,
            consumed: 0,
            json,
        })
    }
}

/// Per token: how many digits it starts with, and its bytes (to follow where the output
/// is in the JSON text).
struct Digits {
    words: Vec<Vec<u8>>,
    /// Digits a token starts with (saturating at 255).
    lead: Vec<u8>,
    /// The tokens that start with a digit.
    led: Vec<u32>,
}

impl Digits {
    fn new(words: &[Vec<u8>]) -> Self {
        let lead: Vec<u8> = words
            .iter()
            .map(|w| {
                if w.first() == Some(&0xFF) {
                    0
                } else {
                    w.iter().take_while(|b| b.is_ascii_digit()).count().min(255) as u8
                }
            })
            .collect();
        let led = (0..lead.len() as u32)
            .filter(|&t| lead[t as usize] > 0)
            .collect();
        Self {
            words: words.to_vec(),
            lead,
            led,
        }
    }
}

/// Where the output is in the JSON text: inside a string (and after a backslash), and how
/// many digits in a row it ends with outside strings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct ScanState {
    in_string: bool,
    escaped: bool,
    run: usize,
}

impl ScanState {
    fn advance(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                self.run = 0;
            } else if b == b'"' {
                self.in_string = true;
                self.run = 0;
            } else if b.is_ascii_digit() {
                self.run += 1;
            } else {
                self.run = 0;
            }
        }
        self
    }
}

/// The number bound of a JSON constraint: one scan state per consumed token (rollback pops).
#[derive(Clone)]
struct JsonScan {
    digits: Arc<Digits>,
    states: Vec<ScanState>,
}

impl JsonScan {
    fn last(&self) -> ScanState {
        self.states.last().copied().unwrap_or_default()
    }

    /// Takes out of `mask` the tokens that would make a run of more than
    /// [`MAX_NUMBER_DIGITS`] digits outside a string, unless nothing else would be left
    /// (a grammar that needs the digits, e.g. a long `const`, gets them).
    fn bound(&self, mask: &mut Mask) {
        let st = self.last();
        if st.in_string {
            return;
        }
        let room = MAX_NUMBER_DIGITS.saturating_sub(st.run);
        let over: Vec<u32> = self
            .digits
            .led
            .iter()
            .copied()
            .filter(|&t| self.digits.lead[t as usize] as usize > room && mask.is_allowed(t))
            .collect();
        for &t in &over {
            mask.disallow_token(t);
        }
        if mask.is_zero() {
            for t in over {
                mask.allow_token(t);
            }
        }
    }

    fn consume(&mut self, tok: u32) {
        let bytes = self
            .digits
            .words
            .get(tok as usize)
            .filter(|w| w.first() != Some(&0xFF))
            .map_or(&[][..], Vec::as_slice);
        let next = self.last().advance(bytes);
        self.states.push(next);
    }

    fn rollback(&mut self, n: usize) {
        let keep = self.states.len().saturating_sub(n).max(1);
        self.states.truncate(keep);
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    m: Matcher,
    consumed: usize,
    /// JSON outputs of the compact style: the number bound.
    json: Option<JsonScan>,
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
            json: None,
        }
    }

    /// An independent copy of this state (the `n` choices of one request).
    pub fn fork(&self) -> Self {
        Self {
            m: self.m.deep_clone(),
            consumed: self.consumed,
            json: self.json.clone(),
        }
    }

    /// The tokens allowed next (end tokens once the grammar may stop).
    pub fn mask(&mut self) -> Result<Mask> {
        let mut m = self.m.compute_mask_or_eos().map_err(|e| anyhow!(e))?;
        if let Some(j) = &self.json {
            j.bound(&mut m);
        }
        Ok(m)
    }

    /// Advances past a committed (or provisionally, a draft) token.
    pub fn consume(&mut self, tok: u32) -> Result<()> {
        self.m.consume_token(tok).map_err(|e| anyhow!(e))?;
        self.consumed += 1;
        if let Some(j) = &mut self.json {
            j.consume(tok);
        }
        Ok(())
    }

    /// Undoes the last `n` consumed tokens (rejected drafts).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > 0 {
            self.m.rollback(n).map_err(|e| anyhow!(e))?;
            self.consumed -= n;
            if let Some(j) = &mut self.json {
                j.rollback(n);
            }
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
/// grammar it could complete. The walk of a schema visits each of its nodes once (a
/// recursive `$ref` contributes nothing past itself) and stops with [`OverBudget`] after
/// `max_work` visits.
pub fn min_output_bytes(spec: &GrammarSpec, max_work: u64) -> Result<usize, OverBudget> {
    Ok(match spec {
        GrammarSpec::JsonObject(_) => 2,
        GrammarSpec::JsonSchema(s, _) => json::Walk::new(s, max_work).schema(s)?,
        GrammarSpec::Regex(r) => regex_syntax::parse(r)
            .ok()
            .and_then(|h| h.properties().minimum_len())
            .unwrap_or(0),
        GrammarSpec::Lark(_) | GrammarSpec::ToolCalls(_) => 0,
    })
}

/// Shortest compact JSON text per schema. The keywords of one schema all constrain the same
/// instance, so the bound is the largest of theirs; unknown keywords, formats, patterns and
/// numeric ranges add nothing.
mod json {
    use super::OverBudget;
    use serde_json::Value;
    use std::collections::{HashMap, HashSet};

    /// Counts larger than this (`minItems: 1e18`) are taken as this many.
    const MAX_COUNT: u64 = 1 << 20;

    /// One walk of a schema: each node's bound is computed once (memoised by address), a
    /// node reached again while its own bound is being computed (a recursive `$ref`)
    /// counts 0, and every node visited and value measured costs one unit of the budget.
    pub(super) struct Walk<'a> {
        root: &'a Value,
        memo: HashMap<*const Value, usize>,
        active: HashSet<*const Value>,
        work: u64,
        limit: u64,
    }

    impl<'a> Walk<'a> {
        pub(super) fn new(root: &'a Value, limit: u64) -> Self {
            Self {
                root,
                memo: HashMap::new(),
                active: HashSet::new(),
                work: 0,
                limit,
            }
        }

        fn spend(&mut self) -> Result<(), OverBudget> {
            self.work += 1;
            if self.work > self.limit {
                Err(OverBudget { limit: self.limit })
            } else {
                Ok(())
            }
        }

        pub(super) fn schema(&mut self, s: &'a Value) -> Result<usize, OverBudget> {
            self.spend()?;
            let key = s as *const Value;
            if let Some(&b) = self.memo.get(&key) {
                return Ok(b);
            }
            if !self.active.insert(key) {
                return Ok(0);
            }
            let r = self.compute(s);
            self.active.remove(&key);
            let b = r?;
            self.memo.insert(key, b);
            Ok(b)
        }

        fn compute(&mut self, s: &'a Value) -> Result<usize, OverBudget> {
            let o = match s {
                Value::Object(o) => o,
                // `true`, `false` (no instance: llguidance refuses it).
                _ => return Ok(0),
            };
            let mut bound = match o.get("type") {
                Some(Value::String(t)) => self.of_type(t, o)?,
                Some(Value::Array(ts)) => {
                    let mut min: Option<usize> = None;
                    for t in ts.iter().filter_map(Value::as_str) {
                        let b = self.of_type(t, o)?;
                        min = Some(min.map_or(b, |m| m.min(b)));
                    }
                    min.unwrap_or(0)
                }
                _ => 0,
            };
            if let Some(v) = o.get("const") {
                bound = bound.max(self.value(v)?);
            }
            if let Some(Value::Array(vs)) = o.get("enum") {
                let mut min: Option<usize> = None;
                for v in vs {
                    let b = self.value(v)?;
                    min = Some(min.map_or(b, |m| m.min(b)));
                }
                bound = bound.max(min.unwrap_or(0));
            }
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(b)) = o.get(key) {
                    let mut min: Option<usize> = None;
                    for x in b {
                        let b = self.schema(x)?;
                        min = Some(min.map_or(b, |m| m.min(b)));
                    }
                    bound = bound.max(min.unwrap_or(0));
                }
            }
            if let Some(Value::Array(b)) = o.get("allOf") {
                for x in b {
                    bound = bound.max(self.schema(x)?);
                }
            }
            if let Some(target) = o
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix('#'))
                .and_then(|p| self.root.pointer(p))
            {
                bound = bound.max(self.schema(target)?);
            }
            Ok(bound)
        }

        fn of_type(
            &mut self,
            t: &str,
            o: &'a serde_json::Map<String, Value>,
        ) -> Result<usize, OverBudget> {
            Ok(match t {
                "null" | "boolean" => 4,
                "integer" | "number" => 1,
                // Each character is at least one byte.
                "string" => 2 + count(o, "minLength"),
                "array" => {
                    let n = count(o, "minItems");
                    let prefix = o.get("prefixItems").and_then(Value::as_array);
                    let given = prefix.map_or(0, |p| p.len().min(n));
                    let mut items = 0usize;
                    for p in prefix.into_iter().flatten().take(given) {
                        items = items.saturating_add(self.schema(p)?);
                    }
                    // The other items share one schema: its bound once, times their count.
                    let rest = n - given;
                    if rest > 0 {
                        let each = match o.get("items") {
                            Some(x) => self.schema(x)?.max(1),
                            None => 1,
                        };
                        items = items.saturating_add(each.saturating_mul(rest));
                    }
                    2usize
                        .saturating_add(items)
                        .saturating_add(n.saturating_sub(1))
                }
                "object" => {
                    let props = o.get("properties").and_then(Value::as_object);
                    let required: Vec<&str> = o
                        .get("required")
                        .and_then(Value::as_array)
                        .map(|r| r.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    // `"name":value` per required property.
                    let mut named = 0usize;
                    for k in &required {
                        self.spend()?;
                        let v = match props.and_then(|p| p.get(*k)) {
                            Some(x) => self.schema(x)?.max(1),
                            None => 1,
                        };
                        named = named.saturating_add(key(k) + 1 + v);
                    }
                    // Further properties `minProperties` asks for: `"":0` at least.
                    let n = count(o, "minProperties").max(required.len());
                    let more = (n - required.len()).saturating_mul(4);
                    2usize
                        .saturating_add(named)
                        .saturating_add(more)
                        .saturating_add(n.saturating_sub(1))
                }
                _ => 0,
            })
        }

        /// Shortest compact JSON text of the value `v` (a number may be written shorter
        /// than serde writes it, so numbers count one byte).
        fn value(&mut self, v: &Value) -> Result<usize, OverBudget> {
            self.spend()?;
            Ok(match v {
                Value::Null | Value::Bool(true) => 4,
                Value::Bool(false) => 5,
                Value::Number(_) => 1,
                Value::String(s) => key(s),
                Value::Array(a) => {
                    let mut n = 2 + a.len().saturating_sub(1);
                    for x in a {
                        n = n.saturating_add(self.value(x)?);
                    }
                    n
                }
                Value::Object(o) => {
                    let mut n = 2 + o.len().saturating_sub(1);
                    for (k, x) in o {
                        n = n.saturating_add(key(k) + 1).saturating_add(self.value(x)?);
                    }
                    n
                }
            })
        }
    }

    fn count(o: &serde_json::Map<String, Value>, key: &str) -> usize {
        o.get(key)
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(MAX_COUNT) as usize
    }

    /// A property name as compact JSON.
    fn key(k: &str) -> usize {
        serde_json::to_string(k).map_or(2, |s| s.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema(s: serde_json::Value) -> usize {
        min_output_bytes(&GrammarSpec::JsonSchema(s, JsonStyle::Compact), u64::MAX).unwrap()
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
        let re = |r: &str| min_output_bytes(&GrammarSpec::Regex(r.into()), u64::MAX).unwrap();
        assert_eq!(re(r"[a-z]{5}@x\.com"), 11);
        assert_eq!(re(r"(yes|no)!?"), 2);
        assert_eq!(re(r"\d*"), 0);
        // An unparsable regex gets no bound here (llguidance reports the error).
        assert_eq!(re(r"(unclosed"), 0);
        assert_eq!(
            min_output_bytes(&GrammarSpec::Lark("start: \"a\" \"b\"".into()), 1).unwrap(),
            0
        );
        assert_eq!(
            min_output_bytes(&GrammarSpec::JsonObject(JsonStyle::Compact), 1).unwrap(),
            2
        );
    }

    /// The hostile schema of issue #51: an object whose properties `l` and `r` are itself and
    /// whose array property asks for 64 items of itself. The walk used to unroll it to depth
    /// 32 (64^32 visits); now each node is visited once.
    fn recursive_schema() -> serde_json::Value {
        json!({"type": "object",
            "properties": {"l": {"$ref": "#"}, "r": {"$ref": "#"},
                "a": {"type": "array", "items": {"$ref": "#"}, "minItems": 64}},
            "required": ["l", "r", "a"]})
    }

    #[test]
    fn recursive_schemas_cost_one_visit_per_node_and_the_budget_holds() {
        let s = recursive_schema();
        let spec = GrammarSpec::JsonSchema(s.clone(), JsonStyle::Compact);
        let t = std::time::Instant::now();
        let n = min_output_bytes(&spec, 10_000).expect("a few dozen visits");
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        // {"l":1,"r":1,"a":[1,...]}: the recursion counts one byte.
        assert_eq!(n, 2 + 5 + 5 + 4 + (2 + 64 + 63) + 2);
        // A budget smaller than the schema is an error naming it, not a hang.
        assert_eq!(min_output_bytes(&spec, 5), Err(OverBudget { limit: 5 }));
        // A wide schema costs one unit per node.
        let wide: serde_json::Map<String, serde_json::Value> = (0..1000)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        let keys: Vec<String> = wide.keys().cloned().collect();
        let wide = json!({"type": "object", "properties": wide, "required": keys});
        let spec = GrammarSpec::JsonSchema(wide, JsonStyle::Compact);
        assert!(min_output_bytes(&spec, 100).is_err());
        assert!(min_output_bytes(&spec, 10_000).unwrap() > 1000 * 5);
    }

    #[test]
    fn the_compact_style_is_injected_unless_the_schema_brings_its_own() {
        let (s, bounded) = JsonStyle::Compact.apply(&json!({"type": "object"}));
        assert!(bounded);
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        assert_eq!(s["x-guidance"]["item_separator"], ",");
        let (s, bounded) = JsonStyle::Flexible("[ \\n]+".into()).apply(&json!({"type": "object"}));
        assert!(!bounded);
        assert_eq!(s["x-guidance"]["whitespace_pattern"], "[ \\n]+");
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        let (s, bounded) = JsonStyle::Compact.apply(&own);
        assert!(!bounded);
        assert_eq!(s, own);
    }

    #[test]
    fn digit_runs_are_followed_outside_strings_only() {
        let st = ScanState::default().advance(b"{\"a\":12");
        assert_eq!((st.in_string, st.run), (false, 2));
        let st = st.advance(b"345");
        assert_eq!(st.run, 5);
        let st = st.advance(b",\"b\":\"99\\\"9");
        assert!(st.in_string && st.run == 0, "{st:?}");
        let st = st.advance(b"\",\"c\":0.");
        assert_eq!((st.in_string, st.run), (false, 0));
        let st = st.advance(b"999");
        assert_eq!(st.run, 3);
    }

    /// A mask over 4 tokens: `1`, `12`, `,`, `x1`.
    fn digits() -> Arc<Digits> {
        Arc::new(Digits::new(&[
            b"1".to_vec(),
            b"12".to_vec(),
            b",".to_vec(),
            b"x1".to_vec(),
        ]))
    }

    #[test]
    fn a_run_at_the_bound_allows_no_more_digits_unless_nothing_else_is_left() {
        let mut scan = JsonScan {
            digits: digits(),
            states: vec![ScanState::default()],
        };
        for _ in 0..MAX_NUMBER_DIGITS - 1 {
            scan.consume(0);
        }
        let mut m = Mask::alloc_ones(4);
        scan.bound(&mut m);
        // One more digit fits, two do not.
        assert!(m.is_allowed(0) && !m.is_allowed(1) && m.is_allowed(2) && m.is_allowed(3));
        scan.consume(0);
        let mut m = Mask::alloc_ones(4);
        scan.bound(&mut m);
        assert!(!m.is_allowed(0) && !m.is_allowed(1) && m.is_allowed(2));
        // Only digits allowed: the grammar needs them, they stay.
        let mut m = Mask::alloc(4);
        m.allow_token(0);
        scan.bound(&mut m);
        assert!(m.is_allowed(0));
        // Rollback returns to the shorter run.
        scan.rollback(1);
        let mut m = Mask::alloc_ones(4);
        scan.bound(&mut m);
        assert!(m.is_allowed(0));
    }

    #[test]
    fn objects_are_closed_where_nothing_says_otherwise() {
        let s = json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object", "properties": {}, "additionalProperties": true},
            "c": {"type": "array", "items": {"properties": {"y": {}}}},
            "d": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
            "e": {"const": {"properties": {"data": 1}}}},
            "$defs": {"n": {"properties": {"z": {}}}}});
        let c = closed_objects(&s);
        assert_eq!(c["additionalProperties"], false);
        assert_eq!(c["properties"]["a"]["additionalProperties"], false);
        assert_eq!(c["properties"]["b"]["additionalProperties"], true);
        assert_eq!(c["properties"]["c"]["items"]["additionalProperties"], false);
        assert_eq!(c["$defs"]["n"]["additionalProperties"], false);
        // allOf members stay open (closing them would forbid each other's properties);
        // data is not a schema.
        assert!(c["properties"]["d"]["allOf"][0]
            .get("additionalProperties")
            .is_none());
        assert_eq!(c["properties"]["e"], s["properties"]["e"]);
    }
}
