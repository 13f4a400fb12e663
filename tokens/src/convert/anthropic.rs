//! Anthropic Messages as the chat body vLLM's `to_chat_completion_request` makes of them.

use indexmap::IndexMap;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{
    is_empty_string, kwargs, raw_json, refuse, string, write, Call, ChatOut, Content, Function,
    Msg, Out, Part, Text, Tool, ToolFunction,
};
use crate::chat::BILLING_HEADER;
use crate::Error;

/// What vLLM decides per model from its template, once (see [`crate::ModelTokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnthropicRules {
    /// The template refuses a system message after the first (it raises on `[system, user,
    /// system, user]`): inline system messages are merged into the leading one.
    pub merge_inline_system: bool,
    /// The `reasoning_effort` that `thinking: {"type": "disabled"}` becomes: `none`, or `low`
    /// where the template refuses `none` or renders it as some effort.
    pub disabled_thinking_effort: &'static str,
}

/// The efforts vLLM compares `none` with to choose [`AnthropicRules::disabled_thinking_effort`].
pub const ANTHROPIC_EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

#[derive(Deserialize)]
struct AnthropicBody<'a> {
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Vec<AnthropicMessage<'a>>,
    #[serde(borrow, default)]
    tools: Option<Vec<AnthropicTool<'a>>>,
    #[serde(default)]
    thinking: Option<Kind>,
    #[serde(default)]
    output_config: Option<OutputConfig>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Kind {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct OutputConfig {
    #[serde(default)]
    effort: Option<String>,
}

#[derive(Deserialize)]
struct AnthropicMessage<'a> {
    role: String,
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type")]
    kind: String,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    thinking: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_use_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ToolResultItem<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct AnthropicTool<'a> {
    #[serde(borrow)]
    name: &'a RawValue,
    #[serde(borrow, default)]
    description: Option<&'a RawValue>,
    #[serde(borrow)]
    input_schema: &'a RawValue,
    #[serde(default)]
    strict: Option<bool>,
    #[serde(default)]
    defer_loading: Option<bool>,
}

/// An Anthropic tool's `input_schema` as vLLM's request model validates it: `"type": "object"`
/// added at its end when it names no type.
fn typed_schema(raw: &RawValue) -> Result<std::borrow::Cow<'_, RawValue>, Error> {
    let mut schema: IndexMap<String, Box<RawValue>> = serde_json::from_str(raw.get())
        .map_err(|e| refuse(format!("input_schema must be an object: {e}")))?;
    if schema.contains_key("type") {
        return Ok(std::borrow::Cow::Borrowed(raw));
    }
    schema.insert("type".into(), raw_json(&"object"));
    let text = serde_json::to_string(&schema).map_err(|e| refuse(e.to_string()))?;
    RawValue::from_string(text)
        .map(std::borrow::Cow::Owned)
        .map_err(|e| refuse(e.to_string()))
}

/// The text of a system prompt or message as vLLM extracts it: a string as it is, text blocks
/// joined, Claude Code's per-request billing header left out (it would defeat the cache).
fn system_text(raw: &RawValue, top_level: bool) -> Result<Option<String>, Error> {
    if raw.get().starts_with('"') {
        let s = string(raw, "system")?;
        return Ok(match top_level {
            // The top-level string is taken as it is.
            true => Some(s).filter(|s| !s.is_empty()),
            false => Some(s).filter(|s| !s.starts_with(BILLING_HEADER)),
        });
    }
    let blocks: Vec<Block> =
        serde_json::from_str(raw.get()).map_err(|e| refuse(format!("system: {e}")))?;
    let mut parts = vec![];
    for b in blocks {
        check_block_kind(&b.kind)?;
        if matches!(b.kind.as_str(), "tool_addition" | "tool_removal") {
            // They change the tools in effect, which vLLM resolves; not done here.
            return Err(refuse("tool_addition or tool_removal blocks"));
        }
        if b.kind != "text" {
            continue;
        }
        if let Some(t) = b.text.filter(|t| !is_empty_string(t)) {
            let t = string(t, "text")?;
            if !t.starts_with(BILLING_HEADER) {
                parts.push(t);
            }
        }
    }
    Ok(match (parts.is_empty(), top_level) {
        (true, false) => None,
        _ => Some(parts.concat()),
    })
}

