//! The structural digest of a JSON value (tool definitions and calls, images, unknown blocks):
//! key order and whitespace do not matter, and keys named `cache_control` are left out at
//! every depth (a caching hint, not prompt content).
//!
//! The bytes hashed are those hash version 2 defined over a `serde_json::Value`: `n`; `t` or
//! `f`; `#` and the number as serde_json prints it; `s`, the length and the string; `[`, the
//! length and the items; `{`, then the keys in byte order (the last of a repeated key), each
//! with its length and its value, then `}`. What a `Value` could not hold (nesting 128 deep, a
//! number out of range, a lone surrogate) is digested as its raw text, as it was. Built on a
//! flat tape of the value's tokens, reused from one digest to the next: no tree, and no
//! allocation per value once the tape has grown.

use std::fmt::Write;

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::json::{scalar_end, ws, Raw};

/// The deepest nesting a `serde_json::Value` is read with.
const MAX_DEPTH: usize = 127;

/// One token of a value; positions are in the value's text, `end`s are tape indices.
#[derive(Clone, Copy)]
enum Tok {
    Null,
    True,
    False,
    Num {
        start: usize,
        end: usize,
    },
    Str {
        start: usize,
        end: usize,
        esc: usize,
    },
    Arr {
        len: u64,
        end: usize,
    },
    Obj {
        end: usize,
    },
    /// A key: its decoded bytes in the text or, when escaped, in the arena.
    Key {
        start: usize,
        end: usize,
        arena: bool,
    },
}

#[derive(Default)]
pub(super) struct Digester {
    tape: Vec<Tok>,
    /// Decoded escaped keys.
    arena: Vec<u8>,
    /// Members of the objects being walked: (key, value) tape indices.
    members: Vec<(usize, usize)>,
    /// A decoded escaped string.
    scratch: Vec<u8>,
    number: String,
}

impl Digester {
    /// The digest of `raw` (a value in a checked span).
    pub fn digest(&mut self, raw: Raw) -> u64 {
        let b = raw.text;
        self.tape.clear();
        self.arena.clear();
        self.members.clear();
        if self.build(raw, 0, 0).is_some() {
            let mut h = Xxh3::new();
            if self.walk(raw, 0, &mut h).is_some() {
                return h.digest();
            }
        }
        xxh3_64(b)
    }

