//! Where a JSON request body ends, seen a chunk at a time.
//!
//! A chunked upload has no length up front. Pingora replays a body it has already read only
//! through its 64 KiB retry buffer, or by reading the rest from the client. So for a chunked
//! body the proxy stops reading as soon as the JSON value is complete, leaving the chunked
//! terminator on the wire: Pingora then reads it and calls `request_body_filter`, where the
//! whole body is sent. This scanner says when that point is reached. Pure and total.

/// Tracks nesting of a streamed JSON object or array, outside strings.
#[derive(Debug, Default, Clone)]
pub struct JsonEnd {
    depth: usize,
    started: bool,
    in_string: bool,
    escaped: bool,
    done: bool,
    /// The body does not start with `{` or `[`: its end cannot be seen.
    opaque: bool,
}

impl JsonEnd {
    /// Feeds the next bytes; once complete, later bytes are ignored.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.done || self.opaque {
                return;
            }
            if !self.started {
                match b {
                    b' ' | b'\t' | b'\r' | b'\n' => continue,
                    b'{' | b'[' => {
                        self.started = true;
                        self.depth = 1;
                        continue;
                    }
                    _ => {
                        self.opaque = true;
                        return;
                    }
                }
            }
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    self.done = self.depth == 0;
                }
                _ => {}
            }
        }
    }

    /// The top-level object or array has closed.
    pub fn complete(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fed_in(pieces: &[&[u8]]) -> Vec<bool> {
        let mut j = JsonEnd::default();
        pieces
            .iter()
            .map(|p| {
                j.feed(p);
                j.complete()
            })
            .collect()
    }

    #[test]
    fn an_object_completes_at_its_closing_brace() {
        assert_eq!(
            fed_in(&[b" {\"a\": [1, {\"b\": ", b"\"}]\\\"\"", b"}]", b"}"]),
            vec![false, false, false, true]
        );
    }

    #[test]
    fn braces_inside_strings_do_not_count() {
        assert_eq!(
            fed_in(&[br#"{"m": "}}]] \" {"#, b"\"", b"}"]),
            vec![false, false, true]
        );
        assert_eq!(fed_in(&[br#"["\\"#, br#"", 1]"#]), vec![false, true]);
    }

    #[test]
    fn non_json_never_completes() {
        assert_eq!(fed_in(&[b"hello", b"}"]), vec![false, false]);
        assert_eq!(fed_in(&[b"", b"  "]), vec![false, false]);
    }

    proptest! {
        #[test]
        fn any_split_of_a_json_document_completes_exactly_at_its_end(
            text in r#"\{"messages":\[(\{"role":"[a-z]{1,5}","content":"([a-z {}\[\]]|\\\\|\\")*"\},){0,4}\{"k":1\}\]\}"#,
            cut in 0usize..200,
        ) {
            let bytes = text.as_bytes();
            let cut = cut.min(bytes.len());
            let mut j = JsonEnd::default();
            j.feed(&bytes[..cut]);
            prop_assert_eq!(j.complete(), cut == bytes.len());
            j.feed(&bytes[cut..]);
            prop_assert!(j.complete());
            prop_assert!(serde_json::from_slice::<serde_json::Value>(bytes).is_ok());
        }

        #[test]
        fn arbitrary_bytes_never_panic(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let mut j = JsonEnd::default();
            for c in &chunks { j.feed(c); }
            let _ = j.complete();
        }
    }
}
