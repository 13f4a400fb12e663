//! A replica's process restarts, as its `/metrics` tells them (read by
//! [`crate::fleet::poll`]): by `process_start_time_seconds`, the latest start it gave; or, on
//! a server that does not give its start (llama.cpp, SGLang, vLLM with several API servers),
//! by its prompt tokens counter going back. A restart empties its cache model; the KV event
//! subscriber, seeing the count move, begins its stream anew.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::Replica;

/// Reads after a counter went back within which a read at or above where it was means two
/// servers taking turns behind one address, not a restart: 2 s of polls at 0.25 s.
const TURNS_WITHIN: u32 = 8;

#[derive(Debug, Default)]
pub(super) struct Restarts {
    /// The latest start given, in milliseconds since the Unix epoch (0: none yet).
    started_ms: AtomicU64,
    count: AtomicU64,
    /// The restarts read from a later start (of `count`).
    by_start: AtomicU64,
    counter: Mutex<Counter>,
}

/// A server's prompt tokens counter, as read one poll after another.
#[derive(Debug, Default)]
struct Counter {
    last: Option<u64>,
    /// Where it was before it last went back, and the reads since, for [`TURNS_WITHIN`].
    fell_from: Option<(u64, u32)>,
    /// Where it was before it last went back, for as long as it has not come back there.
    high: Option<u64>,
    /// Its last read before it came back there: another server's count, if another server
    /// took the first fall's place.
    other: Option<u64>,
    /// It came back to where it was: several servers answer on the address, and their
    /// counters tell nothing of restarts.
    turns: bool,
}

impl Replica {
    /// Its `/metrics` says its process started at `ms` (milliseconds since the Unix epoch).
    /// Later than any start it gave before, it restarted, and its cache is empty: its cache
    /// model forgets it all, then the restart is counted (so a subscriber that sees the count
    /// begins anew on an emptied cache). An earlier start is no restart, as no process starts
    /// back in time: another server answers on the same address (several behind one load
    /// balancer, say), and only the latest start counts, so servers taking turns clear nothing
    /// past the first change. Whether it restarted.
    pub fn started(&self, ms: u64) -> bool {
        let before = self.restarts.started_ms.fetch_max(ms, Ordering::Relaxed);
        if before == 0 || ms <= before {
            return false;
        }
        self.cache.restarted();
        // Release: whoever reads a new count reads this start, or a later one.
        self.restarts.by_start.fetch_add(1, Ordering::Release);
        self.restarts.count.fetch_add(1, Ordering::Release);
        true
    }

    /// The restarts [`Replica::started`] found (of [`Replica::restarts`]): those with a start
    /// to tell other instances.
    pub fn restarts_by_start(&self) -> u64 {
        self.restarts.by_start.load(Ordering::Acquire)
    }

