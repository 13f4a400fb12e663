//! Request body bytes → the request's *shape*, the only thing routing looks at.
//!
//! A chat request becomes the chain of hashes of its message prefixes: `prefixes[i]` names
//! `messages[0..=i]`. The chain is what lets a later turn find the replica that served an
//! earlier one. Everything else (a `/v1/completions` prompt, a body that is not JSON, a chat
//! without messages) is `Other` and spreads.
//!
//! Pure and total: any byte string gives an answer and never a panic. Not for validating
//! requests: the replica answers bad requests itself.

use serde::Deserialize;
use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

/// How many bytes of a non-chat body name its "prefix" for the `affinity` policy.
const OTHER_KEY_BYTES: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// `prefixes[i]` is the chained hash of messages `0..=i` (never empty).
    Chat { prefixes: Vec<u64> },
    /// Anything that is not a chat message list; `key` hashes its first bytes.
    Other { key: u64 },
}

impl Shape {
    /// The hash the `affinity` policy pins by: the first message, or the first bytes.
    pub fn affinity_key(&self) -> u64 {
        match self {
            Shape::Chat { prefixes } => prefixes[0],
            Shape::Other { key } => *key,
        }
    }

    /// The hash naming the whole message list, recorded once it has been served.
    pub fn served_key(&self) -> Option<u64> {
        match self {
            Shape::Chat { prefixes } => prefixes.last().copied(),
            Shape::Other { .. } => None,
        }
    }

    /// Hashes of strict prefixes (at least one message shorter), longest first.
    pub fn strict_prefixes(&self) -> impl Iterator<Item = u64> + '_ {
        let strict: &[u64] = match self {
            Shape::Chat { prefixes } => &prefixes[..prefixes.len() - 1],
            Shape::Other { .. } => &[],
        };
        strict.iter().rev().copied()
    }
}

/// What the balancer learns from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    pub shape: Shape,
    pub model: Option<String>,
    pub stream: bool,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
}

/// Classifies a request body. `body` may be anything, including invalid UTF-8.
pub fn classify(body: &[u8]) -> RequestInfo {
    let other = || RequestInfo {
        shape: Shape::Other {
            key: xxhash_rust::xxh3::xxh3_64(&body[..body.len().min(OTHER_KEY_BYTES)]),
        },
        model: None,
        stream: false,
    };
    let Ok(parsed) = serde_json::from_slice::<Body>(body) else {
        return other();
    };
    let model = match parsed.model {
        Some(Value::String(m)) => Some(m),
        _ => None,
    };
    let stream = matches!(parsed.stream, Some(Value::Bool(true)));
    let shape = match parsed.messages {
        Some(Value::Array(messages)) if !messages.is_empty() => Shape::Chat {
            prefixes: chain(model.as_deref().unwrap_or(""), &messages),
        },
        _ => other().shape,
    };
    RequestInfo {
        shape,
        model,
        stream,
    }
}

/// Chained hashes: each link hashes the previous link and one message, so a prefix's hash
/// does not depend on what follows it. The model seeds the chain: a replica's cache is per model.
fn chain(model: &str, messages: &[Value]) -> Vec<u64> {
    let mut prev = xxhash_rust::xxh3::xxh3_64(model.as_bytes());
    messages
        .iter()
        .map(|m| {
            let mut h = Xxh3::new();
            h.update(&prev.to_le_bytes());
            hash_value(m, &mut h);
            prev = h.digest();
            prev
        })
        .collect()
}

