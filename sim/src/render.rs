//! Prompt rendering: every API's request becomes prompt text the same way, so the prefix cache,
//! prefill cost and usage behave alike whichever API a conversation comes through.
//!
//! The rule: each message renders as `<|role|>\n{content}\n` ([`render_message`]), in order,
//! and the prompt ends with the generation prompt `<|assistant|>\n`. The reply, once generated,
//! joins the history as one more assistant message (the prompt, the reply and `\n`), so a
//! conversation's next turn starts with this turn's whole text and finds it in the cache.
//!
//! - Chat completions: each message's `content` (a string, or its parts' `text` joined).
//! - Responses: `instructions` as a system message, then each input item as one message:
//!   messages under their role; `function_call` as an assistant message holding
//!   `<tool_call>{name} {arguments}</tool_call>`; `function_call_output` as a `tool` message (as
//!   a chat `tool` message renders); `reasoning` as a `reasoning` message of its texts; any other
//!   item as a message headed by its type holding its JSON text.
//! - Anthropic Messages: `system` as a system message, then each message with its blocks
//!   rendered as text in order: `text` as is, `tool_use` as `<tool_call>{name} {input}</tool_call>`,
//!   `tool_result` as `<tool_result>{content}</tool_result>`, `image` as [`IMAGE`], any other
//!   block as its JSON text. `cache_control` never reaches the prompt.
//!
//! So a conversation of text messages renders identically through all three APIs. Tool
//! definitions are not rendered by any of them (chat never rendered them).

use serde_json::{Map, Value};

/// Ends every chat-like prompt: the assistant's turn begins.
pub const GENERATION_PROMPT: &str = "<|assistant|>\n";

/// What an image stands for in the prompt of the Responses and Messages APIs.
pub const IMAGE: &str = "<image>";

/// Renders chat messages so that a conversation's next turn starts with this turn's text.
pub fn render_message(role: &str, content: &str) -> String {
    format!("<|{role}|>\n{content}\n")
}

/// Chat content: a string, or the `text` of each part joined (other parts render nothing).
pub fn content_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A tool call made by the assistant, as the prompt shows it.
pub fn tool_call(name: &str, arguments: &str) -> String {
    format!("<tool_call>{name} {arguments}</tool_call>")
}

/// A request that does not have the API's shape: what is wrong, and where (a path such as
/// `input[2].content`, OpenAI's `param`).
#[derive(Debug, PartialEq)]
pub struct Bad {
    pub param: String,
    pub message: String,
}

pub fn bad(param: &str, what: &str) -> Bad {
    Bad {
        param: param.to_owned(),
        message: format!("`{param}` {what}"),
    }
}

/// A required string field of `obj`.
fn string<'a>(obj: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, Bad> {
    obj.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| bad(&format!("{at}.{key}"), "must be a string"))
}

/// The Responses API's `input`: a string (one user message) or a list of items.
pub fn responses_input(input: &Value) -> Result<String, Bad> {
    match input {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(render_message("user", s)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| responses_item(item, &format!("input[{i}]")))
            .collect(),
        _ => Err(bad("input", "must be a string or a list of items")),
    }
}

