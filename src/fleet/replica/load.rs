//! A replica's load as this process and the other instances of a cluster see it, and as the
//! replica reports it: requests in flight, prefill queued (requests without a first byte and
//! their uncached tokens), decodes running. The guards count a request for as long as it holds
//! its place, and tell the cluster each change.
//!
//! What the replica and the other instances report is clamped where it is read
//! (`crate::fleet::poll`, the cluster); the sums and products here saturate all the same, so no
//! number can wrap a busy replica's load around to look idle.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::Replica;
use crate::fleet::events::Listener;
use crate::fleet::index::Recency;

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

    /// Prefill tokens queued on it: what this process sent that has no first byte yet, plus,
    /// when the replica reports more requests waiting than that, the others at the mean size.
    pub fn queued_tokens(&self) -> u64 {
        let l = &self.load;
        let seen = l
            .queued_tokens
            .load(Ordering::Relaxed)
            .saturating_add(l.peer_queued_tokens.load(Ordering::Relaxed));
        if !l.reported.load(Ordering::Relaxed) {
            return seen;
        }
        let known = (l.waiting.load(Ordering::Relaxed) as u64)
            .saturating_add(l.peer_waiting.load(Ordering::Relaxed));
        let others = l
            .reported_waiting
            .load(Ordering::Relaxed)
            .saturating_sub(known);
        seen.saturating_add(others.saturating_mul(l.mean_uncached.load(Ordering::Relaxed)))
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
        let l = &self.load;
        l.queued_tokens.fetch_add(uncached, Ordering::Relaxed);
        l.waiting.fetch_add(1, Ordering::Relaxed);
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
        }
    }
}

/// Prefill a request still waits for on a replica; released at its first byte (or its end).
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

pub struct QueuedPrefill {
    replica: Arc<Replica>,
    tokens: u64,
}

impl QueuedPrefill {
    /// Its prefill is over: the replica now holds the prompt's `links` in its cache. Gives
    /// when the links it held already were last recorded (see [`CacheModel::answered`]).
    ///
    /// [`CacheModel::answered`]: crate::fleet::replica::CacheModel::answered
    pub fn prefilled(self, links: &[crate::protocol::api::prompt::Link]) -> Recency {
        let recency = self.replica.cache.prefilled(links);
        if let Some(c) = self.replica.listener.get() {
            c.prefilled(&self.replica.id, links);
        }
        recency
    }
}

impl Drop for QueuedPrefill {
    fn drop(&mut self) {
        let l = &self.replica.load;
        l.queued_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        l.waiting.fetch_sub(1, Ordering::Relaxed);
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