    /// Appends the tokens of the value at `i` (at `depth` containers deep); its end in `b`.
    fn build(&mut self, raw: Raw, i: usize, depth: usize) -> Option<usize> {
        let b = raw.text;
        let (tok, end) = match b[i] {
            b'n' => (Tok::Null, i + 4),
            b't' => (Tok::True, i + 4),
            b'f' => (Tok::False, i + 5),
            b'"' => {
                let (end, esc) = raw.string_end(i + 1);
                if !raw.str(i + 1, end, esc).valid() {
                    return None;
                }
                let tok = Tok::Str {
                    start: i + 1,
                    end,
                    esc,
                };
                (tok, end + 1)
            }
            open @ (b'[' | b'{') => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                let at = self.tape.len();
                self.tape.push(Tok::Null);
                let close = if open == b'[' { b']' } else { b'}' };
                let mut j = ws(b, i + 1);
                let mut len = 0;
                while b[j] != close {
                    if open == b'{' {
                        j = self.key(raw, j)?;
                    }
                    j = ws(b, self.build(raw, j, depth + 1)?);
                    len += 1;
                    if b[j] == b',' {
                        j = ws(b, j + 1);
                    }
                }
                let end = self.tape.len();
                self.tape[at] = if open == b'[' {
                    Tok::Arr { len, end }
                } else {
                    Tok::Obj { end }
                };
                return Some(j + 1);
            }
            _ => {
                // Checked here, not when walked: a `Value` refuses one out of range even
                // under a key the digest leaves out.
                let end = scalar_end(b, i);
                self.number(&b[i..end])?;
                (Tok::Num { start: i, end }, end)
            }
        };
        self.tape.push(tok);
        Some(end)
    }

    /// Appends the key at `i` (its opening quote); the start of its value.
    fn key(&mut self, raw: Raw, i: usize) -> Option<usize> {
        let b = raw.text;
        let (end, esc) = raw.string_end(i + 1);
        let s = raw.str(i + 1, end, esc);
        if !s.valid() {
            return None;
        }
        let tok = if esc > 0 {
            let start = self.arena.len();
            s.pieces(|p| self.arena.extend_from_slice(p));
            Tok::Key {
                start,
                end: self.arena.len(),
                arena: true,
            }
        } else {
            Tok::Key {
                start: i + 1,
                end,
                arena: false,
            }
        };
        self.tape.push(tok);
        // The colon between.
        Some(ws(b, ws(b, end + 1) + 1))
    }

    /// Hashes the value at tape index `t`; the index after it.
    fn walk(&mut self, raw: Raw, t: usize, h: &mut Xxh3) -> Option<usize> {
        let b = raw.text;
        match self.tape[t] {
            Tok::Null => h.update(b"n"),
            Tok::True => h.update(b"t"),
            Tok::False => h.update(b"f"),
            Tok::Num { start, end } => {
                h.update(b"#");
                h.update(self.number(&b[start..end])?);
            }
            Tok::Str { start, end, esc } => {
                h.update(b"s");
                let s = if esc > 0 {
                    self.scratch.clear();
                    raw.str(start, end, esc)
                        .pieces(|p| self.scratch.extend_from_slice(p));
                    &self.scratch[..]
                } else {
                    &b[start..end]
                };
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s);
            }
            Tok::Arr { len, end } => {
                h.update(b"[");
                h.update(&len.to_le_bytes());
                let mut i = t + 1;
                while i < end {
                    i = self.walk(raw, i, h)?;
                }
                return Some(end);
            }
            Tok::Obj { end } => {
                h.update(b"{");
                let base = self.members.len();
                let mut i = t + 1;
                while i < end {
                    self.members.push((i, i + 1));
                    i = self.after(i + 1);
                }
                let Digester {
                    tape,
                    arena,
                    members,
                    ..
                } = self;
                let key = |k: usize| key_bytes(b, arena, tape[k]);
                // Stable: among equal keys the last stays last, and is the one kept.
                members[base..].sort_by(|x, y| key(x.0).cmp(key(y.0)));
                for m in base..self.members.len() {
                    let (k, v) = self.members[m];
                    let name = key_bytes(b, &self.arena, self.tape[k]);
                    let repeated = self.members.get(m + 1).is_some_and(|&(next, _)| {
                        key_bytes(b, &self.arena, self.tape[next]) == name
                    });
                    if repeated || name == b"cache_control" {
                        continue;
                    }
                    h.update(&(name.len() as u64).to_le_bytes());
                    h.update(name);
                    self.walk(raw, v, h)?;
                }
                self.members.truncate(base);
                h.update(b"}");
                return Some(end);
            }
            Tok::Key { .. } => return None,
        }
        Some(t + 1)
    }

    /// The tape index after the value at `t`.
    fn after(&self, t: usize) -> usize {
        match self.tape[t] {
            Tok::Arr { end, .. } | Tok::Obj { end } => end,
            _ => t + 1,
        }
    }

    /// A number as serde_json prints the `Number` it reads; `None` out of range.
    fn number<'s>(&'s mut self, text: &'s [u8]) -> Option<&'s [u8]> {
        // Integers of up to 18 digits print as written.
        let digits = text.strip_prefix(b"-").unwrap_or(text);
        let plain = digits.len() <= 18
            && digits.iter().all(u8::is_ascii_digit)
            && (digits == b"0" || digits.first() != Some(&b'0'))
            && text != b"-0";
        if plain {
            return Some(text);
        }
        let n: serde_json::Number = serde_json::from_slice(text).ok()?;
        self.number.clear();
        write!(self.number, "{n}").ok()?;
        Some(self.number.as_bytes())
    }
}

fn key_bytes<'s>(b: &'s [u8], arena: &'s [u8], tok: Tok) -> &'s [u8] {
    match tok {
        Tok::Key {
            start,
            end,
            arena: true,
        } => &arena[start..end],
        Tok::Key { start, end, .. } => &b[start..end],
        _ => &[],
    }
}
