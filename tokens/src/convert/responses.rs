//! OpenAI Responses bodies as the chat body vLLM's `construct_input_messages` and
//! `construct_tool_dicts` make of them.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{
    is_empty_string, kwargs, refuse, string, write, Call, ChatOut, Content, Function, Msg, Out,
    Text, Tool, ToolFunction,
};
use crate::Error;

/// vLLM's separator of a namespace tool's flat name (`<namespace>__<name>`).
const NAMESPACE_SEPARATOR: &str = "__";

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow)]
    input: &'a RawValue,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(default)]
    previous_response_id: Option<IgnoredAny>,
    #[serde(default)]
    previous_input_messages: Option<IgnoredAny>,
    #[serde(default)]
    prompt: Option<IgnoredAny>,
    #[serde(borrow, default)]
    tools: Option<Vec<ResponsesTool<'a>>>,
    #[serde(default)]
    reasoning: Option<Reasoning>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Reasoning {
    #[serde(default)]
    effort: Option<String>,
}

#[derive(Deserialize)]
struct ResponsesTool<'a> {
    #[serde(rename = "type")]
    kind: String,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    parameters: Option<&'a RawValue>,
    #[serde(default)]
    strict: Option<bool>,
    #[serde(default)]
    defer_loading: Option<bool>,
    /// A namespace's tools.
    #[serde(borrow, default)]
    tools: Option<Vec<ResponsesTool<'a>>>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(default)]
    status: Option<String>,
    #[serde(borrow, default)]
    call_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
    #[serde(borrow, default)]
    summary: Option<Vec<TextItem<'a>>>,
    #[serde(borrow, default)]
    encrypted_content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct TextItem<'a> {
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

/// The function tools the template sees: function tools as they are, a namespace's function
/// tools flattened to `<namespace>__<name>`, other tool types (built-in tools, MCP) dropped.
/// No tools is none; tools but no function tool is an empty list.
fn responses_tools<'a>(
    tools: Option<Vec<ResponsesTool<'a>>>,
) -> Result<Option<Vec<Tool<'a>>>, Error> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let function = |t: ResponsesTool<'a>, name: Text<'a>| Tool {
        kind: "function",
        function: ToolFunction {
            name,
            description: t.description.filter(|d| d.get() != "null"),
            parameters: t
                .parameters
                .filter(|p| p.get() != "null")
                .map(std::borrow::Cow::Borrowed),
            strict: t.strict,
            defer_loading: t.defer_loading,
        },
    };
    let mut out = vec![];
    for t in tools {
        match t.kind.as_str() {
            "function" => {
                let name = t
                    .name
                    .ok_or_else(|| refuse("a function tool without a name"))?;
                out.push(function(t, Text::Raw(name)));
            }
            "namespace" => {
                let ns = t
                    .name
                    .ok_or_else(|| refuse("a namespace tool without a name"))?;
                let ns = string(ns, "namespace name")?;
                for inner in t.tools.unwrap_or_default() {
                    if inner.kind != "function" {
                        continue;
                    }
                    let name = inner
                        .name
                        .ok_or_else(|| refuse("a function tool without a name"))?;
                    let flat = format!("{ns}{NAMESPACE_SEPARATOR}{}", string(name, "tool name")?);
                    out.push(function(inner, Text::Owned(flat)));
                }
            }
            // vLLM shows a custom tool as a function of one string: not done here.
            "custom" => return Err(refuse("a custom tool")),
            _ => {}
        }
    }
    Ok(Some(out))
}

