//! A chat or completions stream's usage, asked for on the client's behalf: inferlb learns
//! from every answer's usage (the replica's token count, its cached tokens), but a stream
//! carries usage only when the request asks (`stream_options.include_usage`). So a streamed
//! request that did not ask is sent asking, and the usage event is taken out of its answer
//! again: the client gets the stream it asked for. Pure.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::protocol::members::Members;
use crate::protocol::sse::{split_events, Events};

#[derive(Deserialize)]
struct Streaming<'a> {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, borrow)]
    stream_options: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Options {
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// `body` asking for its stream's usage, when it streams without asking (a chat or
/// completions request); `None` when it does not stream, already asks, or is not an object
/// whose `stream_options` is one.
pub fn asking_for_usage(body: &[u8]) -> Option<Bytes> {
    let s: Streaming = serde_json::from_slice(body).ok()?;
    if s.stream != Some(true) {
        return None;
    }
    let options = match s.stream_options {
        None => "{}".to_owned(),
        Some(raw) if raw.get() == "null" => "{}".to_owned(),
        Some(raw) => {
            let o: Options = serde_json::from_str(raw.get()).ok()?;
            // Asking would put usage on every chunk of a continuous-stats stream.
            if o.include_usage == Some(true) || o.continuous_usage_stats == Some(true) {
                return None;
            }
            raw.get().to_owned()
        }
    };
    let mut opts = Members::parse(options.as_bytes()).ok()?;
    opts.set("include_usage", "true");
    let opts = RawValue::from_string(String::from_utf8(opts.bytes().to_vec()).ok()?).ok()?;
    let mut m = Members::parse(body).ok()?;
    m.set_owned("stream_options", opts);
    Some(m.bytes())
}

/// A chat or completions stream without the usage event its client did not ask for: the
/// event whose `choices` is empty and whose `usage` is an object. Every other event passes
/// byte for byte, whole, as soon as its blank line comes.
#[derive(Debug, Default)]
pub struct UsageStripper {
    events: Events,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default)]
    choices: Option<Vec<serde::de::IgnoredAny>>,
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
}

impl UsageStripper {
    /// The whole events `chunk` completes, the usage event left out.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        let Some(whole) = self.events.feed(chunk) else {
            return Bytes::new();
        };
        if memchr::memmem::find(&whole, b"\"usage\"").is_none() {
            return Bytes::from(whole);
        }
        let mut out = Vec::with_capacity(whole.len());
        for event in split_events(&whole).filter(|e| !is_usage_event(e)) {
            out.extend_from_slice(event);
        }
        Bytes::from(out)
    }

    /// What is left once the stream ended, as it came.
    pub fn finish(&mut self) -> Bytes {
        self.events.finish()
    }

    pub fn pending_len(&self) -> usize {
        self.events.pending_len()
    }
}

fn is_usage_event(event: &[u8]) -> bool {
    let data = event
        .split(|&b| b == b'\n')
        .find_map(|line| line.strip_prefix(b"data:"));
    let Some(data) = data else {
        return false;
    };
    let data = data.trim_ascii();
    match serde_json::from_slice::<Chunk>(data) {
        Ok(c) => {
            c.choices.is_some_and(|c| c.is_empty())
                && c.usage.is_some_and(|u| u.get().starts_with('{'))
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn value(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("JSON")
    }

    /// body → what is sent (None: as it came)
    #[test]
    fn a_stream_that_does_not_ask_is_sent_asking() {
        let rows: &[(Value, Option<Value>)] = &[
            (
                json!({"model": "m", "stream": true}),
                Some(
                    json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}}),
                ),
            ),
            (
                json!({"stream": true, "stream_options": {"continuous_usage_stats": false}}),
                Some(
                    json!({"stream": true, "stream_options": {"continuous_usage_stats": false, "include_usage": true}}),
                ),
            ),
            (
                json!({"stream": true, "stream_options": {"include_usage": false}}),
                Some(json!({"stream": true, "stream_options": {"include_usage": true}})),
            ),
            (
                json!({"stream": true, "stream_options": null}),
                Some(json!({"stream": true, "stream_options": {"include_usage": true}})),
            ),
            (
                json!({"stream": true, "stream_options": {"include_usage": true}}),
                None,
            ),
            (json!({"stream": false}), None),
            (json!({"model": "m"}), None),
            (json!({"stream": true, "stream_options": "odd"}), None),
        ];
        for (body, want) in rows {
            let got = asking_for_usage(body.to_string().as_bytes()).map(|b| value(&b));
            assert_eq!(&got, want, "{body}");
        }
        assert_eq!(asking_for_usage(b"not json"), None);
    }

    #[test]
    fn the_usage_event_goes_and_the_rest_passes_byte_for_byte() {
        let content = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let usage = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";
        // A chunk whose usage is null (continuous stats off) is not the usage event.
        let null_usage = "data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n";
        let done = "data: [DONE]\n\n";
        let stream = format!("{content}{null_usage}{usage}{done}");
        let want = format!("{content}{null_usage}{done}");
        for cut in [
            0,
            10,
            content.len() + 3,
            content.len() + null_usage.len() + 40,
            stream.len(),
        ] {
            let mut s = UsageStripper::default();
            let mut out = s.feed(&stream.as_bytes()[..cut]).to_vec();
            out.extend_from_slice(&s.feed(&stream.as_bytes()[cut..]));
            out.extend_from_slice(&s.finish());
            assert_eq!(String::from_utf8(out).expect("utf8"), want, "cut {cut}");
        }
    }
}
