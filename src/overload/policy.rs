//! When the fleet has room, in the unit the cost policy uses: a replica is full when its queued
//! prefill reaches `max_queued_prefill_tokens` or its running requests reach `max_running`; the
//! fleet is saturated when every live replica is full. A disaggregated pool is judged per pool:
//! saturated when its prefill pool is, or the pool its requests decode on is; a request's
//! prefill is placed on the prefill pool. And how long a refused client should
//! wait, from the rate the fleet drains at. Pure: a snapshot in, an answer out; `now` is passed.

use std::time::{Duration, Instant};

use crate::conf::Role;

/// The per-replica limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_queued_prefill_tokens: Option<u64>,
    pub max_running: Option<usize>,
}

/// One replica's load at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaLoad {
    /// Takes new requests (healthy, not demoted, not drained).
    pub live: bool,
    /// Uncached prompt tokens waiting for prefill on it.
    pub queued_tokens: u64,
    pub running: usize,
    /// Its part in its pool.
    pub role: Role,
}

/// Whether `fleet` (one model's replicas) is split into prefill and decode pools.
pub fn disaggregated(fleet: &[ReplicaLoad]) -> bool {
    pools(fleet).is_some()
}

/// The two pools of a disaggregated fleet, or `None` for one that serves requests whole.
fn pools(fleet: &[ReplicaLoad]) -> Option<(Vec<usize>, Vec<usize>)> {
    let prefill: Vec<usize> = (0..fleet.len())
        .filter(|&i| fleet[i].role.prefills())
        .collect();
    let decode: Vec<usize> = (0..fleet.len())
        .filter(|&i| fleet[i].role.serves_whole())
        .collect();
    let split = !prefill.is_empty() && fleet.iter().any(|r| r.role.decodes());
    split.then_some((prefill, decode))
}

impl Limits {
    pub fn full(&self, r: &ReplicaLoad) -> bool {
        self.max_queued_prefill_tokens
            .is_some_and(|m| r.queued_tokens >= m)
            || self.max_running.is_some_and(|m| r.running >= m)
    }

    /// Whether a live replica exists and every one is full.
    pub fn saturated(&self, fleet: &[ReplicaLoad]) -> bool {
        match pools(fleet) {
            Some((prefill, decode)) => {
                let pick = |ids: &[usize]| ids.iter().map(|&i| fleet[i]).collect::<Vec<_>>();
                self.all_full(&pick(&prefill)) || self.all_full(&pick(&decode))
            }
            None => self.all_full(fleet),
        }
    }

    fn all_full(&self, fleet: &[ReplicaLoad]) -> bool {
        let mut live = fleet.iter().filter(|r| r.live).peekable();
        live.peek().is_some() && live.all(|r| self.full(r))
    }

    /// Places a request of `tokens` on the live replica with the least prefill queued among
    /// those with room, adding its tokens there (so the next placement sees them); false when
    /// the fleet is saturated. With no live replica at all it goes on: routing answers that.
    pub fn place(&self, fleet: &mut [ReplicaLoad], tokens: u64) -> bool {
        if !fleet.iter().any(|r| r.live) {
            return true;
        }
        // Disaggregated: the prefill goes to the prefill pool, once the decode pool has room.
        let among: Vec<usize> = match pools(fleet) {
            Some((prefill, decode)) => {
                let decoding: Vec<ReplicaLoad> = decode.iter().map(|&i| fleet[i]).collect();
                if self.all_full(&decoding) {
                    return false;
                }
                if prefill.iter().any(|&i| fleet[i].live) {
                    prefill
                } else {
                    decode
                }
            }
            None => (0..fleet.len()).collect(),
        };
        let roomiest = fleet
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| among.contains(i))
            .map(|(_, r)| r)
            .filter(|r| r.live && !self.full(r))
            .min_by_key(|r| (r.queued_tokens, r.running));
        match roomiest {
            Some(r) => {
                // Even an empty prompt takes a place.
                r.queued_tokens = r.queued_tokens.saturating_add(tokens.max(1));
                true
            }
            None => false,
        }
    }
}

/// Seconds to tell a refused client to wait: the requests ahead of it over the rate the fleet
/// drains at, at least 1; `ceiling` when nothing drained lately.
pub fn retry_after(ahead: usize, drained_per_s: f64, ceiling: Duration) -> u64 {
    let ceiling = ceiling.as_secs_f64().ceil().max(1.0);
    if !(drained_per_s.is_finite() && drained_per_s > 0.0) {
        return ceiling as u64;
    }
    ((ahead as f64 + 1.0) / drained_per_s)
        .ceil()
        .clamp(1.0, ceiling) as u64
}

const DRAIN_SLICES: usize = 10;

/// Requests that left for a replica, per second over the last ten seconds.
#[derive(Debug)]
pub struct Drain {
    origin: Instant,
    counts: [u32; DRAIN_SLICES],
    second: u64,
}

impl Drain {
    pub fn new(origin: Instant) -> Drain {
        Drain {
            origin,
            counts: [0; DRAIN_SLICES],
            second: 0,
        }
    }

    fn advance(&mut self, now: Instant) {
        let s = now.saturating_duration_since(self.origin).as_secs();
        if s <= self.second {
            return;
        }
        for i in 0..(s - self.second).min(DRAIN_SLICES as u64) {
            self.counts[((self.second + 1 + i) % DRAIN_SLICES as u64) as usize] = 0;
        }
        self.second = s;
    }