fn responses_item(item: &Value, at: &str) -> Result<String, Bad> {
    let obj = item
        .as_object()
        .ok_or_else(|| bad(at, "must be an object"))?;
    let kind = match obj.get("type") {
        None | Some(Value::Null) => "message",
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err(bad(&format!("{at}.type"), "must be a string")),
    };
    match kind {
        "message" => {
            let role = string(obj, "role", at)?;
            if !matches!(role, "user" | "assistant" | "system" | "developer") {
                return Err(bad(
                    &format!("{at}.role"),
                    "must be one of user, assistant, system, developer",
                ));
            }
            let content = match obj.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => responses_parts(parts, &format!("{at}.content"))?,
                _ => {
                    return Err(bad(
                        &format!("{at}.content"),
                        "must be a string or a list of content parts",
                    ))
                }
            };
            Ok(render_message(role, &content))
        }
        "function_call" => {
            let name = string(obj, "name", at)?;
            let arguments = string(obj, "arguments", at)?;
            Ok(render_message("assistant", &tool_call(name, arguments)))
        }
        "function_call_output" => {
            let output = match obj.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => responses_parts(parts, &format!("{at}.output"))?,
                _ => {
                    return Err(bad(
                        &format!("{at}.output"),
                        "must be a string or a list of content parts",
                    ))
                }
            };
            Ok(render_message("tool", &output))
        }
        "reasoning" => {
            let mut text = String::new();
            for key in ["summary", "content"] {
                match obj.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(parts)) => {
                        text.push_str(&responses_parts(parts, &format!("{at}.{key}"))?)
                    }
                    Some(_) => return Err(bad(&format!("{at}.{key}"), "must be a list")),
                }
            }
            Ok(render_message("reasoning", &text))
        }
        other => Ok(render_message(other, &item.to_string())),
    }
}

/// Content parts of a Responses message, joined: text as is, an image as [`IMAGE`], a refusal
/// as its text, anything else as its JSON text.
fn responses_parts(parts: &[Value], at: &str) -> Result<String, Bad> {
    let mut out = String::new();
    for (i, part) in parts.iter().enumerate() {
        let at = format!("{at}[{i}]");
        let obj = part
            .as_object()
            .ok_or_else(|| bad(&at, "must be an object"))?;
        match obj.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text")
            | None => out.push_str(string(obj, "text", &at)?),
            Some("refusal") => out.push_str(string(obj, "refusal", &at)?),
            Some("input_image") => out.push_str(IMAGE),
            Some(_) => out.push_str(&part.to_string()),
        }
    }
    Ok(out)
}

/// The Anthropic Messages API's `system` and `messages`, rendered (without the generation
/// prompt).
pub fn anthropic(system: Option<&Value>, messages: &Value) -> Result<String, Bad> {
    let mut text = String::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => text.push_str(&render_message("system", s)),
        Some(Value::Array(blocks)) => {
            let mut joined = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let at = format!("system.{i}");
                let obj = b.as_object().ok_or_else(|| bad(&at, "must be an object"))?;
                if obj.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(bad(&format!("{at}.type"), "must be \"text\""));
                }
                joined.push_str(string(obj, "text", &at)?);
            }
            text.push_str(&render_message("system", &joined));
        }
        Some(_) => return Err(bad("system", "must be a string or a list of text blocks")),
    }
    let messages = messages
        .as_array()
        .ok_or_else(|| bad("messages", "must be a list"))?;
    if messages.is_empty() {
        return Err(bad("messages", "must hold at least one message"));
    }
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages.{i}");
        let obj = m.as_object().ok_or_else(|| bad(&at, "must be an object"))?;
        let role = string(obj, "role", &at)?;
        if !matches!(role, "user" | "assistant") {
            return Err(bad(
                &format!("{at}.role"),
                "must be \"user\" or \"assistant\"",
            ));
        }
        let content = match obj.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(blocks)) => anthropic_blocks(blocks, &format!("{at}.content"))?,
            _ => {
                return Err(bad(
                    &format!("{at}.content"),
                    "must be a string or a list of content blocks",
                ))
            }
        };
        text.push_str(&render_message(role, &content));
    }
    Ok(text)
}

