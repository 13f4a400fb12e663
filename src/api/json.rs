//! A JSON scanner over the body's bytes: what the prompt readers need of JSON, without a tree.
//!
//! Two passes. [`top_fields`] checks the whole body as `serde_json::from_slice` into a struct
//! of optional raw fields would (strict grammar; UTF-8 checked in keys and in the fields it
//! keeps, not in the values it skips; duplicate fields refused; an array read by position;
//! `null` as absent) and hands back the spans of the fields asked for. Everything inside those
//! spans is then known to be valid JSON and UTF-8, so [`Raw`] navigates it with a fast skipper
//! that only looks for quotes, backslashes and brackets (string bodies are crossed with
//! `memchr`). What typed parsing would still refuse inside a span — a lone surrogate in a
//! string or key, a duplicate key of a struct — is checked where it is read.
//!
//! Not a general JSON library: no numbers beyond what the readers need, and no tree.

use memchr::{memchr, memchr2};

/// The body is not what `serde_json` would have read (any reason: syntax, UTF-8, duplicates).
#[derive(Debug)]
pub(super) struct Invalid;

/// A JSON value's text inside a span [`top_fields`] checked: valid JSON and UTF-8.
#[derive(Clone, Copy, Debug)]
pub(super) struct Raw<'a> {
    pub text: &'a [u8],
    /// A string's escapes: 0 if none, else one past its last backslash, from the body's start
    /// (meaningless for other values).
    esc: usize,
    /// Where `text` starts in the body.
    base: usize,
    strings: &'a Strings,
}

/// What the check learnt of the body's strings and containers, so reading never scans one
/// twice.
#[derive(Debug, Default)]
pub(super) struct Strings {
    /// Strings of at least [`LONG`] bytes: where the body starts, its closing quote, its
    /// escapes (as [`Raw`]'s); in the body's order.
    long: Vec<(usize, usize, usize)>,
    /// Arrays and objects of at least [`LONG`] bytes: where each opens and ends, in order.
    containers: Vec<(usize, usize)>,
    /// The body has `\u` escapes of surrogates: strings must be checked for lone ones.
    surrogates: bool,
}

/// A string, array or object this long is found again by a lookup rather than a scan.
const LONG: usize = 64;

impl Strings {
    fn end(&self, start: usize) -> Option<(usize, usize)> {
        let at = self.long.binary_search_by_key(&start, |l| l.0).ok()?;
        let (_, end, esc) = self.long[at];
        Some((end, esc))
    }

    fn container_end(&self, start: usize) -> Option<usize> {
        let at = self.containers.binary_search_by_key(&start, |c| c.0).ok()?;
        Some(self.containers[at].1)
    }
}

/// A JSON string's body (between its quotes) in a checked span.
#[derive(Clone, Copy, Debug)]
pub(super) struct Str<'a> {
    pub inner: &'a [u8],
    /// 0 if no escape, else one past the last backslash.
    pub esc: usize,
    /// May have escaped surrogates (see [`Raw`]).
    pub sur: bool,
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\n' | b'\t' | b'\r')
}

pub(super) fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && is_ws(b[i]) {
        i += 1;
    }
    i
}

