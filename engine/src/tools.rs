//! Tool calling, the part independent of the wire format: the tools a chat request offers
//! and who chooses whether to call one ([`ToolSet`]), the call syntax the model writes
//! (Hermes / Qwen blocks, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`),
//! the grammar that enforces a call (`tool_choice: required` or a named function), the
//! splitter that separates calls from content as text arrives ([`CallStream`], used for
//! whole answers too), and the conversation rewrite for chat templates that know no tools
//! ([`inline_tools`]: the tools as a system-prompt preamble, earlier calls and results as
//! text in the same syntax).

use crate::chat::{ChatMessage, ChatTemplate};
use serde_json::{json, Value};

/// Opens a call block.
pub const OPEN: &str = "<tool_call>";
/// Closes a call block.
pub const CLOSE: &str = "</tool_call>";

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

impl Tool {
    /// The OpenAI tool object (`{"type": "function", "function": {...}}`), as chat
    /// templates take `tools`.
    pub fn to_json(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        json!({"type": "function", "function": f})
    }
}

/// Who decides whether the answer is a call.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Never call: the tools are not shown to the model.
    None,
    /// The model decides; calls it writes are parsed out of its answer.
    Auto,
    /// At least one call, enforced by a grammar.
    Required,
    /// A call of this function, enforced by a grammar.
    Named(String),
}

/// The tools of one request.
#[derive(Debug, Clone)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one answer (OpenAI's `parallel_tool_calls`, default true).
    pub parallel: bool,
}

impl ToolSet {
    /// Whether the model sees the tools and its answer is parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.tools.is_empty()
    }

    /// The Lark grammar (llguidance) forcing the answer to be calls: one of the named
    /// function, or for `required` one of any tool, and with `parallel` up to one more per
    /// further tool offered. After each call the grammar may end, and after the last call
    /// it must: a model that would go on writing calls (small ones do) stops there, and
    /// the answer ends with `finish_reason: "tool_calls"` instead of running into
    /// `max_tokens`. `None` when the model decides.
    pub fn forced_grammar(&self) -> Option<String> {
        match &self.choice {
            ToolChoice::Required => {
                let most = if self.parallel { self.tools.len() } else { 1 };
                Some(self.grammar_over(self.tools.iter().collect(), most))
            }
            ToolChoice::Named(n) => {
                Some(self.grammar_over(self.tools.iter().filter(|t| &t.name == n).collect(), 1))
            }
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }

    /// The grammar of a call of any tool (compiling it checks every tool's schema).
    pub fn any_call_grammar(&self) -> String {
        self.grammar_over(self.tools.iter().collect(), 1)
    }

    /// Between 1 and `most` calls of `tools`, their arguments compact JSON
    /// ([`crate::constraint::JsonStyle::Compact`]) with only the properties the schema
    /// declares unless it says otherwise ([`crate::constraint::closed_objects`]).
    fn grammar_over(&self, tools: Vec<&Tool>, most: usize) -> String {
        let mut alts: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name},
                        "arguments": crate::constraint::closed_objects(&t.parameters)},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = if alts.len() == 1 {
            alts.pop().unwrap_or_default()
        } else {
            json!({ "anyOf": alts })
        };
        let (schema, _) = crate::constraint::JsonStyle::Compact.apply(&schema);
        // `call ("\n" call ("\n" call)?)?`: at most `most` calls.
        let mut more = String::new();
        for _ in 1..most.max(1) {
            more = format!(" (\"\\n\" call{more})?");
        }
        format!(
            "start: call{more}\ncall: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\nbody: %json {schema}\n"
        )
    }

    fn knows(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name == name)
    }
}

/// A call the model wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// A piece of an answer: content for the user, or a call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Splits an answer into content and calls as its text arrives. Text that may still
/// become a call block (a prefix of `<tool_call>`, an open block) is held back, and so
/// is trailing whitespace until content follows: whitespace before a call, and at the end
/// of an answer that made calls, is not content (an answer without calls comes out
/// verbatim). A block that does not hold a
/// call of a known tool stays content, verbatim.
pub struct CallStream {
    tools: ToolSet,
    buf: String,
    in_call: bool,
    space: String,
    /// Calls emitted so far.
    pub calls: usize,
}

impl CallStream {
    pub fn new(tools: ToolSet) -> Self {
        Self {
            tools,
            buf: String::new(),
            in_call: false,
            space: String::new(),
            calls: 0,
        }
    }

