//! OpenAI Responses: `instructions` (as the system part), `tools`, then `input`: a string (one
//! user message) or a list of items — messages by role, `function_call` (name and arguments),
//! `function_call_output`, `reasoning` (its summary), and unknown item types by structure.

use super::{text, Reader, Top};

const ITEM: [&str; 7] = [
    "type",
    "role",
    "content",
    "name",
    "arguments",
    "output",
    "summary",
];

/// `None` when `input` is absent or neither a string nor a list.
pub(super) fn read(top: &Top, r: &mut Reader) -> Option<()> {
    let input = top.input?;
    if let Some(instructions) = text(top.instructions) {
        r.part("system");
        r.text(Some(instructions));
    }
    r.tools(top.tools);
    if let Some(t) = input.string() {
        r.part("user");
        r.text(Some(t));
        return Some(());
    }
    for raw in input.elements()? {
        let Some([kind, role, content, name, arguments, output, summary]) = raw.fields(&ITEM)
        else {
            r.part("item");
            r.digest(raw);
            continue;
        };
        let kind = text(kind);
        let is = |k: &str| kind.is_some_and(|s| s.is(k));
        match text(role) {
            // A message, with or without `"type": "message"`.
            Some(role) if kind.is_none() || is("message") => {
                r.part_of("", Some(role));
                r.content(content, 0);
            }
            _ if is("function_call") => {
                r.part("function_call");
                r.text(text(name));
                r.text(text(arguments));
            }
            _ if is("function_call_output") => {
                r.part("function_call_output");
                r.content(output, 0);
            }
            _ if is("reasoning") => {
                r.part("reasoning");
                r.content(summary, 0);
            }
            _ => {
                r.part_of("item:", kind);
                r.digest(raw);
            }
        }
    }
    Some(())
}