/// The first index at or after `i` that is not a byte of a number or literal.
pub(super) fn scalar_end(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && !matches!(b[i], b',' | b']' | b'}' | b' ' | b'\n' | b'\t' | b'\r') {
        i += 1;
    }
    i
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
pub(super) struct Elements<'a> {
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

fn hex4(b: &[u8]) -> Option<u16> {
    let s = std::str::from_utf8(b.get(..4)?).ok()?;
    u16::from_str_radix(s, 16).ok()
}

impl<'a> Str<'a> {
    /// No lone surrogate among its `\u` escapes (what `serde_json` checks when it reads a str).
    pub fn valid(&self) -> bool {
        if self.esc == 0 || !self.sur {
            return true;
        }
        let b = self.inner;
        let mut i = 0;
        while let Some(k) = memchr(b'\\', &b[i..]) {
            let j = i + k;
            if b[j + 1] != b'u' {
                i = j + 2;
                continue;
            }
            let Some(n) = hex4(&b[j + 2..]) else {
                return false;
            };
            i = j + 6;
            match n {
                0xDC00..=0xDFFF => return false,
                0xD800..=0xDBFF => {
                    let trail = (b.get(i) == Some(&b'\\') && b.get(i + 1) == Some(&b'u'))
                        .then(|| hex4(&b[i + 2..]))
                        .flatten();
                    if !matches!(trail, Some(0xDC00..=0xDFFF)) {
                        return false;
                    }
                    i += 6;
                }
                _ => {}
            }
        }
        true
    }

    /// Calls `f` with the decoded string in pieces (of a [`Raw::string`]: valid).
    pub fn pieces(&self, mut f: impl FnMut(&[u8])) {
        let b = self.inner;
        if self.esc == 0 {
            return f(b);
        }
        // No backslash from `esc` on: the rest is one piece, found without a scan.
        let mut i = 0;
        while let Some(k) = (i < self.esc).then(|| memchr(b'\\', &b[i..])).flatten() {
            let j = i + k;
            if j > i {
                f(&b[i..j]);
            }
            let simple = match b[j + 1] {
                b'b' => 0x08,
                b'f' => 0x0c,
                b'n' => b'\n',
                b'r' => b'\r',
                b't' => b'\t',
                b'u' => 0,
                c => c,
            };
            if b[j + 1] != b'u' {
                f(&[simple]);
                i = j + 2;
                continue;
            }
            let n = u32::from(hex4(&b[j + 2..]).unwrap_or(0));
            i = j + 6;
            let c = if (0xD800..=0xDBFF).contains(&n) {
                let low = u32::from(hex4(&b[i + 2..]).unwrap_or(0));
                i += 6;
                0x1_0000 + ((n - 0xD800) << 10) + (low.wrapping_sub(0xDC00) & 0x3ff)
            } else {
                n
            };
            let mut buf = [0; 4];
            f(char::from_u32(c)
                .unwrap_or(char::REPLACEMENT_CHARACTER)
                .encode_utf8(&mut buf)
                .as_bytes());
        }
        if i < b.len() {
            f(&b[i..]);
        }
    }

    /// Whether the decoded string is `s`.
    pub fn is(&self, s: &str) -> bool {
        if self.esc == 0 {
            return self.inner == s.as_bytes();
        }
        let mut rest = s.as_bytes();
        let mut same = true;
        self.pieces(|p| match rest.strip_prefix(p) {
            Some(r) if same => rest = r,
            _ => same = false,
        });
        same && rest.is_empty()
    }

    pub fn owned(self) -> String {
        let mut out = Vec::with_capacity(self.inner.len());
        self.pieces(|p| out.extend_from_slice(p));
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The checking scanner of the whole body: strict JSON as `serde_json` reads it.
struct Checker<'a> {
    b: &'a [u8],
    i: usize,
    /// Open brackets of the value being skipped.
    /// Open brackets of the value being skipped, with where each opened.
    stack: Vec<(u8, usize)>,
    strings: Strings,
}

impl<'a> Checker<'a> {
    fn ws(&mut self) {
        self.i = ws(self.b, self.i);
    }

    fn peek(&self) -> Result<u8, Invalid> {
        self.b.get(self.i).copied().ok_or(Invalid)
    }

    fn eat(&mut self, c: u8) -> Result<(), Invalid> {
        self.ws();
        if self.peek()? != c {
            return Err(Invalid);
        }
        self.i += 1;
        Ok(())
    }

    /// A string whose opening quote is at `i`; `utf8`: refuse invalid UTF-8 in it. Returns
    /// its escapes (see [`Raw`]).
    fn string(&mut self, utf8: bool) -> Result<usize, Invalid> {
        let b = self.b;
        let start = self.i + 1;
        let mut i = start;
        let mut esc = 0;
        loop {
            let k = memchr2(b'"', b'\\', &b[i..]).ok_or(Invalid)?;
            let j = i + k;
            check_piece(&b[i..j], utf8)?;
            if b[j] == b'"' {
                if j - start >= LONG {
                    self.strings.long.push((start, j, esc));
                }
                self.i = j + 1;
                return Ok(esc);
            }
            esc = j + 1 - start;
            match b.get(j + 1) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i = j + 2,
                Some(b'u') => {
                    let hex = b.get(j + 2..j + 6).ok_or(Invalid)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return Err(Invalid);
                    }
                    // `\uD800`-`\uDFFF`.
                    self.strings.surrogates |= matches!(hex[0], b'd' | b'D')
                        && matches!(hex[1], b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F');
                    i = j + 6;
                }
                _ => return Err(Invalid),
            }
        }
    }

    fn number(&mut self) -> Result<(), Invalid> {
        let b = self.b;
        let digits = |i: usize| i + b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        let mut i = self.i;
        if b[i] == b'-' {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits(i),
            _ => return Err(Invalid),
        }
        if b.get(i) == Some(&b'.') {
            let end = digits(i + 1);
            if end == i + 1 {
                return Err(Invalid);
            }
            i = end;
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let end = digits(i);
            if end == i {
                return Err(Invalid);
            }
            i = end;
        }
        if matches!(b.get(i), Some(b'0'..=b'9')) {
            // A leading zero followed by digits.
            return Err(Invalid);
        }
        self.i = i;
        Ok(())
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), Invalid> {
        if !self.b[self.i..].starts_with(word) {
            return Err(Invalid);
        }
        self.i += word.len();
        Ok(())
    }

    /// A key and its colon, at an expected key.
    fn key(&mut self, utf8: bool) -> Result<(), Invalid> {
        self.ws();
        if self.peek()? != b'"' {
            return Err(Invalid);
        }
        self.string(utf8)?;
        self.eat(b':')
    }

    /// Skips one value (iteratively: any depth), checking it; `utf8`: refuse invalid UTF-8 in
    /// its strings. Returns the value's span and whether it is a string with escapes.
    fn value(&mut self, utf8: bool) -> Result<Span, Invalid> {
        self.ws();
        let start = self.i;
        let mut esc = 0;
        self.stack.clear();
        loop {
            self.ws();
            match self.peek()? {
                b'"' => esc = self.string(utf8)?,
                b'n' => self.literal(b"null")?,
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'-' | b'0'..=b'9' => self.number()?,
                open @ (b'[' | b'{') => {
                    let at = self.i;
                    self.i += 1;
                    self.ws();
                    let close = if open == b'[' { b']' } else { b'}' };
                    if self.peek()? == close {
                        self.i += 1;
                    } else {
                        self.stack.push((open, at));
                        if open == b'{' {
                            self.key(utf8)?;
                        }
                        continue;
                    }
                }
                _ => return Err(Invalid),
            }
            // After a value: close what ends here, then a comma starts the next one.
            loop {
                let Some(&(open, at)) = self.stack.last() else {
                    return Ok((start, self.i, esc));
                };
                self.ws();
                match (open, self.peek()?) {
                    (_, b',') => {
                        self.i += 1;
                        if open == b'{' {
                            self.key(utf8)?;
                        }
                        break;
                    }
                    (b'[', b']') | (b'{', b'}') => {
                        self.i += 1;
                        self.stack.pop();
                        if self.i - at >= LONG {
                            self.strings.containers.push((at, self.i));
                        }
                    }
                    _ => return Err(Invalid),
                }
            }
        }
    }

    /// A field's value: `None` for `null`, else the checked span (UTF-8 refused if invalid).
    fn field(&mut self) -> Result<Option<Span>, Invalid> {
        self.ws();
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            return Ok(None);
        }
        self.value(true).map(Some)
    }
}

