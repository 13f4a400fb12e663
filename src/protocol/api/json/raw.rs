//! Reading a value in a checked span: [`Raw`] skips and splits values (objects, arrays,
//! strings) trusting the check, and [`Elements`] walks an array.

use memchr::memchr2;

use super::{scalar_end, ws, Span, Str, Strings, LONG};

/// A JSON value's text inside a span [`top_fields`] checked: valid JSON and UTF-8.
///
/// [`top_fields`]: super::top_fields
#[derive(Clone, Copy, Debug)]
pub(crate) struct Raw<'a> {
    pub text: &'a [u8],
    /// A string's escapes: 0 if none, else one past its last backslash, from the body's start
    /// (meaningless for other values).
    esc: usize,
    /// Where `text` starts in the body.
    base: usize,
    strings: &'a Strings,
}

/// In a checked span: the index of the closing quote of the string whose body starts at `i`,
/// and its escapes (see [`Raw`]).
fn string_end(b: &[u8], start: usize) -> (usize, usize) {
    let (mut i, mut esc) = (start, 0);
    while let Some(k) = b.get(i..).and_then(|rest| memchr2(b'"', b'\\', rest)) {
        let j = i + k;
        if b[j] == b'"' {
            return (j, esc);
        }
        esc = j + 1 - start;
        i = j + 2;
    }
    (b.len(), esc)
}

impl<'a> Raw<'a> {
    /// The checked span `start..end` of `body`.
    pub fn new(body: &'a [u8], (start, end, esc): Span, strings: &'a Strings) -> Raw<'a> {
        Raw {
            text: &body[start..end],
            esc,
            base: start,
            strings,
        }
    }

    /// The closing quote of the string whose body starts at `i` of this value's text, and
    /// its escapes (see [`Raw`]).
    pub fn string_end(&self, i: usize) -> (usize, usize) {
        // A short string ends within its first `LONG` bytes (a byte loop beats a call to
        // `memchr` there); a long one the check recorded.
        let b = self.text;
        let (mut j, mut esc) = (i, 0);
        while j < b.len().min(i + LONG) {
            match b[j] {
                b'"' => return (j, esc),
                b'\\' => {
                    esc = j + 1 - i;
                    j += 2;
                }
                _ => j += 1,
            }
        }
        match self.strings.end(self.base + i) {
            Some((end, esc)) => (end - self.base, esc),
            None => string_end(self.text, i),
        }
    }

    /// The end of the value at `i` of this value's text (not whitespace), and its escapes if
    /// it is a string.
    fn skip(&self, i: usize) -> (usize, usize) {
        let b = self.text;
        match b[i] {
            b'"' => {
                let (end, esc) = self.string_end(i + 1);
                (end + 1, esc)
            }
            b'[' | b'{' => {
                if let Some(end) = self.strings.container_end(self.base + i) {
                    return (end - self.base, 0);
                }
                let mut depth = 0usize;
                let mut j = i;
                while j < b.len() {
                    match b[j] {
                        b'"' => j = self.string_end(j + 1).0,
                        b'[' | b'{' => depth += 1,
                        b']' | b'}' => {
                            depth -= 1;
                            if depth == 0 {
                                return (j + 1, 0);
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                (b.len(), 0)
            }
            _ => (scalar_end(b, i), 0),
        }
    }

    /// The value at `i` of this value's text, and its end.
    fn at(&self, i: usize) -> (Raw<'a>, usize) {
        let (end, esc) = self.skip(i);
        let raw = Raw {
            text: &self.text[i..end],
            esc,
            base: self.base + i,
            strings: self.strings,
        };
        (raw, end)
    }

    /// A string's body in this value's text, `start..end`.
    pub fn str(&self, start: usize, end: usize, esc: usize) -> Str<'a> {
        Str {
            inner: &self.text[start..end],
            esc,
            sur: self.strings.surrogates,
        }
    }

    pub fn is_null(&self) -> bool {
        self.text == b"null"
    }

    /// The string this value is, if it is one that `serde_json` would read as a `str` (no
    /// lone surrogate).
    pub fn string(&self) -> Option<Str<'a>> {
        let t = self.text;
        if t.first() != Some(&b'"') {
            return None;
        }
        let s = self.str(1, t.len() - 1, self.esc);
        s.valid().then_some(s)
    }

    /// The elements of this value, if it is an array.
    pub fn elements(&self) -> Option<Elements<'a>> {
        (self.text.first() == Some(&b'[')).then(|| Elements {
            array: *self,
            i: ws(self.text, 1),
        })
    }

    /// The value read as a struct of optional raw fields `names`, as `serde_derive` would: an
    /// object (unknown keys skipped, a repeated field refused, `null` as absent) or an array
    /// of at most `names.len()` values by position.
    pub fn fields<const N: usize>(&self, names: &[&str; N]) -> Option<[Option<Raw<'a>>; N]> {
        let b = self.text;
        let mut out = [None; N];
        match b.first()? {
            b'{' => {
                let mut seen = [false; N];
                let mut i = ws(b, 1);
                if b[i] == b'}' {
                    return Some(out);
                }
                loop {
                    let (end, esc) = self.string_end(i + 1);
                    let key = self.str(i + 1, end, esc);
                    if !key.valid() {
                        return None;
                    }
                    let field = names.iter().position(|n| key.is(n));
                    i = ws(b, ws(b, end + 1) + 1);
                    let (value, next) = self.at(i);
                    if let Some(f) = field {
                        if std::mem::replace(&mut seen[f], true) {
                            return None;
                        }
                        out[f] = (!value.is_null()).then_some(value);
                    }
                    i = ws(b, next);
                    if b[i] == b'}' {
                        return Some(out);
                    }
                    i = ws(b, i + 1);
                }
            }
            b'[' => {
                let mut elements = self.elements()?;
                for slot in out.iter_mut() {
                    match elements.next() {
                        Some(v) => *slot = (!v.is_null()).then_some(v),
                        None => return Some(out),
                    }
                }
                elements.next().is_none().then_some(out)
            }
            _ => None,
        }
    }

    /// The value as a `u32`, as `serde_json` reads one (integers only, in range).
    pub fn u32(&self) -> Option<u32> {
        let t = self.text;
        if !t.is_empty() && t.len() <= 9 && t.iter().all(u8::is_ascii_digit) {
            return Some(t.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')));
        }
        if !matches!(t.first(), Some(b'-' | b'0'..=b'9')) {
            return None;
        }
        serde_json::from_slice(t).ok()
    }
}

/// The elements of an array in a checked span.
#[derive(Clone)]
pub(crate) struct Elements<'a> {
    array: Raw<'a>,
    i: usize,
}

impl<'a> Elements<'a> {
    pub fn is_empty(&self) -> bool {
        self.array.text[self.i] == b']'
    }
}

impl<'a> Iterator for Elements<'a> {
    type Item = Raw<'a>;

    fn next(&mut self) -> Option<Raw<'a>> {
        let b = self.array.text;
        if self.i >= b.len() || b[self.i] == b']' {
            return None;
        }
        let (v, next) = self.array.at(self.i);
        let i = ws(b, next);
        // A comma, or the closing bracket (kept, so the next call ends).
        self.i = if b.get(i) == Some(&b',') {
            ws(b, i + 1)
        } else {
            i
        };
        Some(v)
    }
}
