//! A chat body read into its parts ([`ChatBody`]) once per conversation rather than once per
//! turn. An agent resends its whole history with each turn, so most of a turn's body is, byte
//! for byte, the previous turn's body. Reading it again with serde_json took a third of a warm
//! turn's time.
//!
//! serde_json cannot resume a parse part-way, so the top level (the object's keys, and the
//! commas of its `messages` array) is walked here, and every value is read by serde_json
//! (validated, and borrowed from the body). A body's [`Shape`] keeps where each message lies and
//! a hash chained over the body up to each message's end. Where a new body's bytes up to a
//! message's end hash the same, the walk was in the same state there (the same bytes, read the
//! same way), so it goes on from that message's end.
//!
//! A message that does not end in a delimiter of its own (a bare number, `true`) is not resumed
//! after: where it ends depends on the byte after it, which its hash does not cover.
//!
//! The reference is [`ChatBody::parse`] (serde_json's derive, on an object): bodies it reads,
//! this reads the same (but for the bound below); bodies it refuses, this refuses (the tests
//! below). Unknown fields are skipped as the derive skips them (`IgnoredAny`: their strings
//! are not checked as UTF-8). A body of more than [`MAX_MESSAGES`] messages is refused: its
//! ids are not worth the memory.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::value::RawValue;
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64};

use crate::cache;
use crate::chat::ChatBody;
use crate::Error;

/// Where one message of a body lies, its raw JSON's hash, and the chained hash of the body up to
/// its end.
#[derive(Clone)]
struct Msg {
    span: Range<usize>,
    hash: u64,
    upto: u128,
    /// Its JSON ends in its own delimiter (`}`, `]`, `"`): a later body's walk may resume after
    /// it.
    closed: bool,
}

/// The fields [`ChatBody`] keeps besides `messages`, as the spans of their raw values.
#[derive(Clone, Default)]
struct Fields {
    tools: Option<Range<usize>>,
    add_generation_prompt: Option<Range<usize>>,
    chat_template_kwargs: Option<Range<usize>>,
    continue_final_message: Option<Range<usize>>,
    documents: Option<Range<usize>>,
    reasoning_effort: Option<Range<usize>>,
}

/// What reading a body left to read its successors from: the fields before `messages` (the
/// same bytes in a successor), and the messages.
struct Shape {
    before: Fields,
    messages: Vec<Msg>,
}

impl Shape {
    /// The key it is kept under: bodies that share its bytes up to its last message's start
    /// find it ([`key`]).
    fn key(&self, body: &[u8]) -> Option<u64> {
        let last = self.messages.last()?.span.start;
        let len = prefix_len(last)?;
        Some(key(body, len))
    }
}

/// Shapes under the same key (bodies of one conversation, or that share a long prefix).
struct Bucket(Vec<Arc<Shape>>);

impl cache::Weigh for Bucket {
    fn weight(&self) -> usize {
        self.0.iter().map(|s| shape_weight(s)).sum()
    }
}

fn shape_weight(s: &Shape) -> usize {
    s.messages.capacity() * std::mem::size_of::<Msg>() + 128
}

/// Shapes kept per key.
const BUCKET: usize = 4;
/// The most messages a body may have to be read here.
pub const MAX_MESSAGES: usize = 1 << 16;
/// The smallest shared prefix worth a lookup: a shorter body costs little to read.
const MIN_PREFIX: usize = 1024;
/// Bytes of the body's start and of the prefix's end that make a key.
const KEY_BYTES: usize = 256;

/// The largest power of two at most `n`, if at least [`MIN_PREFIX`].
fn prefix_len(n: usize) -> Option<usize> {
    (n >= MIN_PREFIX).then(|| 1usize << (usize::BITS - 1 - n.leading_zeros()))
}

/// A key for the body's first `len` bytes, from its first and its last [`KEY_BYTES`] (a cheap
/// pick among shapes: a candidate is then checked over every byte it shares).
fn key(body: &[u8], len: usize) -> u64 {
    xxh3_64(&body[..KEY_BYTES]) ^ xxh3_64(&body[len - KEY_BYTES..len]).rotate_left(17) ^ len as u64
}

/// The chained hash after `prev` over `bytes`.
fn chain(prev: u128, bytes: &[u8]) -> u128 {
    xxh3_128_with_seed(bytes, (prev as u64) ^ ((prev >> 64) as u64))
}

/// The shapes of bodies read so far, bounded in bytes (least recently used out first).
pub(crate) struct Shapes {
    map: Mutex<cache::Sized<Bucket>>,
    limit: usize,
    /// Bodies read from an earlier body's message rather than from the start.
    resumed: AtomicU64,
}

