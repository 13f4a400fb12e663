//! The other instances' load, as this instance follows it: each peer's last snapshot with the
//! replicas it said changed since, summed per replica for the routing candidates; and this
//! instance's rank among the live ones, which offsets its tie-breaking counter so that
//! instances deciding at the same moment start a burst on different replicas.
//!
//! Pure: the caller hands in the time and applies the totals.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What an instance reports of its load on one replica, in the units the cost policy uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Requests in flight.
    pub in_flight: i64,
    /// Requests without a first byte yet.
    pub waiting: i64,
    /// Uncached prompt tokens of those requests.
    pub queued_tokens: i64,
}

/// Each peer instance's load per replica.
#[derive(Default)]
pub struct Peers {
    peers: HashMap<String, Peer>,
}

struct Peer {
    seen: Instant,
    load: HashMap<String, LoadReport>,
}

impl Peers {
    /// A peer's snapshot: its whole load now, replacing what was known of it.
    pub fn snapshot(&mut self, instance: &str, replicas: Vec<(String, LoadReport)>, now: Instant) {
        self.peers.insert(
            instance.to_string(),
            Peer {
                seen: now,
                load: replicas.into_iter().collect(),
            },
        );
    }

    /// A peer's load on the replicas it names, as it is now; the others stay as they were.
    pub fn update(&mut self, instance: &str, replicas: Vec<(String, LoadReport)>, now: Instant) {
        let peer = self
            .peers
            .entry(instance.to_string())
            .or_insert_with(|| Peer {
                seen: now,
                load: HashMap::new(),
            });
        peer.seen = now;
        peer.load.extend(replicas);
    }

    /// Forgets peers silent for `ttl` (stopped, or cut from Redis); true when any went.
    pub fn expire(&mut self, now: Instant, ttl: Duration) -> bool {
        let before = self.peers.len();
        self.peers
            .retain(|_, p| now.saturating_duration_since(p.seen) < ttl);
        self.peers.len() != before
    }

    /// The peers' load on `replica`, summed: (in flight, waiting, tokens).
    pub fn total(&self, replica: &str) -> (u64, u64, u64) {
        let mut t = (0u64, 0u64, 0u64);
        let n = |v: i64| v.max(0) as u64;
        for l in self.peers.values().filter_map(|p| p.load.get(replica)) {
            t.0 = t.0.saturating_add(n(l.in_flight));
            t.1 = t.1.saturating_add(n(l.waiting));
            t.2 = t.2.saturating_add(n(l.queued_tokens));
        }
        t
    }

    /// This instance's place among the live instances ordered by id: its counter's offset.
    pub fn rank(&self, me: &str) -> u64 {
        self.peers.keys().filter(|p| p.as_str() < me).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(in_flight: i64, waiting: i64, queued_tokens: i64) -> LoadReport {
        LoadReport {
            in_flight,
            waiting,
            queued_tokens,
        }
    }

    #[test]
    fn snapshots_replace_updates_set_and_peers_add_up() {
        let t0 = Instant::now();
        let mut p = Peers::default();
        // (step, expected total on gpu0 after it)
        type Step = fn(&mut Peers, Instant);
        let steps: [(Step, (u64, u64, u64)); 6] = [
            (
                |p, t| p.snapshot("b", vec![("gpu0".into(), load(2, 1, 900))], t),
                (2, 1, 900),
            ),
            (
                |p, t| p.update("b", vec![("gpu0".into(), load(3, 2, 1200))], t),
                (3, 2, 1200),
            ),
            (
                |p, t| p.update("c", vec![("gpu0".into(), load(1, 1, 50))], t),
                (4, 3, 1250),
            ),
            // An update of another replica leaves gpu0 as it was.
            (
                |p, t| p.update("c", vec![("gpu1".into(), load(5, 5, 5))], t),
                (4, 3, 1250),
            ),
            // A snapshot replaces all of c: gpu0 no longer named, so none.
            (
                |p, t| p.snapshot("c", vec![("gpu1".into(), load(1, 0, 0))], t),
                (3, 2, 1200),
            ),
            (|p, t| p.snapshot("b", vec![], t), (0, 0, 0)),
        ];
        for (i, (step, want)) in steps.into_iter().enumerate() {
            step(&mut p, t0);
            assert_eq!(p.total("gpu0"), want, "step {i}");
        }
        assert_eq!(p.total("gpu1"), (1, 0, 0));
        // Sums saturate.
        p.update("b", vec![("gpu1".into(), load(i64::MAX, 0, 0))], t0);
        p.update("d", vec![("gpu1".into(), load(i64::MAX, 0, 0))], t0);
        p.update("e", vec![("gpu1".into(), load(i64::MAX, 0, 0))], t0);
        assert_eq!(p.total("gpu1").0, u64::MAX);
    }

    #[test]
    fn silent_peers_expire_and_rank_orders_live_instances_by_id() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(2);
        let mut p = Peers::default();
        assert_eq!(p.rank("lb-b"), 0);
        p.snapshot("lb-a", vec![("gpu0".into(), load(1, 0, 0))], t0);
        p.snapshot("lb-c", vec![], t0 + Duration::from_secs(1));
        assert_eq!((p.rank("lb-a"), p.rank("lb-b"), p.rank("lb-d")), (0, 1, 2));
        assert!(!p.expire(t0 + Duration::from_millis(1900), ttl));
        assert!(p.expire(t0 + Duration::from_millis(2100), ttl));
        assert_eq!((p.rank("lb-b"), p.total("gpu0")), (0, (0, 0, 0)));
    }
}
