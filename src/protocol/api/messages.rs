//! Anthropic Messages: `system` (a string or text blocks), `tools`, then each of `messages`
//! with its content blocks (`text`, `tool_use`, `tool_result`, others by structure).
//! `cache_control` never changes the prompt.

use super::{text, Reader, Top, MESSAGE};

pub(super) fn read(top: &Top, r: &mut Reader) -> Option<()> {
    let messages = top.messages?.elements()?;
    if messages.is_empty() {
        return None;
    }
    if top.system.is_some() {
        r.part("system");
        r.content(top.system, 0);
    }
    r.tools(top.tools);
    for raw in messages {
        let Some([role, content, ..]) = raw.fields(&MESSAGE) else {
            r.part("item");
            r.digest(raw);
            continue;
        };
        r.part_of("", text(role));
        r.content(content, 0);
    }
    Some(())
}