fn check_block_kind(kind: &str) -> Result<(), Error> {
    match kind {
        "text" | "image" | "tool_use" | "tool_result" | "tool_reference" | "thinking"
        | "redacted_thinking" | "tool_addition" | "tool_removal" => Ok(()),
        other => Err(refuse(format!("content block of type {other:?}"))),
    }
}

/// The chat body vLLM renders for an Anthropic Messages body.
pub fn anthropic_chat(body: &[u8], rules: &AnthropicRules) -> Result<Vec<u8>, Error> {
    let b: AnthropicBody =
        serde_json::from_slice(body).map_err(|e| refuse(format!("messages body: {e}")))?;
    let mut out: Vec<Out> = vec![];

    // The system prompt: the top-level one, then (where the template wants one system message)
    // every inline one, joined.
    let mut system: Vec<String> = vec![];
    if let Some(s) = b.system.filter(|s| s.get() != "null") {
        if let Some(t) = system_text(s, true)?.filter(|t| !t.is_empty()) {
            system.push(t);
        }
    }
    if rules.merge_inline_system {
        for m in b.messages.iter().filter(|m| m.role == "system") {
            if let Some(t) = system_text(m.content, false)?.filter(|t| !t.is_empty()) {
                system.push(t);
            }
        }
    }
    if !system.is_empty() {
        out.push(Out::Msg(Msg {
            role: "system",
            content: Some(Content::Text(Text::Owned(system.concat()))),
            ..Msg::default()
        }));
    }

    for m in &b.messages {
        let role = match m.role.as_str() {
            "system" => {
                if !rules.merge_inline_system {
                    if let Some(t) = system_text(m.content, false)?.filter(|t| !t.is_empty()) {
                        out.push(Out::Msg(Msg {
                            role: "system",
                            content: Some(Content::Text(Text::Owned(t))),
                            ..Msg::default()
                        }));
                    }
                }
                continue;
            }
            "user" => "user",
            "assistant" => "assistant",
            other => return Err(refuse(format!("a message of role {other:?}"))),
        };
        let mut msg = Msg {
            role,
            ..Msg::default()
        };
        if m.content.get().starts_with('"') {
            msg.content = Some(Content::Text(Text::Raw(m.content)));
            out.push(Out::Msg(msg));
            continue;
        }
        let blocks: Vec<Block> = serde_json::from_str(m.content.get())
            .map_err(|e| refuse(format!("message content: {e}")))?;
        let mut parts: Vec<Part> = vec![];
        let mut calls: Vec<Call> = vec![];
        let mut reasoning: Vec<&RawValue> = vec![];
        for block in blocks {
            check_block_kind(&block.kind)?;
            match block.kind.as_str() {
                "text" => {
                    if let Some(t) = block.text.filter(|t| !is_empty_string(t)) {
                        parts.push(Part {
                            kind: "text",
                            text: Text::Raw(t),
                        });
                    }
                }
                "thinking" => {
                    if let Some(t) = block.thinking.filter(|t| t.get() != "null") {
                        reasoning.push(t);
                    }
                }
                "redacted_thinking" | "tool_reference" => {}
                "tool_use" => {
                    // vLLM names a call without an id by the clock.
                    let id = block
                        .id
                        .filter(|i| i.get() != "null" && !is_empty_string(i))
                        .ok_or_else(|| refuse("a tool_use block without an id"))?;
                    let name = block
                        .name
                        .filter(|n| n.get() != "null")
                        .map_or(Text::Owned(String::new()), Text::Raw);
                    // `json.dumps(input or {})`: the template sees the arguments parsed again,
                    // so the raw object stands for them.
                    let input = block
                        .input
                        .map(RawValue::get)
                        .filter(|i| *i != "null")
                        .unwrap_or("{}");
                    calls.push(Call::Anthropic {
                        id: Text::Raw(id),
                        kind: "function",
                        function: Function {
                            name,
                            arguments: Text::Owned(input.to_string()),
                        },
                    });
                }
                "tool_result" if role == "user" => {
                    let text = match block.content.filter(|c| c.get() != "null") {
                        None => String::new(),
                        Some(c) if c.get().starts_with('"') => string(c, "tool_result")?,
                        Some(c) => {
                            let items: Vec<ToolResultItem> = serde_json::from_str(c.get())
                                .map_err(|e| refuse(format!("tool_result content: {e}")))?;
                            let mut texts = vec![];
                            for item in items {
                                match item.kind.as_deref() {
                                    Some("text") => texts.push(match item.text {
                                        Some(t) => string(t, "text")?,
                                        None => String::new(),
                                    }),
                                    Some("image" | "tool_reference") => {
                                        return Err(refuse(format!(
                                            "a tool_result holding {:?}",
                                            item.kind.unwrap_or_default()
                                        )))
                                    }
                                    _ => {}
                                }
                            }
                            texts.join("\n")
                        }
                    };
                    let id = block
                        .tool_use_id
                        .filter(|i| i.get() != "null")
                        .map_or(Text::Owned(String::new()), Text::Raw);
                    out.push(Out::Msg(Msg {
                        role: "tool",
                        content: Some(Content::Text(Text::Owned(text))),
                        tool_call_id: Some(id),
                        ..Msg::default()
                    }));
                }
                "tool_result" => {
                    // An assistant's tool result is `str(content)`: Python's repr of a list.
                    let text = match block.content.filter(|c| c.get() != "null") {
                        None => String::new(),
                        Some(c) if c.get().starts_with('"') => string(c, "tool_result")?,
                        Some(_) => return Err(refuse("an assistant's tool_result with blocks")),
                    };
                    parts.push(Part {
                        kind: "text",
                        text: Text::Owned(format!("Tool result: {text}")),
                    });
                }
                "image" => return Err(refuse("an image block")),
                other => return Err(refuse(format!("a {other} block in a message"))),
            }
        }
        if !reasoning.is_empty() {
            let joined: Result<Vec<String>, Error> =
                reasoning.iter().map(|r| string(r, "thinking")).collect();
            msg.reasoning = Some(Text::Owned(joined?.concat()));
        }
        if !calls.is_empty() {
            msg.tool_calls = Some(calls);
        }
        if !parts.is_empty() {
            msg.content = Some(match parts.len() {
                1 => Content::Text(parts.pop().expect("one part").text),
                _ => Content::Parts(parts),
            });
        }
        // A user message left with no content (only tool results) is not sent.
        if !(role == "user" && msg.content.is_none()) {
            out.push(Out::Msg(msg));
        }
    }

    // The effort: the output config's, then thinking turned off overrides it.
    let mut effort = b.output_config.and_then(|o| o.effort);
    if let Some(t) = &b.thinking {
        if t.kind == "disabled" {
            effort = Some(rules.disabled_thinking_effort.to_string());
        }
    }
    let tools = b
        .tools
        .map(|tools| {
            tools
                .into_iter()
                .map(|t| {
                    Ok(Tool {
                        kind: "function",
                        function: ToolFunction {
                            name: Text::Raw(t.name),
                            description: t.description.filter(|d| d.get() != "null"),
                            parameters: Some(typed_schema(t.input_schema)?),
                            strict: t.strict,
                            defer_loading: t.defer_loading,
                        },
                    })
                })
                .collect::<Result<Vec<_>, Error>>()
        })
        .transpose()?;
    Ok(write(&ChatOut {
        tools,
        chat_template_kwargs: kwargs(b.chat_template_kwargs, effort.as_deref())?,
        messages: out,
    }))
}
