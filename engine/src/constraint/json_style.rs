//! How JSON outputs are written: compact (OpenAI's strict mode, bounded numbers) by default,
//! or with the whitespace a request asks for, as llguidance's `x-guidance` options.

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
