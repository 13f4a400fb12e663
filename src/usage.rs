//! What the balancer reads from a response as it passes: token usage as the replicas report it
//! (chat and completions: `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens`;
//! Responses: `usage.input_tokens` and `input_tokens_details.cached_tokens`; Anthropic:
//! `input_tokens` counts only uncached input, `cache_read_input_tokens` the cached part), and
//! the id of a stored Responses answer (`id`, or the `response.created` event when streamed).
//!
//! The balancer never waits for this: a streamed response is scanned event by event as it is
//! relayed, a whole JSON response is kept (up to a bound) only to be parsed at its end. Pure.

use serde_json::Value;

use crate::api::Family;

/// A JSON response larger than this is not parsed for usage.
const MAX_JSON_BODY: usize = 4 * 1024 * 1024;
/// An SSE line longer than this is skipped.
const MAX_SSE_LINE: usize = 1024 * 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Generated tokens (`completion_tokens`, or `output_tokens`).
    pub completion_tokens: u64,
}

/// Reads a response's usage (and a Responses answer's id) from its body chunks.
#[derive(Debug)]
pub struct UsageReader {
    family: Family,
    sse: bool,
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
    response_id: Option<String>,
}

fn u64_at(v: &Value, path: &[&str]) -> Option<u64> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_u64()
}

/// The usage in a response object or stream event of `family`.
fn usage_of(family: Family, v: &Value) -> Option<Usage> {
    match family {
        Family::Chat | Family::Completions => {
            let u = v.get("usage")?;
            Some(Usage {
                prompt_tokens: u64_at(u, &["prompt_tokens"])?,
                cached_tokens: u64_at(u, &["prompt_tokens_details", "cached_tokens"]).unwrap_or(0),
                completion_tokens: u64_at(u, &["completion_tokens"]).unwrap_or(0),
            })
        }
        Family::Responses => {
            // Streamed, the usage is in `response.completed`'s response object.
            let u = v.get("usage").or_else(|| v.get("response")?.get("usage"))?;
            Some(Usage {
                prompt_tokens: u64_at(u, &["input_tokens"])?,
                cached_tokens: u64_at(u, &["input_tokens_details", "cached_tokens"]).unwrap_or(0),
                completion_tokens: u64_at(u, &["output_tokens"]).unwrap_or(0),
            })
        }
        Family::Messages => {
            // Streamed, the input side is in `message_start`'s message; `message_delta` carries
            // output tokens only.
            let u = v.get("usage").or_else(|| v.get("message")?.get("usage"))?;
            let uncached = u64_at(u, &["input_tokens"])?;
            let read = u64_at(u, &["cache_read_input_tokens"]).unwrap_or(0);
            let created = u64_at(u, &["cache_creation_input_tokens"]).unwrap_or(0);
            Some(Usage {
                prompt_tokens: uncached + read + created,
                cached_tokens: read,
                completion_tokens: u64_at(u, &["output_tokens"]).unwrap_or(0),
            })
        }
    }
}

/// A Responses answer's id: the object's own, or the one `response.created` announces.
fn response_id_of(v: &Value) -> Option<String> {
    let object = match v.get("type").and_then(Value::as_str) {
        Some("response.created") => v.get("response")?,
        _ if v.get("object").and_then(Value::as_str) == Some("response") => v,
        _ => return None,
    };
    Some(object.get("id")?.as_str()?.to_owned())
}