/// The message an item makes, or None where it went into the previous assistant message.
fn responses_item<'a>(
    raw: &'a RawValue,
    item: Item<'a>,
    prev: Option<&mut Out<'a>>,
) -> Result<Option<Out<'a>>, Error> {
    // The previous message, where it is an assistant message this conversion made.
    let mut prev = match prev {
        Some(Out::Msg(m)) if m.role == "assistant" => Some(m),
        Some(Out::Raw(r)) if raw_role(r).as_deref() == Some("assistant") => {
            return Err(refuse("an item after an assistant message kept as it came"))
        }
        _ => None,
    };
    let kind = item.kind.as_deref();
    match kind {
        Some("function_call") => {
            let (Some(id), Some(name), Some(args)) = (item.call_id, item.name, item.arguments)
            else {
                return Err(refuse("a function_call without call_id, name or arguments"));
            };
            let name = match item.namespace.filter(|n| !n.is_empty()) {
                Some(ns) => Text::Owned(format!(
                    "{ns}{NAMESPACE_SEPARATOR}{}",
                    string(name, "function_call name")?
                )),
                None => Text::Raw(name),
            };
            string(args, "function_call arguments")?;
            let call = Call::Responses {
                id: Text::Raw(id),
                function: Function {
                    name,
                    arguments: Text::Raw(args),
                },
                kind: "function",
            };
            if let Some(p) = prev.as_deref_mut() {
                p.tool_calls.get_or_insert_with(Vec::new).push(call);
                return Ok(None);
            }
            Ok(Some(Out::Msg(Msg {
                role: "assistant",
                tool_calls: Some(vec![call]),
                ..Msg::default()
            })))
        }
        Some("custom_tool_call") => Err(refuse("a custom tool call")),
        Some("reasoning") => {
            if item.encrypted_content.is_some_and(|e| e.get() != "null") {
                return Err(refuse("encrypted reasoning"));
            }
            let content: Vec<TextItem> = match item.content.filter(|c| c.get() != "null") {
                Some(c) => serde_json::from_str(c.get())
                    .map_err(|e| refuse(format!("reasoning content: {e}")))?,
                None => vec![],
            };
            let first = content
                .into_iter()
                .next()
                .or_else(|| item.summary.and_then(|s| s.into_iter().next()));
            let text = match first {
                Some(t) => Text::Raw(t.text.ok_or_else(|| refuse("reasoning without text"))?),
                None => Text::Owned(String::new()),
            };
            if let Some(p) = prev.as_deref_mut() {
                if p.reasoning.is_none() {
                    p.reasoning = Some(text);
                    return Ok(None);
                }
            }
            Ok(Some(Out::Msg(Msg {
                role: "assistant",
                reasoning: Some(text),
                ..Msg::default()
            })))
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let output = item
                .output
                .ok_or_else(|| refuse("a tool output without output"))?;
            Ok(Some(Out::Msg(Msg {
                role: "tool",
                content: Some(Content::Raw(output)),
                tool_call_id: Some(item.call_id.map_or(Text::Owned(String::new()), Text::Raw)),
                ..Msg::default()
            })))
        }
        _ if item.role.as_deref() == Some("assistant") => {
            let content = item.content.filter(|c| c.get() != "null");
            // vLLM makes a `message` item with a list into an output message: its first
            // part's text. Other assistant items give their string, or their first part's text.
            let text: Option<Text> = match content {
                Some(c) if c.get().starts_with('"') => Some(Text::Raw(c)),
                Some(c) if c.get().starts_with('[') => {
                    let parts: Vec<TextItem> = serde_json::from_str(c.get())
                        .map_err(|e| refuse(format!("assistant content: {e}")))?;
                    match (parts.into_iter().next(), kind) {
                        (Some(TextItem { text: Some(t) }), _) if t.get() != "null" => {
                            Some(Text::Raw(t))
                        }
                        (_, Some("message")) => {
                            return Err(refuse("an assistant message without output_text"))
                        }
                        _ => None,
                    }
                }
                _ if kind == Some("message") => {
                    return Err(refuse("an assistant message without content"))
                }
                _ => None,
            };
            let Some(text) = text else {
                return Ok(Some(Out::Raw(raw)));
            };
            if let Some(p) = prev {
                if p.content.is_none() {
                    p.content = Some(Content::Text(text));
                    return Ok(None);
                }
            }
            Ok(Some(Out::Msg(Msg {
                role: "assistant",
                content: Some(Content::Text(text)),
                ..Msg::default()
            })))
        }
        _ if item.role.is_some() => Ok(Some(Out::Raw(raw))),
        other => Err(refuse(format!("an input item of type {other:?}"))),
    }
}

fn raw_role(raw: &RawValue) -> Option<String> {
    #[derive(Deserialize)]
    struct Role {
        #[serde(default)]
        role: Option<String>,
    }
    serde_json::from_str::<Role>(raw.get()).ok()?.role
}

/// The chat body vLLM renders for a Responses body (not a Harmony model's: gpt-oss renders
/// Responses its own way).
pub fn responses_chat(body: &[u8]) -> Result<Vec<u8>, Error> {
    let b: ResponsesBody =
        serde_json::from_slice(body).map_err(|e| refuse(format!("responses body: {e}")))?;
    if b.previous_response_id.is_some() || b.previous_input_messages.is_some() {
        return Err(refuse(
            "a continued response: its history is on the replica",
        ));
    }
    if b.prompt.is_some() {
        return Err(refuse("a prompt template"));
    }
    let mut out: Vec<Out> = vec![];
    if let Some(i) = b
        .instructions
        .filter(|i| i.get() != "null" && !is_empty_string(i))
    {
        string(i, "instructions")?;
        out.push(Out::Msg(Msg {
            role: "system",
            content: Some(Content::Text(Text::Raw(i))),
            ..Msg::default()
        }));
    }
    if b.input.get().starts_with('"') {
        out.push(Out::Msg(Msg {
            role: "user",
            content: Some(Content::Text(Text::Raw(b.input))),
            ..Msg::default()
        }));
    } else {
        let items: Vec<&RawValue> =
            serde_json::from_str(b.input.get()).map_err(|e| refuse(format!("input: {e}")))?;
        let n = items.len();
        for (i, raw) in items.into_iter().enumerate() {
            let item: Item =
                serde_json::from_str(raw.get()).map_err(|e| refuse(format!("input item: {e}")))?;
            // A last message or reasoning in progress is continued, not answered: vLLM renders
            // it without a generation prompt and cuts the template's end of message.
            let continued =
                matches!(
                    item.kind.as_deref().unwrap_or("message"),
                    "message" | "reasoning"
                ) && matches!(item.status.as_deref(), Some("in_progress" | "incomplete"));
            if i + 1 == n && continued {
                return Err(refuse("a partial final message, which vLLM continues"));
            }
            if let Some(m) = responses_item(raw, item, out.last_mut())? {
                out.push(m);
            }
        }
    }
    let effort = b.reasoning.and_then(|r| r.effort);
    Ok(write(&ChatOut {
        tools: responses_tools(b.tools)?,
        chat_template_kwargs: kwargs(b.chat_template_kwargs, effort.as_deref())?,
        messages: out,
    }))
}
