//! An OpenAI chat request made into what vLLM hands a Hugging Face template: the conversation
//! vLLM's `parse_chat_messages` builds (text parts joined or kept as parts, tool-call arguments
//! parsed into objects, `reasoning` under both its names) and the tools as vLLM's request model
//! dumps them (every declared field present, `null` when absent).

use indexmap::IndexMap;
use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::template::ContentFormat;
use crate::Error;

/// The parts of a chat body that reach the template, each as its raw JSON text (the message
/// cache keys on a message's bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatBody<'a> {
    pub messages: Vec<&'a str>,
    pub tools: Option<&'a str>,
    /// vLLM's default is true.
    pub add_generation_prompt: Option<bool>,
    /// Extra template variables (`enable_thinking`, …), passed as vLLM passes them.
    pub chat_template_kwargs: Option<&'a str>,
    /// The rendering ends inside the last message, for the model to continue it.
    pub continue_final_message: Option<bool>,
    /// Passed to the template as `documents` (retrieval templates), as raw JSON.
    pub documents: Option<&'a str>,
    /// Passed to the template, with `enable_thinking` unless the kwargs set it.
    pub reasoning_effort: Option<String>,
    /// How its tool calls reach the template (not read from the body: the caller's to say).
    pub calls: Calls,
}

/// How vLLM hands an assistant message's tool calls to the template.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Calls {
    /// As a chat request's model validates them: `id`, `function` (`arguments`, `name`),
    /// `type`, and nothing else; only function calls.
    #[default]
    Validated,
    /// As built, in their own order (the messages vLLM builds from a Responses body).
    AsBuilt,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(borrow)]
    messages: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    #[serde(default)]
    reasoning_effort: Option<String>,
}

impl<'a> ChatBody<'a> {
    /// The whole body read by serde_json (the reference for `body.rs`, which
    /// reads a resent history only once).
    pub fn parse(body: &'a [u8]) -> Result<Self, Error> {
        // An object, as vLLM reads a request (serde would take a struct from an array too).
        let first = body
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        if first != Some(&b'{') {
            return Err(Error::Body("a request body is a JSON object".into()));
        }
        let r: Raw<'a> = serde_json::from_slice(body).map_err(|e| Error::Body(e.to_string()))?;
        Ok(ChatBody {
            messages: r.messages.into_iter().map(RawValue::get).collect(),
            tools: r.tools.map(RawValue::get),
            add_generation_prompt: r.add_generation_prompt,
            chat_template_kwargs: r.chat_template_kwargs.map(RawValue::get),
            continue_final_message: r.continue_final_message,
            documents: r.documents.map(RawValue::get).filter(|d| *d != "null"),
            reasoning_effort: r.reasoning_effort,
            calls: Calls::Validated,
        })
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    role: String,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    name: Option<serde_json::Value>,
    #[serde(default)]
    tool_calls: Option<Vec<IndexMap<String, Value>>>,
    #[serde(default)]
    tool_call_id: Option<Value>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    reasoning_content: Option<Value>,
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    thinking: Option<String>,
}

/// Text content parts, in order (vLLM's text-like part types; a part with null text is skipped).
fn texts(content: Option<&RawValue>) -> Result<Vec<String>, Error> {
    let Some(raw) = content else {
        return Ok(vec![]);
    };
    let raw = raw.get();
    if raw == "null" {
        return Ok(vec![]);
    }
    if raw.starts_with('"') {
        let s: String = serde_json::from_str(raw).map_err(|e| Error::Body(e.to_string()))?;
        return Ok(vec![s]);
    }
    let parts: Vec<serde_json::Value> =
        serde_json::from_str(raw).map_err(|e| Error::Body(format!("message content: {e}")))?;
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        if let serde_json::Value::String(s) = part {
            out.push(s);
            continue;
        }
        let p: Part = serde_json::from_value(part)
            .map_err(|e| Error::Body(format!("message content part: {e}")))?;
        let text = match p.kind.as_deref() {
            Some("text" | "input_text" | "output_text") => p.text,
            Some("refusal") => p.refusal.or(p.text),
            Some("thinking") => p.thinking.or(p.text),
            other => {
                return Err(Error::Body(format!(
                    "content part of type {other:?}: only text parts can be tokenized here"
                )))
            }
        };
        if let Some(t) = text {
            out.push(t);
        }
    }
    Ok(out)
}