impl Shapes {
    pub fn new(limit: usize) -> Self {
        Self {
            map: Mutex::new(cache::Sized::new(limit)),
            limit,
            resumed: AtomicU64::new(0),
        }
    }

    /// The body's parts, and the hash of each message's raw JSON.
    pub fn read<'a>(&self, body: &'a [u8]) -> Result<(ChatBody<'a>, Vec<u64>), Error> {
        let from = self.resume(body);
        if from.is_some() {
            self.resumed.fetch_add(1, Ordering::Relaxed);
        }
        let (parts, shape) = walk(body, from)?;
        let hashes = shape.messages.iter().map(|m| m.hash).collect();
        // A shape that would take more than an eighth of the bound is not kept: one body does
        // not push out every conversation's.
        let heavy = cache::Weigh::weight(&Bucket(vec![])) + shape_weight(&shape) > self.limit / 8;
        if let (Some(k), false) = (shape.key(body), heavy) {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            let mut shapes = match map.get(&k) {
                Some(b) => b.0.clone(),
                None => Vec::new(),
            };
            // A shape this one extends (the same chain at its last message) is dropped: a
            // request read twice, or a conversation's earlier turn.
            shapes.retain(|old| {
                let n = old.messages.len();
                n > shape.messages.len() || old.messages[n - 1].upto != shape.messages[n - 1].upto
            });
            shapes.insert(0, Arc::new(shape));
            shapes.truncate(BUCKET);
            map.put(k, Bucket(shapes));
            map.trim();
        }
        Ok((parts, hashes))
    }

    /// How many bodies were read from an earlier body's message on.
    pub fn resumed(&self) -> u64 {
        self.resumed.load(Ordering::Relaxed)
    }

    /// The shape that shares the most leading messages with `body`, and how many, among those
    /// kept under the longest prefix's key that has any.
    fn resume(&self, body: &[u8]) -> Option<(Arc<Shape>, usize)> {
        let mut len = prefix_len(body.len())?;
        // Shapes of one conversation share their leading messages: the body's hashes at their
        // ends are taken once.
        let mut chained = Vec::new();
        while len >= MIN_PREFIX {
            let k = key(body, len);
            let found = {
                let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
                map.get(&k).map(|b| b.0.clone())
            };
            let best = found
                .into_iter()
                .flatten()
                .map(|s| {
                    let n = shared(&s, body, &mut chained);
                    (s, n)
                })
                .filter(|(_, n)| *n > 0)
                .max_by_key(|(_, n)| *n);
            if best.is_some() {
                return best;
            }
            len /= 2;
        }
        None
    }
}

/// How many of the shape's leading messages end where `body`'s bytes hash the same. `chained`
/// holds the body's hash at message ends taken so far (by an earlier shape), reused where this
/// shape's messages end at the same places.
fn shared(shape: &Shape, body: &[u8], chained: &mut Vec<(usize, u128)>) -> usize {
    let mut h = 0u128;
    let mut at = 0;
    let mut aligned = true;
    for (i, m) in shape.messages.iter().enumerate() {
        let end = m.span.end;
        if !m.closed {
            return i;
        }
        match chained.get(i) {
            Some(&(e, known)) if aligned && e == end => h = known,
            _ => {
                let Some(bytes) = body.get(at..end) else {
                    return i;
                };
                h = chain(h, bytes);
                aligned = aligned && i == chained.len();
                if aligned {
                    chained.push((end, h));
                }
            }
        }
        if h != m.upto {
            return i;
        }
        at = end;
    }
    shape.messages.len()
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::Body(e.to_string())
}

