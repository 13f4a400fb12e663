//! Anthropic Messages and OpenAI Responses bodies made into the chat body vLLM (0.33) renders
//! for them, so that their prompts tokenize as the engine's do.
//!
//! vLLM serves both APIs by converting a request into a chat request and rendering that with
//! the model's template: `AnthropicServingMessages.to_chat_completion_request` for
//! `/v1/messages`, `construct_input_messages` and `construct_tool_dicts` for `/v1/responses`
//! (with the `input_item_parsing` validator before them). The conversion here writes the chat
//! body those would produce (`messages`, `tools`, `chat_template_kwargs`), which
//! [`crate::ModelTokens::chat_ids_within`] then renders and tokenizes like any chat body. It is
//! deterministic, so a conversation's next turn converts to a body that shares the previous
//! one's bytes and the message cache serves it.
//!
//! Texts, tool inputs and schemas are copied as the client's raw JSON, never re-serialized:
//! their key order reaches the template (`tojson`), and copying costs less than parsing.
//!
//! What vLLM would render from more than the text (images, tool references), what depends on
//! state this process does not have (`previous_response_id`, a prompt template, custom tools,
//! Anthropic tool additions and removals), a partial final message that vLLM continues, and
//! what vLLM refuses, are [`Error::Body`]: the caller then keeps its estimate.

use indexmap::IndexMap;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

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

/// vLLM's separator of a namespace tool's flat name (`<namespace>__<name>`).
const NAMESPACE_SEPARATOR: &str = "__";

fn refuse(what: impl Into<String>) -> Error {
    Error::Body(what.into())
}

/// A JSON string: the client's raw text, or one made here.
#[derive(Serialize, Clone)]
#[serde(untagged)]
enum Text<'a> {
    Raw(&'a RawValue),
    Owned(String),
}

#[derive(Serialize)]
struct Part<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: Text<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(Text<'a>),
    Parts(Vec<Part<'a>>),
    /// As the client sent it (a Responses tool output or message content).
    Raw(&'a RawValue),
}

#[derive(Serialize)]
struct Function<'a> {
    name: Text<'a>,
    arguments: Text<'a>,
}

/// A tool call, its keys in the order each conversion writes them (a template may print the
/// whole call).
#[derive(Serialize)]
#[serde(untagged)]
enum Call<'a> {
    Anthropic {
        id: Text<'a>,
        #[serde(rename = "type")]
        kind: &'static str,
        function: Function<'a>,
    },
    Responses {
        id: Text<'a>,
        function: Function<'a>,
        #[serde(rename = "type")]
        kind: &'static str,
    },
}

/// A chat message as vLLM's conversion builds it (only the fields it sets).
#[derive(Serialize, Default)]
struct Msg<'a> {
    role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Content<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Text<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Call<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<Text<'a>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Out<'a> {
    Msg(Msg<'a>),
    /// A Responses input message passed on as it came.
    Raw(&'a RawValue),
}

#[derive(Serialize)]
struct ToolFunction<'a> {
    name: Text<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<std::borrow::Cow<'a, RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    defer_loading: Option<bool>,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

/// The chat body written: the small fields first, so that successive turns share every byte up
/// to their new messages.
#[derive(Serialize)]
struct ChatOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(skip_serializing_if = "IndexMap::is_empty")]
    chat_template_kwargs: IndexMap<String, Box<RawValue>>,
    messages: Vec<Out<'a>>,
}

fn raw_json<T: Serialize>(v: &T) -> Box<RawValue> {
    let s = serde_json::to_string(v).expect("a string or a bool serializes");
    RawValue::from_string(s).expect("serde_json writes valid JSON")
}

/// The request's `chat_template_kwargs` with what vLLM's `build_chat_params` sets over them:
/// `add_generation_prompt` (always true here), and with an effort `reasoning_effort` and, unless
/// the client set it, `enable_thinking`. (`continue_final_message: false` and `documents:
/// null` are left out: a template reads them as it reads an undefined name.)
fn kwargs(user: Option<&RawValue>, effort: Option<&str>) -> Result<ChatKwargs, Error> {
    let mut kw: IndexMap<String, Box<RawValue>> = match user.filter(|r| r.get() != "null") {
        Some(r) => serde_json::from_str(r.get())
            .map_err(|e| refuse(format!("chat_template_kwargs: {e}")))?,
        None => IndexMap::new(),
    };
    let user_thinking = kw.contains_key("enable_thinking");
    kw.shift_remove("continue_final_message");
    kw.insert("add_generation_prompt".into(), raw_json(&true));
    if let Some(effort) = effort.filter(|e| *e != "auto") {
        kw.insert("reasoning_effort".into(), raw_json(&effort));
        if !user_thinking {
            kw.insert("enable_thinking".into(), raw_json(&(effort != "none")));
        }
    }
    Ok(kw)
}