fn text_parts(texts: Vec<String>) -> Value {
    texts
        .into_iter()
        .map(|t| {
            let mut m = IndexMap::new();
            m.insert("type", Value::from("text"));
            m.insert("text", Value::from(t));
            obj(m)
        })
        .collect()
}

/// One message as vLLM's conversation holds it.
pub fn message(raw: &str, format: ContentFormat, calls: Calls) -> Result<Value, Error> {
    fields(raw, format, calls).map(obj)
}

/// One message's fields, in the order vLLM's conversation holds them.
pub fn fields(
    raw: &str,
    format: ContentFormat,
    calls: Calls,
) -> Result<IndexMap<&'static str, Value>, Error> {
    let m: Message = serde_json::from_str(raw).map_err(|e| Error::Body(format!("message: {e}")))?;
    let mut texts = texts(m.content)?;
    if m.role == "system" {
        texts = without_billing_header(texts);
    }
    let mut out: IndexMap<&str, Value> = IndexMap::new();
    out.insert("role", Value::from(m.role.as_str()));
    // Tool results are strings for most templates, so vLLM joins their text parts in both formats.
    let content = if format == ContentFormat::String || m.role == "tool" {
        Value::from(texts.join("\n"))
    } else {
        text_parts(texts)
    };
    out.insert("content", content);
    if m.role == "assistant" {
        if let Some(tool_calls) = m.tool_calls {
            if !tool_calls.is_empty() {
                let calls: Result<Vec<Value>, Error> = tool_calls
                    .into_iter()
                    .map(|c| tool_call(c, calls))
                    .collect();
                out.insert("tool_calls", Value::from(calls?));
            }
        }
        if let Some(r) = m.reasoning.or(m.reasoning_content).filter(|r| !r.is_none()) {
            out.insert("reasoning", r.clone());
            out.insert("reasoning_content", r);
        }
    } else if m.role == "tool" {
        if let Some(id) = m.tool_call_id {
            out.insert("tool_call_id", id);
        }
    }
    if let Some(serde_json::Value::String(name)) = m.name {
        out.insert("name", Value::from(name));
    }
    Ok(out)
}

/// The line Claude Code starts a system text with: a hash that changes with every request.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A system message's texts as vLLM keeps them: a text that begins with Claude Code's
/// attribution header loses that first line, and goes if nothing is left.
fn without_billing_header(texts: Vec<String>) -> Vec<String> {
    texts
        .into_iter()
        .filter_map(|t| match t.strip_prefix(BILLING_HEADER) {
            None => Some(t),
            Some(rest) => rest
                .split_once('\n')
                .map(|(_, rest)| rest.to_owned())
                .filter(|r| !r.is_empty()),
        })
        .collect()
}

