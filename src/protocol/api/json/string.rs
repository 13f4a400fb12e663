//! A string's body in a checked span: [`Str`] checks it for lone surrogates, compares it and
//! decodes it.

use memchr::memchr;

/// A JSON string's body (between its quotes) in a checked span.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Str<'a> {
    pub inner: &'a [u8],
    /// 0 if no escape, else one past the last backslash.
    pub esc: usize,
    /// May have escaped surrogates (see [`Raw`]).
    ///
    /// [`Raw`]: super::Raw
    pub sur: bool,
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
    ///
    /// [`Raw::string`]: super::Raw::string
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
