//! Responses API conversations as the balancer keeps them (`responses.store: balancer`), as
//! bodies: what a create request says about its conversation ([`Turn`]), one stored exchange
//! ([`Exchange`]), a chain made into the full prompt a replica without a store can serve
//! ([`expand`]), the answer given back the fields the client sent ([`restore`],
//! [`EventRewriter`]), and `input_items`' pages. Pure: bytes in, bytes out.
//!
//! OpenAI's semantics: a request continuing `previous_response_id` sees, in order, every
//! earlier turn's input items and output items, then its own input. Instructions are not
//! carried over. As vLLM 0.33's own store chains a previous response, its reasoning items are
//! not sent again; and vLLM refuses a reasoning item's `encrypted_content` in input, so a
//! client's own reasoning items go without it. The store keeps both (a `GET` shows them).

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::protocol::members::Members;

/// Why a create request's conversation fields cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadTurn {
    pub param: &'static str,
    pub message: &'static str,
}

/// What a `POST /v1/responses` body says about its conversation.
#[derive(Debug)]
pub struct Turn {
    /// `store` as the client sent it; absent is OpenAI's default, true.
    pub store: bool,
    pub previous: Option<String>,
    pub background: bool,
    /// It names a Conversations API conversation (the replica's, not the store's).
    pub conversation: bool,
    /// Its `input` as a list of items: a string is one user message.
    pub input: Box<RawValue>,
}

fn flag(m: &Members, key: &'static str) -> Result<Option<bool>, BadTurn> {
    match m.get(key).map(RawValue::get) {
        None | Some("null") => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(_) => Err(BadTurn {
            param: key,
            message: "must be a boolean",
        }),
    }
}

/// Reads a create request's conversation fields.
pub fn turn(body: &[u8]) -> Result<Turn, BadTurn> {
    let m = Members::parse(body).map_err(|_| BadTurn {
        param: "",
        message: "the request body must be a JSON object",
    })?;
    let previous = match m.get("previous_response_id") {
        None => None,
        Some(raw) if raw.get() == "null" => None,
        Some(raw) => match serde_json::from_str::<String>(raw.get()) {
            Ok(id) if !id.is_empty() => Some(id),
            _ => {
                return Err(BadTurn {
                    param: "previous_response_id",
                    message: "must be a non-empty string",
                })
            }
        },
    };
    let input = match m.get("input") {
        None => RawValue::from_string("[]".into()).expect("JSON"),
        Some(raw) if raw.get().starts_with('[') => raw.to_owned(),
        Some(raw) => match serde_json::from_str::<String>(raw.get()) {
            Ok(text) => {
                let item =
                    serde_json::json!([{"type": "message", "role": "user", "content": text}]);
                serde_json::value::to_raw_value(&item).expect("JSON")
            }
            Err(_) => {
                return Err(BadTurn {
                    param: "input",
                    message: "must be a string or a list of items",
                })
            }
        },
    };
    Ok(Turn {
        store: flag(&m, "store")?.unwrap_or(true),
        previous,
        background: flag(&m, "background")?.unwrap_or(false),
        conversation: m.get("conversation").is_some_and(|c| c.get() != "null"),
        input,
    })
}

/// One stored exchange: what one request added to its conversation, and its answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Exchange {
    /// The response's id.
    pub id: String,
    /// The client key it belongs to, as a tag (see the proxy's scope): another key's id is
    /// unknown to a request.
    pub scope: u64,
    /// The exchanges before it, oldest first (not itself): a chain is read in one round trip.
    pub ancestors: Vec<String>,
    /// Its request's input items.
    pub input: Box<RawValue>,
    /// The response object as the client got it (its `output` items among its members).
    pub response: Box<RawValue>,
    /// When it was stored (seconds since the epoch).
    pub stored_at: u64,
}

impl Exchange {
    /// Bytes it holds, as counted against the store's bounds: its texts and the fixed part.
    pub fn size(&self) -> usize {
        std::mem::size_of::<Exchange>()
            + self.id.len()
            + self.ancestors.iter().map(|a| a.len() + 24).sum::<usize>()
            + self.input.get().len()
            + self.response.get().len()
    }

    /// The previous response it continued, if any.
    pub fn previous(&self) -> Option<&str> {
        self.ancestors.last().map(String::as_str)
    }

