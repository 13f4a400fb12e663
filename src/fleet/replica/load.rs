//! A replica's load as this process and the other instances of a cluster see it, and as the
//! replica reports it: requests in flight, prefill queued (requests without a first byte and
//! their uncached tokens), decodes running. The guards count a request for as long as it holds
//! its place, and tell the cluster each change.
//!
//! What the replica and the other instances report is clamped where it is read
//! (`crate::fleet::poll`, the cluster); the sums and products here saturate all the same, so no
//! number can wrap a busy replica's load around to look idle.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::progress::{credit, Progress};
use super::Replica;
use crate::fleet::events::Listener;
use crate::fleet::index::Recency;
use crate::protocol::api::prompt::Link;

/// The most requests waiting or running a replica's report counts for (`crate::fleet::poll` reads
/// its `/metrics` with this bound).
pub const MAX_REPORTED_REQUESTS: u64 = 1_000_000;

/// Prefill queued and decodes running, as this process sees them and as the replica reports.
#[derive(Default)]
pub(super) struct Load {
    /// Requests in flight on it from this process.
    in_flight: AtomicUsize,
    /// Uncached prompt tokens of requests sent from here that have no first byte yet.
    queued_tokens: AtomicU64,
    /// How many such requests.
    waiting: AtomicUsize,
    /// A running mean of the uncached tokens of a request sent from here.
    mean_uncached: AtomicU64,
    /// From the replica's `/metrics` (all clients, all balancers), while fresh.
    reported_waiting: AtomicU64,
    reported_running: AtomicU64,
    reported: AtomicBool,
    /// Its `/metrics` could not be read at the last try (to log each transition once).
    metrics_unread: AtomicBool,
    /// What the other inferlb instances of a cluster sent it: queued prefill tokens, requests
    /// without a first byte, requests in flight.
    peer_queued_tokens: AtomicU64,
    peer_waiting: AtomicU64,
    peer_in_flight: AtomicU64,
    /// KV tokens held by the requests sent here from this process (the context of each).
    kv_tokens: AtomicU64,
    /// Its KV cache in use as it reports it, in millionths; `u64::MAX`: not reported.
    reported_kv_ppm: AtomicU64,
    /// How far its prefill has gone into what this process queued there.
    progress: Mutex<Progress>,
}

impl Load {
    /// Its progress, locked with the queue counts it goes with (never held across an await;
    /// nothing panics while it is held, and a poisoned lock is taken as it is).
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Replica {
    /// Requests in flight on it from this process.
    pub fn in_flight(&self) -> usize {
        self.load.in_flight.load(Ordering::Relaxed)
    }

    /// Requests in flight on it from this process and from the other instances of a cluster.
    pub fn in_flight_everywhere(&self) -> usize {
        let peers = self.load.peer_in_flight.load(Ordering::Relaxed);
        self.in_flight()
            .saturating_add(usize::try_from(peers).unwrap_or(usize::MAX))
    }

    /// Tells `listener` its load changes and what it prefilled from now on.
    pub fn listen(&self, listener: &Arc<dyn Listener>) {
        let _ = self.listener.set(listener.clone());
    }

    /// Its load changed: the listener, if any (the cluster, which tells the others soon),
    /// hears it. Never waits, never allocates.
    fn changed(&self) {
        if let Some(c) = self.listener.get() {
            c.load_changed();
        }
    }

    /// Counts a request in flight until the guard drops.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.start_holding(0)
    }

    /// Counts a request in flight, and `kv_tokens` of KV its context holds there (a decode's
    /// load), until the guard drops.
    pub fn start_holding(self: &Arc<Self>, kv_tokens: u64) -> InFlight {
        self.load.in_flight.fetch_add(1, Ordering::Relaxed);
        self.load.kv_tokens.fetch_add(kv_tokens, Ordering::Relaxed);
        self.changed();
        InFlight {
            replica: self.clone(),
            kv_tokens,
        }
    }

