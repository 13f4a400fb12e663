//! What the balancer reads from a response as it passes: token usage as the replicas report it
//! (chat and completions: `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens`;
//! Responses: `usage.input_tokens` and `input_tokens_details.cached_tokens`; Anthropic:
//! `input_tokens` counts only uncached input, `cache_read_input_tokens` the cached part), and
//! the id of a stored Responses answer (`id`, or the `response.created` event when streamed).
//!
//! The balancer never waits for this: a streamed response is scanned event by event as it is
//! relayed, a whole JSON response is kept (up to a bound) only to be parsed at its end. Pure.
//!
//! The counts are the replica's word, not trusted: each is at most [`MAX_TOKENS`], a cached
//! count at most the prompt, and what is added up saturates, so that no answer can overflow
//! the token counters and budgets it feeds.

use std::borrow::Cow;

use bytes::Bytes;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::protocol::api::Family;

/// A JSON response larger than this is not parsed for usage.
const MAX_JSON_BODY: usize = 4 * 1024 * 1024;
/// An SSE line longer than this is skipped.
const MAX_SSE_LINE: usize = 1024 * 1024;
/// The most tokens one count of a response is taken for (10^10: a thousand times the longest
/// context of 2026); more reads as this many. A count that is not a whole number from 0 to
/// `u64::MAX` (negative, fractional, `1e19`, larger) is no count at all.
pub const MAX_TOKENS: u64 = 10_000_000_000;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Generated tokens (`completion_tokens`, or `output_tokens`).
    pub completion_tokens: u64,
    /// The replica reported its cached count (vLLM does only with
    /// `--enable-prompt-tokens-details`): `cached_tokens` is its word, not a default 0.
    pub cached_reported: bool,
}

/// Reads a response's usage (and a Responses answer's id) from its body chunks.
#[derive(Debug)]
pub struct UsageReader {
    family: Family,
    sse: bool,
    /// A JSON answer's first chunk, kept without a copy: most answers are one chunk.
    first: Option<Bytes>,
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
    response_id: Option<String>,
}

