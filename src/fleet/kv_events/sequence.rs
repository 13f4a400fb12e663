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
    /// The publisher's timestamp of the last batch applied (as bits): a publisher that began
    /// again may reuse its sequence number, never its time.
    last_ts: Option<u64>,
    complete: bool,
}

/// Where a publisher stands against what was applied, by what its replay socket gave from the
/// last batch applied on.
#[derive(Debug, PartialEq, Eq)]
pub enum Standing {
    /// It has that batch and nothing newer.
    Same,
    /// It has that batch and newer ones.
    Ahead,
    /// Its buffer begins after that batch: what came between cannot be replayed.
    Lost,
    /// It has nothing from that number on, or another batch under it: it began again.
    Restarted,
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

    /// `seq`, stamped `ts` by its publisher, was applied.
    pub fn applied(&mut self, seq: i64, ts: f64) {
        self.next = Some(seq + 1);
        self.last_ts = Some(ts.to_bits());
    }

    /// What a replay from the last batch applied on (`next - 1`) says, as (sequence number,
    /// timestamp) of each batch it gave; `None` before any batch was applied.
    pub fn standing(&self, replayed: &[(i64, f64)]) -> Option<Standing> {
        let last = self.next? - 1;
        Some(match replayed {
            [(s, ts), rest @ ..] if *s == last && Some(ts.to_bits()) == self.last_ts => {
                if rest.is_empty() {
                    Standing::Same
                } else {
                    Standing::Ahead
                }
            }
            [(s, _), ..] if *s > last => Standing::Lost,
            _ => Standing::Restarted,
        })
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
                    s.applied(q, 0.0);
                }
                steps.push(step);
            }
            assert_eq!(&steps, want, "{seqs:?}");
            assert_eq!(s.state(), *state, "{seqs:?}");
        }
        let mut s = Sequence::default();
        s.step(7);
        s.applied(7, 0.0);
        assert_eq!(s.state(), StreamState::Partial);
        s.cleared();
        assert_eq!(s.state(), StreamState::Live, "a clear starts it clean");
        s.broken();
        assert_eq!(s.state(), StreamState::Partial, "an unhealed gap");
    }

    /// (batches replayed from the last applied on, as (seq, ts)) → where the publisher stands,
    /// after batch 7 stamped 70.0 was applied.
    #[test]
    fn a_replay_from_the_last_batch_applied_tells_a_quiet_publisher_from_a_restarted_one() {
        let rows: &[(&[(i64, f64)], Standing)] = &[
            (&[(7, 70.0)], Standing::Same),
            (&[(7, 70.0), (8, 71.0)], Standing::Ahead),
            // Began again, and has not come as far yet.
            (&[], Standing::Restarted),
            // Began again, and has come as far: the same number, another batch.
            (&[(7, 75.0)], Standing::Restarted),
            (&[(7, 75.0), (8, 76.0)], Standing::Restarted),
            // Its buffer no longer holds it (a restarted one would, had it come as far).
            (&[(9, 90.0)], Standing::Lost),
        ];
        let mut s = Sequence::default();
        assert_eq!(s.standing(&[]), None, "nothing applied yet");
        s.step(7);
        s.applied(7, 70.0);
        for (replayed, want) in rows {
            assert_eq!(s.standing(replayed).as_ref(), Some(want), "{replayed:?}");
        }
    }
}