    /// Prefill tokens queued on it: what this process sent that has no first byte yet, less
    /// what its prefill rate says is done of it once that is at least `MIN_CREDIT_TOKENS`, plus what the other instances sent, plus,
    /// when the replica reports more requests waiting than that, the others at the mean size.
    pub fn queued_tokens(&self) -> u64 {
        let l = &self.load;
        let peers = l.peer_queued_tokens.load(Ordering::Relaxed);
        let others = if l.reported.load(Ordering::Relaxed) {
            let known = (l.waiting.load(Ordering::Relaxed) as u64)
                .saturating_add(l.peer_waiting.load(Ordering::Relaxed));
            l.reported_waiting
                .load(Ordering::Relaxed)
                .saturating_sub(known)
        } else {
            0
        };
        let own = {
            let progress = l.progress();
            let own = l.queued_tokens.load(Ordering::Relaxed);
            // Credited only while this process's requests are all the queue it knows of:
            // work the replica did for another instance's or client's request would be
            // taken off twice, since their counts fall as they are served.
            if peers == 0 && others == 0 {
                own - credit(progress.done_by(own, Instant::now()))
            } else {
                own
            }
        };
        own.saturating_add(peers)
            .saturating_add(others.saturating_mul(l.mean_uncached.load(Ordering::Relaxed)))
    }

    /// Requests it runs: past their first byte here or at a peer instance, or as it reports,
    /// whichever is more.
    pub fn running(&self) -> usize {
        let l = &self.load;
        let local = self
            .in_flight()
            .saturating_sub(l.waiting.load(Ordering::Relaxed));
        let peers = l
            .peer_in_flight
            .load(Ordering::Relaxed)
            .saturating_sub(l.peer_waiting.load(Ordering::Relaxed));
        let seen = local.saturating_add(usize::try_from(peers).unwrap_or(usize::MAX));
        if !l.reported.load(Ordering::Relaxed) {
            return seen;
        }
        let reported = l.reported_running.load(Ordering::Relaxed);
        seen.max(usize::try_from(reported).unwrap_or(usize::MAX))
    }

    /// Whether its `/metrics` was read; true when that changed since the last read.
    pub fn note_metrics_read(&self, ok: bool) -> bool {
        self.load.metrics_unread.swap(!ok, Ordering::Relaxed) == ok
    }

    /// This process's own queued prefill: (tokens, requests), to share with a cluster.
    pub fn local_prefill(&self) -> (u64, u64) {
        let l = &self.load;
        (
            l.queued_tokens.load(Ordering::Relaxed),
            l.waiting.load(Ordering::Relaxed) as u64,
        )
    }

    /// The other instances' load on it, summed.
    pub fn set_peer_load(&self, queued_tokens: u64, waiting: u64, in_flight: u64) {
        let l = &self.load;
        l.peer_queued_tokens.store(queued_tokens, Ordering::Relaxed);
        l.peer_waiting.store(waiting, Ordering::Relaxed);
        l.peer_in_flight.store(in_flight, Ordering::Relaxed);
    }

    /// What its `/metrics` says now; `None` when it could not be read (local counts only).
    /// Each count is taken as at most [`MAX_REPORTED_REQUESTS`], as `crate::fleet::poll::parse`
    /// already bounds it: here too, so that no caller can hand in more.
    pub fn set_reported_load(&self, waiting_running: Option<(u64, u64)>) {
        let l = &self.load;
        if let Some((waiting, running)) = waiting_running {
            l.reported_waiting
                .store(waiting.min(MAX_REPORTED_REQUESTS), Ordering::Relaxed);
            l.reported_running
                .store(running.min(MAX_REPORTED_REQUESTS), Ordering::Relaxed);
        }
        l.reported
            .store(waiting_running.is_some(), Ordering::Relaxed);
    }

    /// The KV its running requests hold, in tokens: the larger of what this process sent it
    /// and what it reports (its KV cache usage times its capacity), so another client's load
    /// counts too.
    pub fn kv_tokens(&self) -> u64 {
        let l = &self.load;
        let local = l.kv_tokens.load(Ordering::Relaxed);
        match l.reported_kv_ppm.load(Ordering::Relaxed) {
            u64::MAX | 0 => local,
            ppm => {
                let capacity = self.cache.index.capacity_tokens();
                let reported = (u128::from(capacity) * u128::from(ppm) / 1_000_000) as u64;
                // In the replica's tokens: in estimate tokens, as the local count.
                local.max(self.cache.index.to_estimate(reported))
            }
        }
    }

