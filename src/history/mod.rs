//! The Responses store in the balancer (`responses.store: balancer`): every stored exchange,
//! so that a `previous_response_id` chain is expanded here and any replica can serve it.
//!
//! - **Memory** ([`memory`]): each process holds what it made and what it read, bounded by
//!   count, bytes, TTL and a quota per client key.
//! - **Redis** (with `cluster.redis_url`, on [`Lane::Bulk`]): every exchange made is written
//!   there too, so any instance expands any chain; continuing a chain renews its exchanges'
//!   TTL. A chain is read in one round trip when its last exchange is held here (two when it is
//!   not): the exchanges this process lacks, and for those it holds, whether one was deleted
//!   since (`DELETE` leaves a tombstone for the TTL: another instance's copy must not bring it
//!   back). A read waits at most [`READ_BOUND`]; past it, what is held here is used.
//! - **Redis down**: exchanges and deletions are kept here and written once it is back; and
//!   when Redis comes back restarted (its `run_id` changed, so possibly empty), each process
//!   writes again every exchange it made and still holds, so chains made before the outage
//!   survive it.
//!
//! Keys: `inferlb:responses:v1:{key}` and `inferlb:responses:v1:gone:{key}`, where the key is
//! a hash of the client key's scope and the response id: an id never names another key's
//! exchange. The values are the exchanges' JSON; no client key is in them.

pub mod memory;
mod resend;

pub use resend::Resender;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::conf::responses::ResponsesConf;
use crate::link::{Lane, Link};
use crate::protocol::conversation::Exchange;
use crate::telemetry::metrics::METRICS;
use memory::{Bounds, Memory};

/// Seconds since the epoch: an exchange's age survives restarts and is the same for every
/// instance (the TTL is counted from it in memory and in Redis alike).
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The store's key for `id` under `scope`.
pub fn key(scope: u64, id: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"inferlb-response\0");
    h.update(&scope.to_le_bytes());
    h.update(id.as_bytes());
    h.digest()
}

fn redis_key(key: u64) -> String {
    format!("inferlb:responses:v1:{key:016x}")
}

fn gone_key(key: u64) -> String {
    format!("inferlb:responses:v1:gone:{key:016x}")
}

pub struct Store {
    conf: ResponsesConf,
    memory: Mutex<Memory>,
    link: Option<Arc<Link>>,
    /// Exchanges made here (by key) that Redis has not taken yet; written from memory, so an
    /// exchange evicted meanwhile is not kept alive for it.
    unsent: Mutex<HashSet<u64>>,
    /// Deletions Redis has not taken yet: their tombstones are written first when it is back.
    unsent_gone: Mutex<HashSet<u64>>,
}

/// How long a read on the request path waits for Redis before going on with what is held here.
pub const READ_BOUND: Duration = Duration::from_millis(250);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn event(name: &str) {
    METRICS.responses_store.with_label_values(&[name]).inc();
}

impl Store {
    pub fn new(conf: ResponsesConf, link: Option<Arc<Link>>) -> Arc<Store> {
        let bounds = Bounds {
            max_items: conf.max_items,
            max_bytes: conf.max_bytes,
            ttl_seconds: conf.ttl.as_secs().max(1),
            key_max_items: conf.key_max_items,
            key_max_bytes: conf.key_max_bytes,
        };
        Arc::new(Store {
            conf,
            memory: Mutex::new(Memory::new(bounds)),
            link,
            unsent: Mutex::new(HashSet::new()),
            unsent_gone: Mutex::new(HashSet::new()),
        })
    }

    /// Runs `f` on the memory, then shows its size in the gauges.
    fn memory<R>(&self, f: impl FnOnce(&mut Memory) -> R) -> R {
        let mut m = lock(&self.memory);
        let r = f(&mut m);
        METRICS.responses_items.set(m.len() as i64);
        METRICS.responses_bytes.set(m.bytes() as i64);
        r
    }

    /// The link, when it is up: while it is down nothing waits on it.
    fn up(&self) -> Option<&Arc<Link>> {
        self.link.as_ref().filter(|l| l.is_up())
    }

    fn ttl(&self) -> u64 {
        self.conf.ttl.as_secs().max(1)
    }