    /// New text of the answer; returns what can be emitted now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(j) = self.buf.find(CLOSE) else { break };
                let inner: String = self.buf[..j].to_string();
                self.buf.drain(..j + CLOSE.len());
                self.in_call = false;
                match self.call(&inner) {
                    Some(c) => self.emit(&mut out, Piece::Call(c)),
                    None => self.emit(&mut out, Piece::Text(format!("{OPEN}{inner}{CLOSE}"))),
                }
            } else if let Some(i) = self.buf.find(OPEN) {
                let before: String = self.buf[..i].to_string();
                self.buf.drain(..i + OPEN.len());
                self.in_call = true;
                self.emit(&mut out, Piece::Text(before));
            } else {
                let keep = partial_suffix(&self.buf, OPEN);
                let ready: String = self.buf[..self.buf.len() - keep].to_string();
                self.buf.drain(..self.buf.len() - keep);
                self.emit(&mut out, Piece::Text(ready));
                break;
            }
        }
        out
    }

    /// The answer ended: what was held back (an unclosed block that parses is a call,
    /// as when the model stops right after the JSON).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            match self.call(&rest) {
                Some(c) => self.emit(&mut out, Piece::Call(c)),
                None => self.emit(&mut out, Piece::Text(format!("{OPEN}{rest}"))),
            }
        } else {
            self.emit(&mut out, Piece::Text(rest));
        }
        if self.calls == 0 && !self.space.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.space)));
        }
        self.space.clear();
        out
    }

    fn emit(&mut self, out: &mut Vec<Piece>, p: Piece) {
        match p {
            Piece::Text(t) => {
                // Trailing whitespace waits: it is content only if content follows.
                let t = std::mem::take(&mut self.space) + &t;
                let (body, space) = t.split_at(t.trim_end().len());
                self.space = space.to_string();
                if body.is_empty() {
                    return;
                }
                match out.last_mut() {
                    Some(Piece::Text(prev)) => prev.push_str(body),
                    _ => out.push(Piece::Text(body.to_string())),
                }
            }
            Piece::Call(c) => {
                self.space.clear();
                self.calls += 1;
                out.push(Piece::Call(c));
            }
        }
    }

    /// The call a block holds: a JSON object with a known `name` and object `arguments`
    /// (`parameters`, as some models write it, also works).
    fn call(&self, inner: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(inner.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.tools.knows(name) {
            return None;
        }
        let args = v.get("arguments").or_else(|| v.get("parameters"))?;
        let arguments = match args {
            Value::Object(_) => args.to_string(),
            // Some models write the arguments as a JSON string.
            Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => {
                s.clone()
            }
            _ => return None,
        };
        Some(ToolCall {
            name: name.to_string(),
            arguments,
        })
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat` (on char
/// boundaries).
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && pat.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// Whether a chat template renders `tools` and teaches the call syntax itself (Qwen,
/// Hermes); for the others [`inline_tools`] rewrites the conversation first.
pub fn native_template(t: &ChatTemplate) -> bool {
    t.mentions("tools") && t.mentions(OPEN)
}

/// A call as a block of the call syntax.
pub fn call_block(name: &str, arguments: &Value) -> String {
    format!(
        "{OPEN}\n{}\n{CLOSE}",
        json!({"name": name, "arguments": arguments})
    )
}

/// The system-prompt preamble that teaches a model the tools and the call syntax, for
/// chat templates without tools of their own.
pub fn preamble(tools: &[Tool]) -> String {
    let sigs: Vec<String> = tools.iter().map(|t| t.to_json().to_string()).collect();
    format!(
        "You may call one or more functions to answer. Their signatures, as JSON schemas, are inside <tools></tools>:\n<tools>\n{}\n</tools>\nTo call a function, answer with one block per call, each holding a JSON object with the function's name and arguments:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <arguments-json-object>}}\n{CLOSE}",
        sigs.join("\n")
    )
}

/// Rewrites a conversation for a template that knows no tools: the tools' preamble opens
/// the system message (one is added when there is none), an assistant message's calls
/// are appended to its content as call blocks, and tool results become a user message of
/// `<tool_response>` blocks (consecutive results merged; templates without tools often
/// refuse a `tool` role).
pub fn inline_tools(messages: Vec<ChatMessage>, tools: Option<&[Tool]>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut last_was_tool = false;
    for mut m in messages {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(prev) if last_was_tool => {
                    prev.content.push('\n');
                    prev.content.push_str(&block);
                }
                _ => out.push(ChatMessage::text("user", block)),
            }
            last_was_tool = true;
            continue;
        }
        last_was_tool = false;
        if let Some(calls) = m.tool_calls.take() {
            for c in calls {
                let f = &c["function"];
                let block = call_block(f["name"].as_str().unwrap_or(""), &f["arguments"]);
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&block);
            }
        }
        m.tool_call_id = None;
        out.push(m);
    }
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let pre = preamble(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{pre}", first.content);
            }
            _ => out.insert(0, ChatMessage::text("system", pre)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(choice: ToolChoice, parallel: bool) -> ToolSet {
        ToolSet {
            tools: vec![
                Tool {
                    name: "get_weather".into(),
                    description: Some("Weather in a city".into()),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                },
                Tool {
                    name: "add".into(),
                    description: None,
                    parameters: json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
                },
            ],
            choice,
            parallel,
        }
    }

    fn whole(text: &str, chunk: usize) -> Vec<Piece> {
        let mut s = CallStream::new(set(ToolChoice::Auto, true));
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(chunk) {
            out.extend(s.push(&c.iter().collect::<String>()));
        }
        out.extend(s.finish());
        // Merge adjacent text pieces (chunking splits them).
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn calls_are_split_from_content_however_the_text_arrives() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n";
        let want = vec![
            Piece::Text("Let me check.".into()),
            Piece::Call(ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            }),
            Piece::Call(ToolCall {
                name: "add".into(),
                arguments: "{\"a\":1,\"b\":2}".into(),
            }),
        ];
        for chunk in [1, 2, 3, 7, 1000] {
            assert_eq!(whole(text, chunk), want, "chunks of {chunk}");
        }
    }

    #[test]
    fn unknown_tools_bad_json_and_plain_text_stay_content() {
        for text in [
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
            "<tool_call>{not json}</tool_call>",
            "<tool_call>{\"name\": \"add\", \"arguments\": 3}</tool_call>",
            "a < b and <tool_ is not a tag",
            "  indented answer\n",
        ] {
            assert_eq!(whole(text, 2), vec![Piece::Text(text.into())], "{text}");
        }
        // An unclosed block that parses is a call; one that does not is content.
        assert!(matches!(
            whole("<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}", 3)[..],
            [Piece::Call(ToolCall { ref arguments, .. })] if arguments == "{\"a\": 1}"
        ));
        assert_eq!(
            whole("<tool_call>{\"name\": \"add\"", 3),
            vec![Piece::Text("<tool_call>{\"name\": \"add\"".into())]
        );
    }

    #[test]
    fn held_back_text_is_only_a_possible_tag() {
        let mut s = CallStream::new(set(ToolChoice::Auto, true));
        assert_eq!(s.push("Hello <tool"), vec![Piece::Text("Hello".into())]);
        assert_eq!(s.push("box> x"), vec![Piece::Text(" <toolbox> x".into())]);
        assert_eq!(partial_suffix("ab<tool_ca", OPEN), 8);
        assert_eq!(partial_suffix("é<", OPEN), 1);
        assert_eq!(partial_suffix("<tool_call", "<tool_call>"), 10);
    }

    #[test]
    fn grammars_name_the_tools_they_force() {
        let g = set(ToolChoice::Named("add".into()), false)
            .forced_grammar()
            .unwrap();
        assert!(
            g.contains("\"const\":\"add\"") && !g.contains("get_weather"),
            "{g}"
        );
        assert!(!g.contains("call)?"));
        assert!(g.contains("\"whitespace_flexible\":false"), "{g}");
        // Parallel calls: at most one per tool (two here), then the grammar ends.
        let g = set(ToolChoice::Required, true).forced_grammar().unwrap();
        assert!(
            g.contains("anyOf") && g.starts_with("start: call (\"\\n\" call)?\n"),
            "{g}"
        );
        let g = set(ToolChoice::Required, false).forced_grammar().unwrap();
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(set(ToolChoice::Auto, true).forced_grammar().is_none());
        assert!(!set(ToolChoice::None, true).active());
    }

    #[test]
    fn only_templates_with_tools_and_the_call_syntax_are_native() {
        use crate::model::Arch;
        let t = |src: &str| ChatTemplate::new(Some(src), Arch::Qwen3, "", "").unwrap();
        assert!(native_template(&t(
            "{% if tools %}{{ tools | tojson }} use <tool_call>{% endif %}"
        )));
        assert!(!native_template(&t(
            "{% if tools %}{{ tools | tojson }}{% endif %}"
        )));
        assert!(!native_template(
            &ChatTemplate::new(None, Arch::Llama, "", "").unwrap()
        ));
    }

    #[test]
    fn history_is_inlined_for_templates_without_tools() {
        let tools = set(ToolChoice::Auto, true).tools;
        let mut asst = ChatMessage::text("assistant", "");
        asst.tool_calls = Some(vec![json!({"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": {"a": 1, "b": 2}}})]);
        let mut r1 = ChatMessage::text("tool", "3");
        r1.tool_call_id = Some("call_1".into());
        let r2 = ChatMessage::text("tool", "4");
        let out = inline_tools(
            vec![ChatMessage::text("user", "1+2?"), asst, r1, r2],
            Some(&tools),
        );
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(out[0].content.contains("\"name\":\"get_weather\""));
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":2}}\n</tool_call>"
        );
        assert_eq!(
            out[3].content,
            "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
        );
        assert!(out.iter().all(|m| m.tool_calls.is_none()));
        // An existing system prompt keeps its text and gains the preamble.
        let out = inline_tools(vec![ChatMessage::text("system", "Be brief.")], Some(&tools));
        assert!(out.len() == 1 && out[0].content.starts_with("Be brief.\n\nYou may call"));
    }
}
