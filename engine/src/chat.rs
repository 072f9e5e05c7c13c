//! Chat templates: the model's own Jinja template (GGUF metadata or tokenizer_config.json)
//! rendered with minijinja, with a built-in template per family when the files carry none.

use crate::model::Arch;
use anyhow::{Context, Result};
use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls, as Hugging Face templates take them: `[{"id", "type":
    /// "function", "function": {"name", "arguments": {...}}}]` (arguments an object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.to_string(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const GEMMA: &str = "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's source (what [`crate::tools::native_template`] reads).
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(
        template: Option<&str>,
        arch: Arch,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self> {
        let source = match template {
            Some(t) => t.to_string(),
            None if arch == Arch::Gemma3 => GEMMA.to_string(),
            None => CHATML.to_string(),
        };
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.clone())
            .context("the model's chat template does not parse")?;
        Ok(Self {
            env,
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders the conversation; the template's own errors (e.g. `raise_exception` for a
    /// bad role order) come back as a message a client can act on.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Whether the template's source mentions `text`.
    pub fn mentions(&self, text: &str) -> bool {
        self.source.contains(text)
    }

    /// Renders with `tools` (OpenAI tool objects) passed to the template.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| anyhow::anyhow!("chat template: {}", e.detail().unwrap_or(&e.to_string())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", " Hi "),
        ]
    }

    #[test]
    fn builtin_gemma_template_folds_system_into_first_turn() {
        let t = ChatTemplate::new(None, Arch::Gemma3, "<bos>", "<eos>").unwrap();
        let s = t.render(&msgs(), true).unwrap();
        assert_eq!(
            s,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn chatml_and_raise_exception() {
        let t = ChatTemplate::new(None, Arch::Llama, "", "").unwrap();
        let s = t.render(&msgs(), true).unwrap();
        assert!(s.ends_with("<|im_start|>assistant\n"));
        let t = ChatTemplate::new(
            Some("{% if messages[0].content.strip() == 'x' %}{{ raise_exception('no x') }}{% endif %}ok"),
            Arch::Llama,
            "",
            "",
        )
        .unwrap();
        let bad = vec![ChatMessage::text("user", " x ")];
        assert!(t
            .render(&bad, true)
            .unwrap_err()
            .to_string()
            .contains("no x"));
    }

    #[test]
    fn a_template_with_tools_gets_them_and_the_calls() {
        let qwen_like = r#"{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools> Answer with <tool_call></tool_call> blocks.<|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}"#;
        let t = ChatTemplate::new(Some(qwen_like), Arch::Qwen3, "", "").unwrap();
        assert!(t.mentions("tools") && t.mentions("<tool_call>"));
        let tools = [serde_json::json!({"type": "function", "function": {"name": "add"}})];
        let mut asst = ChatMessage::text("assistant", "");
        asst.tool_calls = Some(vec![serde_json::json!(
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}})]);
        let s = t
            .render_with_tools(
                &[
                    ChatMessage::text("user", "1+?"),
                    asst,
                    ChatMessage::text("tool", "2"),
                ],
                Some(&tools),
                false,
            )
            .unwrap();
        assert!(
            s.contains(r#"{"function":{"name":"add"},"type":"function"}"#)
                || s.contains(r#""name":"add""#),
            "{s}"
        );
        assert!(
            s.contains("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\":1}}"),
            "{s}"
        );
        assert!(s.contains("<tool_response>2</tool_response>"), "{s}");
        // Without tools the template renders no tool section.
        let s = t.render(&[ChatMessage::text("user", "hi")], true).unwrap();
        assert!(!s.contains("<tools>"), "{s}");
    }
}