/// Refuses control characters, and with `utf8` invalid UTF-8, in a piece of a string body.
fn check_piece(p: &[u8], utf8: bool) -> Result<(), Invalid> {
    // Plain printable ASCII is the common case: one pass without branches, which vectorises.
    let odd = p
        .iter()
        .fold(0u8, |odd, &c| odd | u8::from(c.wrapping_sub(0x20) >= 0x60));
    if odd == 0 {
        return Ok(());
    }
    if p.iter().any(|&c| c < 0x20) || (utf8 && std::str::from_utf8(p).is_err()) {
        return Err(Invalid);
    }
    Ok(())
}

/// A checked value's place in the body: start, end, and its escapes if a string (see [`Raw`]).
pub(super) type Span = (usize, usize, usize);

/// Reads `body` as `serde_json::from_slice` reads a struct of the optional raw fields `names`
/// (see the module doc), checking all of it: the fields' spans (see [`Raw::new`]), and what
/// reading them needs to know of the body's strings.
pub(super) fn top_fields<const N: usize>(
    body: &[u8],
    names: &[&str; N],
) -> Result<([Option<Span>; N], Strings), Invalid> {
    let mut c = Checker {
        b: body,
        i: 0,
        stack: Vec::new(),
        strings: Strings::default(),
    };
    let mut out = [None; N];
    c.ws();
    match c.peek()? {
        b'{' => {
            c.i += 1;
            let mut seen = [false; N];
            c.ws();
            if c.peek()? == b'}' {
                c.i += 1;
            } else {
                loop {
                    c.ws();
                    if c.peek()? != b'"' {
                        return Err(Invalid);
                    }
                    let start = c.i;
                    let esc = c.string(true)?;
                    let key = Str {
                        inner: &body[start + 1..c.i - 1],
                        esc,
                        sur: true,
                    };
                    if !key.valid() {
                        return Err(Invalid);
                    }
                    c.eat(b':')?;
                    match names.iter().position(|n| key.is(n)) {
                        Some(f) => {
                            if std::mem::replace(&mut seen[f], true) {
                                return Err(Invalid);
                            }
                            out[f] = c.field()?;
                        }
                        None => {
                            c.value(false)?;
                        }
                    }
                    c.ws();
                    match c.peek()? {
                        b',' => c.i += 1,
                        b'}' => {
                            c.i += 1;
                            break;
                        }
                        _ => return Err(Invalid),
                    }
                }
            }
        }
        b'[' => {
            c.i += 1;
            c.ws();
            if c.peek()? == b']' {
                c.i += 1;
            } else {
                let mut n = 0;
                loop {
                    *out.get_mut(n).ok_or(Invalid)? = c.field()?;
                    n += 1;
                    c.ws();
                    match c.peek()? {
                        b',' => c.i += 1,
                        b']' => {
                            c.i += 1;
                            break;
                        }
                        _ => return Err(Invalid),
                    }
                }
            }
        }
        _ => return Err(Invalid),
    }
    c.ws();
    if c.i != body.len() {
        return Err(Invalid);
    }
    // Recorded as they closed; looked up by where they open.
    c.strings.containers.sort_unstable();
    Ok((out, c.strings))
}
