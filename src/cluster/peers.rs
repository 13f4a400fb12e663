//! The other instances' load, as this instance follows it: each peer's last snapshot with the
//! changes it announced since, summed per replica for the routing candidates; and this
//! instance's rank among the live ones, which offsets its tie-breaking counter so that
//! instances deciding at the same moment start a burst on different replicas.
//!
//! Pure: the caller hands in the time and applies the totals.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Load on one replica in the units the cost policy uses; as a change, each field may be
/// negative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests in flight.
    pub in_flight: i64,
    /// Requests without a first byte yet.
    pub waiting: i64,
    /// Uncached prompt tokens of those requests.
    pub queued_tokens: i64,
}

impl Load {
    pub fn add(&mut self, d: Load) {
        self.in_flight += d.in_flight;
        self.waiting += d.waiting;
        self.queued_tokens += d.queued_tokens;
    }
    pub fn is_zero(&self) -> bool {
        *self == Load::default()
    }
}

/// Each peer instance's load per replica.
#[derive(Default)]
pub struct Peers {
    peers: HashMap<String, Peer>,
}

struct Peer {
    seen: Instant,
    load: HashMap<String, Load>,
}

impl Peers {
    /// A peer's snapshot: its whole load now, replacing what was known of it.
    pub fn snapshot(&mut self, instance: &str, replicas: Vec<(String, Load)>, now: Instant) {
        self.peers.insert(
            instance.to_string(),
            Peer {
                seen: now,
                load: replicas.into_iter().collect(),
            },
        );
    }

    /// A peer's changes since its last snapshot. A peer not heard of yet counts from zero
    /// until its snapshot, at most one interval later, sets it right.
    pub fn change(&mut self, instance: &str, replicas: Vec<(String, Load)>, now: Instant) {
        let peer = self
            .peers
            .entry(instance.to_string())
            .or_insert_with(|| Peer {
                seen: now,
                load: HashMap::new(),
            });
        peer.seen = now;
        for (replica, d) in replicas {
            peer.load.entry(replica).or_default().add(d);
        }
    }

    /// Forgets peers silent for `ttl` (stopped, or cut from Redis); true when any went.
    pub fn expire(&mut self, now: Instant, ttl: Duration) -> bool {
        let before = self.peers.len();
        self.peers
            .retain(|_, p| now.saturating_duration_since(p.seen) < ttl);
        self.peers.len() != before
    }

    pub fn clear(&mut self) {
        self.peers.clear();
    }

    /// The peers' load on `replica`, summed, each peer's counts floored at zero (a change
    /// may arrive before the snapshot that holds its start): (in flight, waiting, tokens).
    pub fn total(&self, replica: &str) -> (u64, u64, u64) {
        let mut t = (0, 0, 0);
        for l in self.peers.values().filter_map(|p| p.load.get(replica)) {
            t.0 += l.in_flight.max(0) as u64;
            t.1 += l.waiting.max(0) as u64;
            t.2 += l.queued_tokens.max(0) as u64;
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

    fn load(in_flight: i64, waiting: i64, queued_tokens: i64) -> Load {
        Load {
            in_flight,
            waiting,
            queued_tokens,
        }
    }

    #[test]
    fn snapshots_replace_and_changes_add_up_per_peer() {
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
                |p, t| p.change("b", vec![("gpu0".into(), load(1, 1, 300))], t),
                (3, 2, 1200),
            ),
            (
                |p, t| p.change("c", vec![("gpu0".into(), load(1, 1, 50))], t),
                (4, 3, 1250),
            ),
            // c's snapshot says its request already had its first byte.
            (
                |p, t| p.snapshot("c", vec![("gpu0".into(), load(1, 0, 0))], t),
                (4, 2, 1200),
            ),
            // b's end arrives before any start of it: floored at zero for b alone.
            (
                |p, t| p.change("b", vec![("gpu0".into(), load(-5, -5, -5000))], t),
                (1, 0, 0),
            ),
            (|p, t| p.snapshot("b", vec![], t), (1, 0, 0)),
        ];
        for (i, (step, want)) in steps.into_iter().enumerate() {
            step(&mut p, t0);
            assert_eq!(p.total("gpu0"), want, "step {i}");
        }
        assert_eq!(p.total("gpu1"), (0, 0, 0));
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
        p.clear();
        assert_eq!(p.rank("lb-z"), 0);
    }
}
