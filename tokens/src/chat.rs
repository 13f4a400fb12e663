//! An OpenAI chat request made into what vLLM hands a Hugging Face template: the conversation
//! vLLM's `parse_chat_messages` builds (text parts joined or kept as parts, tool-call arguments
//! parsed into objects, `reasoning` under both its names) and the tools as vLLM's request model
//! dumps them (every declared field present, `null` when absent).

use indexmap::IndexMap;
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
pub fn message(raw: &str, format: ContentFormat) -> Result<Value, Error> {
    fields(raw, format).map(obj)
}

/// One message's fields, in the order vLLM's conversation holds them.
pub fn fields(raw: &str, format: ContentFormat) -> Result<IndexMap<&'static str, Value>, Error> {
    let m: Message = serde_json::from_str(raw).map_err(|e| Error::Body(format!("message: {e}")))?;
    let texts = texts(m.content)?;
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
        if let Some(calls) = m.tool_calls {
            if !calls.is_empty() {
                let calls: Result<Vec<Value>, Error> = calls.into_iter().map(tool_call).collect();
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

/// `function.arguments` as an object: a JSON string parsed, empty or null as `{}`, and (as vLLM
/// does) anything that is not an object as `{}`.
fn tool_call(mut call: IndexMap<String, Value>) -> Result<Value, Error> {
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
        let v = message(raw.get(), format).unwrap();
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
                r#"{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{"z":1,"a":2}}}]}"#,
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
                r#"{"role":"assistant","content":"x","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":{}}}],"name":"bot"}"#,
            ),
        ];
        for (input, format, want) in cases {
            assert_eq!(msg(input, format), want, "{input}");
        }
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
        let e = message(raw.get(), ContentFormat::String)
            .unwrap_err()
            .to_string();
        assert!(e.contains("image_url"), "{e}");
    }
}