impl UsageReader {
    /// `sse`: the response is `text/event-stream`; otherwise it is read as one JSON document.
    pub fn new(family: Family, sse: bool) -> Self {
        UsageReader {
            family,
            sse,
            buf: Vec::new(),
            overflow: false,
            found: None,
            response_id: None,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if !self.sse {
            if self.buf.len() + chunk.len() > MAX_JSON_BODY {
                self.overflow = true;
                self.buf = Vec::new();
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        for piece in chunk.split_inclusive(|b| *b == b'\n') {
            self.buf.extend_from_slice(piece);
            if !self.buf.ends_with(b"\n") {
                if self.buf.len() > MAX_SSE_LINE {
                    self.buf.clear();
                }
                continue;
            }
            let line = std::mem::take(&mut self.buf);
            if let Some(data) = line.strip_prefix(b"data:") {
                self.event(data.trim_ascii());
            }
        }
    }

    /// One SSE data line: only the events that carry usage or an id are parsed, not every token.
    fn event(&mut self, data: &[u8]) {
        let has = |needle: &[u8]| data.windows(needle.len()).any(|w| w == needle);
        let wants_id = self.family == Family::Responses && self.response_id.is_none();
        let wanted = has(b"\"usage\"") || (wants_id && has(b"response.created"));
        if !wanted {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<Value>(data) {
            self.found = match (usage_of(self.family, &v), self.found) {
                (Some(u), _) => Some(u),
                // Anthropic's `message_delta` carries the final output count alone.
                (None, Some(mut u)) => {
                    let out = v.get("usage").and_then(|u| u64_at(u, &["output_tokens"]));
                    u.completion_tokens = out.unwrap_or(u.completion_tokens);
                    Some(u)
                }
                (None, None) => None,
            };
            if wants_id {
                self.response_id = response_id_of(&v);
            }
        }
    }

    /// The usage found, once the body has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if !self.sse && !self.overflow && !self.buf.is_empty() {
            let body = std::mem::take(&mut self.buf);
            if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                self.found = usage_of(self.family, &v);
                if self.family == Family::Responses {
                    self.response_id = response_id_of(&v);
                }
            }
        }
        self.found
    }

    /// The stored response's id, as soon as it was seen (a stream announces it first).
    pub fn response_id(&self) -> Option<&str> {
        self.response_id.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_response_split_anywhere() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":900,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":640}}}"#;
        for cut in [0, 1, 17, body.len() - 1, body.len()] {
            let mut r = UsageReader::new(Family::Chat, false);
            r.feed(&body[..cut]);
            r.feed(&body[cut..]);
            assert_eq!(
                r.finish(),
                Some(Usage {
                    prompt_tokens: 900,
                    cached_tokens: 640,
                    completion_tokens: 3
                })
            );
        }
    }

    #[test]
    fn the_usage_event_of_a_stream_split_across_chunks() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n\
data: [DONE]\n\n";
        for cut in [5, 60, 100, 130] {
            let mut r = UsageReader::new(Family::Chat, true);
            r.feed(&stream[..cut]);
            r.feed(&stream[cut..]);
            assert_eq!(
                r.finish(),
                Some(Usage {
                    prompt_tokens: 12,
                    cached_tokens: 8,
                    completion_tokens: 0
                }),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn no_usage_or_garbage_is_none() {
        let mut r = UsageReader::new(Family::Chat, true);
        r.feed(b"data: {\"usage\": \"nope\"}\n\ndata: [DONE]\n\n");
        assert_eq!(r.finish(), None);
        let mut r = UsageReader::new(Family::Chat, false);
        r.feed(b"\xff not json");
        assert_eq!(r.finish(), None);
        let mut r = UsageReader::new(Family::Chat, false);
        r.feed(br#"{"usage":{"prompt_tokens":5}}"#);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 5,
                cached_tokens: 0,
                completion_tokens: 0
            })
        );
    }

    #[test]
    fn responses_and_anthropic_usage_in_their_own_shapes() {
        let mut r = UsageReader::new(Family::Responses, false);
        r.feed(br#"{"id":"resp_9","object":"response","usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":64},"output_tokens":5}}"#);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: 64,
                completion_tokens: 5
            })
        );
        assert_eq!(r.response_id(), Some("resp_9"));
        let mut r = UsageReader::new(Family::Messages, false);
        r.feed(br#"{"id":"msg_1","type":"message","usage":{"input_tokens":36,"cache_read_input_tokens":64,"cache_creation_input_tokens":0,"output_tokens":5}}"#);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: 64,
                completion_tokens: 5
            })
        );
        assert_eq!(r.response_id(), None, "only Responses answers are stored");
    }

    #[test]
    fn streamed_responses_and_anthropic_usage_and_the_id_come_first() {
        let stream = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_7\",\"object\":\"response\",\"status\":\"in_progress\"}}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n\
event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_7\",\"usage\":{\"input_tokens\":50,\"input_tokens_details\":{\"cached_tokens\":32}}}}\n\n";
        let mut r = UsageReader::new(Family::Responses, true);
        r.feed(&stream[..140]);
        assert_eq!(
            r.response_id(),
            Some("resp_7"),
            "known before the stream ends"
        );
        r.feed(&stream[140..]);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 50,
                cached_tokens: 32,
                completion_tokens: 0
            })
        );
        let stream = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":90,\"output_tokens\":1}}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let mut r = UsageReader::new(Family::Messages, true);
        r.feed(stream);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: 90,
                completion_tokens: 7
            })
        );
    }
}