type ChatKwargs = IndexMap<String, Box<RawValue>>;

fn write(out: &ChatOut) -> Vec<u8> {
    serde_json::to_vec(out).expect("raw JSON and strings serialize")
}

fn is_empty_string(raw: &RawValue) -> bool {
    raw.get() == "\"\""
}

fn string(raw: &RawValue, what: &str) -> Result<String, Error> {
    serde_json::from_str(raw.get()).map_err(|_| refuse(format!("{what}: not a string")))
}

// --- Anthropic Messages -------------------------------------------------------------------

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

use crate::chat::BILLING_HEADER;

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

// --- OpenAI Responses ---------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const KEEP: AnthropicRules = AnthropicRules {
        merge_inline_system: false,
        disabled_thinking_effort: "none",
    };
    const MERGE: AnthropicRules = AnthropicRules {
        merge_inline_system: true,
        disabled_thinking_effort: "low",
    };

    fn anthropic(body: Value, rules: &AnthropicRules) -> Value {
        let out = anthropic_chat(body.to_string().as_bytes(), rules).expect("converts");
        serde_json::from_slice(&out).expect("JSON")
    }

    fn responses(body: Value) -> Value {
        let out = responses_chat(body.to_string().as_bytes()).expect("converts");
        serde_json::from_slice(&out).expect("JSON")
    }

    /// Each case's want is what vLLM 0.33's `to_chat_completion_request` gives (its
    /// `messages`, `tools` and chat template kwargs), read from its code.
    #[test]
    fn anthropic_bodies_convert_as_vllm_converts_them() {
        let gen = json!({"add_generation_prompt": true});
        let cases = [
            (
                "a string system and contents",
                json!({"model": "m", "max_tokens": 5, "system": "Be brief.",
                       "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": ""}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": ""}]}),
            ),
            (
                "system blocks joined without a separator, the billing header left out",
                json!({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                                  {"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "AB"},
                    {"role": "user", "content": "Hi"}]}),
            ),
            (
                "text blocks kept as parts, empty ones dropped",
                json!({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": ""},
                    {"type": "text", "text": "b"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}]}),
            ),
            (
                "thinking, a tool call, its result before the user's text",
                json!({"messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Use ", "signature": "s"},
                        {"type": "thinking", "thinking": "the tool."},
                        {"type": "redacted_thinking", "data": "zz"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "tu_1", "name": "get_weather",
                         "input": {"city": "Paris", "unit": "c"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "tu_1",
                         "content": [{"type": "text", "text": "20"}, {"type": "text", "text": "sunny"}]},
                        {"type": "text", "text": "Thanks"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Checking.", "reasoning": "Use the tool.",
                     "tool_calls": [{"id": "tu_1", "type": "function", "function": {
                         "name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"c\"}"}}]},
                    {"role": "tool", "content": "20\nsunny", "tool_call_id": "tu_1"},
                    {"role": "user", "content": "Thanks"}]}),
            ),
            (
                "a user message of tool results only is not sent; an empty input is {}",
                json!({"messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": null}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "t", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "content": "ok", "tool_call_id": "t"}]}),
            ),
            (
                "tools as functions; an effort and the user's kwargs",
                json!({"messages": [{"role": "user", "content": "Hi"}],
                       "tools": [{"name": "f", "description": "d",
                                  "input_schema": {"type": "object", "b": 1, "a": 2}, "strict": true}],
                       "output_config": {"effort": "high"},
                       "chat_template_kwargs": {"x": 1, "add_generation_prompt": false}}),
                json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                           "parameters": {"type": "object", "b": 1, "a": 2}, "strict": true}}],
                       "chat_template_kwargs": {"x": 1, "add_generation_prompt": true,
                           "reasoning_effort": "high", "enable_thinking": true},
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
            (
                "a schema without a type is an object's",
                json!({"messages": [{"role": "user", "content": "Hi"}],
                       "tools": [{"name": "f", "input_schema": {"properties": {}}}]}),
                json!({"tools": [{"type": "function", "function": {"name": "f",
                           "parameters": {"properties": {}, "type": "object"}}}],
                       "chat_template_kwargs": gen,
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ];
        for (name, body, want) in cases {
            assert_eq!(anthropic(body, &KEEP), want, "{name}");
        }
    }

    #[test]
    fn inline_system_messages_are_merged_where_the_template_wants_one_system_message() {
        let body = json!({"system": "A", "messages": [
            {"role": "user", "content": "u1"},
            {"role": "system", "content": "B"},
            {"role": "system", "content": "x-anthropic-billing-header: 1"},
            {"role": "user", "content": "u2"}]});
        let msgs = |v: Value| v["messages"].clone();
        assert_eq!(
            msgs(anthropic(body.clone(), &MERGE)),
            json!([{"role": "system", "content": "AB"},
                   {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}])
        );
        assert_eq!(
            msgs(anthropic(body, &KEEP)),
            json!([{"role": "system", "content": "A"}, {"role": "user", "content": "u1"},
                   {"role": "system", "content": "B"}, {"role": "user", "content": "u2"}])
        );
    }

    #[test]
    fn thinking_turned_off_becomes_the_models_effort() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                          "output_config": {"effort": "max"}, "thinking": {"type": "disabled"},
                          "chat_template_kwargs": {"enable_thinking": true}});
        let kw = |rules| anthropic(body.clone(), rules)["chat_template_kwargs"].clone();
        // The client's enable_thinking stands; the effort is the model's for "off".
        assert_eq!(
            kw(&KEEP),
            json!({"enable_thinking": true, "add_generation_prompt": true, "reasoning_effort": "none"})
        );
        assert_eq!(kw(&MERGE)["reasoning_effort"], "low");
    }

    #[test]
    fn anthropic_bodies_beyond_text_are_refused() {
        for body in [
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result",
                "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}),
            json!({"messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {"name": "f"}}]},
                                {"role": "user", "content": "Hi"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
            json!({"messages": "Hi"}),
        ] {
            assert!(
                anthropic_chat(body.to_string().as_bytes(), &KEEP).is_err(),
                "{body}"
            );
        }
    }

    /// Each case's want is what vLLM 0.33's `construct_input_messages` and
    /// `construct_tool_dicts` give, after its `input_item_parsing`.
    #[test]
    fn responses_bodies_convert_as_vllm_converts_them() {
        let gen = json!({"add_generation_prompt": true});
        let cases = [
            (
                "instructions and a string input",
                json!({"model": "m", "instructions": "Be brief.", "input": "Hi", "tools": []}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
            ),
            (
                "reasoning, an output message and calls go into one assistant message",
                json!({"input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                     "content": [{"type": "reasoning_text", "text": "think"}]},
                    {"type": "message", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                    {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"a\": 1}"},
                    {"type": "function_call", "call_id": "c2", "name": "get", "namespace": "wx", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "20"},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
                    {"role": "assistant", "content": "Done."}]}),
                json!({"chat_template_kwargs": gen, "messages": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"role": "assistant", "content": "Checking.", "reasoning": "think", "tool_calls": [
                        {"id": "c1", "function": {"name": "get", "arguments": "{\"a\": 1}"}, "type": "function"},
                        {"id": "c2", "function": {"name": "wx__get", "arguments": "{}"}, "type": "function"}]},
                    {"role": "tool", "content": "20", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "Done.", "reasoning": "only a summary"}]}),
            ),
            (
                "function and namespace tools, built-in ones dropped; an effort",
                json!({"input": "Hi", "reasoning": {"effort": "low"}, "tools": [
                    {"type": "function", "name": "f", "parameters": {"z": 1, "a": 2}, "strict": null},
                    {"type": "web_search"},
                    {"type": "namespace", "name": "wx", "description": "ns", "tools": [
                        {"type": "function", "name": "get", "description": "d", "parameters": null, "strict": true}]}]}),
                json!({"tools": [
                        {"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}},
                        {"type": "function", "function": {"name": "wx__get", "description": "d", "strict": true}}],
                       "chat_template_kwargs": {"add_generation_prompt": true,
                           "reasoning_effort": "low", "enable_thinking": true},
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
            (
                "only built-in tools: an empty list",
                json!({"input": "Hi", "tools": [{"type": "web_search"}]}),
                json!({"tools": [], "chat_template_kwargs": gen,
                       "messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ];
        for (name, body, want) in cases {
            assert_eq!(responses(body), want, "{name}");
        }
    }

    #[test]
    fn responses_bodies_this_process_cannot_render_are_refused() {
        for body in [
            json!({"input": "Hi", "previous_response_id": "resp_1"}),
            json!({"input": "Hi", "prompt": {"id": "p"}}),
            json!({"input": [{"role": "user", "content": "Hi"},
                             {"type": "message", "role": "assistant", "status": "in_progress",
                              "content": [{"type": "output_text", "text": "Par"}]}]}),
            json!({"input": [{"type": "reasoning", "encrypted_content": "xx", "summary": []}]}),
            json!({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]}),
            json!({"input": "Hi", "tools": [{"type": "custom", "name": "f"}]}),
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            json!({"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}),
        ] {
            assert!(
                responses_chat(body.to_string().as_bytes()).is_err(),
                "{body}"
            );
        }
    }

    /// A conversation's next turn converts to a body that starts with the previous one's bytes
    /// up to its last message: the message cache reads it from there.
    #[test]
    fn a_next_turn_converts_to_a_body_sharing_the_previous_ones_bytes() {
        let turn1 = json!({"system": "S", "tools": [{"name": "f", "input_schema": {}}],
                           "messages": [{"role": "user", "content": "one"}]});
        let mut turn2 = turn1.clone();
        turn2["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": "two"}),
            json!({"role": "user", "content": "three"}),
        ]);
        let a = anthropic_chat(turn1.to_string().as_bytes(), &KEEP).unwrap();
        let b = anthropic_chat(turn2.to_string().as_bytes(), &KEEP).unwrap();
        let upto = a.len() - 2; // before `]}`
        assert_eq!(a[..upto], b[..upto]);
    }

    fn model(template: &str) -> (tempfile::TempDir, crate::ModelTokens) {
        let dir = tempfile::tempdir().expect("tempdir");
        crate::fixture::write_dir(dir.path(), template).expect("fixture");
        let t = crate::ModelTokens::from_dir(dir.path()).expect("load");
        (dir, t)
    }

    #[test]
    fn the_rules_are_probed_from_the_template() {
        let (_d, chatml) = model(crate::fixture::CHATML_TOOLS);
        assert!(!chatml.anthropic_rules().merge_inline_system);
        let (_d, llama) = model(crate::fixture::LLAMA3_LIKE);
        assert!(llama.anthropic_rules().merge_inline_system);
        // Neither template reads an effort: "none" renders as every effort does.
        assert_eq!(chatml.anthropic_rules().disabled_thinking_effort, "low");
        let reads = "{%- for m in messages %}{{ m.content }}{% endfor %}\
                     {%- if reasoning_effort == 'none' %}/no_think{% else %}/think{% endif %}";
        let (_d, effort) = model(reads);
        assert_eq!(effort.anthropic_rules().disabled_thinking_effort, "none");
    }

    /// The ids are the chat body's that vLLM makes of the request, cold and as a next turn.
    #[test]
    fn messages_and_responses_tokenize_as_their_chat_bodies() {
        for template in [crate::fixture::CHATML_TOOLS, crate::fixture::QWEN3_LIKE] {
            let (_d, t) = model(template);
            let history = |n: usize| -> Vec<Value> {
                (0..n)
                    .map(|i| match i % 2 {
                        0 => json!({"role": "user", "content": format!("The quick brown fox {i} ").repeat(20)}),
                        _ => json!({"role": "assistant", "content": [
                            {"type": "thinking", "thinking": "reasoning"},
                            {"type": "text", "text": format!("The lazy dog {i}").repeat(20)}]}),
                    })
                    .collect()
            };
            for n in [1, 3, 5] {
                let body = json!({"system": "You are a helpful assistant.",
                                  "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                                  "messages": history(n)});
                let bytes = body.to_string();
                let chat = anthropic_chat(bytes.as_bytes(), &t.anthropic_rules()).unwrap();
                let want = t.chat_ids_uncached(&chat).unwrap();
                let got = t.messages_ids_within(bytes.as_bytes(), usize::MAX).unwrap();
                assert_eq!(got.ids.to_vec(), want, "{n} messages");
                if n > 1 {
                    assert!(got.reused > 0, "turn {n} reuses the previous turn's ids");
                }
            }
            let body = json!({"instructions": "Be brief.", "input": [
                {"role": "user", "content": "What is the weather like today?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "20"}],
                "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
            let bytes = body.to_string();
            let chat = responses_chat(bytes.as_bytes()).unwrap();
            assert_eq!(
                t.responses_ids_within(bytes.as_bytes(), usize::MAX)
                    .unwrap()
                    .ids
                    .to_vec(),
                t.chat_ids_uncached(&chat).unwrap()
            );
        }
        let (_d, harmony) =
            model("{{ '<|channel|>' }}{% for m in messages %}{{ m.content }}{% endfor %}");
        assert!(harmony
            .responses_ids_within(br#"{"input":"Hi"}"#, usize::MAX)
            .is_err());
    }
}
