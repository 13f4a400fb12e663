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
//!
//! The files: `check` is the first pass ([`top_fields`]), `raw` reads values in the checked
//! spans ([`Raw`], [`Elements`]), `string` reads strings in them ([`Str`]); what they share
//! is here.

mod check;
mod raw;
mod string;

pub(super) use check::{top_fields, top_members};
pub(super) use raw::{Elements, Raw};
pub(super) use string::Str;

/// The body is not what `serde_json` would have read (any reason: syntax, UTF-8, duplicates).
#[derive(Debug)]
pub(super) struct Invalid;

/// A checked value's place in the body: start, end, and its escapes if a string (see [`Raw`]).
pub(super) type Span = (usize, usize, usize);

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
