//! A Responses stream given back the client's fields as it passes, event by event.

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{restore, Sent};
use crate::protocol::members::Members;
use crate::protocol::sse::{split_events, Events};

/// A Responses stream as it passes: each event whose `response` member is the response object
/// (`response.created`, `.in_progress`, `.completed`, ...) gets the client's fields back; any
/// other event passes byte for byte. Events are passed whole, once their blank line came.
#[derive(Debug)]
pub struct EventRewriter {
    sent: Sent,
    events: Events,
    /// The final response object (`response.completed` or `.incomplete`), as rewritten.
    last: Option<Bytes>,
}

/// The events of a stream that end it with a response worth keeping.
const FINAL: [&str; 2] = ["response.completed", "response.incomplete"];

impl EventRewriter {
    pub fn new(sent: Sent) -> EventRewriter {
        EventRewriter {
            sent,
            events: Events::default(),
            last: None,
        }
    }

    /// The whole events `chunk` completes, rewritten; the rest waits for its end.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        let Some(whole) = self.events.feed(chunk) else {
            return Bytes::new();
        };
        let mut out = Vec::with_capacity(whole.len() + 64);
        for event in split_events(&whole) {
            self.event(event, &mut out);
        }
        Bytes::from(out)
    }

    /// What is left once the stream ended (an event without its blank line), as it came.
    pub fn finish(&mut self) -> Bytes {
        self.events.finish()
    }

    /// The final response object seen, once.
    pub fn take_final(&mut self) -> Option<Bytes> {
        self.last.take()
    }

    /// Bytes of an event not yet whole.
    pub fn pending_len(&self) -> usize {
        self.events.pending_len()
    }

    /// Whether the final response object has been seen (and not taken).
    pub fn has_final(&self) -> bool {
        self.last.is_some()
    }

    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let rewritten = self.rewrite(event);
        out.extend_from_slice(rewritten.as_deref().unwrap_or(event));
    }

    fn rewrite(&mut self, event: &[u8]) -> Option<Vec<u8>> {
        memchr::memmem::find(event, b"\"response\":")?;
        let mut out = Vec::with_capacity(event.len() + 64);
        let mut changed = false;
        for line in event.split_inclusive(|&b| b == b'\n') {
            let Some(data) = line.strip_prefix(b"data:") else {
                out.extend_from_slice(line);
                continue;
            };
            let eol = line.len() - line.trim_ascii_end().len();
            let json = data[..data.len() - eol].trim_ascii();
            match self.data(json) {
                Some(new) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&new);
                    out.extend_from_slice(&line[line.len() - eol..]);
                    changed = true;
                }
                None => out.extend_from_slice(line),
            }
        }
        changed.then_some(out)
    }

    fn data(&mut self, json: &[u8]) -> Option<Bytes> {
        let mut m = Members::parse(json).ok()?;
        let response = m.get("response").filter(|r| r.get().starts_with('{'))?;
        let restored = restore(response.get().as_bytes(), &self.sent)?;
        let kind: Option<String> = m
            .get("type")
            .and_then(|t| serde_json::from_str(t.get()).ok());
        if kind.as_deref().is_some_and(|k| FINAL.contains(&k)) {
            self.last = Some(restored.clone());
        }
        let text = String::from_utf8(restored.to_vec()).ok()?;
        m.set_owned("response", RawValue::from_string(text).ok()?);
        Some(m.bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn value(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("JSON")
    }

    #[test]
    fn a_stream_is_rewritten_event_by_event_wherever_it_is_cut() {
        let stream = concat!(
            "event: response.created\n",
            "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\",\"store\":false,\"previous_response_id\":null}}\n\n",
            "event: response.output_text.delta\n",
            "data: {\"type\":\"response.output_text.delta\",\"delta\":\"say \\\"response\\\": x\"}\n\n",
            "event: response.completed\r\n",
            "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_2\",\"status\":\"completed\",\"store\":false,\"output\":[]}}\r\n\r\n",
        )
        .as_bytes();
        let sent = Sent {
            store: true,
            previous: Some("resp_1".into()),
        };
        let mut whole = None;
        for cut in [0, 1, 30, 150, 200, stream.len() - 1, stream.len()] {
            let mut r = EventRewriter::new(sent.clone());
            let mut out = r.feed(&stream[..cut]).to_vec();
            out.extend_from_slice(&r.feed(&stream[cut..]));
            out.extend_from_slice(&r.finish());
            let last = r.take_final().expect("the final object");
            assert_eq!(value(&last)["previous_response_id"], json!("resp_1"));
            assert_eq!(whole.get_or_insert(out.clone()), &out, "cut {cut}");
        }
        let out = String::from_utf8(whole.expect("out")).expect("UTF-8");
        assert_eq!(out.matches("\"store\":true").count(), 2, "{out}");
        assert!(!out.contains("\"store\":false"));
        assert!(out.contains("\"delta\":\"say \\\"response\\\": x\"}\n\n"));
        assert!(out.ends_with("}\r\n\r\n"), "line ends kept: {out}");
    }
}
