//! OpenAI chat completions: `tools`, then each of `messages` by role, with its content, tool
//! calls and name.

use super::{text, Reader, Top, MESSAGE};

/// `None` when the body has no message list.
pub(super) fn read(top: &Top, r: &mut Reader) -> Option<()> {
    let messages = top.messages?.elements()?;
    if messages.is_empty() {
        return None;
    }
    r.tools(top.tools);
    for raw in messages {
        let Some([role, content, name, tool_calls]) = raw.fields(&MESSAGE) else {
            r.part("item");
            r.digest(raw);
            continue;
        };
        r.part_of("", text(role));
        if let Some(name) = text(name) {
            r.text(Some(name));
        }
        r.content(content, 0);
        if let Some(calls) = tool_calls {
            r.digest(calls);
        }
    }
    Some(())
}
