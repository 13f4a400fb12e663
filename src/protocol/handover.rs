//! Prefill/decode handover, as bodies: what the prefill leg is sent, what the decode leg is
//! sent, what is read from the prefill's answer, and where a decode stream's first token is.
//! Pure: bytes in, bytes out.
//!
//! - vLLM (NixlConnector): the prefill leg asks for one token, not streamed, with
//!   `kv_transfer_params.do_remote_decode`; its answer's `kv_transfer_params` go into the
//!   client's own request, untouched, for the decode leg. inferlb reads none of their fields.
//! - SGLang (bootstrap): both legs get `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::protocol::api::Family;
use crate::protocol::members::Members;

/// Why a body could not be made into a handover leg: the request is served whole instead.
#[derive(Debug, PartialEq, Eq)]
pub struct NotHandedOver(pub &'static str);

/// The vLLM prefill leg of `body`: one token, not streamed, one choice, `kv_transfer_params`
/// asking the replica to keep the prompt's KV for a remote decode. A Responses prefill is not
/// stored (the decode leg's answer is the one the client gets).
pub fn vllm_prefill(family: Family, body: &[u8]) -> Result<Bytes, NotHandedOver> {
    let mut m = one_token(family, body)?;
    m.set(
        "kv_transfer_params",
        r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#,
    );
    Ok(m.bytes())
}

/// A prefill replica's copy of a turn served whole on its decode replica: the same one
/// token, with no `kv_transfer_params`, so the replica caches the prompt and holds no blocks
/// for a decode that will not come.
pub fn vllm_warm(family: Family, body: &[u8]) -> Result<Bytes, NotHandedOver> {
    Ok(one_token(family, body)?.bytes())
}

/// `body` asking for one token, not streamed, one choice, not stored.
fn one_token(family: Family, body: &[u8]) -> Result<Members<'_>, NotHandedOver> {
    let mut m = Members::parse(body).map_err(|_| NotHandedOver("the body is not a JSON object"))?;
    if m.has("kv_transfer_params") {
        // Stripped at the edge; never trusted from a client.
        return Err(NotHandedOver("the client sent kv_transfer_params"));
    }
    m.set("stream", "false");
    // vLLM refuses stream_options without stream; min_tokens above 1 would contradict max 1.
    m.remove("stream_options");
    m.remove("min_tokens");
    match family {
        Family::Chat => {
            m.set("max_tokens", "1");
            m.set("max_completion_tokens", "1");
            m.set("n", "1");
        }
        Family::Completions => {
            m.set("max_tokens", "1");
            m.set("n", "1");
        }
        Family::Responses => {
            m.set("max_output_tokens", "1");
            m.set("store", "false");
            m.remove("background");
        }
        Family::Messages => {
            m.set("max_tokens", "1");
        }
    }
    Ok(m)
}

/// The `kv_transfer_params` of a prefill answer, as they came; `None` when there are none (a
/// replica without a connector) or they are not an object.
pub fn vllm_params(answer: &[u8]) -> Option<Box<RawValue>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        kv_transfer_params: Option<Box<RawValue>>,
    }
    let p = serde_json::from_slice::<Answer>(answer)
        .ok()?
        .kv_transfer_params?;
    p.get().trim_start().starts_with('{').then_some(p)
}

/// The client's `body` for the decode leg, with the prefill's `params` as they came.
pub fn vllm_decode(body: &[u8], params: &RawValue) -> Result<Bytes, NotHandedOver> {
    let mut m = Members::parse(body).map_err(|_| NotHandedOver("the body is not a JSON object"))?;
    m.set_raw("kv_transfer_params", params);
    Ok(m.bytes())
}

/// `body` with SGLang's bootstrap fields: the prefill server's bootstrap host and port, and
/// the room both legs meet in.
pub fn sglang_legs(body: &[u8], host: &str, port: u16, room: u64) -> Result<Bytes, NotHandedOver> {
    let mut m = Members::parse(body).map_err(|_| NotHandedOver("the body is not a JSON object"))?;
    for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        if m.has(k) {
            return Err(NotHandedOver("the client sent bootstrap fields"));
        }
    }
    let host = serde_json::to_string(host).expect("a string serialises");
    m.set("bootstrap_host", &host);
    m.set("bootstrap_port", &port.to_string());
    m.set("bootstrap_room", &room.to_string());
    Ok(m.bytes())
}

/// Where a decode stream stands before anything of it is passed to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Nothing generated yet: hold what came.
    Held,
    /// A token (or the end) came: pass everything on.
    Flowing,
    /// An error event before any token: the KV pull failed, nothing reached the client.
    Failed,
}