fn anthropic_blocks(blocks: &[Value], at: &str) -> Result<String, Bad> {
    let mut out = String::new();
    for (i, block) in blocks.iter().enumerate() {
        let at = format!("{at}.{i}");
        let obj = block
            .as_object()
            .ok_or_else(|| bad(&at, "must be an object"))?;
        let kind = string(obj, "type", &at)?;
        match kind {
            "text" => out.push_str(string(obj, "text", &at)?),
            "image" => out.push_str(IMAGE),
            "tool_use" => {
                let name = string(obj, "name", &at)?;
                let input = obj.get("input").cloned().unwrap_or(Value::Null);
                out.push_str(&tool_call(name, &input.to_string()));
            }
            "tool_result" => {
                string(obj, "tool_use_id", &at)?;
                let content = match obj.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(inner)) => anthropic_blocks(inner, &format!("{at}.content"))?,
                    Some(_) => {
                        return Err(bad(
                            &format!("{at}.content"),
                            "must be a string or a list of content blocks",
                        ))
                    }
                };
                match obj.get("is_error") {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => {
                        out.push_str(&format!("<tool_result>{content}</tool_result>"))
                    }
                    Some(Value::Bool(true)) => {
                        out.push_str(&format!("<tool_result error>{content}</tool_result>"))
                    }
                    Some(_) => return Err(bad(&format!("{at}.is_error"), "must be a boolean")),
                }
            }
            _ => {
                // Unknown blocks as their JSON text, without the cache breakpoint, which is a
                // caching hint and never part of the prompt.
                let obj: Map<String, Value> = obj
                    .iter()
                    .filter(|(k, _)| *k != "cache_control")
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                out.push_str(&Value::Object(obj).to_string());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(messages: &Value) -> String {
        messages
            .as_array()
            .unwrap()
            .iter()
            .map(|m| render_message(m["role"].as_str().unwrap(), &content_text(&m["content"])))
            .collect()
    }

    #[test]
    fn a_text_conversation_renders_alike_through_every_api() {
        let chat_text = chat(&json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            {"role": "user", "content": "more"},
        ]));
        let responses = render_message("system", "be brief")
            + &responses_input(&json!([
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
                {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
            ]))
            .unwrap();
        let anthropic = anthropic(
            Some(&json!([{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}])),
            &json!([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]},
            ]),
        )
        .unwrap();
        assert_eq!(responses, chat_text);
        assert_eq!(anthropic, chat_text);
    }

    #[test]
    fn tool_calls_and_results_render_as_text() {
        let r = responses_input(&json!([
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "web_search_call", "id": "ws"},
        ]))
        .unwrap();
        assert_eq!(
            r,
            "<|assistant|>\n<tool_call>f {\"a\":1}</tool_call>\n<|tool|>\n42\n\
             <|reasoning|>\nthink\n<|web_search_call|>\n{\"id\":\"ws\",\"type\":\"web_search_call\"}\n"
        );
        // The tool result renders as a chat `tool` message does.
        assert!(r.contains(&chat(&json!([{"role": "tool", "content": "42"}]))));
        let a = anthropic(
            None,
            &json!([{"role": "assistant", "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                {"type": "image", "source": {}},
                {"thinking": "hm", "type": "thinking", "cache_control": {"type": "ephemeral"}},
            ]}]),
        )
        .unwrap();
        assert_eq!(
            a,
            "<|assistant|>\ncalling<tool_call>f {\"a\":1}</tool_call>\n\
             <|user|>\n<tool_result>42</tool_result><image>{\"thinking\":\"hm\",\"type\":\"thinking\"}\n"
        );
    }

    #[test]
    fn wrong_types_are_errors_with_their_place() {
        assert_eq!(responses_input(&json!(3)).unwrap_err().param, "input");
        assert_eq!(
            responses_input(&json!([{"role": "user", "content": 3}]))
                .unwrap_err()
                .param,
            "input[0].content"
        );
        assert_eq!(
            responses_input(&json!([{"role": "robot", "content": "x"}]))
                .unwrap_err()
                .param,
            "input[0].role"
        );
        assert_eq!(
            responses_input(&json!([{"type": "function_call", "name": "f"}]))
                .unwrap_err()
                .param,
            "input[0].arguments"
        );
        assert_eq!(
            anthropic(
                None,
                &json!([{"role": "user", "content": [{"type": "text"}]}])
            )
            .unwrap_err()
            .param,
            "messages.0.content.0.text"
        );
        assert_eq!(
            anthropic(Some(&json!(1)), &json!([])).unwrap_err().param,
            "system"
        );
        assert_eq!(anthropic(None, &json!([])).unwrap_err().param, "messages");
    }
}
