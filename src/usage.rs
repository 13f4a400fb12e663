//! Token usage as the replicas report it (`usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens`), read from responses as they pass through.
//!
//! The balancer never waits for this: a streamed response is scanned event by event as it is
//! relayed, a whole JSON response is kept (up to a bound) only to be parsed at its end. Pure.

use serde_json::Value;

/// A JSON response larger than this is not parsed for usage.
const MAX_JSON_BODY: usize = 4 * 1024 * 1024;
/// An SSE line longer than this is skipped.
const MAX_SSE_LINE: usize = 1024 * 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Reads a response's usage from its body chunks.
#[derive(Debug, Default)]
pub struct UsageReader {
    sse: bool,
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
}

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage")?;
    Some(Usage {
        prompt_tokens: u.get("prompt_tokens")?.as_u64()?,
        cached_tokens: u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}

impl UsageReader {
    /// `sse`: the response is `text/event-stream`; otherwise it is read as one JSON document.
    pub fn new(sse: bool) -> Self {
        UsageReader {
            sse,
            ..Default::default()
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
                // Only the event that carries usage is parsed, not every token.
                if data.windows(7).any(|w| w == b"\"usage\"") {
                    if let Ok(v) = serde_json::from_slice::<Value>(data.trim_ascii()) {
                        self.found = usage_of(&v).or(self.found);
                    }
                }
            }
        }
    }

    /// The usage found, once the body has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if !self.sse && !self.overflow && !self.buf.is_empty() {
            let body = std::mem::take(&mut self.buf);
            if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                self.found = usage_of(&v);
            }
        }
        self.found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_response_split_anywhere() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":900,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":640}}}"#;
        for cut in [0, 1, 17, body.len() - 1, body.len()] {
            let mut r = UsageReader::new(false);
            r.feed(&body[..cut]);
            r.feed(&body[cut..]);
            assert_eq!(
                r.finish(),
                Some(Usage {
                    prompt_tokens: 900,
                    cached_tokens: 640
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
            let mut r = UsageReader::new(true);
            r.feed(&stream[..cut]);
            r.feed(&stream[cut..]);
            assert_eq!(
                r.finish(),
                Some(Usage {
                    prompt_tokens: 12,
                    cached_tokens: 8
                }),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn no_usage_or_garbage_is_none() {
        let mut r = UsageReader::new(true);
        r.feed(b"data: {\"usage\": \"nope\"}\n\ndata: [DONE]\n\n");
        assert_eq!(r.finish(), None);
        let mut r = UsageReader::new(false);
        r.feed(b"\xff not json");
        assert_eq!(r.finish(), None);
        let mut r = UsageReader::new(false);
        r.feed(br#"{"usage":{"prompt_tokens":5}}"#);
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: 5,
                cached_tokens: 0
            })
        );
    }
}