/// Reads the start of a decode leg's SSE stream, event by event, until its first token or an
/// error event. A stream that holds more than [`StreamStart::MAX_HELD`] bytes without either
/// is let through (it is not one this reader understands).
#[derive(Debug, Default)]
pub struct StreamStart {
    pending: Vec<u8>,
    held: usize,
    state: Option<Start>,
}

impl StreamStart {
    pub const MAX_HELD: usize = 64 * 1024;

    pub fn feed(&mut self, chunk: &[u8]) -> Start {
        if let Some(s) = self.state {
            return s;
        }
        self.held += chunk.len();
        self.pending.extend_from_slice(chunk);
        while let Some(end) = event_end(&self.pending) {
            let event: Vec<u8> = self.pending.drain(..end).collect();
            if let Some(s) = judge(&event) {
                self.state = Some(s);
                return s;
            }
        }
        if self.held > Self::MAX_HELD {
            self.state = Some(Start::Flowing);
            return Start::Flowing;
        }
        Start::Held
    }
}

/// The end (past the blank line) of the first complete SSE event in `buf`.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::find(buf, b"\n\n").map(|i| i + 2);
    let crlf = memchr::memmem::find(buf, b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether an error object is the replica's failure rather than a refusal of the request:
/// a 5xx code (vLLM's), or a server-side type (vLLM's `InternalServerError`, Anthropic's
/// `api_error` and `overloaded_error`).
fn server_side(e: &Value) -> bool {
    let code = e["code"]
        .as_u64()
        .or_else(|| e["code"].as_str().and_then(|c| c.parse().ok()));
    match code {
        Some(c) => c >= 500,
        None => matches!(
            e["type"].as_str(),
            Some("InternalServerError" | "api_error" | "overloaded_error" | "server_error") | None
        ),
    }
}

/// One event's verdict: `None` while it generated nothing (a role chunk, `message_start`,
/// `response.created`).
fn judge(event: &[u8]) -> Option<Start> {
    let text = String::from_utf8_lossy(event);
    let mut name = "";
    let mut data = String::new();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = v.trim();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim());
        }
    }
    if data.is_empty() {
        return (name == "error").then_some(Start::Failed);
    }
    if data == "[DONE]" {
        return Some(Start::Flowing);
    }
    let Ok(v) = serde_json::from_str::<Value>(&data) else {
        return Some(Start::Flowing);
    };
    let error = v.get("error").filter(|e| !e.is_null());
    if let Some(e) = error {
        // The replica's own failure (a failed KV pull is vLLM's 500) is another replica's
        // to serve; a refusal of the request itself goes to the client as it came.
        return Some(if server_side(e) {
            Start::Failed
        } else {
            Start::Flowing
        });
    }
    if name == "error" {
        return Some(Start::Failed);
    }
    // Anthropic and Responses name their events in the data too.
    if let Some(t) = v["type"].as_str() {
        let preamble = matches!(
            t,
            "message_start"
                | "content_block_start"
                | "ping"
                | "response.created"
                | "response.in_progress"
                | "response.output_item.added"
                | "response.content_part.added"
        );
        return (!preamble).then_some(Start::Flowing);
    }
    // Chat and completions: a choice with content, a tool call, or an end.
    let generated = v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            let d = &c["delta"];
            c["finish_reason"].is_string()
                || c["text"].as_str().is_some_and(|t| !t.is_empty())
                || d["content"].as_str().is_some_and(|t| !t.is_empty())
                || d["reasoning_content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                || d["reasoning"].as_str().is_some_and(|t| !t.is_empty())
                || d["tool_calls"].is_array()
        })
    });
    // A usage-only chunk, or one with no choices, generated nothing yet.
    generated.then_some(Start::Flowing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("json")
    }

    #[test]
    fn a_warm_prefill_is_the_prefill_leg_without_kv_transfer_params() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":500,"n":2}"#;
        for family in [
            Family::Chat,
            Family::Completions,
            Family::Responses,
            Family::Messages,
        ] {
            let mut leg = json(&vllm_prefill(family, body).expect("prefill"));
            let warm = json(&vllm_warm(family, body).expect("warm"));
            assert!(warm.get("kv_transfer_params").is_none(), "{family:?}");
            leg.as_object_mut().unwrap().remove("kv_transfer_params");
            assert_eq!(warm, leg, "{family:?}");
        }
        let sent = br#"{"kv_transfer_params":{"do_remote_prefill":true}}"#;
        assert!(vllm_warm(Family::Chat, sent).is_err());
    }

    #[test]
    fn a_vllm_prefill_asks_for_one_token_unstreamed_with_remote_decode() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":500,"min_tokens":4,"n":3}"#;
        let p = json(&vllm_prefill(Family::Chat, body).expect("prefill"));
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(
            (&p["max_tokens"], &p["max_completion_tokens"], &p["n"]),
            (&Value::from(1), &Value::from(1), &Value::from(1))
        );
        let r = json(&vllm_prefill(Family::Responses, br#"{"input":"x","store":true}"#).unwrap());
        assert_eq!(
            (&r["store"], &r["max_output_tokens"]),
            (&Value::Bool(false), &Value::from(1))
        );
        let m = json(&vllm_prefill(Family::Messages, br#"{"max_tokens":9}"#).unwrap());
        assert_eq!(m["max_tokens"], 1);
        assert!(vllm_prefill(Family::Chat, b"[1]").is_err());
    }

    #[test]
    fn the_prefill_answers_params_pass_to_the_decode_leg_as_they_came() {
        let answer = br#"{"id":"x","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_host":"10.0.0.1","remote_port":5600,"future_field":{"a":1}}}"#;
        let params = vllm_params(answer).expect("params");
        let d = json(&vllm_decode(br#"{"model":"m","stream":true}"#, &params).unwrap());
        assert_eq!(d["stream"], true);
        assert_eq!(d["kv_transfer_params"]["future_field"]["a"], 1);
        assert_eq!(d["kv_transfer_params"]["remote_block_ids"][0][1], 2);
        for none in [
            &br#"{"choices":[]}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":[1]}"#,
            b"nope",
        ] {
            assert!(
                vllm_params(none).is_none(),
                "{}",
                String::from_utf8_lossy(none)
            );
        }
    }

    /// The prompt passes byte for byte: members are edited at the top level only, and what
    /// is nested (escapes, number forms, key order) is never rewritten.
    #[test]
    fn nested_members_pass_as_they_came() {
        let messages = r#"[{"role":"user","content":"caf\u00e9 \"q\" 1.0e3","z":1,"a":2}]"#;
        let body = format!(r#"{{"model":"m","messages":{messages},"stream":true}}"#);
        for b in [
            vllm_prefill(Family::Chat, body.as_bytes()).unwrap(),
            sglang_legs(body.as_bytes(), "h", 1, 2).unwrap(),
        ] {
            let text = std::str::from_utf8(&b).unwrap();
            assert!(text.contains(messages), "{text}");
        }
        assert!(vllm_prefill(Family::Chat, br#"{"a":1"#).is_err());
    }

    #[test]
    fn sglang_legs_carry_the_bootstrap_room() {
        let b = json(&sglang_legs(br#"{"model":"m"}"#, "10.0.0.2", 8998, 42).unwrap());
        assert_eq!(
            (
                &b["bootstrap_host"],
                &b["bootstrap_port"],
                &b["bootstrap_room"]
            ),
            (
                &Value::from("10.0.0.2"),
                &Value::from(8998),
                &Value::from(42u64)
            )
        );
        assert!(sglang_legs(br#"{"bootstrap_room":1}"#, "h", 1, 2).is_err());
    }

    #[test]
    fn a_stream_is_held_until_its_first_token_or_an_error() {
        // (chunks, verdict after each)
        let rows: &[(&[&str], &[Start])] = &[
            // vLLM chat: a role chunk, then content
            (
                &["data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n", "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n"],
                &[Start::Held, Start::Flowing],
            ),
            // a failed pull: the error object before any token
            (
                &["data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n", "data: {\"error\":{\"message\":\"Internal server error\",\"code\":500}}\n\n"],
                &[Start::Held, Start::Failed],
            ),
            // an event split across chunks
            (&["data: {\"choices\":[{\"te", "xt\":\"a\"}]}\n", "\n"], &[Start::Held, Start::Held, Start::Flowing]),
            // Anthropic: message_start is a preamble, a delta is a token
            (
                &["event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\n"],
                &[Start::Flowing],
            ),
            (&["event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\"}}\n\n"], &[Start::Failed]),
            // a refusal of the request itself passes to the client
            (&["data: {\"error\":{\"message\":\"bad grammar\",\"code\":400}}\n\n"], &[Start::Flowing]),
            (&["event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\"}}\n\n"], &[Start::Flowing]),
            // Responses
            (&["event: response.created\ndata: {\"type\":\"response.created\"}\r\n\r\n"], &[Start::Held]),
            (&["data: [DONE]\n\n"], &[Start::Flowing]),
        ];
        for (chunks, want) in rows {
            let mut s = StreamStart::default();
            let got: Vec<Start> = chunks.iter().map(|c| s.feed(c.as_bytes())).collect();
            assert_eq!(&got, want, "{chunks:?}");
        }
        let mut s = StreamStart::default();
        let big = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"role\":\"{}\"}}}}]}}\n\n",
            "x".repeat(70_000)
        );
        assert_eq!(
            s.feed(big.as_bytes()),
            Start::Flowing,
            "held past the bound: let through"
        );
    }
}