    /// What its `/metrics` says of its KV cache in use (millionths), or None.
    pub fn set_reported_kv_usage(&self, ppm: Option<u64>) {
        let v = ppm.map_or(u64::MAX, |p| p.min(1_000_000));
        self.load.reported_kv_ppm.store(v, Ordering::Relaxed);
    }

    /// Counts `tokens` of KV held on it by one decode until the guard drops.
    pub fn hold_kv(self: &Arc<Self>, tokens: u64) -> HeldKv {
        self.load.kv_tokens.fetch_add(tokens, Ordering::Relaxed);
        HeldKv {
            replica: self.clone(),
            tokens,
        }
    }

    /// Counts `uncached` prompt tokens as queued on it until the guard is released or drops.
    pub fn queue_prefill(self: &Arc<Self>, uncached: u64) -> QueuedPrefill {
        self.queue_prompt(uncached, &[], false)
    }

    /// Like [`Replica::queue_prefill`], for a prompt of `links`, which count as pending on it
    /// (a request sharing their prefix may ride on this one's prefill) until the guard is
    /// released or drops. `shares_pending`: a prompt pending there shares more of this one
    /// than the replica holds, so the replica will find that part cached and its first byte
    /// says nothing of its prefill rate (`uncached` counts what it would lack without the
    /// other's prefill, not what it prefills).
    pub fn queue_prompt(
        self: &Arc<Self>,
        uncached: u64,
        links: &[Link],
        shares_pending: bool,
    ) -> QueuedPrefill {
        let pending = self.cache.pending.add(links);
        let l = &self.load;
        let now = Instant::now();
        let mut progress = l.progress();
        let idle = progress.settle(l.queued_tokens.fetch_add(uncached, Ordering::Relaxed), now);
        l.waiting.fetch_add(1, Ordering::Relaxed);
        drop(progress);
        // A mean over roughly the last 16 requests.
        let mean = l.mean_uncached.load(Ordering::Relaxed);
        let next = if mean == 0 {
            uncached
        } else {
            mean.saturating_mul(15).saturating_add(uncached) / 16
        };
        l.mean_uncached.store(next, Ordering::Relaxed);
        self.changed();
        QueuedPrefill {
            replica: self.clone(),
            tokens: uncached,
            sent: now,
            first: idle && !shares_pending,
            pending,
        }
    }
}

/// One decode's KV on a replica, counted until it drops.
pub struct HeldKv {
    replica: Arc<Replica>,
    tokens: u64,
}

