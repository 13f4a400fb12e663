//! A request's *shape*: the only thing routing looks at.
//!
//! A request whose prompt could be read (see [`crate::protocol::api`]) is the chain of its prompt's
//! links; anything else (a body that is not JSON, an empty prompt, the wrong types) is `Other`
//! and spreads. Not for validating requests: the replica answers bad requests itself.

use crate::protocol::api::prompt::Link;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// The prompt's chain; at least one part end, the last link is one.
    Prompt { links: Vec<Link> },
    /// No readable prompt; `key` hashes the body's first bytes (for the `affinity` policy).
    Other { key: u64 },
}

impl Shape {
    /// The hashes naming each prefix of whole parts: `i` names parts `0..=i`.
    pub fn part_ends(&self) -> impl DoubleEndedIterator<Item = u64> + '_ {
        self.links().iter().filter(|l| l.part_end).map(|l| l.hash)
    }

    /// The hash the `affinity` policy pins by: the first part, or the first bytes.
    pub fn affinity_key(&self) -> u64 {
        match self {
            Shape::Prompt { .. } => self.part_ends().next().unwrap_or(0),
            Shape::Other { key } => *key,
        }
    }

    /// The hash naming the whole prompt, recorded once it has been served.
    pub fn served_key(&self) -> Option<u64> {
        self.part_ends().next_back()
    }

    /// Hashes of strict prefixes (at least one part shorter), longest first.
    pub fn strict_prefixes(&self) -> impl Iterator<Item = u64> + '_ {
        self.strict_prefix_links().map(|l| l.hash)
    }

    /// The links ending strict prefixes of whole parts, longest first.
    pub fn strict_prefix_links(&self) -> impl Iterator<Item = &Link> + '_ {
        self.links().iter().filter(|l| l.part_end).rev().skip(1)
    }

    /// Every link of the prompt's chain (none for `Other`).
    pub fn links(&self) -> &[Link] {
        match self {
            Shape::Prompt { links } => links,
            Shape::Other { .. } => &[],
        }
    }

    /// The prompt's size in tokens, estimated at 4 bytes a token.
    pub fn prompt_tokens(&self) -> u64 {
        self.links().last().map_or(0, |l| l.bytes / 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(hash: u64, part_end: bool) -> Link {
        Link {
            hash,
            part_end,
            bytes: 0,
        }
    }

    #[test]
    fn prefixes_are_the_part_ends_only() {
        let s = Shape::Prompt {
            links: vec![link(1, true), link(2, false), link(3, true), link(4, true)],
        };
        assert_eq!(s.affinity_key(), 1);
        assert_eq!(s.served_key(), Some(4));
        assert_eq!(s.strict_prefixes().collect::<Vec<_>>(), vec![3, 1]);
        let o = Shape::Other { key: 9 };
        assert_eq!((o.affinity_key(), o.served_key()), (9, None));
        assert_eq!(o.strict_prefixes().count(), 0);
    }
}