    /// A pipeline on the bulk lane, bounded by [`READ_BOUND`] (the request waits on it).
    async fn read<T: redis::FromRedisValue>(link: &Link, pipe: &redis::Pipeline) -> Option<T> {
        match tokio::time::timeout(READ_BOUND, link.pipe::<T>(Lane::Bulk, pipe)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                log::debug!("reading stored responses from redis: {e}");
                None
            }
            Err(_) => {
                event("read_slow");
                None
            }
        }
    }

    /// The chain ending at `id` (its exchanges oldest first, `id`'s last), or `None` when any
    /// of it is nowhere this process can reach: never part of a chain.
    pub async fn chain(&self, scope: u64, id: &str) -> Option<Vec<Arc<Exchange>>> {
        let now = now();
        let leaf_key = key(scope, id);
        let leaf = match self.memory(|m| m.get(leaf_key, now)) {
            Some(held) => held,
            // Not held: read first, for its ancestors (its tombstone is read with it).
            None => self.get(scope, id).await?,
        };
        let ids: Vec<&str> = leaf.ancestors.iter().map(String::as_str).collect();
        let keys: Vec<u64> = ids.iter().map(|a| key(scope, a)).collect();
        let mut found: Vec<Option<Arc<Exchange>>> =
            self.memory(|m| keys.iter().map(|k| m.get(*k, now)).collect());
        if let Some(link) = self.up() {
            // One round trip: what is missing, and whether what is held was deleted (the
            // leaf's own tombstone too, when it was held here).
            let mut pipe = redis::pipe();
            pipe.exists(gone_key(leaf_key));
            for (k, f) in keys.iter().zip(&found) {
                pipe.exists(gone_key(*k));
                if f.is_none() {
                    pipe.get(redis_key(*k));
                }
            }
            if let Some(answers) = Self::read::<Vec<redis::Value>>(link, &pipe).await {
                let mut answers = answers.into_iter();
                if matches!(answers.next(), Some(redis::Value::Int(1))) {
                    self.memory(|m| m.remove(leaf_key));
                    return None;
                }
                for (k, f) in keys.iter().zip(found.iter_mut()) {
                    let gone = matches!(answers.next(), Some(redis::Value::Int(1)));
                    let value = if f.is_none() { answers.next() } else { None };
                    if gone {
                        self.memory(|m| m.remove(*k));
                        *f = None;
                    } else if let Some(v) = value {
                        *f = self.held_from(scope, *k, &v, now);
                    }
                }
            }
        }
        let mut chain = Vec::with_capacity(found.len() + 1);
        for (a, f) in ids.iter().zip(found) {
            match f {
                Some(e) if e.id == *a => chain.push(e),
                _ => {
                    event("broken");
                    return None;
                }
            }
        }
        chain.push(leaf);
        Some(chain)
    }

    /// An exchange read from Redis, held here from now on; `None` unless it is the one asked.
    fn held_from(&self, scope: u64, k: u64, v: &redis::Value, now: u64) -> Option<Arc<Exchange>> {
        let redis::Value::BulkString(bytes) = v else {
            return None;
        };
        let e: Exchange = serde_json::from_slice(bytes).ok()?;
        if e.scope != scope || key(scope, &e.id) != k {
            return None;
        }
        let e = Arc::new(e);
        // Read now: its TTL starts now here (Redis renews it as its chain goes on).
        self.memory(|m| m.insert(k, e.clone(), false, now, now));
        Some(e)
    }

    /// The exchange `id` of `scope`: held here (unless deleted through another instance), or
    /// in Redis.
    pub async fn get(&self, scope: u64, id: &str) -> Option<Arc<Exchange>> {
        let k = key(scope, id);
        let now = now();
        let held = self.memory(|m| m.get(k, now));
        let Some(link) = self.up() else {
            return held;
        };
        let mut pipe = redis::pipe();
        pipe.exists(gone_key(k));
        if held.is_none() {
            pipe.get(redis_key(k));
        }
        let Some(answers) = Self::read::<Vec<redis::Value>>(link, &pipe).await else {
            return held;
        };
        let mut answers = answers.into_iter();
        if matches!(answers.next(), Some(redis::Value::Int(1))) {
            self.memory(|m| m.remove(k));
            return None;
        }
        match (held, answers.next()) {
            (Some(h), _) => Some(h),
            (None, Some(v)) => self.held_from(scope, k, &v, now),
            (None, None) => None,
        }
    }

    /// Holds a new exchange here: from now on this process finds it. `None` when it is not
    /// kept: it names itself among its ancestors, or is larger than its key may hold.
    pub fn keep(&self, e: Exchange) -> Option<Arc<Exchange>> {
        if e.ancestors.contains(&e.id) {
            return None;
        }
        let k = key(e.scope, &e.id);
        let e = Arc::new(e);
        let now = now();
        let held = self.memory(|m| {
            m.insert(k, e.clone(), true, e.stored_at.min(now), now);
            m.peek(k, now).is_some()
        });
        if !held {
            return None;
        }
        event("stored");
        Some(e)
    }

    /// Marks an exchange made here as not in Redis yet: it is written when Redis is back. At
    /// most as many as memory may hold, those it still holds first.
    fn not_sent(&self, k: u64) {
        if self.link.is_none() {
            return;
        }
        let mut unsent = lock(&self.unsent);
        if unsent.len() >= self.conf.max_items {
            let now = now();
            let m = lock(&self.memory);
            unsent.retain(|k| m.peek(*k, now).is_some());
        }
        if unsent.len() < self.conf.max_items {
            unsent.insert(k);
        }
    }

    /// Writes a kept exchange to Redis, renewing its ancestors' TTL; it stays unsent (written
    /// when Redis is back) if that fails.
    pub async fn share(&self, e: &Exchange) {
        let k = key(e.scope, &e.id);
        let Some(link) = self.up() else {
            self.not_sent(k);
            return;
        };
        let Ok(json) = serde_json::to_vec(e) else {
            return;
        };
        let mut pipe = redis::pipe();
        // Never over another exchange of the same id.
        pipe.cmd("SET")
            .arg(redis_key(k))
            .arg(json)
            .arg("EX")
            .arg(self.ttl())
            .arg("NX")
            .ignore();
        for a in &e.ancestors {
            pipe.expire(redis_key(key(e.scope, a)), self.ttl() as i64)
                .ignore();
        }
        match link.pipe::<()>(Lane::Bulk, &pipe).await {
            Ok(()) => {}
            Err(e) => {
                event("unsent");
                self.not_sent(k);
                log::debug!("writing a stored response to redis: {e}");
            }
        }
    }

    /// Keeps `e` and writes it to Redis, waiting at most `responses.hold_ms` for the write:
    /// the caller (a response's last chunk) goes on then, and a write still running finishes
    /// or is retried when Redis is back. For the hooks Pingora calls without `await`. Where
    /// this thread cannot wait (a runtime of one thread, `work_stealing: false`), the time the
    /// caller should wait instead, before its chunk goes on.
    pub fn keep_and_share(self: &Arc<Self>, e: Exchange) -> Option<Duration> {
        let e = self.keep(e)?;
        if self.up().is_none() {
            self.not_sent(key(e.scope, &e.id));
            return None;
        }
        let (done, wait) = std::sync::mpsc::sync_channel::<()>(1);
        let store = self.clone();
        tokio::spawn(async move {
            store.share(&e).await;
            let _ = done.send(());
        });
        let hold = self.conf.hold;
        if hold.is_zero() {
            return None;
        }
        let can_block = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if !can_block {
            // The write runs on this thread once the caller yields: a sleep lets it.
            return Some(hold);
        }
        // The hook is synchronous: this thread waits (its other tasks move to the runtime's
        // other threads meanwhile) for a write that takes a round trip.
        let waited = tokio::task::block_in_place(|| wait.recv_timeout(hold));
        if waited.is_err() {
            event("hold_expired");
        }
        None
    }

    /// Forgets `id` of `scope` here and in Redis, leaving a tombstone there (written when
    /// Redis is back, if it is down now); whether it was stored.
    pub async fn delete(&self, scope: u64, id: &str) -> bool {
        let found = self.get(scope, id).await.is_some();
        if !found {
            return false;
        }
        let k = key(scope, id);
        self.memory(|m| m.remove(k));
        lock(&self.unsent).remove(&k);
        let written = match self.up() {
            Some(link) => link
                .pipe::<()>(Lane::Bulk, &self.tombstone(k))
                .await
                .is_ok(),
            None => false,
        };
        if !written && self.link.is_some() {
            let mut gone = lock(&self.unsent_gone);
            if gone.len() < self.conf.max_items {
                gone.insert(k);
            }
        }
        true
    }

    fn tombstone(&self, k: u64) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        pipe.del(redis_key(k)).ignore();
        pipe.cmd("SET")
            .arg(gone_key(k))
            .arg(1)
            .arg("EX")
            .arg(self.ttl())
            .ignore();
        pipe
    }
}
