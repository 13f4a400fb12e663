//! A JSON object's top-level members, each value kept as the raw text it came as: a long
//! prompt is scanned once, never built into a tree and written out again (a 90k-token history
//! is several hundred KB, and request bodies are edited on the request path: handover legs,
//! expanded Responses chains). Members are written back in key order.

use std::borrow::Cow;
use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::value::RawValue;

/// The body is not one JSON object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotAnObject;

pub struct Members<'a>(BTreeMap<String, Cow<'a, RawValue>>);

impl<'a> Members<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Members<'a>, NotAnObject> {
        let m: BTreeMap<String, &'a RawValue> =
            serde_json::from_slice(body).map_err(|_| NotAnObject)?;
        Ok(Members(
            m.into_iter().map(|(k, v)| (k, Cow::Borrowed(v))).collect(),
        ))
    }

    pub fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// A member's raw value.
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.0.get(key).map(|v| &**v)
    }

    /// Sets `key` to `value`, which must be a JSON text (a literal the caller wrote, or one
    /// it serialised).
    pub fn set(&mut self, key: &str, value: &str) {
        let raw = RawValue::from_string(value.to_owned()).expect("a JSON text");
        self.0.insert(key.to_owned(), Cow::Owned(raw));
    }

    pub fn set_owned(&mut self, key: &str, raw: Box<RawValue>) {
        self.0.insert(key.to_owned(), Cow::Owned(raw));
    }

    pub fn set_raw(&mut self, key: &str, raw: &'a RawValue) {
        self.0.insert(key.to_owned(), Cow::Borrowed(raw));
    }

    pub fn remove(&mut self, key: &str) {
        self.0.remove(key);
    }

    pub fn bytes(&self) -> Bytes {
        let len: usize = self
            .0
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum();
        let mut out = Vec::with_capacity(len + 2);
        out.push(b'{');
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut out, k).expect("a key serialises");
            out.push(b':');
            out.extend_from_slice(v.get().as_bytes());
        }
        out.push(b'}');
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_edited_and_the_rest_passes_byte_for_byte() {
        let body = br#"{"b": [1, 2 ,3], "a":{"x" : "\u00e9"}, "c":true}"#;
        let mut m = Members::parse(body).expect("object");
        assert_eq!(m.get("b").map(RawValue::get), Some("[1, 2 ,3]"));
        m.remove("c");
        m.set("d", "false");
        assert_eq!(
            &m.bytes()[..],
            br#"{"a":{"x" : "\u00e9"},"b":[1, 2 ,3],"d":false}"#
        );
        assert!(Members::parse(b"[1]").is_err() && Members::parse(b"{").is_err());
    }
}
