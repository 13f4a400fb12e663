//! JSON text for the equivalence proptests, written as clients may write it: key order,
//! whitespace, escapes and the odd repeated key drawn from a seed.

use serde_json::Value;

/// A string holding this marker is written as the raw text that follows it.
pub const RAW: &str = "\u{0}RAW:";

/// Writes `v` as JSON, with the choices a client may make drawn from `rng`: key order,
/// whitespace, which characters are escaped and how; now and then a repeated key.
struct Writer {
    out: Vec<u8>,
    rng: u64,
}

impl Writer {
    fn roll(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n
    }

    fn ws(&mut self) {
        const WS: [&[u8]; 6] = [b"", b"", b"", b" ", b"\n  ", b"\t\r\n"];
        let w = WS[self.roll(WS.len() as u64) as usize];
        self.out.extend_from_slice(w);
    }

    fn string(&mut self, s: &str) {
        self.out.push(b'"');
        for c in s.chars() {
            let escape = self.roll(8) == 0;
            match c {
                '"' => self.out.extend_from_slice(b"\\\""),
                '\\' => self.out.extend_from_slice(b"\\\\"),
                '/' if escape => self.out.extend_from_slice(b"\\/"),
                '\n' if !escape => self.out.extend_from_slice(b"\\n"),
                c if (c as u32) < 0x20 || escape => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let hex = if self.roll(2) == 0 {
                            format!("\\u{:04x}", u)
                        } else {
                            format!("\\u{:04X}", u)
                        };
                        self.out.extend_from_slice(hex.as_bytes());
                    }
                }
                c => {
                    let mut buf = [0; 4];
                    self.out
                        .extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        self.out.push(b'"');
    }

    fn value(&mut self, v: &Value) {
        self.ws();
        match v {
            Value::String(s) if s.starts_with(RAW) => {
                self.out.extend_from_slice(&s.as_bytes()[RAW.len()..])
            }
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                self.out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    self.value(item);
                }
                self.ws();
                self.out.push(b']');
            }
            Value::Object(map) => {
                let mut members: Vec<(&String, &Value)> = map.iter().collect();
                for i in (1..members.len()).rev() {
                    let j = self.roll(i as u64 + 1) as usize;
                    members.swap(i, j);
                }
                if !members.is_empty() && self.roll(24) == 0 {
                    let again = members[self.roll(members.len() as u64) as usize];
                    members.push(again);
                }
                self.out.push(b'{');
                for (i, (k, v)) in members.into_iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    self.ws();
                    self.string(k);
                    self.ws();
                    self.out.push(b':');
                    self.value(v);
                }
                self.ws();
                self.out.push(b'}');
            }
            other => self
                .out
                .extend_from_slice(serde_json::to_string(other).expect("json").as_bytes()),
        }
        self.ws();
    }
}

pub fn write(v: &Value, seed: u64) -> Vec<u8> {
    let mut w = Writer {
        out: Vec::new(),
        rng: seed | 1,
    };
    w.value(v);
    w.out
}
