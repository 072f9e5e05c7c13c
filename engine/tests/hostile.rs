//! Hostile outputs at the grammar level, on the default model's own tokenizer: the JSON a
//! constraint accepts by default is compact with bounded numbers (issue #51), so a model
//! cannot loop inside what the grammar allows; a request may still ask for whitespace.

mod common;

use dspark_engine::constraint::{Constraint, GrammarSpec, Grammars, JsonStyle};
use dspark_engine::tokenizer::TextTokenizer;
use serde_json::json;
use std::sync::Arc;

fn grammars() -> (Arc<TextTokenizer>, Grammars) {
    let (_, ct) = dspark_engine::model::weights::open_gguf(&common::smollm2()).unwrap();
    let tok = Arc::new(TextTokenizer::from_gguf(&ct).unwrap());
    let g = Grammars::new(tok.clone(), tok.vocab_size).unwrap();
    (tok, g)
}

/// Whether the constraint takes `text` whole, token by token as the engine would (each
/// token in the mask of its position), and may then end.
fn accepts(tok: &TextTokenizer, mut c: Constraint, text: &str) -> bool {
    for t in tok.encode(text, false).unwrap() {
        let Ok(mask) = c.mask() else { return false };
        if !mask.is_allowed(t) || c.consume(t).is_err() {
            return false;
        }
    }
    let Ok(mask) = c.mask() else { return false };
    tok.stop_ids.iter().any(|&e| mask.is_allowed(e))
}

#[test]
fn json_is_compact_by_default_with_whitespace_on_request_and_numbers_bounded() {
    let (tok, g) = grammars();
    let schema = json!({"type": "object", "properties": {"a": {"type": "number"}},
        "required": ["a"], "additionalProperties": false});
    let compact = GrammarSpec::JsonSchema(schema.clone(), JsonStyle::Compact);
    let flexible = GrammarSpec::JsonSchema(schema.clone(), JsonStyle::Flexible("[ ]{0,4}".into()));
    let spaced = r#"{ "a" : 1}"#;
    assert!(accepts(&tok, g.compile(&compact).unwrap(), r#"{"a":1}"#));
    assert!(
        !accepts(&tok, g.compile(&compact).unwrap(), spaced),
        "whitespace accepted by default"
    );
    assert!(accepts(&tok, g.compile(&flexible).unwrap(), spaced));
    // A schema's own `x-guidance` options are taken as they are.
    let own = json!({"type": "object", "properties": {"a": {"type": "number"}},
        "required": ["a"], "x-guidance": {"whitespace_flexible": true}});
    assert!(accepts(
        &tok,
        g.compile(&GrammarSpec::JsonSchema(own, JsonStyle::Compact))
            .unwrap(),
        spaced
    ));
    // Numbers: 20 digits in a row are the most (integer part or fraction).
    let n = |d: usize| format!("{{\"a\":0.{}}}", "9".repeat(d));
    assert!(accepts(&tok, g.compile(&compact).unwrap(), &n(19)));
    assert!(accepts(
        &tok,
        g.compile(&compact).unwrap(),
        &format!("{{\"a\":{}}}", "1".repeat(20))
    ));
    for text in [n(40), format!("{{\"a\":{}}}", "1".repeat(40))] {
        assert!(
            !accepts(&tok, g.compile(&compact).unwrap(), &text),
            "{text}"
        );
    }
    // Runs of newlines are whitespace too: refused by default.
    assert!(!accepts(
        &tok,
        g.compile(&compact).unwrap(),
        "{\"a\":1\n\n\n\n}"
    ));
    // Digits inside strings are text, not a number: no bound there.
    let s = GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}),
        JsonStyle::Compact,
    );
    assert!(accepts(
        &tok,
        g.compile(&s).unwrap(),
        &format!("{{\"s\":\"{}\"}}", "7".repeat(40))
    ));
}

/// Forced tool calls: the grammar ends after the last call allowed, so the model's only
/// choice after a complete call is to stop (one call, or up to one per tool with
/// `parallel_tool_calls`).
#[test]
fn a_forced_call_grammar_ends_after_its_calls() {
    use dspark_engine::tools::{Tool, ToolChoice, ToolSet};
    let (tok, g) = grammars();
    let tool = |name: &str| Tool {
        name: name.into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}),
    };
    let call = |name: &str| {
        format!(
            "<tool_call>\n{{\"name\":\"{name}\",\"arguments\":{{\"city\":\"Paris\"}}}}\n</tool_call>"
        )
    };
    for (choice, parallel, tools, most) in [
        (ToolChoice::Required, false, vec![tool("a"), tool("b")], 1),
        (ToolChoice::Required, true, vec![tool("a")], 1),
        (
            ToolChoice::Named("b".into()),
            true,
            vec![tool("a"), tool("b")],
            1,
        ),
        (ToolChoice::Required, true, vec![tool("a"), tool("b")], 2),
    ] {
        let set = ToolSet {
            tools,
            choice: choice.clone(),
            parallel,
        };
        let spec = GrammarSpec::ToolCalls(set.forced_grammar().unwrap());
        let name = if let ToolChoice::Named(n) = &choice {
            n.clone()
        } else {
            "a".into()
        };
        let one = call(&name);
        assert!(accepts(&tok, g.compile(&spec).unwrap(), &one), "{choice:?}");
        let mut c = g.compile(&spec).unwrap();
        let ids = tok
            .encode(&vec![one.clone(); most].join("\n"), false)
            .unwrap();
        for &t in &ids {
            c.consume(t).unwrap();
        }
        // After the last call allowed only the end is left.
        let mask = c.mask().unwrap();
        assert!(tok.stop_ids.iter().any(|&e| mask.is_allowed(e)));
        let others = (0..tok.vocab_size as u32)
            .filter(|t| mask.is_allowed(*t) && !tok.stop_ids.contains(t))
            .count();
        assert_eq!(
            others, 0,
            "{choice:?} parallel {parallel}: more after {most}"
        );
    }
}