    /// Its `/metrics`, which gives no process start, counts `total` prompt tokens served. Below
    /// the count read before, the server restarted (a counter only goes back to zero with its
    /// process): as [`Replica::started`], its cache model forgets it all, and the restart is
    /// counted. Unless it comes back to where it was within [`TURNS_WITHIN`] reads, or, having
    /// come back there later, goes back to no lower than its last read before that (another
    /// server's count, which went on; a restarted counter starts again from zero): then
    /// several servers take turns on the address, and counters are not read for restarts
    /// again (the one emptied estimate is the cost, as with starts). The first read is none.
    /// Whether it restarted.
    pub fn counted(&self, total: u64) -> bool {
        let Ok(mut c) = self.restarts.counter.lock() else {
            return false;
        };
        if c.turns {
            return false;
        }
        let last = c.last.replace(total);
        if let Some((from, reads)) = c.fell_from {
            if total >= from {
                c.turns = true;
                log::warn!(
                    "replica {}: its prompt tokens counter went back and came back: several \
                     servers answer on its address, so no restart is read from it",
                    self.id
                );
                return false;
            }
            c.fell_from = (reads + 1 < TURNS_WITHIN).then_some((from, reads + 1));
        }
        if let (Some(high), Some(last)) = (c.high, last) {
            if total >= high && last < high {
                c.high = None;
                c.other = Some(last);
            }
        }
        match last {
            // Back where the other count was, or past it: that server went on counting.
            Some(last) if total < last && c.other.is_some_and(|o| o > 0 && total >= o) => {
                c.turns = true;
                log::warn!(
                    "replica {}: its prompt tokens counter went back to another count it gave \
                     before, or past it: several servers answer on its address, so no restart \
                     is read from it",
                    self.id
                );
                false
            }
            Some(last) if total < last => {
                c.fell_from = Some((last, 0));
                c.high = Some(last);
                c.other = None;
                drop(c);
                self.cache.restarted();
                self.restarts.count.fetch_add(1, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// A start another process read (the one before this one, through the state file, or
    /// another instance, through Redis), taken as this process's first read when it has none
    /// yet: a later start read next is then a restart, one that happened while no process
    /// here followed the replica. Whether it was taken.
    pub fn seed_start(&self, ms: u64) -> bool {
        ms > 0
            && self
                .restarts
                .started_ms
                .compare_exchange(0, ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The latest process start its `/metrics` gave (or [`Replica::seed_start`] took), in
    /// milliseconds since the Unix epoch (0: none yet).
    pub fn started_ms(&self) -> u64 {
        self.restarts.started_ms.load(Ordering::Relaxed)
    }

    /// The restarts [`Replica::started`] found.
    pub fn restarts(&self) -> u64 {
        self.restarts.count.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use crate::fleet::replica::{Freshness, Prompt};
    use crate::protocol::api::prompt::{PromptHasher, CHUNK_BYTES};

    /// (the starts its `/metrics` gave, one after another) → after each, whether it
    /// restarted; a restart empties the estimate, and only a start later than all before is
    /// one.
    #[test]
    fn only_a_later_process_start_is_a_restart() {
        let table: &[(&[u64], &[bool])] = &[
            // The first start read is where it stands, not a restart.
            (&[1_000], &[false]),
            (&[1_000, 1_000, 1_000], &[false, false, false]),
            (&[1_000, 5_000], &[false, true]),
            (&[1_000, 5_000, 5_000, 9_000], &[false, true, false, true]),
            // Two servers behind one address, taking turns: the later one's first answer
            // reads as a restart, then nothing.
            (
                &[5_000, 1_000, 5_000, 1_000, 5_000],
                &[false, false, false, false, false],
            ),
            (&[1_000, 5_000, 1_000, 5_000], &[false, true, false, false]),
        ];
        let mut h = PromptHasher::new("m");
        h.begin_part("user");
        h.text(&"x".repeat(CHUNK_BYTES * 3));
        let links = h.finish();
        for (starts, want) in table {
            let reg = crate::fleet::registry::test_registry(&["restarts-r"]);
            let fleet = reg.all();
            let r = fleet.first().expect("a replica");
            let mut got = Vec::new();
            for (n, ms) in starts.iter().enumerate() {
                r.cache.prefilled(&links);
                let restarted = r.started(*ms);
                let held = r.cache.likely_cached(Prompt::of_links(&links)).0;
                assert_eq!(held == 0, restarted, "{starts:?}, start {n}");
                got.push(restarted);
            }
            assert_eq!(&got, want, "{starts:?}");
            let restarts = want.iter().filter(|r| **r).count() as u64;
            assert_eq!(r.restarts(), restarts, "{starts:?}");
        }
    }

    /// (the prompt tokens counter, one read after another) → whether each read is a restart:
    /// a counter that goes back is one, unless it comes back to where it was within a few
    /// reads (servers taking turns on the address), after which none is read from it.
    #[test]
    fn a_counter_that_goes_back_is_a_restart_unless_it_comes_back() {
        let table: &[(&[u64], &[bool])] = &[
            (&[0, 0, 5, 5], &[false, false, false, false]),
            (&[100, 200, 10, 20, 30], &[false, false, true, false, false]),
            // Two restarts, the second after the turns window.
            (
                &[100, 5, 6, 7, 8, 9, 10, 11, 12, 13, 2],
                &[
                    false, true, false, false, false, false, false, false, false, false, true,
                ],
            ),
            // Back at 100 after the window: a restarted server that served as much again.
            (
                &[100, 5, 6, 7, 8, 9, 10, 11, 12, 13, 100, 3],
                &[
                    false, true, false, false, false, false, false, false, false, false, false,
                    true,
                ],
            ),
            // Two servers behind one address: one false restart, then nothing.
            (
                &[1_000, 50, 1_001, 51, 1_002, 52],
                &[false, true, false, false, false, false],
            ),
            // A restarted counter's first read is often 0: the next restart is one too.
            (
                &[100, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
                &[
                    false, true, false, false, false, false, false, false, false, false, false,
                    true,
                ],
            ),
            // Two servers, the poll staying on each for a while (kept-alive connections):
            // the second fall lands above the other's last count.
            (
                &[
                    1_000, 50, 60, 70, 80, 90, 100, 110, 120, 130, 1_200, 1_300, 140, 150,
                ],
                &[
                    false, true, false, false, false, false, false, false, false, false, false,
                    false, false, false,
                ],
            ),
        ];
        for (totals, want) in table {
            let reg = crate::fleet::registry::test_registry(&["counted"]);
            let fleet = reg.all();
            let r = fleet.first().expect("a replica");
            let got: Vec<bool> = totals.iter().map(|t| r.counted(*t)).collect();
            assert_eq!(&got, want, "{totals:?}");
            let restarts = want.iter().filter(|r| **r).count() as u64;
            assert_eq!((r.restarts(), r.started_ms()), (restarts, 0), "{totals:?}");
        }
    }

    /// A start read elsewhere is taken only as the first: the next read later than it is a
    /// restart; once a start was read here, it is not taken (a later one is for the poll to
    /// find, as a restart).
    #[test]
    fn a_seeded_start_is_taken_only_as_the_first() {
        let reg = crate::fleet::registry::test_registry(&["seeded-a", "seeded-b"]);
        let fleet = reg.all();
        let (a, b) = (&fleet[0], &fleet[1]);
        assert!(!a.seed_start(0), "no start is none");
        assert!(a.seed_start(1_000));
        assert!(!a.seed_start(2_000), "taken once");
        assert!(!a.started(1_000));
        assert!(a.started(3_000), "later than the seed: a restart");
        assert_eq!(a.restarts(), 1);
        assert!(!b.started(5_000));
        assert!(!b.seed_start(9_000), "read here already");
        assert_eq!((b.started_ms(), b.restarts()), (5_000, 0));
    }

    /// With KV events, the emptied block index is not live until the new stream is read.
    #[test]
    fn a_restart_leaves_the_block_index_partial() {
        let m = crate::fleet::replica::CacheModel::estimate(Some(1_000_000)).with_events();
        m.set_freshness(Freshness::Live);
        m.restarted();
        assert_eq!(m.freshness(), Freshness::Partial);
    }
}