    /// Its response's `output` items.
    pub fn output(&self) -> Option<Box<RawValue>> {
        let m = Members::parse(self.response.get().as_bytes()).ok()?;
        m.get("output")
            .filter(|o| o.get().starts_with('['))
            .map(RawValue::to_owned)
    }
}

/// The items of a raw JSON array (empty when it is not one).
fn elements(array: &RawValue) -> Vec<&RawValue> {
    serde_json::from_str(array.get()).unwrap_or_default()
}

fn is_reasoning(item: &RawValue) -> bool {
    item.get().contains("\"reasoning\"")
        && Members::parse(item.get().as_bytes())
            .is_ok_and(|m| m.get("type").map(RawValue::get) == Some("\"reasoning\""))
}

/// An item as a replica is sent it: a reasoning item without its `encrypted_content`.
fn for_replica(item: &RawValue) -> Cow<'_, RawValue> {
    if !item.get().contains("\"encrypted_content\"") {
        return Cow::Borrowed(item);
    }
    let Ok(mut m) = Members::parse(item.get().as_bytes()) else {
        return Cow::Borrowed(item);
    };
    if m.get("type").map(RawValue::get) != Some("\"reasoning\"") {
        return Cow::Borrowed(item);
    }
    m.remove("encrypted_content");
    let text = String::from_utf8(m.bytes().to_vec()).expect("JSON is UTF-8");
    Cow::Owned(RawValue::from_string(text).expect("JSON"))
}

/// The body a replica without a store is sent: not stored there, no `previous_response_id`,
/// and, when it continues a chain, `input` made of every earlier exchange's input and output
/// items in order (`history`, oldest first), then its own. Its other members pass as they
/// came, `instructions` included.
pub fn expand(body: &[u8], history: &[&Exchange], own: &RawValue) -> Option<Bytes> {
    let mut m = Members::parse(body).ok()?;
    m.set("store", "false");
    m.remove("previous_response_id");
    // vLLM makes a client's `request_id` the response's id: one client could then name its
    // answer as another exchange of the store.
    m.remove("request_id");
    if history.is_empty() {
        return Some(m.bytes());
    }
    let outputs: Vec<Option<Box<RawValue>>> = history.iter().map(|e| e.output()).collect();
    let mut text = String::with_capacity(
        history
            .iter()
            .map(|e| e.input.get().len() + e.response.get().len())
            .sum::<usize>()
            + own.get().len(),
    );
    text.push('[');
    let mut push = |item: &RawValue| {
        if text.len() > 1 {
            text.push(',');
        }
        text.push_str(for_replica(item).get());
    };
    for (e, output) in history.iter().zip(&outputs) {
        elements(&e.input).into_iter().for_each(&mut push);
        if let Some(output) = output {
            // As vLLM's own store chains a previous output: without its reasoning items.
            elements(output)
                .into_iter()
                .filter(|item| !is_reasoning(item))
                .for_each(&mut push);
        }
    }
    elements(own).into_iter().for_each(&mut push);
    text.push(']');
    m.set_owned("input", RawValue::from_string(text).ok()?);
    Some(m.bytes())
}

/// What the client sent that the replica was not: `store` and `previous_response_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub store: bool,
    pub previous: Option<String>,
}

impl Sent {
    fn apply(&self, m: &mut Members) {
        m.set("store", if self.store { "true" } else { "false" });
        match &self.previous {
            Some(id) => m.set(
                "previous_response_id",
                &serde_json::to_string(id).expect("a string serialises"),
            ),
            None => m.set("previous_response_id", "null"),
        }
    }
}

/// A response object given back what the client sent; `None` when it is not an object.
pub fn restore(response: &[u8], sent: &Sent) -> Option<Bytes> {
    let mut m = Members::parse(response).ok()?;
    sent.apply(&mut m);
    Some(m.bytes())
}

/// A response object's id and status.
pub fn id_and_status(response: &[u8]) -> Option<(String, String)> {
    #[derive(Deserialize)]
    struct Head {
        id: String,
        #[serde(default)]
        status: String,
    }
    let h: Head = serde_json::from_slice(response).ok()?;
    Some((h.id, h.status))
}

/// Whether a response in this status is kept: finished, whole or cut short by a limit.
pub fn is_kept(status: &str) -> bool {
    matches!(status, "completed" | "incomplete")
}

