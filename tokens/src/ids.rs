//! A prompt's token ids, held as the segments they were tokenized in. The turns of a
//! conversation share the segments of its history with the message cache, so a warm turn's
//! ids are not copied into one vector (for a 400 KB conversation that copy was a sixth of the
//! turn's cost).

use std::sync::Arc;

/// Token ids in shared segments, read in order.
#[derive(Clone, Default)]
pub struct TokenIds {
    segments: Vec<Arc<[u32]>>,
    len: usize,
}

impl TokenIds {
    pub fn from_segments(segments: Vec<Arc<[u32]>>) -> TokenIds {
        let len = segments.iter().map(|s| s.len()).sum();
        TokenIds { segments, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segments, in order (some may be empty).
    pub fn segments(&self) -> &[Arc<[u32]>] {
        &self.segments
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.segments.iter().flat_map(|s| s.iter().copied())
    }

    /// The ids in one vector (a copy).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for s in &self.segments {
            out.extend_from_slice(s);
        }
        out
    }
}

impl From<Vec<u32>> for TokenIds {
    fn from(ids: Vec<u32>) -> TokenIds {
        TokenIds::from_segments(vec![ids.into()])
    }
}

impl PartialEq for TokenIds {
    fn eq(&self, other: &TokenIds) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for TokenIds {}

impl PartialEq<Vec<u32>> for TokenIds {
    fn eq(&self, other: &Vec<u32>) -> bool {
        self.len == other.len() && self.iter().eq(other.iter().copied())
    }
}

impl PartialEq<TokenIds> for Vec<u32> {
    fn eq(&self, other: &TokenIds) -> bool {
        other == self
    }
}

impl std::fmt::Debug for TokenIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_read_as_one_sequence() {
        let ids = TokenIds::from_segments(vec![
            Arc::from(vec![1, 2]),
            Arc::from(Vec::new()),
            Arc::from(vec![3, 4, 5]),
        ]);
        assert_eq!(ids.len(), 5);
        assert_eq!(ids.to_vec(), vec![1, 2, 3, 4, 5]);
        assert_eq!(ids, TokenIds::from(vec![1, 2, 3, 4, 5]));
    }
}
