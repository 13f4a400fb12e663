//! Anthropic Messages: `system` (a string or text blocks), `tools`, then each of `messages`
//! with its content blocks (`text`, `tool_use`, `tool_result`, others by structure).
//! `cache_control` never changes the prompt.

use serde_json::value::RawValue;

use super::prompt::{json_digest, PromptHasher};
use super::{content, field, text, tools, Message, Top};

pub(super) fn read(top: &Top, h: &mut PromptHasher) -> Option<()> {
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