/// Whether vLLM would keep `developer` messages for this template: it converts them to system
/// messages for a template whose source names no `developer` role.
pub fn template_knows_developer(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

/// The conversation vLLM renders for a template that knows no `developer` role: where there is
/// a developer message, each becomes a system message (without `tools`), and then, if a system
/// message is not first or there are several, they are merged into one first message, their
/// non-empty contents joined by a blank line (a content of parts by its texts' lines).
pub fn developer_as_system(messages: Vec<Value>) -> Vec<Value> {
    // Asked of every message of every whole render: no allocation.
    let is = |m: &Value, role: &str| m.get_attr("role").is_ok_and(|r| r.as_str() == Some(role));
    if !messages.iter().any(|m| is(m, "developer")) {
        return messages;
    }
    let mut merged: Vec<String> = Vec::new();
    let mut others = Vec::with_capacity(messages.len());
    let mut consolidate = false;
    let mut converted = Vec::with_capacity(messages.len());
    for m in messages {
        if !is(&m, "developer") {
            converted.push(m);
            continue;
        }
        let mut fields: IndexMap<Value, Value> = IndexMap::new();
        if let Ok(keys) = m.try_iter() {
            for k in keys {
                if k.as_str() == Some("tools") {
                    continue;
                }
                let v = if k.as_str() == Some("role") {
                    Value::from("system")
                } else {
                    m.get_item(&k).unwrap_or_default()
                };
                fields.insert(k, v);
            }
        }
        converted.push(obj(fields));
    }
    for (i, m) in converted.iter().enumerate() {
        if !is(m, "system") {
            others.push(m.clone());
            continue;
        }
        consolidate |= i > 0 || !merged.is_empty();
        let content = m.get_attr("content").unwrap_or_default();
        let text = match content.as_str() {
            Some(s) => s.to_owned(),
            None => content
                .try_iter()
                .map(|parts| {
                    parts
                        .filter_map(|p| match p.as_str() {
                            Some(s) => Some(s.to_owned()),
                            None => p
                                .get_attr("text")
                                .ok()
                                .and_then(|t| t.as_str().map(str::to_owned)),
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default(),
        };
        if !text.is_empty() {
            merged.push(text);
        }
    }
    if !consolidate {
        return converted;
    }
    let mut first: IndexMap<&str, Value> = IndexMap::new();
    first.insert("role", Value::from("system"));
    first.insert("content", Value::from(merged.join("\n\n")));
    std::iter::once(obj(first)).chain(others).collect()
}

/// A map's fields with `key`'s value replaced.
fn with_field(map: &Value, key: &str, value: Value) -> Value {
    let mut fields: IndexMap<Value, Value> = IndexMap::new();
    if let Ok(keys) = map.try_iter() {
        for k in keys {
            let v = match k.as_str() == Some(key) {
                true => value.clone(),
                false => map.get_item(&k).unwrap_or_default(),
            };
            fields.insert(k, v);
        }
    }
    obj(fields)
}

/// The message with `suffix` after its content's text (a list's last part with a text), and
/// that text: how transformers marks the message a request continues, to cut the rendering
/// where it ends.
pub fn with_content_suffix(message: &Value, suffix: &str) -> Result<(Value, String), Error> {
    let refuse = || Error::Body("continue_final_message: the last message has no text".into());
    let content = message.get_attr("content").map_err(|_| refuse())?;
    if let Some(text) = content.as_str() {
        let tagged = Value::from(format!("{text}{suffix}"));
        return Ok((with_field(message, "content", tagged), text.to_owned()));
    }
    if content.kind() != ValueKind::Seq {
        return Err(refuse());
    }
    let mut parts: Vec<Value> = content.try_iter().map_err(|_| refuse())?.collect();
    let text_of = |p: &Value| {
        p.get_attr("text")
            .ok()
            .and_then(|t| t.as_str().map(str::to_owned))
    };
    let (i, text) = parts
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, p)| text_of(p).map(|t| (i, t)))
        .ok_or_else(refuse)?;
    parts[i] = with_field(&parts[i], "text", Value::from(format!("{text}{suffix}")));
    Ok((with_field(message, "content", Value::from(parts)), text))
}

/// `function.arguments` as an object: a JSON string parsed, empty or null as `{}`, and (as vLLM
/// does) anything that is not an object as `{}`; the call's keys as `calls` says.
fn tool_call(mut call: IndexMap<String, Value>, calls: Calls) -> Result<Value, Error> {
    if calls == Calls::Validated {
        let kind = call.get("type").and_then(|t| t.as_str().map(str::to_owned));
        if kind.as_deref() != Some("function") {
            return Err(Error::Body(format!(
                "tool_calls: a call of type {kind:?}: only function calls are tokenized here"
            )));
        }
        let function = call.get("function").cloned().unwrap_or_default();
        let mut validated: IndexMap<String, Value> = IndexMap::new();
        for key in ["arguments", "name"] {
            if let Ok(v) = function.get_attr(key) {
                if !v.is_undefined() {
                    validated.insert(key.into(), v);
                }
            }
        }
        call = ["id", "function", "type"]
            .into_iter()
            .filter_map(|k| match k {
                "function" => Some((k.to_owned(), obj(validated.clone()))),
                _ => call.get(k).map(|v| (k.to_owned(), v.clone())),
            })
            .collect();
    }
    if let Some(f) = call.get("function").cloned() {
        let mut function: IndexMap<String, Value> = IndexMap::new();
        for k in f
            .try_iter()
            .map_err(|e| Error::Body(format!("tool_calls: {e}")))?
        {
            let v = f.get_item(&k).unwrap_or_default();
            function.insert(k.to_string(), v);
        }
        let args = function.get("arguments").cloned().unwrap_or_default();
        let parsed = if let Some(s) = args.as_str() {
            if s.is_empty() {
                empty_object()
            } else {
                match serde_json::from_str::<Value>(s) {
                    Ok(v) if v.kind() == minijinja::value::ValueKind::Map => v,
                    _ => empty_object(),
                }
            }
        } else if args.kind() == minijinja::value::ValueKind::Map {
            args
        } else {
            empty_object()
        };
        function.insert("arguments".into(), parsed);
        call.insert("function".into(), obj(function));
    }
    Ok(obj(call))
}

/// A map value that keeps its keys' order (as Python's dicts do).
pub fn obj<K: Into<Value>>(pairs: IndexMap<K, Value>) -> Value {
    Value::from_object(
        pairs
            .into_iter()
            .map(|(k, v)| (k.into(), v))
            .collect::<IndexMap<Value, Value>>(),
    )
}

fn empty_object() -> Value {
    obj(IndexMap::<String, Value>::new())
}

/// The tools as vLLM's `ChatCompletionToolsParam.model_dump()` gives them: `type`, then
/// `function` with `name`, `description` and `parameters` (null when absent), then any extra
/// fields the client sent, in its order.
pub fn tools(raw: Option<&str>) -> Result<Value, Error> {
    let Some(raw) = raw.filter(|r| *r != "null") else {
        return Ok(Value::from(()));
    };
    let list: Vec<IndexMap<String, Value>> =
        serde_json::from_str(raw).map_err(|e| Error::Body(format!("tools: {e}")))?;
    let mut out = Vec::with_capacity(list.len());
    for mut tool in list {
        let f = tool
            .shift_remove("function")
            .ok_or_else(|| Error::Body("tools: a tool without `function`".into()))?;
        let mut fields: IndexMap<String, Value> = IndexMap::new();
        for k in f
            .try_iter()
            .map_err(|e| Error::Body(format!("tools: {e}")))?
        {
            fields.insert(k.to_string(), f.get_item(&k).unwrap_or_default());
        }
        let mut function: IndexMap<String, Value> = IndexMap::new();
        for key in ["name", "description", "parameters"] {
            function.insert(
                key.into(),
                fields.shift_remove(key).unwrap_or_else(|| Value::from(())),
            );
        }
        function.extend(fields);
        let kind = tool
            .shift_remove("type")
            .unwrap_or_else(|| Value::from("function"));
        let mut t: IndexMap<String, Value> = IndexMap::new();
        t.insert("type".into(), kind);
        t.insert("function".into(), obj(function));
        t.extend(tool);
        out.push(obj(t));
    }
    Ok(Value::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(json: &str, format: ContentFormat) -> String {
        let raw: Box<RawValue> = serde_json::from_str(json).unwrap();
        let v = message(raw.get(), format, Calls::Validated).unwrap();
        serde_json::to_string(&v).unwrap()
    }

    #[test]
    fn messages_as_vllm_builds_them() {
        use ContentFormat::*;
        let cases = [
            (
                r#"{"role":"user","content":"hi"}"#,
                String,
                r#"{"role":"user","content":"hi"}"#,
            ),
            (
                r#"{"role":"user","content":null}"#,
                String,
                r#"{"role":"user","content":""}"#,
            ),
            (
                r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
                String,
                r#"{"role":"user","content":"a\nb"}"#,
            ),
            (
                r#"{"role":"user","content":"hi"}"#,
                OpenAi,
                r#"{"role":"user","content":[{"type":"text","text":"hi"}]}"#,
            ),
            (
                r#"{"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
                OpenAi,
                r#"{"role":"tool","content":"a\nb","tool_call_id":"c1"}"#,
            ),
            (
                r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": 2}"}}]}"#,
                String,
                r#"{"role":"assistant","content":"","tool_calls":[{"id":"c1","function":{"arguments":{"z":1,"a":2},"name":"f"},"type":"function"}]}"#,
            ),
            (
                r#"{"role":"assistant","content":"x","tool_calls":[]}"#,
                String,
                r#"{"role":"assistant","content":"x"}"#,
            ),
            (
                r#"{"role":"assistant","content":"x","reasoning_content":"think"}"#,
                String,
                r#"{"role":"assistant","content":"x","reasoning":"think","reasoning_content":"think"}"#,
            ),
            (
                r#"{"role":"assistant","content":"x","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"[1]"}}],"name":"bot"}"#,
                String,
                r#"{"role":"assistant","content":"x","tool_calls":[{"id":"c","function":{"arguments":{},"name":"f"},"type":"function"}],"name":"bot"}"#,
            ),
            // A call's other keys go, as the request model drops them.
            (
                r#"{"role":"assistant","content":"x","tool_calls":[{"index":0,"type":"function","function":{"name":"f","arguments":"{}","x":1},"id":"c"}]}"#,
                String,
                r#"{"role":"assistant","content":"x","tool_calls":[{"id":"c","function":{"arguments":{},"name":"f"},"type":"function"}]}"#,
            ),
            // Claude Code's attribution line leaves a system text; a text of it alone goes.
            (
                r#"{"role":"system","content":"x-anthropic-billing-header: cch=1\nBe kind."}"#,
                String,
                r#"{"role":"system","content":"Be kind."}"#,
            ),
            (
                r#"{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=1"},{"type":"text","text":"B"}]}"#,
                OpenAi,
                r#"{"role":"system","content":[{"type":"text","text":"B"}]}"#,
            ),
            (
                r#"{"role":"user","content":"x-anthropic-billing-header: cch=1\nhi"}"#,
                String,
                r#"{"role":"user","content":"x-anthropic-billing-header: cch=1\nhi"}"#,
            ),
        ];
        for (input, format, want) in cases {
            assert_eq!(msg(input, format), want, "{input}");
        }
    }

    /// Calls of the messages vLLM builds from a Responses body reach the template as built;
    /// a chat request's custom tool call is not tokenized.
    #[test]
    fn calls_as_built_keep_their_order() {
        let raw = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"},"type":"function"}]}"#;
        let v = message(raw, ContentFormat::String, Calls::AsBuilt).unwrap();
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"c","function":{"name":"f","arguments":{}},"type":"function"}]}"#
        );
        let custom = r#"{"role":"assistant","tool_calls":[{"id":"c","type":"custom","custom":{"name":"f","input":"x"}}]}"#;
        assert!(message(custom, ContentFormat::String, Calls::Validated).is_err());
    }

    /// (messages, template knows `developer`) → what vLLM renders.
    #[test]
    fn developer_messages_become_one_system_message_for_a_template_without_that_role() {
        let conv = |msgs: &[&str]| -> Vec<Value> {
            msgs.iter()
                .map(|m| message(m, ContentFormat::String, Calls::Validated).unwrap())
                .collect()
        };
        let json = |v: Vec<Value>| serde_json::to_string(&v).unwrap();
        let sys = r#"{"role":"system","content":"S"}"#;
        let dev = r#"{"role":"developer","content":"D"}"#;
        let user = r#"{"role":"user","content":"U"}"#;
        let empty_dev = r#"{"role":"developer","content":""}"#;
        let rows: &[(&[&str], &str)] = &[
            // No developer message: as it is, a system message anywhere.
            (
                &[user, sys],
                r#"[{"role":"user","content":"U"},{"role":"system","content":"S"}]"#,
            ),
            // One developer message first: a system message, nothing to merge.
            (
                &[dev, user],
                r#"[{"role":"system","content":"D"},{"role":"user","content":"U"}]"#,
            ),
            // System then developer, and one later: merged first, by blank lines.
            (
                &[sys, dev, user, dev],
                r#"[{"role":"system","content":"S\n\nD\n\nD"},{"role":"user","content":"U"}]"#,
            ),
            // An empty one adds nothing to the merge.
            (
                &[sys, user, empty_dev],
                r#"[{"role":"system","content":"S"},{"role":"user","content":"U"}]"#,
            ),
        ];
        for (msgs, want) in rows {
            assert_eq!(json(developer_as_system(conv(msgs))), *want, "{msgs:?}");
        }
        assert!(!template_knows_developer("{% if m.role == 'system' %}"));
        assert!(template_knows_developer("{% if m.role == \"developer\" %}"));
    }

    #[test]
    fn tools_as_vllm_dumps_them() {
        let raw: Box<RawValue> = serde_json::from_str(
            r#"[{"function":{"parameters":{"type":"object"},"name":"f","strict":true},"type":"function"}]"#,
        )
        .unwrap();
        let v = tools(Some(raw.get())).unwrap();
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object"},"strict":true}}]"#
        );
        assert!(tools(None).unwrap().is_none());
    }

    #[test]
    fn non_text_parts_are_refused() {
        let raw: Box<RawValue> = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}"#,
        )
        .unwrap();
        let e = message(raw.get(), ContentFormat::String, Calls::Validated)
            .unwrap_err()
            .to_string();
        assert!(e.contains("image_url"), "{e}");
    }
}