impl Drop for HeldKv {
    fn drop(&mut self) {
        let l = &self.replica.load;
        l.kv_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Prefill a request still waits for on a replica; released at its first byte (or its end).
pub struct QueuedPrefill {
    replica: Arc<Replica>,
    tokens: u64,
    sent: Instant,
    /// Nothing of this process's was left to prefill there when it came: its first byte
    /// times its own prefill, the replica's rate.
    first: bool,
    /// Its prompt's key among the replica's pending prompts, when it counts there.
    pending: Option<u64>,
}

impl QueuedPrefill {
    /// Its prefill is over: the replica now holds the prompt's `links` in its cache. Gives
    /// when the links it held already were last recorded (see [`CacheModel::answered`]).
    ///
    /// [`CacheModel::answered`]: crate::fleet::replica::CacheModel::answered
    pub fn prefilled(self, links: &[Link]) -> Recency {
        if self.first {
            let seconds = self.sent.elapsed().as_secs_f64();
            self.replica.load.progress().learn(self.tokens, seconds);
        }
        let recency = self.replica.cache.prefilled(links);
        if let Some(c) = self.replica.listener.get() {
            c.prefilled(&self.replica.id, links);
        }
        recency
    }
}

impl Drop for QueuedPrefill {
    fn drop(&mut self) {
        if let Some(key) = self.pending {
            self.replica.cache.pending.remove(key);
        }
        let l = &self.replica.load;
        let mut progress = l.progress();
        progress.settle(
            l.queued_tokens.fetch_sub(self.tokens, Ordering::Relaxed),
            Instant::now(),
        );
        progress.done = progress.done.saturating_sub(self.tokens);
        l.waiting.fetch_sub(1, Ordering::Relaxed);
        drop(progress);
        self.replica.changed();
    }
}

/// Counts one request in flight on a replica, and the KV it holds there, for as long as it
/// lives.
pub struct InFlight {
    replica: Arc<Replica>,
    kv_tokens: u64,
}

impl InFlight {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let l = &self.replica.load;
        l.in_flight.fetch_sub(1, Ordering::Relaxed);
        l.kv_tokens.fetch_sub(self.kv_tokens, Ordering::Relaxed);
        self.replica.changed();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::fleet::replica::Replica;

    /// The instances of a cluster routing one burst see equal queues, as they would with no
    /// credit: two replicas queued a few milliseconds apart are not told apart.
    #[test]
    fn a_burst_arriving_over_milliseconds_leaves_the_queues_equal() {
        // At 1,000 tokens a second the threshold is a second away: a test thread stalled
        // for less than that cannot cross it.
        let (a, b) = (replica_at(1_000.0), replica_at(1_000.0));
        let first = a.queue_prefill(3_000);
        let second = b.queue_prefill(3_000);
        // `a`'s came 10 ms before `b`'s.
        {
            let mut p = a.load.progress();
            p.at = p.at.map(|at| at - Duration::from_millis(10));
        }
        assert_eq!(
            a.queued_tokens(),
            3_000,
            "10 tokens of progress are not credited"
        );
        assert_eq!(a.queued_tokens(), b.queued_tokens());
        age(&a, 2);
        assert!(a.queued_tokens() < 2_000, "two seconds' are");
        drop((first, second));
    }

    fn replica_at(rate: f64) -> Arc<Replica> {
        let r = Arc::new(super::super::tests::replica("a", "127.0.0.1:1"));
        r.load.progress().learn((rate * 10.0) as u64, 10.0);
        r
    }

    /// Moves the replica's last event `seconds` back, as if that long had passed.
    fn age(r: &Replica, seconds: u64) {
        let mut p = r.load.progress();
        p.at = p.at.map(|at| at - Duration::from_secs(seconds));
    }

    #[test]
    fn a_long_prefill_under_way_counts_what_is_left_of_it() {
        let r = replica_at(10_000.0);
        let a = r.queue_prefill(40_000);
        assert!(a.first, "nothing was queued before it");
        assert!(r.queued_tokens() > 39_000);
        age(&r, 3);
        // 30k of it done: about 10k left (less the test's own time).
        let left = r.queued_tokens();
        assert!((9_000..=10_000).contains(&left), "{left}");
        let b = r.queue_prefill(20_000);
        assert!(!b.first, "a's prefill was not over");
        drop(a);
        age(&r, 100);
        assert_eq!(r.queued_tokens(), 0, "b's done too, at most the queue");
        drop(b);
        assert_eq!(r.queued_tokens(), 0);
    }

    #[test]
    fn time_with_nothing_left_to_prefill_is_not_credited_to_a_later_request() {
        let r = replica_at(1_000.0);
        // A short request whose guard lives on (a whole answer, not streamed): its prefill
        // is over long before its first byte.
        let short = r.queue_prefill(2_000);
        age(&r, 100);
        assert_eq!(r.queued_tokens(), 0);
        let long = r.queue_prefill(40_000);
        assert!(long.first, "nothing of ours was left to prefill there");
        let left = r.queued_tokens();
        assert!(
            left >= 39_000,
            "the 98 s idle are not credited to it: {left}"
        );
        drop(short);
        let left = r.queued_tokens();
        assert!(
            left >= 39_000,
            "the short one's tokens were its own: {left}"
        );
        drop(long);
    }

    #[test]
    fn another_instances_queue_turns_the_credit_off() {
        let r = replica_at(10_000.0);
        let a = r.queue_prefill(40_000);
        age(&r, 100);
        assert_eq!(r.queued_tokens(), 0);
        r.load
            .peer_queued_tokens
            .store(5_000, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(r.queued_tokens(), 45_000);
        drop(a);
    }
}