/// Hashes a JSON value by structure, so formatting and key order of the client's encoder
/// do not matter (serde_json's map iterates in sorted key order).
fn hash_value(v: &Value, h: &mut Xxh3) {
    match v {
        Value::Null => h.update(b"n"),
        Value::Bool(b) => h.update(if *b { b"t" } else { b"f" }),
        Value::Number(n) => {
            h.update(b"#");
            h.update(n.to_string().as_bytes());
        }
        Value::String(s) => {
            h.update(b"s");
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        Value::Array(items) => {
            h.update(b"[");
            h.update(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| hash_value(i, h));
        }
        Value::Object(map) => {
            h.update(b"{");
            h.update(&(map.len() as u64).to_le_bytes());
            for (k, v) in map {
                h.update(&(k.len() as u64).to_le_bytes());
                h.update(k.as_bytes());
                hash_value(v, h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chat(msgs: &[(&str, &str)]) -> Vec<u8> {
        let messages: Vec<Value> = msgs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
            .expect("test fixture")
    }

    fn prefixes(info: &RequestInfo) -> Vec<u64> {
        match &info.shape {
            Shape::Chat { prefixes } => prefixes.clone(),
            other => panic!("expected a chat, got {other:?}"),
        }
    }

    #[test]
    fn a_longer_conversation_extends_the_chain_of_the_shorter_one() {
        let turn1 = classify(&chat(&[("system", "S"), ("user", "hi")]));
        let turn2 = classify(&chat(&[
            ("system", "S"),
            ("user", "hi"),
            ("assistant", "hello"),
            ("user", "more"),
        ]));
        let (p1, p2) = (prefixes(&turn1), prefixes(&turn2));
        assert_eq!(p2.len(), 4);
        assert_eq!(&p2[..2], &p1[..]);
        assert_eq!(turn2.strict_prefixes_vec(), vec![p2[2], p2[1], p2[0]]);
    }

    #[test]
    fn formatting_and_key_order_do_not_change_the_hash() {
        let a = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
        let b =
            b"{ \"messages\" : [ {\"content\": \"x\", \"role\": \"user\"} ], \"model\": \"m\" }";
        assert_eq!(classify(a).shape, classify(b).shape);
    }

    #[test]
    fn the_model_seeds_the_chain() {
        let a = br#"{"model":"a","messages":[{"role":"user","content":"x"}]}"#;
        let b = br#"{"model":"b","messages":[{"role":"user","content":"x"}]}"#;
        assert_ne!(classify(a).shape, classify(b).shape);
    }

    #[test]
    fn non_chat_bodies_are_other() {
        for body in [
            &b""[..],
            b"not json",
            b"[1,2,3]",
            b"\xff\xfe\x00",
            br#"{"prompt":"hello"}"#,
            br#"{"messages":"a string"}"#,
            br#"{"messages":[]}"#,
        ] {
            let info = classify(body);
            assert!(matches!(info.shape, Shape::Other { .. }), "{body:?}");
            assert_eq!(info.shape.strict_prefixes().count(), 0);
            assert_eq!(info.shape.served_key(), None);
        }
    }

    #[test]
    fn model_and_stream_are_read() {
        let info = classify(br#"{"model":"llama","stream":true,"prompt":"p"}"#);
        assert_eq!(info.model.as_deref(), Some("llama"));
        assert!(info.stream);
        let info = classify(br#"{"model":3,"stream":"yes"}"#);
        assert_eq!(info.model, None);
        assert!(!info.stream);
    }

    impl RequestInfo {
        fn strict_prefixes_vec(&self) -> Vec<u64> {
            self.shape.strict_prefixes().collect()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn any_bytes_classify_without_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let info = classify(&body);
            let _ = info.shape.affinity_key();
            // Every strict prefix, and only those: one fewer than the messages, or none.
            let strict: Vec<u64> = info.shape.strict_prefixes().collect();
            match &info.shape {
                Shape::Chat { prefixes } => {
                    let mut expected: Vec<u64> = prefixes[..prefixes.len() - 1].to_vec();
                    expected.reverse();
                    prop_assert_eq!(strict, expected);
                    prop_assert_eq!(info.shape.served_key(), prefixes.last().copied());
                }
                Shape::Other { .. } => {
                    prop_assert!(strict.is_empty());
                    prop_assert_eq!(info.shape.served_key(), None);
                }
            }
        }

        #[test]
        fn any_json_ish_text_classifies_without_panic(body in r#"\{"messages":\[(\{"role":"[a-z]{0,6}","content":"[^"\\]{0,20}"\},?){0,5}\]\}"#) {
            let info = classify(body.as_bytes());
            if let Shape::Chat { prefixes } = &info.shape {
                prop_assert!(!prefixes.is_empty());
            }
        }
    }
}
