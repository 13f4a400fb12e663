//! The first pass: [`top_fields`] checks the whole body as `serde_json` would (the
//! [`Checker`]), and records in [`Strings`] what reading its fields will need.

use memchr::memchr2;

use super::{ws, Invalid, Span, Str, Strings, LONG};

/// The checking scanner of the whole body: strict JSON as `serde_json` reads it.
struct Checker<'a> {
    b: &'a [u8],
    i: usize,
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
    ///
    /// [`Raw`]: super::Raw
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

/// Reads `body` as `serde_json::from_slice` reads a struct of the optional raw fields `names`
/// (see the [module doc]), checking all of it: the fields' spans (see [`Raw::new`]), and what
/// reading them needs to know of the body's strings.
///
/// [module doc]: super
/// [`Raw::new`]: super::Raw::new
pub(crate) fn top_fields<const N: usize>(
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

/// A top-level object's members: where the object opens and closes, and each member's span
/// (its key's opening quote to its value's end) with whether its decoded key is in `names`.
#[derive(Debug)]
pub(crate) struct Members {
    pub open: usize,
    pub close: usize,
    pub members: Vec<(usize, usize, bool)>,
}

/// Checks all of `body` as [`top_fields`] does, but lets keys repeat (as Python's `json`
/// does) and returns every top-level member; `None` for valid JSON that is not an object.
pub(crate) fn top_members(body: &[u8], names: &[&str]) -> Result<Option<Members>, Invalid> {
    let mut c = Checker {
        b: body,
        i: 0,
        stack: Vec::new(),
        strings: Strings::default(),
    };
    c.ws();
    if c.peek()? != b'{' {
        c.value(false)?;
        c.ws();
        return if c.i == body.len() {
            Ok(None)
        } else {
            Err(Invalid)
        };
    }
    let open = c.i;
    c.i += 1;
    let mut members = Vec::new();
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
            let named = names.iter().any(|n| key.is(n));
            c.eat(b':')?;
            c.value(false)?;
            members.push((start, c.i, named));
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
    let close = c.i - 1;
    c.ws();
    if c.i != body.len() {
        return Err(Invalid);
    }
    Ok(Some(Members {
        open,
        close,
        members,
    }))
}