    pub fn record(&mut self, now: Instant) {
        self.advance(now);
        let at = (self.second % DRAIN_SLICES as u64) as usize;
        self.counts[at] = self.counts[at].saturating_add(1);
    }

    /// The rate over the whole seconds seen (the current one counts as a whole second).
    pub fn per_second(&mut self, now: Instant) -> f64 {
        self.advance(now);
        let seconds = (self.second + 1).min(DRAIN_SLICES as u64) as f64;
        self.counts.iter().map(|c| f64::from(*c)).sum::<f64>() / seconds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_queued_prefill_tokens: Some(1000),
        max_running: Some(4),
    };

    fn load(live: bool, queued_tokens: u64, running: usize) -> ReplicaLoad {
        ReplicaLoad {
            role: Role::Plain,
            live,
            queued_tokens,
            running,
        }
    }

    #[test]
    fn saturated_only_when_every_live_replica_is_full() {
        // (fleet, saturated)
        let rows: &[(&[ReplicaLoad], bool)] = &[
            (&[load(true, 0, 0)], false),
            (&[load(true, 1000, 0)], true),
            (&[load(true, 999, 3)], false),
            (&[load(true, 0, 4)], true),
            (&[load(true, 1000, 0), load(true, 0, 0)], false),
            (&[load(true, 1000, 0), load(false, 0, 0)], true),
            (&[load(false, 0, 0)], false),
            (&[], false),
        ];
        for (fleet, want) in rows {
            assert_eq!(LIMITS.saturated(fleet), *want, "{fleet:?}");
        }
        let no_limits = Limits::default();
        assert!(!no_limits.saturated(&[load(true, u64::MAX, usize::MAX)]));
    }

    #[test]
    fn placement_fills_the_roomiest_replica_until_the_fleet_is_full() {
        let mut fleet = [load(true, 600, 0), load(true, 0, 3), load(false, 0, 0)];
        assert!(LIMITS.place(&mut fleet, 500));
        assert_eq!(fleet[1].queued_tokens, 500);
        assert!(LIMITS.place(&mut fleet, 500));
        assert_eq!(fleet[1].queued_tokens, 1000, "still the least queued");
        assert!(LIMITS.place(&mut fleet, 500));
        assert_eq!(fleet[0].queued_tokens, 1100);
        assert!(!LIMITS.place(&mut fleet, 1), "every live replica full");
        assert!(
            LIMITS.place(&mut [load(false, 0, 0)], 1),
            "none live: routing says"
        );
    }

    fn of(role: Role, queued_tokens: u64, running: usize) -> ReplicaLoad {
        ReplicaLoad {
            role,
            ..load(true, queued_tokens, running)
        }
    }

    /// A disaggregated fleet is full when either pool is: prefill by its queue, decode by its
    /// running requests; a prefill is placed on the prefill pool.
    #[test]
    fn a_disaggregated_fleet_is_judged_per_pool() {
        use Role::{Decode, Prefill};
        let rows: &[(&[ReplicaLoad], bool)] = &[
            // both pools have room
            (&[of(Prefill, 0, 0), of(Decode, 0, 0)], false),
            // the prefill pool is full; the decode pool's room does not help
            (
                &[of(Prefill, 1000, 0), of(Prefill, 1000, 0), of(Decode, 0, 0)],
                true,
            ),
            // the decode pool is full; an idle prefill pool does not help
            (
                &[of(Prefill, 0, 0), of(Decode, 0, 4), of(Decode, 0, 4)],
                true,
            ),
            // one decode replica with room is enough
            (
                &[of(Prefill, 0, 0), of(Decode, 0, 4), of(Decode, 0, 1)],
                false,
            ),
        ];
        for (fleet, want) in rows {
            assert_eq!(LIMITS.saturated(fleet), *want, "{fleet:?}");
        }
        let mut fleet = [of(Prefill, 0, 0), of(Decode, 0, 0)];
        assert!(LIMITS.place(&mut fleet, 1000));
        assert_eq!(
            (fleet[0].queued_tokens, fleet[1].queued_tokens),
            (1000, 0),
            "on the prefill pool"
        );
        assert!(!LIMITS.place(&mut fleet, 600), "the prefill pool is full");
        let mut decode_full = [of(Prefill, 0, 0), of(Decode, 0, 4)];
        assert!(!LIMITS.place(&mut decode_full, 1));
    }

    #[test]
    fn retry_after_is_what_is_ahead_over_the_drain_rate() {
        let c = Duration::from_secs(30);
        assert_eq!(retry_after(0, 10.0, c), 1);
        assert_eq!(retry_after(49, 10.0, c), 5);
        assert_eq!(retry_after(10_000, 10.0, c), 30, "capped");
        assert_eq!(retry_after(5, 0.0, c), 30, "nothing drained: the ceiling");
        assert_eq!(retry_after(5, f64::NAN, Duration::from_millis(10)), 1);
    }

    #[test]
    fn the_drain_rate_counts_the_last_ten_seconds() {
        let t0 = Instant::now();
        let mut d = Drain::new(t0);
        for i in 0..20 {
            d.record(t0 + Duration::from_millis(i * 100));
        }
        assert_eq!(d.per_second(t0 + Duration::from_millis(1999)), 10.0);
        assert_eq!(d.per_second(t0 + Duration::from_millis(10_500)), 1.0);
        assert_eq!(d.per_second(t0 + Duration::from_secs(30)), 0.0);
    }
}
