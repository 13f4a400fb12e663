//! The prompt model every endpoint family is read into, and its chain of hashes (version 2).
//!
//! A prompt is an ordered list of *parts* as the replica renders them: system text or
//! instructions, tool definitions, each message or input item with its role or type. A part's
//! content is a stream of text fragments (and digests of structured content such as tool
//! arguments). The content of every part, with a header naming its kind, is cut into fixed-size
//! chunks of [`CHUNK_BYTES`], and each chunk's hash chains the previous one, so:
//! - the hash at the end of part `i` names parts `0..=i` exactly (continuations: a later turn
//!   finds the replica that served an earlier one);
//! - the hash at each chunk boundary names everything before it, even inside one long message
//!   (partial reuse: a prefix index can match a shared beginning).
//!
//! Key order and whitespace of the client's JSON never reach the hasher: the family modules
//! feed it decoded strings and structural digests (`digest.rs`). Streaming by design: parts and fragments are
//! fed in order and nothing is kept but the running state and the links.

use xxhash_rust::xxh3::Xxh3Default;

/// Bumped whenever any input to the chain changes meaning; state written under another
/// version is not read back.
pub const HASH_VERSION: u32 = 2;

/// Content bytes per chunk: about 256 tokens at 4 bytes a token (16 of vLLM's blocks).
pub const CHUNK_BYTES: usize = 1024;

/// One point of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Names the whole prompt up to this point.
    pub hash: u64,
    /// The end of a part (a message, an item); otherwise a chunk boundary inside one.
    pub part_end: bool,
    /// Content bytes up to this point (a size in tokens is about a quarter of it).
    pub bytes: u64,
}

const PART_HEADER: u8 = 0x1d;
const FRAGMENT: u8 = 0x1e;
const DIGEST: u8 = 0x1f;
const PART_END: u8 = 0x1c;

/// Builds the chain: `begin_part`, then `text`/`digest` fragments, then `end_part`, per part.
pub struct PromptHasher {
    prev: u64,
    /// The running chunk's hash (the default secret, as `Xxh3::new()`, but reset in place).
    state: Xxh3Default,
    in_chunk: usize,
    bytes: u64,
    fragments: usize,
    open: bool,
    links: Vec<Link>,
}

impl PromptHasher {
    /// The model seeds the chain: a replica's cache is per model.
    pub fn new(model: &str) -> PromptHasher {
        let mut seed = Xxh3Default::new();
        seed.update(b"inferlb-prompt");
        seed.update(&HASH_VERSION.to_le_bytes());
        seed.update(model.as_bytes());
        let prev = seed.digest();
        let mut state = Xxh3Default::new();
        state.update(&prev.to_le_bytes());
        PromptHasher {
            prev,
            state,
            in_chunk: 0,
            bytes: 0,
            fragments: 0,
            open: false,
            links: Vec::new(),
        }
    }

    /// Starts a part of kind `kind` (a role, an item type); ends an open one first.
    pub fn begin_part(&mut self, kind: &str) {
        self.start_part();
        self.extend(kind.as_bytes());
        self.end_kind();
    }

    /// Starts a part whose kind is then given in pieces by [`Self::extend`], up to
    /// [`Self::end_kind`]: the same chain as [`Self::begin_part`] with the pieces joined.
    pub fn start_part(&mut self) {
        if self.open {
            self.end_part();
        }
        self.open = true;
        self.fragments = 0;
        self.feed(&[PART_HEADER]);
    }

    pub fn end_kind(&mut self) {
        self.feed(&[PART_HEADER]);
    }

    /// One text fragment of the open part.
    pub fn text(&mut self, text: &str) {
        self.bytes(text.as_bytes());
    }

    /// Starts a fragment of the open part, whose bytes are then given in pieces by
    /// [`Self::extend`]: the same chain as [`Self::bytes`] with the pieces joined.
    pub fn begin_fragment(&mut self) {
        self.separate();
    }

