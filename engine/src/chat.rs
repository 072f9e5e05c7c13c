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
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const GEMMA: &str = "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

pub struct ChatTemplate {
    env: Environment<'static>,
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
        env.add_template_owned("chat", source)
            .context("the model's chat template does not parse")?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders the conversation; the template's own errors (e.g. `raise_exception` for a
    /// bad role order) come back as a message a client can act on.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(context! {
            messages => messages,
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
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: " Hi ".into(),
            },
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
        let bad = vec![ChatMessage {
            role: "user".into(),
            content: " x ".into(),
        }];
        assert!(t
            .render(&bad, true)
            .unwrap_err()
            .to_string()
            .contains("no x"));
    }
}
