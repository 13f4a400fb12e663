//! `tokenizer_config.json`: the chat template and the special tokens a template may name.

use serde_json::Value;
use std::path::Path;

use crate::Error;

/// What a template needs from `tokenizer_config.json`, read once.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// The template transformers uses by default (the only one, or the one named `default`).
    pub chat_template: Option<String>,
    /// The one named `tool_use`, which transformers uses instead for a request with tools.
    pub tool_use_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

impl TokenizerConfig {
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.to_owned(),
            source: e,
        })?;
        Self::from_json(path, &text)
    }

    pub fn from_json(path: &Path, text: &str) -> Result<Self, Error> {
        let bad = |key: &str, msg: String| Error::Key {
            path: path.to_owned(),
            key: key.to_owned(),
            msg,
        };
        let doc: Value = serde_json::from_str(text).map_err(|e| Error::Json {
            path: path.to_owned(),
            msg: e.to_string(),
        })?;
        let Value::Object(doc) = doc else {
            return Err(bad("(top level)", "expected an object".into()));
        };
        let mut tool_use_template = None;
        let chat_template = match doc.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            // Several named templates: transformers uses the one named `default`, and the one
            // named `tool_use` for a request with tools.
            Some(Value::Array(list)) => {
                let mut found = None;
                for (i, item) in list.iter().enumerate() {
                    let name = item.get("name").and_then(Value::as_str);
                    let template = item.get("template").and_then(Value::as_str);
                    match (name, template) {
                        (Some(n), Some(t)) => {
                            if n == "default" {
                                found = Some(t.to_owned());
                            } else if n == "tool_use" {
                                tool_use_template = Some(t.to_owned());
                            }
                        }
                        _ => {
                            return Err(bad(
                                &format!("chat_template[{i}]"),
                                "expected {\"name\": string, \"template\": string}".into(),
                            ))
                        }
                    }
                }
                Some(found.ok_or_else(|| {
                    bad(
                        "chat_template",
                        "a list of templates with none named \"default\"".into(),
                    )
                })?)
            }
            Some(_) => {
                return Err(bad(
                    "chat_template",
                    "expected a string or a list of {name, template}".into(),
                ))
            }
        };
        let token = |key: &str| -> Result<Option<String>, Error> {
            match doc.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                // An AddedToken object, as older transformers saved them.
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(bad(key, "an object without a string \"content\"".into())),
                },
                Some(_) => Err(bad(
                    key,
                    "expected a string or an object with \"content\"".into(),
                )),
            }
        };
        Ok(Self {
            chat_template,
            tool_use_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            unk_token: token("unk_token")?,
            pad_token: token("pad_token")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<TokenizerConfig, Error> {
        TokenizerConfig::from_json(Path::new("tokenizer_config.json"), s)
    }

    #[test]
    fn templates_and_tokens_in_each_form() {
        let c = parse(r#"{"chat_template": "x", "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}}"#).unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("x"));
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        let c = parse(r#"{"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]}"#).unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("d"));
        assert_eq!(c.tool_use_template.as_deref(), Some("t"));
        assert!(parse("{}").unwrap().chat_template.is_none());
    }

    #[test]
    fn errors_name_the_file_and_key() {
        for (body, key) in [
            (r#"{"chat_template": 3}"#, "chat_template"),
            (
                r#"{"chat_template": [{"name": "a", "template": "t"}]}"#,
                "chat_template",
            ),
            (r#"{"chat_template": [{"name": "a"}]}"#, "chat_template[0]"),
            (r#"{"bos_token": {"x": 1}}"#, "bos_token"),
            (r#"{"eos_token": 1}"#, "eos_token"),
        ] {
            let e = parse(body).unwrap_err().to_string();
            assert!(
                e.contains("tokenizer_config.json") && e.contains(&format!("`{key}`")),
                "{e}"
            );
        }
        assert!(parse("{")
            .unwrap_err()
            .to_string()
            .contains("tokenizer_config.json"));
    }
}