    /// More bytes of the kind or fragment being given in pieces.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.feed(bytes);
    }

    /// One fragment of raw bytes (token ids, say) of the open part.
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.separate();
        self.feed(bytes);
    }

    /// Structured content of the open part (tool arguments, an image, an unknown block),
    /// given as a structural digest.
    pub fn digest(&mut self, digest: u64) {
        self.separate();
        self.feed(&[DIGEST]);
        self.feed(&digest.to_le_bytes());
    }

    pub fn end_part(&mut self) {
        if !self.open {
            return;
        }
        self.state.update(&[PART_END]);
        self.emit(true);
        self.open = false;
    }

    pub fn finish(mut self) -> Vec<Link> {
        self.end_part();
        self.links
    }

    fn separate(&mut self) {
        if self.fragments > 0 {
            self.feed(&[FRAGMENT]);
        }
        self.fragments += 1;
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (CHUNK_BYTES - self.in_chunk).min(bytes.len());
            self.state.update(&bytes[..take]);
            self.in_chunk += take;
            self.bytes += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == CHUNK_BYTES {
                self.emit(false);
            }
        }
    }

    fn emit(&mut self, part_end: bool) {
        let hash = self.state.digest();
        self.links.push(Link {
            hash,
            part_end,
            bytes: self.bytes,
        });
        self.prev = hash;
        self.state.reset();
        self.state.update(&hash.to_le_bytes());
        self.in_chunk = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(parts: &[(&str, &[&str])]) -> Vec<Link> {
        let mut h = PromptHasher::new("m");
        for (kind, texts) in parts {
            h.begin_part(kind);
            texts.iter().for_each(|t| h.text(t));
        }
        h.finish()
    }

    fn ends(links: &[Link]) -> Vec<u64> {
        links
            .iter()
            .filter(|l| l.part_end)
            .map(|l| l.hash)
            .collect()
    }

    #[test]
    fn a_longer_prompt_extends_the_chain_of_the_shorter() {
        let short = chain(&[("system", &["S"]), ("user", &["hi"])]);
        let long = chain(&[
            ("system", &["S"]),
            ("user", &["hi"]),
            ("assistant", &["yo"]),
        ]);
        assert_eq!(&long[..short.len()], &short[..]);
        assert_eq!(ends(&long).len(), 3);
    }

    #[test]
    fn role_fragment_boundaries_and_model_all_count() {
        let base = ends(&chain(&[("user", &["ab"])]));
        assert_ne!(base, ends(&chain(&[("assistant", &["ab"])])));
        assert_ne!(base, ends(&chain(&[("user", &["a", "b"])])));
        let mut other_model = PromptHasher::new("n");
        other_model.begin_part("user");
        other_model.text("ab");
        assert_ne!(base, ends(&other_model.finish()));
        // The same parts split differently are different prompts.
        assert_ne!(
            ends(&chain(&[("user", &["a"]), ("user", &["b"])])),
            ends(&chain(&[("user", &["a", "b"])]))
        );
    }

    #[test]
    fn long_content_is_cut_into_chunks_that_a_shared_beginning_shares() {
        let a = "x".repeat(5 * CHUNK_BYTES);
        let b = format!(
            "{}{}",
            "x".repeat(3 * CHUNK_BYTES),
            "y".repeat(2 * CHUNK_BYTES)
        );
        let (la, lb) = (chain(&[("user", &[&a])]), chain(&[("user", &[&b])]));
        let chunks = la.iter().filter(|l| !l.part_end).count();
        assert_eq!(chunks, 5, "{la:?}");
        // The header and the first three chunks' worth of x are shared; then they differ.
        let shared = la.iter().zip(&lb).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, 3);
        assert_eq!(la.last().map(|l| l.bytes), Some(5 * CHUNK_BYTES as u64 + 6));
        // Where the text is fed in pieces does not move a boundary.
        let mut h = PromptHasher::new("m");
        h.begin_part("user");
        let mut pieces = a
            .as_bytes()
            .chunks(333)
            .map(|c| std::str::from_utf8(c).expect("ascii"));
        let first = pieces.next().expect("a piece");
        h.text(first);
        // (One fragment is one text: continue it through the hasher's feed.)
        for p in pieces {
            h.feed(p.as_bytes());
        }
        assert_eq!(h.finish(), la);
    }
}
