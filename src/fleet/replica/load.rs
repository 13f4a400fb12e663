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

/// How far a replica's prefill has gone into the requests this process queued on it: since
/// when it has had one waiting without a pause, the uncached tokens of those released since
/// then, and its prefill rate, learned from the first bytes of requests that found nothing
/// of this process's queued before them.
#[derive(Default)]
struct Progress {
    busy_since: Option<Instant>,
    released: u64,
    /// Uncached tokens prefilled a second; 0 until learned.
    tokens_per_s: f64,
}

impl Progress {
    /// Tokens of the queue prefilled already (see [`prefilled_meanwhile`]).
    fn credit(&self, queued: u64, now: Instant) -> u64 {
        let Some(since) = self.busy_since else {
            return 0;
        };
        let elapsed = now.saturating_duration_since(since).as_secs_f64();
        prefilled_meanwhile(self.tokens_per_s, elapsed, self.released, queued)
    }

    /// A request that started a busy period had its prefill (`tokens`) over in `seconds`.
    fn learn(&mut self, tokens: u64, seconds: f64) {
        if tokens < MIN_RATE_SAMPLE_TOKENS || seconds <= 0.0 {
            return;
        }
        let sample = tokens as f64 / seconds;
        self.tokens_per_s = if self.tokens_per_s == 0.0 {
            sample
        } else {
            self.tokens_per_s * 0.875 + sample * 0.125
        };
    }
}

/// A request's first byte also takes a decode step and the network: a prefill shorter than
/// this says more of those than of the rate.
const MIN_RATE_SAMPLE_TOKENS: u64 = 1024;

/// Of `queued` uncached tokens waiting on a replica that has been prefilling for `elapsed`
/// seconds at `tokens_per_s`, how many are done already: the work since the busy period
/// began less what was released meanwhile (requests past their first byte), at most the
/// queue. The queue counts each request whole until its first byte; without this a replica
/// half way through a long prefill looks as busy as when it began, and a continuation moves
/// off its holder for a queue that is nearly over. 0 while the rate is unknown.
pub(crate) fn prefilled_meanwhile(
    tokens_per_s: f64,
    elapsed: f64,
    released: u64,
    queued: u64,
) -> u64 {
    if !(tokens_per_s > 0.0 && elapsed > 0.0) {
        return 0;
    }
    let work = (tokens_per_s * elapsed).min(u64::MAX as f64) as u64;
    work.saturating_sub(released).min(queued)
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
    /// what its prefill rate says is done of it, plus what the other instances sent, plus,
    /// when the replica reports more requests waiting than that, the others at the mean size.
    pub fn queued_tokens(&self) -> u64 {
        let l = &self.load;
        let own = l.queued_tokens.load(Ordering::Relaxed);
        let done = l.progress().credit(own, Instant::now());
        let seen = own
            .saturating_sub(done)
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
        let now = Instant::now();
        let mut progress = l.progress();
        l.queued_tokens.fetch_add(uncached, Ordering::Relaxed);
        let first = l.waiting.fetch_add(1, Ordering::Relaxed) == 0;
        if first {
            progress.busy_since = Some(now);
            progress.released = 0;
        }
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
            first,
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
    /// Nothing of this process's was queued there before it: its first byte times its own
    /// prefill, the replica's rate.
    first: bool,
}

impl QueuedPrefill {
    /// Its prefill is over: the replica now holds the prompt's `links` in its cache. Gives
    /// when the links it held already were last recorded (see [`CacheModel::answered`]).
    ///
    /// [`CacheModel::answered`]: crate::fleet::replica::CacheModel::answered
    pub fn prefilled(self, links: &[crate::protocol::api::prompt::Link]) -> Recency {
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
        let l = &self.replica.load;
        let mut progress = l.progress();
        l.queued_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        if l.waiting.fetch_sub(1, Ordering::Relaxed) == 1 {
            progress.busy_since = None;
            progress.released = 0;
        } else {
            progress.released = progress.released.saturating_add(self.tokens);
        }
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
    use std::time::{Duration, Instant};

    use super::{prefilled_meanwhile, Progress};

    #[test]
    fn a_queue_is_credited_the_work_done_since_it_began_less_what_was_released() {
        // (tokens a second, seconds busy, released, queued) → credited
        let rows: &[(f64, f64, u64, u64, u64)] = &[
            // the rate unknown: nothing
            (0.0, 1.0, 0, 40_000, 0),
            // half a 40k prefill done
            (20_000.0, 1.0, 0, 40_000, 20_000),
            // a 10k request released meanwhile: its work is not credited twice
            (20_000.0, 1.0, 10_000, 30_000, 10_000),
            // never more than the queue
            (20_000.0, 10.0, 0, 40_000, 40_000),
            // released more than the rate says was done (a slower replica): nothing
            (1_000.0, 1.0, 5_000, 10_000, 0),
            // no time, or a rate that is not a number
            (20_000.0, 0.0, 0, 40_000, 0),
            (f64::NAN, 1.0, 0, 40_000, 0),
            (f64::INFINITY, 1.0, 0, 40_000, 40_000),
        ];
        for &(rate, seconds, released, queued, want) in rows {
            assert_eq!(
                prefilled_meanwhile(rate, seconds, released, queued),
                want,
                "{rate} t/s, {seconds} s, {released} released, {queued} queued"
            );
        }
    }

    #[test]
    fn the_rate_is_learned_from_long_enough_prefills_and_moves_slowly() {
        let mut p = Progress::default();
        // (tokens, seconds) → the rate after it
        let rows: &[(u64, f64, f64, &str)] = &[
            (512, 0.01, 0.0, "a short prefill says little of the rate"),
            (20_000, 1.0, 20_000.0, "the first sample"),
            (
                40_000,
                1.0,
                22_500.0,
                "an eighth of the way to a new sample",
            ),
            (40_000, 0.0, 22_500.0, "no time: no sample"),
        ];
        for &(tokens, seconds, want, why) in rows {
            p.learn(tokens, seconds);
            assert_eq!(p.tokens_per_s, want, "{why}");
        }
    }

    #[test]
    fn a_busy_period_begins_with_the_first_queued_and_ends_with_the_last_released() {
        let r = Arc::new(super::super::tests::replica("a", "127.0.0.1:1"));
        r.load.progress().tokens_per_s = 10_000.0;
        let a = r.queue_prefill(30_000);
        let since = r
            .load
            .progress()
            .busy_since
            .expect("busy from its first request");
        let b = r.queue_prefill(20_000);
        assert_eq!(r.load.progress().busy_since, Some(since), "the same period");
        assert!(!b.first && a.first);
        drop(a);
        assert_eq!(r.load.progress().released, 30_000);
        // 2 s into the period at 10k a second: 20k done, 30k of it a's, released: none of b.
        let later = since + Duration::from_secs(2);
        assert_eq!(r.load.progress().credit(20_000, later), 0);
        // 4 s in: 10k of b's 20k done.
        let later = since + Duration::from_secs(4);
        assert_eq!(r.load.progress().credit(20_000, later), 10_000);
        drop(b);
        let p = r.load.progress();
        assert_eq!((p.busy_since, p.released), (None, 0));
        assert_eq!(p.credit(0, Instant::now()), 0);
        drop(p);
        assert_eq!(r.queued_tokens(), 0);
    }
}