/// A position in a body's top level.
struct Walk<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Walk<'a> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// The next byte after whitespace, taken.
    fn next(&mut self) -> Option<u8> {
        self.ws();
        let c = *self.b.get(self.at)?;
        self.at += 1;
        Some(c)
    }

    fn expect(&mut self, c: u8, what: &str) -> Result<(), Error> {
        match self.next() {
            Some(got) if got == c => Ok(()),
            Some(_) => Err(err(format!("expected {what} at byte {}", self.at - 1))),
            None => Err(err(format!("EOF while parsing, expected {what}"))),
        }
    }

    /// One JSON value read by serde_json: its text and span.
    fn value(&mut self) -> Result<(&'a str, Range<usize>), Error> {
        self.ws();
        let start = self.at;
        let mut values =
            serde_json::Deserializer::from_slice(&self.b[start..]).into_iter::<&'a RawValue>();
        let raw = match values.next() {
            Some(Ok(raw)) => raw,
            Some(Err(e)) => return Err(err(e)),
            None => return Err(err("EOF while parsing a value")),
        };
        self.at = start + values.byte_offset();
        Ok((raw.get(), start..self.at))
    }

    /// A value skipped as serde's derive skips an unknown field's (not kept, strings not checked
    /// as UTF-8).
    fn skip(&mut self) -> Result<(), Error> {
        self.ws();
        let start = self.at;
        let mut values = serde_json::Deserializer::from_slice(&self.b[start..])
            .into_iter::<serde::de::IgnoredAny>();
        match values.next() {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(err(e)),
            None => return Err(err("EOF while parsing a value")),
        }
        self.at = start + values.byte_offset();
        Ok(())
    }

    /// An object key, unescaped.
    fn key(&mut self) -> Result<String, Error> {
        self.ws();
        if self.b.get(self.at) != Some(&b'"') {
            return Err(err(format!("key must be a string at byte {}", self.at)));
        }
        let mut keys =
            serde_json::Deserializer::from_slice(&self.b[self.at..]).into_iter::<String>();
        let k = match keys.next() {
            Some(Ok(k)) => k,
            Some(Err(e)) => return Err(err(e)),
            None => return Err(err("EOF while parsing a key")),
        };
        self.at += keys.byte_offset();
        Ok(k)
    }
}

/// Adds the message read at `span`, or refuses a body of more than [`MAX_MESSAGES`].
fn push<'a>(
    messages: &mut Vec<(&'a str, Msg)>,
    raw: &'a str,
    span: Range<usize>,
    upto: u128,
) -> Result<(), Error> {
    if messages.len() >= MAX_MESSAGES {
        return Err(err(format!(
            "more than {MAX_MESSAGES} messages: not tokenized"
        )));
    }
    let closed = matches!(raw.as_bytes().last(), Some(b'}' | b']' | b'"'));
    let msg = Msg {
        span,
        hash: xxh3_64(raw.as_bytes()),
        upto,
        closed,
    };
    messages.push((raw, msg));
    Ok(())
}

