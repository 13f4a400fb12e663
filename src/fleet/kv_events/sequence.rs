//! What a KV event stream's sequence numbers say of it, without sockets: whether each batch is
//! the next, already seen or after a gap, and whether every batch since the publisher's first
//! was seen (`live`) or not (`partial`). Pure; the subscriber in the parent module acts on it.

/// A stream's state; the gauge `inferlb_kv_events_state` reads 0, 1, 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    Gone = 0,
    Partial = 1,
    Live = 2,
}

impl StreamState {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamState::Gone => "gone",
            StreamState::Partial => "partial",
            StreamState::Live => "live",
        }
    }
}

/// What a sequence of batches says of a stream, without sockets: the next sequence number
/// expected, and whether every batch since the publisher's first was seen. Pure.
#[derive(Debug, Default)]
pub struct Sequence {
    next: Option<i64>,
    complete: bool,
}

/// What to do with a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The expected one (or the first): apply it.
    Apply,
    /// Already seen (a replay overlapping the live stream): skip it.
    Seen,
    /// Batches `from..seq` were missed: replay them, then apply this one.
    Gap { from: i64 },
}

impl Sequence {
    /// A fresh stream, complete when its first batch is the publisher's first (sequence 0).
    pub fn step(&mut self, seq: i64) -> Step {
        match self.next {
            None => {
                self.complete = seq == 0;
                Step::Apply
            }
            Some(n) if seq < n => Step::Seen,
            Some(n) if seq == n => Step::Apply,
            Some(n) => Step::Gap { from: n },
        }
    }

    /// The next sequence number expected, once a batch was applied.
    pub fn next(&self) -> Option<i64> {
        self.next
    }

    /// Joined through the replay socket: whole if the replay began at the publisher's first
    /// batch.
    pub fn joined(&mut self, from_first: bool) {
        self.complete = from_first;
    }

    /// `seq` was applied.
    pub fn applied(&mut self, seq: i64) {
        self.next = Some(seq + 1);
    }

    /// A gap was not healed: what came before is not known whole.
    pub fn broken(&mut self) {
        self.complete = false;
    }

    /// The cache was cleared: nothing before matters.
    pub fn cleared(&mut self) {
        self.complete = true;
    }

    pub fn state(&self) -> StreamState {
        if self.complete {
            StreamState::Live
        } else {
            StreamState::Partial
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (sequence numbers seen, in order) → the steps and the final state
    #[test]
    fn a_stream_is_live_only_when_seen_whole() {
        let rows: &[(&[i64], &[Step], StreamState)] = &[
            (
                &[0, 1, 2],
                &[Step::Apply, Step::Apply, Step::Apply],
                StreamState::Live,
            ),
            // joined late, no replay: what came before is unknown
            (&[5, 6], &[Step::Apply, Step::Apply], StreamState::Partial),
            (
                &[0, 1, 1],
                &[Step::Apply, Step::Apply, Step::Seen],
                StreamState::Live,
            ),
            (
                &[0, 3],
                &[Step::Apply, Step::Gap { from: 1 }],
                StreamState::Live,
            ),
        ];
        for (seqs, want, state) in rows {
            let mut s = Sequence::default();
            let mut steps = vec![];
            for &q in seqs.iter() {
                let step = s.step(q);
                if step != Step::Seen {
                    s.applied(q);
                }
                steps.push(step);
            }
            assert_eq!(&steps, want, "{seqs:?}");
            assert_eq!(s.state(), *state, "{seqs:?}");
        }
        let mut s = Sequence::default();
        s.step(7);
        s.applied(7);
        assert_eq!(s.state(), StreamState::Partial);
        s.cleared();
        assert_eq!(s.state(), StreamState::Live, "a clear starts it clean");
        s.broken();
        assert_eq!(s.state(), StreamState::Partial, "an unhealed gap");
    }
}
