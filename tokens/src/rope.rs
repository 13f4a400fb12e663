//! A rendered text held as the pieces it is made of (the placeholder render's text between
//! contents, and the contents), so that only a new tail is copied into one string.

use xxhash_rust::xxh3::Xxh3;

/// A text held as the pieces it is made of.
pub(crate) struct Rope<'a> {
    pieces: Vec<&'a str>,
    /// For a piece that is a message's content, the hash of the message's raw JSON (the content
    /// is made from it alone).
    of: Vec<Option<u64>>,
    /// Where each piece starts.
    starts: Vec<usize>,
    pub(crate) len: usize,
}

impl<'a> Rope<'a> {
    pub(crate) fn new(pieces: Vec<&'a str>, of: Vec<Option<u64>>) -> Self {
        let mut starts = Vec::with_capacity(pieces.len());
        let mut len = 0;
        for p in &pieces {
            starts.push(len);
            len += p.len();
        }
        Self {
            pieces,
            of,
            starts,
            len,
        }
    }

    /// The pieces that overlap `lo..hi`, each with its start.
    pub(crate) fn over(&self, lo: usize, hi: usize) -> impl Iterator<Item = (usize, &'a str)> + '_ {
        let first = self.starts.partition_point(|&s| s <= lo).saturating_sub(1);
        self.pieces[first..]
            .iter()
            .zip(&self.starts[first..])
            .map(|(p, s)| (*s, *p))
            .take_while(move |(s, _)| *s < hi)
    }

    pub(crate) fn is_char_boundary(&self, at: usize) -> bool {
        at == self.len
            || self
                .over(at, at + 1)
                .find(|(s, p)| at < s + p.len())
                .is_some_and(|(s, p)| p.is_char_boundary(at - s))
    }

    /// The bytes `lo..hi` (a few, to look across a cut).
    pub(crate) fn bytes(&self, lo: usize, hi: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(hi - lo);
        for (s, p) in self.over(lo, hi) {
            let a = lo.saturating_sub(s).min(p.len());
            let b = (hi - s).min(p.len());
            out.extend_from_slice(&p.as_bytes()[a..b]);
        }
        out
    }

    /// The text from `from` (a char boundary) to the end.
    pub(crate) fn string_from(&self, from: usize) -> String {
        let mut out = String::with_capacity(self.len - from);
        for (s, p) in self.over(from, self.len) {
            out.push_str(&p[from.saturating_sub(s).min(p.len())..]);
        }
        out
    }

    /// A 128-bit digest of the first `cut` bytes that costs their pieces, not their bytes: a
    /// content wholly before the cut counts as its message's hash and its length, other text
    /// as its bytes, each piece framed by its kind and length. Equal digests are the same text,
    /// up to a collision of two messages' 64-bit hashes (a content is a function of its
    /// message's raw JSON; the skeleton and message caches trust the same hash); the same text
    /// in other pieces (a whole render) digests otherwise, which is a miss.
    pub(crate) fn digest_to(&self, cut: usize) -> u128 {
        let mut h = Xxh3::new();
        let pieces = self.pieces.iter().zip(&self.starts).zip(&self.of);
        for ((p, &s), of) in pieces.take_while(|((_, &s), _)| s < cut) {
            let n = (cut - s).min(p.len());
            match *of {
                Some(message) if n == p.len() => {
                    h.update(&[1]);
                    h.update(&message.to_le_bytes());
                    h.update(&(n as u64).to_le_bytes());
                }
                _ => {
                    h.update(&[0]);
                    h.update(&(n as u64).to_le_bytes());
                    h.update(&p.as_bytes()[..n]);
                }
            }
        }
        h.digest128()
    }
}
