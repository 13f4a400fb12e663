//! Endpoint families: how each API's request body becomes a prompt (see [`prompt`]).
//!
//! One module per family (`chat`, `responses`, `messages`, `completions`); each reads only the
//! fields its API defines into the shared prompt model. Pure and total: any bytes give an
//! answer and never a panic; what cannot be read is `Shape::Other` and spreads, and the
//! replica answers a bad request itself.

mod chat;
mod completions;
mod messages;
pub mod prompt;
mod responses;

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::shape::Shape;
use prompt::{json_digest, PromptHasher};

/// How many bytes of an unreadable body name its "prefix" for the `affinity` policy.
const OTHER_KEY_BYTES: usize = 4096;

/// The API a request speaks, from its method and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `POST /v1/chat/completions`, and any other path (read as chat, as before there were
    /// families).
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages` (Anthropic).
    Messages,
}

impl Family {
    pub fn of(path: &str) -> Family {
        match path.trim_end_matches('/') {
            "/v1/completions" => Family::Completions,
            "/v1/responses" => Family::Responses,
            "/v1/messages" => Family::Messages,
            _ => Family::Chat,
        }
    }

    /// Whether inferlb's own answers take Anthropic's error shape.
    pub fn is_anthropic(self) -> bool {
        self == Family::Messages
    }
}

/// The stored response a path names: `/v1/responses/{id}` and `/v1/responses/{id}/cancel`.
pub fn stored_response_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// What the balancer learns from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    pub shape: Shape,
    pub model: Option<String>,
    pub stream: bool,
    /// Responses: the stored response this request continues.
    pub previous_response_id: Option<String>,
}

/// The top-level fields any family reads, each kept raw until its family reads it, so one of
/// the wrong type spoils only itself.
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

/// A JSON string, borrowed from the body unless it had escapes.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// Reads one raw field as `T`; `None` when absent or of another type.
fn field<'a, T: Deserialize<'a>>(raw: Option<&'a RawValue>) -> Option<T> {
    serde_json::from_str(raw?.get()).ok()
}

fn text<'a>(raw: Option<&'a RawValue>) -> Option<Cow<'a, str>> {
    field::<Text>(raw).map(|t| t.0)
}

/// Classifies a request body of `family`. `body` may be anything, including invalid UTF-8.
pub fn classify(family: Family, body: &[u8]) -> RequestInfo {
    let other = || Shape::Other {
        key: xxhash_rust::xxh3::xxh3_64(&body[..body.len().min(OTHER_KEY_BYTES)]),
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
        Family::Chat => chat::read(&top, &mut h),
        Family::Completions => completions::read(&top, &mut h),
        Family::Responses => responses::read(&top, &mut h),
        Family::Messages => messages::read(&top, &mut h),
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

/// A message of chat or Anthropic Messages: each family reads the fields its API defines
/// (Anthropic has no `name` or `tool_calls`).
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

/// A content block of any family: the fields that carry prompt text.
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    /// Anthropic `tool_use`.
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    /// Anthropic `tool_result`.
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// Feeds message content: a string, or a list of blocks (text blocks as text, tool uses as
/// name and input, tool results by their own content, anything else by its structure).
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

/// Feeds tool definitions as one part, by structure.
fn tools(raw: Option<&RawValue>, h: &mut PromptHasher) {
    if let Some(raw) = raw.filter(|r| r.get() != "[]") {
        h.begin_part("tools");
        h.digest(json_digest(raw));
    }
}

#[cfg(test)]
mod tests;