/// A JSON text's top-level fields, read without building a tree: the wanted ones as raw text,
/// the others skipped. A repeated key keeps its last value, as a `serde_json::Value` would.
struct Fields<'a, const N: usize> {
    names: [&'static str; N],
    found: [Option<&'a RawValue>; N],
}

/// A key, borrowed unless it has escapes.
#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

impl<'de, const N: usize> Visitor<'de> for Fields<'de, N> {
    type Value = [Option<&'de RawValue>; N];

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Self::Value, A::Error> {
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match self.names.iter().position(|n| *n == key) {
                Some(i) => self.found[i] = Some(map.next_value::<&RawValue>()?),
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(self.found)
    }
}

impl<'de, const N: usize> DeserializeSeed<'de> for Fields<'de, N> {
    type Value = [Option<&'de RawValue>; N];

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

/// The fields `names` of the JSON object `json` (None when it is not one, or not JSON).
fn fields<'a, const N: usize>(
    json: &'a [u8],
    names: [&'static str; N],
) -> Option<[Option<&'a RawValue>; N]> {
    let mut d = serde_json::Deserializer::from_slice(json);
    let found = Fields {
        names,
        found: [None; N],
    }
    .deserialize(&mut d)
    .ok()?;
    d.end().ok()?;
    Some(found)
}

/// One field of an object given as raw text.
fn field<'a>(raw: Option<&'a RawValue>, name: &'static str) -> Option<&'a RawValue> {
    let [v] = fields(raw?.get().as_bytes(), [name])?;
    v
}

/// A token count, at most [`MAX_TOKENS`].
fn as_u64(raw: Option<&RawValue>) -> Option<u64> {
    serde_json::from_str::<u64>(raw?.get())
        .ok()
        .map(|n| n.min(MAX_TOKENS))
}

fn is_str(raw: Option<&RawValue>, s: &str) -> bool {
    raw.and_then(|r| serde_json::from_str::<Key>(r.get()).ok())
        .is_some_and(|k| k.0 == s)
}

/// The usage object `u` in the terms of `family`; its cached count at most its prompt.
fn usage_in(family: Family, u: Option<&RawValue>) -> Option<Usage> {
    let u = usage_as_written(family, u)?;
    Some(Usage {
        cached_tokens: u.cached_tokens.min(u.prompt_tokens),
        ..u
    })
}

fn usage_as_written(family: Family, u: Option<&RawValue>) -> Option<Usage> {
    match family {
        Family::Chat | Family::Completions => {
            let [prompt, details, completion] = fields(
                u?.get().as_bytes(),
                [
                    "prompt_tokens",
                    "prompt_tokens_details",
                    "completion_tokens",
                ],
            )?;
            let cached = as_u64(field(details, "cached_tokens"));
            Some(Usage {
                prompt_tokens: as_u64(prompt)?,
                cached_tokens: cached.unwrap_or(0),
                completion_tokens: as_u64(completion).unwrap_or(0),
                cached_reported: cached.is_some(),
            })
        }
        Family::Responses => {
            let [input, details, output] = fields(
                u?.get().as_bytes(),
                ["input_tokens", "input_tokens_details", "output_tokens"],
            )?;
            let cached = as_u64(field(details, "cached_tokens"));
            Some(Usage {
                prompt_tokens: as_u64(input)?,
                cached_tokens: cached.unwrap_or(0),
                completion_tokens: as_u64(output).unwrap_or(0),
                cached_reported: cached.is_some(),
            })
        }
        Family::Messages => {
            let [input, read, created, output] = fields(
                u?.get().as_bytes(),
                [
                    "input_tokens",
                    "cache_read_input_tokens",
                    "cache_creation_input_tokens",
                    "output_tokens",
                ],
            )?;
            let reported = as_u64(read).is_some();
            let (uncached, read) = (as_u64(input)?, as_u64(read).unwrap_or(0));
            Some(Usage {
                cached_reported: reported,
                prompt_tokens: uncached
                    .saturating_add(read)
                    .saturating_add(as_u64(created).unwrap_or(0))
                    .min(MAX_TOKENS),
                cached_tokens: read,
                completion_tokens: as_u64(output).unwrap_or(0),
            })
        }
    }
}

/// What a response object or stream event says: its usage, a Responses answer's id, and the
/// output count of a usage that has no input side (Anthropic's `message_delta`).
struct Read {
    usage: Option<Usage>,
    id: Option<String>,
    output_tokens: Option<u64>,
}

/// Reads `json` (a whole answer or one event) of `family`.
fn read(family: Family, json: &[u8]) -> Option<Read> {
    let [usage, response, message, kind, object, id] = fields(
        json,
        ["usage", "response", "message", "type", "object", "id"],
    )?;
    // Streamed, the usage is in `response.completed`'s response object (Responses), or the
    // input side in `message_start`'s message (Anthropic; `message_delta` carries output
    // tokens only).
    let nested = match family {
        Family::Responses => response,
        Family::Messages => message,
        _ => None,
    };
    let usage_raw = usage.or_else(|| field(nested, "usage"));
    // A Responses answer's id: the object's own, or the one `response.created` announces.
    let id = if family != Family::Responses {
        None
    } else if is_str(kind, "response.created") {
        field(response, "id")
    } else if is_str(object, "response") {
        id
    } else {
        None
    };
    Some(Read {
        usage: usage_in(family, usage_raw),
        id: id.and_then(|r| serde_json::from_str::<String>(r.get()).ok()),
        output_tokens: as_u64(field(usage, "output_tokens")),
    })
}

impl UsageReader {
    /// `sse`: the response is `text/event-stream`; otherwise it is read as one JSON document.
    pub fn new(family: Family, sse: bool) -> Self {
        UsageReader {
            family,
            sse,
            first: None,
            buf: Vec::new(),
            overflow: false,
            found: None,
            response_id: None,
        }
    }

    /// [`UsageReader::feed`], keeping a JSON answer's first chunk without copying it.
    pub fn feed_bytes(&mut self, chunk: &Bytes) {
        if !self.sse && !self.overflow && self.first.is_none() && self.buf.is_empty() {
            self.first = Some(chunk.clone());
        } else {
            self.feed(chunk);
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if !self.sse {
            if let Some(first) = self.first.take() {
                self.buf.extend_from_slice(&first);
            }
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
        if let Some(r) = read(self.family, data) {
            self.found = match (r.usage, self.found) {
                (Some(u), _) => Some(u),
                // Anthropic's `message_delta` carries the final output count alone.
                (None, Some(mut u)) => {
                    u.completion_tokens = r.output_tokens.unwrap_or(u.completion_tokens);
                    Some(u)
                }
                (None, None) => None,
            };
            if wants_id {
                self.response_id = r.id;
            }
        }
    }

    /// The usage found, once the body has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.sse || self.overflow {
            return self.found;
        }
        // `feed` moves the first chunk into `buf` before a second one.
        let body = match self.first.take() {
            Some(first) => first,
            None => Bytes::from(std::mem::take(&mut self.buf)),
        };
        if let Some(r) = read(self.family, &body) {
            self.found = r.usage;
            if self.family == Family::Responses {
                self.response_id = r.id;
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
    use proptest::prelude::*;

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
                    completion_tokens: 3,
                    cached_reported: true
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
                    completion_tokens: 0,
                    cached_reported: true
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
                completion_tokens: 0,
                cached_reported: false
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
                completion_tokens: 5,
                cached_reported: true
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
                completion_tokens: 5,
                cached_reported: true
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
                completion_tokens: 0,
                cached_reported: true
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
                completion_tokens: 7,
                cached_reported: true
            })
        );
    }

    #[test]
    fn read_without_a_tree_as_a_tree_would() {
        let chat = |body: &[u8]| {
            let mut r = UsageReader::new(Family::Chat, false);
            r.feed_bytes(&Bytes::copy_from_slice(body));
            r.finish().map(|u| (u.prompt_tokens, u.cached_tokens))
        };
        // Skipped fields of any shape, an escaped key, the last of a repeated key.
        let body = br#" {"choices":[{"message":{"content":"a \"b\" \u00e9"}}],"us\u0061ge":{"prompt_tokens":1},"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}} "#;
        assert_eq!(chat(body), Some((7, 3)));
        assert_eq!(chat(br#"{"usage":null}"#), None);
        assert_eq!(chat(br#"{"usage":{"prompt_tokens":7.5}}"#), None);
        assert_eq!(chat(br#"{"usage":{"prompt_tokens":-1}}"#), None);
        assert_eq!(
            chat(br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":null}}"#),
            Some((7, 0))
        );
        assert_eq!(
            chat(br#"{"usage":{"prompt_tokens":7}} x"#),
            None,
            "trailing bytes"
        );
        assert_eq!(
            chat(br#"[{"usage":{"prompt_tokens":7}}]"#),
            None,
            "not an object"
        );
        assert_eq!(chat(b""), None);
    }

    #[test]
    fn a_json_answer_fed_as_shared_chunks() {
        let body =
            br#"{"id":"resp_1","object":"response","usage":{"input_tokens":9,"output_tokens":2}}"#;
        for cut in [0, 10, body.len()] {
            let mut r = UsageReader::new(Family::Responses, false);
            r.feed_bytes(&Bytes::copy_from_slice(&body[..cut]));
            r.feed_bytes(&Bytes::copy_from_slice(&body[cut..]));
            assert_eq!(r.finish().map(|u| u.prompt_tokens), Some(9), "cut {cut}");
            assert_eq!(r.response_id(), Some("resp_1"));
        }
    }

    /// The counts are the replica's word: each is clamped to [`MAX_TOKENS`], a cached count
    /// to the prompt, and what is not a whole number in u64 is no count. Unchecked, three
    /// `u64::MAX` Anthropic counts wrapped to a prompt of `u64::MAX - 2` (or panicked).
    #[test]
    fn hostile_usage_numbers_are_clamped_or_refused() {
        let max = MAX_TOKENS;
        let big = u64::MAX;
        let read = |family: Family, body: String| {
            let mut r = UsageReader::new(family, false);
            r.feed(body.as_bytes());
            r.finish()
                .map(|u| (u.prompt_tokens, u.cached_tokens, u.completion_tokens))
        };
        let chat = |prompt: &str, cached: &str, completion: &str| {
            read(
                Family::Chat,
                format!(
                    r#"{{"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
                ),
            )
        };
        type Row<'a> = ((&'a str, &'a str, &'a str), Option<(u64, u64, u64)>);
        let rows: &[Row] = &[
            (("900", "640", "3"), Some((900, 640, 3))),
            (
                (
                    "18446744073709551615",
                    "18446744073709551615",
                    "18446744073709551615",
                ),
                Some((max, max, max)),
            ),
            (("10000000001", "0", "0"), Some((max, 0, 0))),
            (("100", "5000", "0"), Some((100, 100, 0))),
            (("18446744073709551616", "0", "0"), None),
            (("99999999999999999999999999999", "0", "0"), None),
            (("1e19", "0", "0"), None),
            (("1e400", "0", "0"), None),
            (("-1", "0", "0"), None),
            (("NaN", "0", "0"), None),
            (("7.5", "0", "0"), None),
            // A bad optional count reads as none.
            (("100", "-1", "1e19"), Some((100, 0, 0))),
            (("100", "18446744073709551616", "0"), Some((100, 0, 0))),
        ];
        for ((prompt, cached, completion), want) in rows {
            assert_eq!(
                chat(prompt, cached, completion),
                *want,
                "{prompt} {cached} {completion}"
            );
        }
        let messages = |input: u64, read_: u64, created: u64, output: u64| {
            read(
                Family::Messages,
                format!(
                    r#"{{"usage":{{"input_tokens":{input},"cache_read_input_tokens":{read_},"cache_creation_input_tokens":{created},"output_tokens":{output}}}}}"#
                ),
            )
        };
        assert_eq!(messages(big, big, big, big), Some((max, max, max)));
        assert_eq!(messages(max, max, max, 1), Some((max, max, 1)));
        assert_eq!(messages(1, 2, 3, 4), Some((6, 2, 4)));
        let responses = read(
            Family::Responses,
            format!(
                r#"{{"usage":{{"input_tokens":{big},"input_tokens_details":{{"cached_tokens":{big}}},"output_tokens":{big}}}}}"#
            ),
        );
        assert_eq!(responses, Some((max, max, max)));
        // The output count of a `message_delta`, streamed after the input side.
        let mut r = UsageReader::new(Family::Messages, true);
        r.feed(format!("data: {{\"type\":\"message_start\",\"message\":{{\"usage\":{{\"input_tokens\":{big},\"cache_read_input_tokens\":{big}}}}}}}\n\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{big}}}}}\n\n").as_bytes());
        assert_eq!(
            r.finish(),
            Some(Usage {
                prompt_tokens: max,
                cached_tokens: max,
                completion_tokens: max,
                cached_reported: true
            })
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        /// Any counts, any family, JSON or streamed, split anywhere: reading never panics,
        /// and what it gives is within bounds.
        #[test]
        fn any_usage_reads_within_bounds(
            counts in prop::collection::vec(
                prop_oneof![
                    any::<u64>().prop_map(|v| v.to_string()),
                    any::<i64>().prop_map(|v| v.to_string()),
                    any::<f64>().prop_map(|v| v.to_string()),
                    "[-+0-9.eE]{1,30}",
                ],
                6,
            ),
            family in 0..4usize,
            sse in any::<bool>(),
            cut in 0..400usize,
        ) {
            let family = [Family::Chat, Family::Completions, Family::Responses, Family::Messages][family];
            let c = &counts;
            let usage = format!(
                r#"{{"prompt_tokens":{},"completion_tokens":{},"prompt_tokens_details":{{"cached_tokens":{}}},"input_tokens":{},"input_tokens_details":{{"cached_tokens":{}}},"output_tokens":{},"cache_read_input_tokens":{},"cache_creation_input_tokens":{}}}"#,
                c[0], c[1], c[2], c[3], c[4], c[5], c[0], c[2]
            );
            let body = if sse {
                format!("data: {{\"usage\":{usage}}}\n\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{}}}}}\n\n", c[1])
            } else {
                format!("{{\"usage\":{usage}}}")
            };
            let body = body.as_bytes();
            let cut = cut.min(body.len());
            let mut r = UsageReader::new(family, sse);
            r.feed(&body[..cut]);
            r.feed(&body[cut..]);
            if let Some(u) = r.finish() {
                prop_assert!(u.prompt_tokens <= MAX_TOKENS);
                prop_assert!(u.cached_tokens <= u.prompt_tokens);
                prop_assert!(u.completion_tokens <= MAX_TOKENS);
            }
        }
    }
}