/// A Responses stream as it passes: each event whose `response` member is the response object
/// (`response.created`, `.in_progress`, `.completed`, ...) gets the client's fields back; any
/// other event passes byte for byte. Events are passed whole, once their blank line came.
#[derive(Debug)]
pub struct EventRewriter {
    sent: Sent,
    pending: Vec<u8>,
    /// The final response object (`response.completed` or `.incomplete`), as rewritten.
    last: Option<Bytes>,
}

/// The events of a stream that end it with a response worth keeping.
const FINAL: [&str; 2] = ["response.completed", "response.incomplete"];

impl EventRewriter {
    pub fn new(sent: Sent) -> EventRewriter {
        EventRewriter {
            sent,
            pending: Vec::new(),
            last: None,
        }
    }

    /// The whole events `chunk` completes, rewritten; the rest waits for its end.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        // Only the new bytes (and the three before them) can hold a new blank line.
        let from = self.pending.len().saturating_sub(3);
        self.pending.extend_from_slice(chunk);
        let Some(end) = last_boundary(&self.pending[from..]).map(|e| e + from) else {
            return Bytes::new();
        };
        let rest = self.pending.split_off(end);
        let whole = std::mem::replace(&mut self.pending, rest);
        let mut out = Vec::with_capacity(whole.len() + 64);
        for event in split_events(&whole) {
            self.event(event, &mut out);
        }
        Bytes::from(out)
    }

    /// What is left once the stream ended (an event without its blank line), as it came.
    pub fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }

    /// The final response object seen, once.
    pub fn take_final(&mut self) -> Option<Bytes> {
        self.last.take()
    }

    /// Bytes of an event not yet whole.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
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

/// The end of the last whole event in `buf` (past its blank line).
fn last_boundary(buf: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::rfind(buf, b"\n\n").map(|i| i + 2);
    let crlf = memchr::memmem::rfind(buf, b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// Whole events, each with its blank line.
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let lf = memchr::memmem::find(rest, b"\n\n").map(|i| i + 2);
        let crlf = memchr::memmem::find(rest, b"\r\n\r\n").map(|i| i + 4);
        let end = match (lf, crlf) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(rest.len()),
        };
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// `GET /v1/responses/{id}/input_items`' query: OpenAI's paging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub after: Option<String>,
    pub before: Option<String>,
    pub limit: usize,
    /// Oldest first; OpenAI's default is newest first.
    pub ascending: bool,
}

/// Reads the paging query, or why not (`limit` 1 to 100, `order` asc or desc).
pub fn page(query: Option<&str>) -> Result<Page, String> {
    let mut page = Page {
        after: None,
        before: None,
        limit: 20,
        ascending: false,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "after" => page.after = Some(v.to_owned()).filter(|v| !v.is_empty()),
            "before" => page.before = Some(v.to_owned()).filter(|v| !v.is_empty()),
            "limit" => {
                page.limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| format!("limit: `{v}` is not an integer from 1 to 100"))?
            }
            "order" => {
                page.ascending = match v {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(format!("order: `{v}` is not `asc` or `desc`")),
                }
            }
            // `include[]` and the like change what an item shows, not which: ignored.
            _ => {}
        }
    }
    Ok(page)
}

/// One page of an exchange's input items, in OpenAI's list shape. An item sent without an
/// `id` is given one made from the response's id and its place, the same on every call.
pub fn input_items(e: &Exchange, page: &Page) -> Bytes {
    let mut items: Vec<(String, Cow<'_, RawValue>)> = elements(&e.input)
        .into_iter()
        .enumerate()
        .map(|(i, item)| with_id(&e.id, i, item))
        .collect();
    if !page.ascending {
        items.reverse();
    }
    let start = match &page.after {
        Some(after) => items
            .iter()
            .position(|(id, _)| id == after)
            .map_or(items.len(), |p| p + 1),
        None => 0,
    };
    let (start, end, has_more) = match &page.before {
        // The page just before that item, in the same order: more lie before it.
        Some(before) => {
            let until = items
                .iter()
                .position(|(id, _)| id == before)
                .unwrap_or(start)
                .max(start);
            let from = until.saturating_sub(page.limit).max(start);
            (from, until, from > start)
        }
        None => {
            let end = (start + page.limit).min(items.len());
            (start, end, end < items.len())
        }
    };
    let shown = &items[start..end];
    let mut out = String::from(r#"{"object":"list","data":["#);
    for (i, (_, item)) in shown.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item.get());
    }
    let id = |x: Option<&(String, Cow<RawValue>)>| {
        x.map_or("null".to_owned(), |(id, _)| {
            serde_json::to_string(id).expect("a string serialises")
        })
    };
    out.push_str(&format!(
        r#"],"first_id":{},"last_id":{},"has_more":{}}}"#,
        id(shown.first()),
        id(shown.last()),
        has_more
    ));
    Bytes::from(out)
}

