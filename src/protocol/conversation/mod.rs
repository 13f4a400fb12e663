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

mod events;
mod items;

pub use events::EventRewriter;
pub use items::{input_items, page, Page};

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
pub(super) fn elements(array: &RawValue) -> Vec<&RawValue> {
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
    pub(super) fn apply(&self, m: &mut Members) {
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
}
