//! Endpoint families: how each API's request body becomes a prompt (see [`prompt`]).
//!
//! One module per family (`chat`, `responses`, `messages`, `completions`); each reads only the
//! fields its API defines into the shared prompt model, from the body's bytes in one checked
//! pass and one read (`json`, `digest`; `oracle` keeps the tree-based reader they are tested
//! against). Pure and total: any bytes give an
//! answer and never a panic; what cannot be read is `Shape::Other` and spreads, and the
//! replica answers a bad request itself.

mod chat;
mod completions;
mod digest;
mod json;
mod messages;
pub mod prompt;
mod responses;
pub mod shape;
pub mod strip;

use crate::protocol::api::shape::Shape;
use digest::Digester;
use json::{Raw, Str, Strings};
use prompt::PromptHasher;

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
struct Top<'a> {
    model: Option<Raw<'a>>,
    stream: Option<Raw<'a>>,
    messages: Option<Raw<'a>>,
    tools: Option<Raw<'a>>,
    system: Option<Raw<'a>>,
    instructions: Option<Raw<'a>>,
    input: Option<Raw<'a>>,
    prompt: Option<Raw<'a>>,
    previous_response_id: Option<Raw<'a>>,
}

const TOP: [&str; 9] = [
    "model",
    "stream",
    "messages",
    "tools",
    "system",
    "instructions",
    "input",
    "prompt",
    "previous_response_id",
];

impl<'a> Top<'a> {
    /// The fields of `body`, whose check gave `spans` and `strings`.
    fn new(body: &'a [u8], spans: [Option<json::Span>; 9], strings: &'a Strings) -> Top<'a> {
        let [model, stream, messages, tools, system, instructions, input, prompt, previous_response_id] =
            spans.map(|s| s.map(|s| Raw::new(body, s, strings)));
        Top {
            model,
            stream,
            messages,
            tools,
            system,
            instructions,
            input,
            prompt,
            previous_response_id,
        }
    }
}

fn text(raw: Option<Raw>) -> Option<Str> {
    raw?.string()
}

/// Classifies a request body of `family`. `body` may be anything, including invalid UTF-8.
///
/// One check of the body, then one read of the fields the family needs, fed straight into
/// the hasher: no tree and no allocation per message (see [`json`]).
pub fn classify(family: Family, body: &[u8]) -> RequestInfo {
    let other = || Shape::Other {
        key: xxhash_rust::xxh3::xxh3_64(&body[..body.len().min(OTHER_KEY_BYTES)]),
    };
    let Ok((spans, strings)) = json::top_fields(body, &TOP) else {
        return RequestInfo {
            shape: other(),
            model: None,
            stream: false,
            previous_response_id: None,
        };
    };
    let top = Top::new(body, spans, &strings);
    let model = text(top.model).map(Str::owned);
    let mut r = Reader {
        h: PromptHasher::new(model.as_deref().unwrap_or("")),
        digests: Digester::default(),
    };
    let read = match family {
        Family::Chat => chat::read(&top, &mut r),
        Family::Completions => completions::read(&top, &mut r),
        Family::Responses => responses::read(&top, &mut r),
        Family::Messages => messages::read(&top, &mut r),
    };
    let links = r.h.finish();
    let shape = match read {
        Some(()) if !links.is_empty() => Shape::Prompt { links },
        _ => other(),
    };
    RequestInfo {
        shape,
        model,
        stream: top.stream.is_some_and(|s| s.text == b"true"),
        previous_response_id: match family {
            Family::Responses => text(top.previous_response_id).map(Str::owned),
            _ => None,
        },
    }
}

/// The fields of a message of chat or Anthropic Messages: each family reads the ones its API
/// defines (Anthropic has no `name` or `tool_calls`), but a message repeating any is unread.
const MESSAGE: [&str; 4] = ["role", "content", "name", "tool_calls"];

/// The fields of a content block of any family that carry prompt text: `text`; Anthropic's
/// `tool_use` (`name`, `input`) and `tool_result` (`content`).
const BLOCK: [&str; 5] = ["type", "text", "name", "input", "content"];

/// How deep `tool_result` blocks are read inside each other; deeper ones are digested whole.
const MAX_NESTED_RESULTS: usize = 32;

/// A prompt being read: the hasher, and the digests' reusable scratch.
struct Reader {
    h: PromptHasher,
    digests: Digester,
}

impl Reader {
    fn part(&mut self, kind: &str) {
        self.h.begin_part(kind);
    }

    /// A part whose kind is `prefix` and a string (a role, an item type); `""` if none.
    fn part_of(&mut self, prefix: &str, kind: Option<Str>) {
        self.h.start_part();
        self.h.extend(prefix.as_bytes());
        if let Some(k) = kind {
            k.pieces(|p| self.h.extend(p));
        }
        self.h.end_kind();
    }

    /// A text fragment: the string, or `""` if none.
    fn text(&mut self, s: Option<Str>) {
        self.h.begin_fragment();
        if let Some(s) = s {
            s.pieces(|p| self.h.extend(p));
        }
    }

    fn digest(&mut self, raw: Raw) {
        let d = self.digests.digest(raw);
        self.h.digest(d);
    }

    /// Feeds message content: a string, or a list of blocks (text blocks as text, tool uses
    /// as name and input, tool results by their own content, anything else by its
    /// structure).
    fn content(&mut self, raw: Option<Raw>, nested: usize) {
        let Some(raw) = raw else { return };
        if let Some(t) = raw.string() {
            return self.text(Some(t));
        }
        let Some(blocks) = raw.elements() else {
            return self.digest(raw);
        };
        for b in blocks {
            let Some([kind, text_, name, input, content]) = b.fields(&BLOCK) else {
                self.digest(b);
                continue;
            };
            let kind = text(kind);
            let is = |k: &str| kind.is_some_and(|s| s.is(k));
            match text(text_) {
                Some(t) => self.text(Some(t)),
                None if is("tool_use") => {
                    self.text(text(name));
                    if let Some(input) = input {
                        self.digest(input);
                    }
                }
                None if is("tool_result") && nested < MAX_NESTED_RESULTS => {
                    self.content(content, nested + 1)
                }
                None => self.digest(b),
            }
        }
    }

    /// Feeds tool definitions as one part, by structure.
    fn tools(&mut self, raw: Option<Raw>) {
        if let Some(raw) = raw.filter(|r| r.text != b"[]") {
            self.part("tools");
            self.digest(raw);
        }
    }
}

#[cfg(test)]
mod oracle;
#[cfg(test)]
mod tests;