/// Reads the body, from a shape's `n` leading messages where given (their bytes are the
/// body's), else from the start.
fn walk(body: &[u8], from: Option<(Arc<Shape>, usize)>) -> Result<(ChatBody<'_>, Shape), Error> {
    let mut w = Walk { b: body, at: 0 };
    let mut fields = Fields::default();
    let mut before = None;
    let mut messages: Vec<(&str, Msg)> = Vec::new();
    let mut upto = 0u128;
    let mut hashed = 0;
    // After a message, still in the array.
    let mut in_messages = false;
    if let Some((shape, n)) = from.filter(|(_, n)| *n > 0) {
        let end = shape.messages[n - 1].span.end;
        // The bytes are a body's that was read (up to a 128-bit hash): each message checked as
        // UTF-8 again rather than trusted, and the body read from the start if one is not.
        for m in &shape.messages[..n] {
            let Ok(raw) = std::str::from_utf8(&body[m.span.clone()]) else {
                return walk(body, None);
            };
            messages.push((raw, m.clone()));
        }
        fields = shape.before.clone();
        before = Some(shape.before.clone());
        upto = shape.messages[n - 1].upto;
        hashed = end;
        w.at = end;
        in_messages = true;
    } else {
        w.expect(b'{', "`{`")?;
        w.ws();
        if w.b.get(w.at) == Some(&b'}') {
            return Err(err("missing field `messages`"));
        }
    }
    loop {
        if in_messages {
            match w.next() {
                Some(b',') => {
                    let (raw, span) = w.value()?;
                    upto = chain(upto, &body[hashed..span.end]);
                    hashed = span.end;
                    push(&mut messages, raw, span, upto)?;
                    continue;
                }
                Some(b']') => in_messages = false,
                _ => return Err(err("expected `,` or `]` in `messages`")),
            }
        } else {
            let key = w.key()?;
            w.expect(b':', "`:`")?;
            let slot = match key.as_str() {
                "messages" => {
                    if before.is_some() {
                        return Err(err("duplicate field `messages`"));
                    }
                    before = Some(fields.clone());
                    w.expect(b'[', "an array of messages")?;
                    w.ws();
                    if w.b.get(w.at) == Some(&b']') {
                        w.at += 1;
                    } else {
                        let (raw, span) = w.value()?;
                        upto = chain(upto, &body[hashed..span.end]);
                        hashed = span.end;
                        push(&mut messages, raw, span, upto)?;
                        in_messages = true;
                        continue;
                    }
                    None
                }
                "tools" => Some(&mut fields.tools),
                "add_generation_prompt" => Some(&mut fields.add_generation_prompt),
                "chat_template_kwargs" => Some(&mut fields.chat_template_kwargs),
                "continue_final_message" => Some(&mut fields.continue_final_message),
                "documents" => Some(&mut fields.documents),
                "reasoning_effort" => Some(&mut fields.reasoning_effort),
                _ => {
                    w.skip()?;
                    None
                }
            };
            if let Some(slot) = slot {
                if slot.is_some() {
                    return Err(err(format!("duplicate field `{key}`")));
                }
                *slot = Some(w.value()?.1);
            }
        }
        match w.next() {
            Some(b',') => {}
            Some(b'}') => break,
            _ => return Err(err("expected `,` or `}`")),
        }
    }
    w.ws();
    if w.at != body.len() {
        return Err(err(format!("trailing characters at byte {}", w.at)));
    }
    let Some(before) = before else {
        return Err(err("missing field `messages`"));
    };
    let text = |r: &Option<Range<usize>>| -> Result<Option<&str>, Error> {
        match r {
            None => Ok(None),
            Some(r) => {
                let s = std::str::from_utf8(&body[r.clone()]).map_err(err)?;
                Ok((s != "null").then_some(s))
            }
        }
    };
    let flag = |r: &Option<Range<usize>>| -> Result<Option<bool>, Error> {
        match text(r)? {
            Some(s) => Ok(Some(serde_json::from_str::<bool>(s).map_err(err)?)),
            None => Ok(None),
        }
    };
    let reasoning_effort = match text(&fields.reasoning_effort)? {
        Some(s) => Some(serde_json::from_str::<String>(s).map_err(err)?),
        None => None,
    };
    let parts = ChatBody {
        messages: messages.iter().map(|(raw, _)| *raw).collect(),
        tools: text(&fields.tools)?,
        add_generation_prompt: flag(&fields.add_generation_prompt)?,
        chat_template_kwargs: text(&fields.chat_template_kwargs)?,
        continue_final_message: flag(&fields.continue_final_message)?,
        documents: text(&fields.documents)?,
        reasoning_effort,
        calls: crate::chat::Calls::Validated,
    };
    let mut kept: Vec<Msg> = messages.into_iter().map(|(_, m)| m).collect();
    kept.shrink_to_fit();
    let shape = Shape {
        before,
        messages: kept,
    };
    Ok((parts, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The same parts as serde_json's derive gives, or an error where it gives one.
    fn same(shapes: &Shapes, body: &[u8]) {
        let want = ChatBody::parse(body);
        let got = shapes.read(body);
        match (&want, &got) {
            (Ok(w), Ok((g, hashes))) => {
                assert_eq!(w, g, "{}", String::from_utf8_lossy(body));
                let h: Vec<u64> = w.messages.iter().map(|m| xxh3_64(m.as_bytes())).collect();
                assert_eq!(&h, hashes);
            }
            (Err(_), Err(_)) => {}
            _ => panic!(
                "reference {:?}, here {:?}: {}",
                want.map(|_| ()),
                got.map(|_| ()),
                String::from_utf8_lossy(body)
            ),
        }
    }

    fn turn(i: usize) -> serde_json::Value {
        let role = if i.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        json!({"role": role, "content": format!("turn {i}: {}", "words and more words ".repeat(20 + i % 7))})
    }

    #[test]
    fn bodies_read_as_serde_reads_them() {
        let s = Shapes::new(1 << 20);
        let m = r#"{"role":"user","content":"hi"}"#;
        let cases = [
            format!(r#"{{"messages":[{m}]}}"#),
            format!(r#"  {{ "messages" : [ {m} , {m} ] , "tools" : null }} "#),
            format!(
                r#"{{"tools":[{{"type":"function"}}],"messages":[{m}],"add_generation_prompt":false}}"#
            ),
            format!(
                r#"{{"messages":[{m}],"chat_template_kwargs":{{"enable_thinking":true}},"x":[1,{{"a":2}}]}}"#
            ),
            format!(r#"{{"mess\u0061ges":[{m}]}}"#),
            r#"{"messages":[]}"#.to_string(),
            format!(r#"{{"messages":[{m}],"add_generation_prompt":null}}"#),
            format!(
                r#"{{"reasoning_effort":"high","messages":[{m}],"continue_final_message":true,"documents":[{{"title":"t"}}]}}"#
            ),
            format!(
                r#"{{"messages":[{m}],"reasoning_effort":null,"documents":null,"continue_final_message":null}}"#
            ),
            // Refused by both.
            format!(r#"{{"messages":[{m}],"reasoning_effort":1}}"#),
            format!(r#"{{"messages":[{m}],"continue_final_message":"yes"}}"#),
            format!(r#"{{"messages":[{m}],"messages":[{m}]}}"#),
            format!(r#"{{"messages":[{m}],"tools":[],"tools":[]}}"#),
            format!(r#"{{"messages":[{m}]}} x"#),
            format!(r#"{{"messages":[{m},]}}"#),
            format!(r#"{{"messages":[{m}],}}"#),
            format!(r#"{{"messages":[{m}] "tools":[]}}"#),
            format!(r#"{{"messages":[{m}],"add_generation_prompt":1}}"#),
            r#"{"messages":null}"#.to_string(),
            format!(r#"{{"messages":[{m}]"#),
            r#"{"tools":[]}"#.to_string(),
            "{}".to_string(),
            "[]".to_string(),
            "".to_string(),
            format!(r#"{{messages:[{m}]}}"#),
            r#"{"messages":[{"role":"user","content":"\ud800"}]}"#.to_string(),
            format!(r#"[[{m}]]"#),
            "[[],null,true]".to_string(),
            format!(r#"{{"messages":[{m},5]}}"#),
        ];
        for c in &cases {
            same(&s, c.as_bytes());
        }
        same(&s, b"{\"messages\":[\"\xff\"]}");
        // An unknown field's string is skipped unchecked, as serde's derive skips it.
        same(
            &s,
            b"{\"messages\":[{\"role\":\"user\"}],\"user\":\"\xff\",\"x\":{\"\xff\":1}}",
        );
        let many = format!(r#"{{"messages":[{}{{}}]}}"#, "{},".repeat(MAX_MESSAGES));
        assert!(s.read(many.as_bytes()).is_err(), "past the bound");
        assert!(ChatBody::parse(many.as_bytes()).is_ok());
    }

    #[test]
    fn a_resent_history_is_read_from_its_last_shared_message() {
        let s = Shapes::new(1 << 24);
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
        for i in 0..40 {
            messages.push(turn(i));
            // Fields before and after the messages, as SDKs order them.
            let body = json!({"messages": messages, "model": "m", "tools": tools});
            same(&s, serde_json::to_string(&body).unwrap().as_bytes());
            let pretty = serde_json::to_string_pretty(&body).unwrap();
            same(&s, pretty.as_bytes());
        }
        assert!(s.resumed() >= 60, "resumed {}", s.resumed());
        // A history edited in its middle is read from before the edit, and read right.
        messages[20] = json!({"role": "user", "content": "edited"});
        let before = s.resumed();
        let body =
            serde_json::to_string(&json!({"messages": messages, "model": "m", "tools": tools}));
        same(&s, body.unwrap().as_bytes());
        assert_eq!(s.resumed(), before + 1);
    }

    #[test]
    fn a_message_without_its_own_delimiter_is_not_resumed_after() {
        let s = Shapes::new(1 << 20);
        let head = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}},"#,
            "a".repeat(1100)
        );
        same(&s, format!("{head}5]}}").as_bytes());
        for tail in ["55]}", "5.5]}", "5e3]}", "5,{}]}"] {
            same(&s, format!("{head}{tail}").as_bytes());
        }
    }

    #[test]
    fn a_body_read_twice_is_kept_once() {
        let s = Shapes::new(1 << 20);
        let messages: Vec<_> = (0..8).map(turn).collect();
        let body = serde_json::to_vec(&json!({"messages": messages})).unwrap();
        for _ in 0..3 {
            same(&s, &body);
        }
        let (shape, n) = s.resume(&body).expect("a shape");
        assert_eq!((shape.messages.len(), n), (8, 8));
        let k = shape.key(&body).expect("a key");
        assert_eq!(s.map.lock().unwrap().get(&k).expect("kept").0.len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// A body of a known conversation with one byte changed (in the history, in a new turn,
        /// or in the fields after it) reads as serde_json reads it.
        #[test]
        fn a_changed_byte_reads_as_serde_reads_it(
            turns in 4usize..24,
            at in any::<prop::sample::Index>(),
            byte in prop::sample::select(b"{}[],:\"\\ ax0\xff\x7f".to_vec()),
        ) {
            let s = Shapes::new(1 << 24);
            let mut messages: Vec<_> = (0..turns).map(turn).collect();
            let body = |m: &[serde_json::Value]| {
                serde_json::to_vec(&json!({"messages": m, "model": "m", "add_generation_prompt": true})).unwrap()
            };
            same(&s, &body(&messages));
            messages.push(turn(turns));
            let mut b = body(&messages);
            let i = at.index(b.len());
            b[i] = byte;
            same(&s, &b);
        }
    }
}