fn with_id<'a>(response: &str, i: usize, item: &'a RawValue) -> (String, Cow<'a, RawValue>) {
    let Ok(mut m) = Members::parse(item.get().as_bytes()) else {
        return (format!("item_{i}"), Cow::Borrowed(item));
    };
    // A message's text content, as OpenAI lists it: a list of parts.
    let text: Option<String> = m
        .get("content")
        .and_then(|c| serde_json::from_str::<String>(c.get()).ok());
    let given = m
        .get("id")
        .and_then(|id| serde_json::from_str::<String>(id.get()).ok());
    if let Some(text) = &text {
        let role: Option<String> = m
            .get("role")
            .and_then(|r| serde_json::from_str(r.get()).ok());
        let kind = if role.as_deref() == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        let parts = serde_json::json!([{"type": kind, "text": text}]);
        m.set("content", &parts.to_string());
        if !m.has("type") {
            m.set("type", "\"message\"");
        }
    }
    if let (Some(id), None) = (&given, &text) {
        return (id.clone(), Cow::Borrowed(item));
    }
    let id = given.unwrap_or_else(|| {
        let h = xxhash_rust::xxh3::xxh3_64(response.as_bytes());
        format!("msg_{h:016x}{i:04x}")
    });
    m.set(
        "id",
        &serde_json::to_string(&id).expect("a string serialises"),
    );
    let text = String::from_utf8(m.bytes().to_vec()).expect("JSON is UTF-8");
    (id, Cow::Owned(RawValue::from_string(text).expect("JSON")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).expect("JSON")
    }

    fn exchange(id: &str, ancestors: &[&str], input: Value, output: Value) -> Exchange {
        Exchange {
            id: id.into(),
            scope: 7,
            ancestors: ancestors.iter().map(|a| a.to_string()).collect(),
            input: raw(input),
            response: raw(json!({"id": id, "object": "response", "output": output})),
            stored_at: 1,
        }
    }

    fn value(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("JSON")
    }

    #[test]
    fn a_turn_reads_its_fields_and_a_string_input_is_one_user_message() {
        let t =
            turn(br#"{"input":"hi","previous_response_id":"resp_1","store":false}"#).expect("turn");
        assert!(!t.store && !t.background);
        assert_eq!(t.previous.as_deref(), Some("resp_1"));
        assert_eq!(
            value(t.input.get().as_bytes()),
            json!([{"type":"message","role":"user","content":"hi"}])
        );
        let t = turn(br#"{"input":[{"role":"user","content":"x"}]}"#).expect("turn");
        assert!(t.store, "absent is OpenAI's default");
        assert_eq!(t.input.get(), r#"[{"role":"user","content":"x"}]"#);
        for (body, param) in [
            (&br#"{"store":"yes"}"#[..], "store"),
            (br#"{"previous_response_id":7}"#, "previous_response_id"),
            (br#"{"previous_response_id":""}"#, "previous_response_id"),
            (br#"{"input":3}"#, "input"),
            (br#"{"background":1}"#, "background"),
            (b"[]", ""),
        ] {
            assert_eq!(turn(body).expect_err("bad").param, param);
        }
    }

    #[test]
    fn a_chain_expands_into_every_earlier_item_then_its_own() {
        let first = exchange(
            "resp_1",
            &[],
            json!([{"type":"message","role":"user","content":"weather?"}]),
            json!([{"type":"function_call","call_id":"c1","name":"w","arguments":"{}"}]),
        );
        let second = exchange(
            "resp_2",
            &["resp_1"],
            json!([{"type":"function_call_output","call_id":"c1","output":"sun"}]),
            json!([
                {"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"SECRET"},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"sunny"}]}
            ]),
        );
        let body = br#"{"model":"m","instructions":"be brief","input":"thanks","previous_response_id":"resp_2","stream":true}"#;
        let own = turn(body).expect("turn").input;
        let out = expand(body, &[&first, &second], &own).expect("expanded");
        let v = value(&out);
        assert_eq!(v["store"], json!(false));
        assert!(v.get("previous_response_id").is_none());
        assert_eq!(v["instructions"], json!("be brief"), "its own, as sent");
        assert_eq!(v["stream"], json!(true));
        let kinds: Vec<&str> = v["input"]
            .as_array()
            .expect("list")
            .iter()
            .map(|i| i["type"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "function_call",
                "function_call_output",
                "message",
                "message"
            ],
            "a previous reasoning item is not sent again"
        );
        assert!(!String::from_utf8_lossy(&out).contains("SECRET"));
        // A client's own reasoning item goes without its encrypted content.
        let own =
            raw(json!([{"type":"reasoning","id":"rs_2","summary":[],"encrypted_content":"E"}]));
        let out = expand(br#"{"input":[],"request_id":"resp_1"}"#, &[&first], &own).expect("body");
        let v = value(&out);
        assert_eq!(v["input"][2]["id"], json!("rs_2"));
        assert!(v["input"][2].get("encrypted_content").is_none());
        assert!(
            v.get("request_id").is_none(),
            "a client may not name its response"
        );
        // Alone, only the store is switched off; the input passes as it came.
        let alone = expand(br#"{"input":"hi","store":true}"#, &[], &own).expect("body");
        assert_eq!(&alone[..], br#"{"input":"hi","store":false}"#);
    }

    #[test]
    fn the_answer_gets_the_clients_fields_back() {
        let sent = Sent {
            store: true,
            previous: Some("resp_1".into()),
        };
        let out = restore(
            br#"{"id":"resp_2","store":false,"previous_response_id":null,"output":[]}"#,
            &sent,
        )
        .expect("object");
        assert_eq!(
            value(&out),
            json!({"id":"resp_2","store":true,"previous_response_id":"resp_1","output":[]})
        );
        assert_eq!(restore(b"[]", &sent), None);
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

    #[test]
    fn input_items_are_paged_as_openai_does() {
        let e = exchange(
            "resp_1",
            &[],
            json!([
                {"type":"message","role":"user","content":"a"},
                {"type":"function_call_output","call_id":"c","output":"b","id":"fco_1"},
                {"type":"message","role":"user","content":"c"}
            ]),
            json!([]),
        );
        let list = |q: &str| value(&input_items(&e, &page(Some(q)).expect("query")));
        let all = list("order=asc");
        assert_eq!(all["object"], json!("list"));
        assert_eq!(all["data"].as_array().map(Vec::len), Some(3));
        assert_eq!(all["data"][1]["id"], json!("fco_1"));
        assert_eq!(all["has_more"], json!(false));
        let first = all["first_id"].as_str().expect("an id").to_owned();
        assert_eq!(list("order=asc")["first_id"], json!(first), "stable ids");
        let desc = list("limit=2");
        assert_eq!(
            desc["data"][0]["content"],
            json!([{"type": "input_text", "text": "c"}]),
            "newest first, its text as OpenAI lists it"
        );
        assert_eq!(desc["has_more"], json!(true));
        let next = list(&format!(
            "limit=2&after={}",
            desc["last_id"].as_str().expect("id")
        ));
        assert_eq!(next["data"].as_array().map(Vec::len), Some(1));
        assert_eq!(next["last_id"], json!(first));
        assert_eq!(next["has_more"], json!(false));
        let back = list(&format!(
            "limit=1&before={}",
            next["last_id"].as_str().expect("id")
        ));
        assert_eq!(back["data"][0]["id"], desc["last_id"], "the page before");
        assert_eq!(back["has_more"], json!(true), "the newest lies before it");
        let first_page = list(&format!(
            "limit=5&before={}",
            desc["last_id"].as_str().expect("id")
        ));
        assert_eq!(
            first_page["has_more"],
            json!(false),
            "nothing before the newest"
        );
        assert_eq!(list("before=unknown")["has_more"], json!(false));
        let none = list("after=unknown");
        assert_eq!(none["data"], json!([]));
        assert_eq!(none["first_id"], Value::Null);
        assert!(page(Some("limit=0")).is_err() && page(Some("order=up")).is_err());
    }
}
