//! The test oracle: today's tree-based reader (before the single-pass scanner), kept verbatim
//! in logic so proptests can pin the scanner's output to it bit for bit. Every field is kept
//! as a `RawValue` until its family reads it, and structure is digested through a
//! `serde_json::Value`. Slow on purpose; never compiled outside tests.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::prompt::PromptHasher;
use super::{Family, RequestInfo, OTHER_KEY_BYTES};
use crate::protocol::api::shape::Shape;

#[derive(Deserialize, Default)]
struct Top<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

fn field<'a, T: Deserialize<'a>>(raw: Option<&'a RawValue>) -> Option<T> {
    serde_json::from_str(raw?.get()).ok()
}

fn text<'a>(raw: Option<&'a RawValue>) -> Option<Cow<'a, str>> {
    field::<Text>(raw).map(|t| t.0)
}

pub fn classify(family: Family, body: &[u8]) -> RequestInfo {
    let other = || Shape::Other {
        key: xxh3_64(&body[..body.len().min(OTHER_KEY_BYTES)]),
    };
    let Ok(top) = serde_json::from_slice::<Top>(body) else {
        return RequestInfo {
            shape: other(),
            model: None,
            stream: false,
            previous_response_id: None,
        };
    };
    let model = text(top.model).map(Cow::into_owned);
    let mut h = PromptHasher::new(model.as_deref().unwrap_or(""));
    let read = match family {
        Family::Chat => chat(&top, &mut h),
        Family::Completions => completions(&top, &mut h),
        Family::Responses => responses(&top, &mut h),
        Family::Messages => messages(&top, &mut h),
    };
    let links = h.finish();
    let shape = match read {
        Some(()) if !links.is_empty() => Shape::Prompt { links },
        _ => other(),
    };
    RequestInfo {
        shape,
        model,
        stream: field::<bool>(top.stream) == Some(true),
        previous_response_id: match family {
            Family::Responses => text(top.previous_response_id).map(Cow::into_owned),
            _ => None,
        },
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

fn content(raw: Option<&RawValue>, h: &mut PromptHasher) {
    let Some(raw) = raw else { return };
    if let Some(t) = field::<Text>(Some(raw)) {
        return h.text(&t.0);
    }
    let Some(blocks) = field::<Vec<&RawValue>>(Some(raw)) else {
        return h.digest(json_digest(raw));
    };
    for b in blocks {
        let Some(block) = field::<Block>(Some(b)) else {
            h.digest(json_digest(b));
            continue;
        };
        let kind = text(block.kind);
        match (kind.as_deref(), text(block.text)) {
            (_, Some(t)) => h.text(&t),
            (Some("tool_use"), None) => {
                h.text(&text(block.name).unwrap_or_default());
                if let Some(input) = block.input {
                    h.digest(json_digest(input));
                }
            }
            (Some("tool_result"), None) => content(block.content, h),
            _ => h.digest(json_digest(b)),
        }
    }
}

fn tools(raw: Option<&RawValue>, h: &mut PromptHasher) {
    if let Some(raw) = raw.filter(|r| r.get() != "[]") {
        h.begin_part("tools");
        h.digest(json_digest(raw));
    }
}

fn chat(top: &Top, h: &mut PromptHasher) -> Option<()> {
    let messages = field::<Vec<&RawValue>>(top.messages)?;
    if messages.is_empty() {
        return None;
    }
    tools(top.tools, h);
    for raw in messages {
        let Some(m) = field::<Message>(Some(raw)) else {
            h.begin_part("item");
            h.digest(json_digest(raw));
            continue;
        };
        h.begin_part(&text(m.role).unwrap_or_default());
        if let Some(name) = text(m.name) {
            h.text(&name);
        }
        content(m.content, h);
        if let Some(calls) = m.tool_calls {
            h.digest(json_digest(calls));
        }
    }
    Some(())
}

fn completions(top: &Top, h: &mut PromptHasher) -> Option<()> {
    let raw = top.prompt?;
    if let Some(t) = field::<Text>(Some(raw)) {
        h.begin_part("prompt");
        h.text(&t.0);
    } else if let Some(ids) = field::<Vec<u32>>(Some(raw)) {
        tokens(&ids, h);
    } else if let Some(batch) = field::<Vec<Text>>(Some(raw)) {
        for t in batch {
            h.begin_part("prompt");
            h.text(&t.0);
        }
    } else {
        for ids in field::<Vec<Vec<u32>>>(Some(raw))? {
            tokens(&ids, h);
        }
    }
    Some(())
}

fn tokens(ids: &[u32], h: &mut PromptHasher) {
    h.begin_part("tokens");
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    ids.iter()
        .for_each(|id| bytes.extend_from_slice(&id.to_le_bytes()));
    h.bytes(&bytes);
}

fn messages(top: &Top, h: &mut PromptHasher) -> Option<()> {
    let messages = field::<Vec<&RawValue>>(top.messages)?;
    if messages.is_empty() {
        return None;
    }
    if top.system.is_some() {
        h.begin_part("system");
        content(top.system, h);
    }
    tools(top.tools, h);
    for raw in messages {
        let Some(m) = field::<Message>(Some(raw)) else {
            h.begin_part("item");
            h.digest(json_digest(raw));
            continue;
        };
        h.begin_part(&text(m.role).unwrap_or_default());
        content(m.content, h);
    }
    Some(())
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(borrow, default)]
    summary: Option<&'a RawValue>,
}

fn responses(top: &Top, h: &mut PromptHasher) -> Option<()> {
    let input = top.input?;
    if let Some(instructions) = text(top.instructions) {
        h.begin_part("system");
        h.text(&instructions);
    }
    tools(top.tools, h);
    if let Some(t) = field::<Text>(Some(input)) {
        h.begin_part("user");
        h.text(&t.0);
        return Some(());
    }
    for raw in field::<Vec<&RawValue>>(Some(input))? {
        let Some(item) = field::<Item>(Some(raw)) else {
            h.begin_part("item");
            h.digest(json_digest(raw));
            continue;
        };
        match (text(item.kind).as_deref(), text(item.role)) {
            (None | Some("message"), Some(role)) => {
                h.begin_part(&role);
                content(item.content, h);
            }
            (Some("function_call"), _) => {
                h.begin_part("function_call");
                h.text(&text(item.name).unwrap_or_default());
                h.text(&text(item.arguments).unwrap_or_default());
            }
            (Some("function_call_output"), _) => {
                h.begin_part("function_call_output");
                content(item.output, h);
            }
            (Some("reasoning"), _) => {
                h.begin_part("reasoning");
                content(item.summary, h);
            }
            (kind, _) => {
                h.begin_part(&format!("item:{}", kind.unwrap_or("")));
                h.digest(json_digest(raw));
            }
        }
    }
    Some(())
}

/// The structural digest through a `Value` tree; the raw text's hash when it cannot be built.
pub fn json_digest(raw: &RawValue) -> u64 {
    match serde_json::from_str::<Value>(raw.get()) {
        Ok(v) => {
            let mut h = Xxh3::new();
            hash_value(&v, &mut h);
            h.digest()
        }
        Err(_) => xxh3_64(raw.get().as_bytes()),
    }
}

fn hash_value(v: &Value, h: &mut Xxh3) {
    match v {
        Value::Null => h.update(b"n"),
        Value::Bool(b) => h.update(if *b { b"t" } else { b"f" }),
        Value::Number(n) => {
            h.update(b"#");
            h.update(n.to_string().as_bytes());
        }
        Value::String(s) => {
            h.update(b"s");
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        Value::Array(items) => {
            h.update(b"[");
            h.update(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| hash_value(i, h));
        }
        Value::Object(map) => {
            h.update(b"{");
            for (k, v) in map.iter().filter(|(k, _)| *k != "cache_control") {
                h.update(&(k.len() as u64).to_le_bytes());
                h.update(k.as_bytes());
                hash_value(v, h);
            }
            h.update(b"}");
        }
    }
}

/// The single-pass reader against this oracle, on generated bodies of every family written
/// with random key order, whitespace and escapes, tricky numbers and strings, and mutated.
mod equivalence;
mod writer;
