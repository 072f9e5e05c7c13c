//! The shortest output a constraint accepts, bounded in work: what the `max_tokens` check
//! compares against.

use super::{GrammarSpec, OverBudget};

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
