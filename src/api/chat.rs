//! OpenAI chat completions: `tools`, then each of `messages` by role, with its content, tool
//! calls and name.

use serde_json::value::RawValue;

use super::prompt::{json_digest, PromptHasher};
use super::{content, field, text, tools, Message, Top};

/// `None` when the body has no message list.
pub(super) fn read(top: &Top, h: &mut PromptHasher) -> Option<()> {
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
