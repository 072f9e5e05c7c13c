//! Tests of the pure parts of structured outputs: the shortest-output bound, the JSON
//! style, the number bound and strict objects (the grammar itself on a real tokenizer:
//! `tests/hostile.rs`).

use super::number_bound::{Digits, JsonScan, ScanState};
use super::*;
use serde_json::json;
use std::sync::Arc;

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
    let mut scan = JsonScan::new(digits());
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
