//! OpenAI Responses: `instructions` (as the system part), `tools`, then `input`: a string (one
//! user message) or a list of items — messages by role, `function_call` (name and arguments),
//! `function_call_output`, `reasoning` (its summary), and unknown item types by structure.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::prompt::{json_digest, PromptHasher};
use super::{content, field, text, tools, Text, Top};

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

/// `None` when `input` is absent or neither a string nor a list.
pub(super) fn read(top: &Top, h: &mut PromptHasher) -> Option<()> {
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
            // A message, with or without `"type": "message"`.
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
