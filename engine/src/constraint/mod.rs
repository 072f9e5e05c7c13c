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
//!
//! One file per concept: [`json_style`] (compact or flexible JSON), [`strict`] (closed
//! object schemas), [`grammars`] (the compiler), [`state`] (a sequence's [`Constraint`]),
//! [`number_bound`] (digit runs of compact JSON), [`min_length`] (the shortest output, for
//! the `max_tokens` check).

mod grammars;
mod json_style;
mod min_length;
mod number_bound;
mod state;
mod strict;

pub use grammars::Grammars;
pub use json_style::{JsonStyle, MAX_NUMBER_DIGITS};
pub use min_length::min_output_bytes;
pub use state::Constraint;
pub use strict::closed_objects;

use llguidance::toktrie::SimpleVob;

/// `serve --max-grammar-work` by default: the work units giving llguidance's own limits
/// (see [`Grammars::compile_within`]).
pub const DEFAULT_MAX_GRAMMAR_WORK: u64 = 1_000_000;

/// Allowed tokens at one position.
pub type Mask = SimpleVob;

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

#[cfg(test)]
mod tests;
