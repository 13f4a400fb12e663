//! The Responses store in the balancer (`responses.store: balancer`): every stored exchange,
//! so that a `previous_response_id` chain is expanded here and any replica can serve it.
//!
//! - **Memory** ([`memory`]): each process holds what it made and what it read, bounded by
//!   count, bytes, TTL and a quota per client key.
//! - **Redis** (with `cluster.redis_url`, on [`Lane::Bulk`]): every exchange made is written
//!   there too, so any instance expands any chain. A chain is read in one round trip: the
//!   exchanges this process lacks, and for those it holds, whether one was deleted since
//!   (`DELETE` leaves a tombstone for the TTL: another instance's copy must not bring it back).
//! - **Redis down**: exchanges are kept here and written once it is back; and when it comes
//!   back (possibly empty, after a restart), each process writes again every exchange it made
//!   and still holds, so chains made before the outage survive it.
//!
//! Keys: `inferlb:responses:v1:{key}` and `inferlb:responses:v1:gone:{key}`, where the key is
//! a hash of the client key's scope and the response id: an id never names another key's
//! exchange. The values are the exchanges' JSON; no client key is in them.

pub mod memory;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

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
    /// Exchanges made here that Redis has not taken yet.
    unsent: Mutex<HashMap<u64, Arc<Exchange>>>,
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
            unsent: Mutex::new(HashMap::new()),
        })
    }

    fn memory(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unsent(&self) -> MutexGuard<'_, HashMap<u64, Arc<Exchange>>> {
        self.unsent.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gauges(&self, m: &Memory) {
        METRICS.responses_items.set(m.len() as i64);
        METRICS.responses_bytes.set(m.bytes() as i64);
    }

    /// The link, when it is up: while it is down nothing waits on it.
    fn up(&self) -> Option<&Arc<Link>> {
        self.link.as_ref().filter(|l| l.is_up())
    }

    fn ttl_left(&self, e: &Exchange) -> u64 {
        let age = now().saturating_sub(e.stored_at);
        self.conf.ttl.as_secs().saturating_sub(age).max(1)
    }

    /// The chain ending at `id` (its exchanges oldest first, `id`'s last), or `None` when any
    /// of it is nowhere this process can reach: never part of a chain.
    pub async fn chain(&self, scope: u64, id: &str) -> Option<Vec<Arc<Exchange>>> {
        let leaf = self.get(scope, id).await?;
        let ids: Vec<&str> = leaf.ancestors.iter().map(String::as_str).collect();
        let keys: Vec<u64> = ids.iter().map(|a| key(scope, a)).collect();
        let now = now();
        let mut found: Vec<Option<Arc<Exchange>>> = {
            let mut m = self.memory();
            keys.iter().map(|k| m.get(*k, now)).collect()
        };
        if let Some(link) = self.up() {
            // One round trip: what is missing, and whether what is held was deleted.
            let mut pipe = redis::pipe();
            for (k, f) in keys.iter().zip(&found) {
                pipe.exists(gone_key(*k));
                if f.is_none() {
                    pipe.get(redis_key(*k));
                }
            }
            if !keys.is_empty() {
                match link.pipe::<Vec<redis::Value>>(Lane::Bulk, &pipe).await {
                    Ok(answers) => {
                        let mut answers = answers.into_iter();
                        for (k, f) in keys.iter().zip(found.iter_mut()) {
                            let gone = matches!(answers.next(), Some(redis::Value::Int(1)));
                            let value = if f.is_none() { answers.next() } else { None };
                            if gone {
                                self.memory().remove(*k);
                                *f = None;
                            } else if let Some(v) = value {
                                *f = self.read(scope, *k, &v, now);
                            }
                        }
                    }
                    Err(e) => log::debug!("reading a Responses chain from redis: {e}"),
                }
            }
        }
        let mut chain = Vec::with_capacity(found.len() + 1);
        for (a, f) in ids.iter().zip(found) {
            match f {
                Some(e) if e.id == *a => chain.push(e),
                _ => {
                    METRICS.responses_store.with_label_values(&["broken"]).inc();
                    return None;
                }
            }
        }
        chain.push(leaf);
        Some(chain)
    }

    /// An exchange read from Redis, held here from now on; `None` unless it is the one asked.
    fn read(&self, scope: u64, k: u64, v: &redis::Value, now: u64) -> Option<Arc<Exchange>> {
        let redis::Value::BulkString(bytes) = v else {
            return None;
        };
        let e: Exchange = serde_json::from_slice(bytes).ok()?;
        if e.scope != scope || key(scope, &e.id) != k {
            return None;
        }
        let e = Arc::new(e);
        let mut m = self.memory();
        m.insert(k, e.clone(), false, now);
        self.gauges(&m);
        Some(e)
    }

    /// The exchange `id` of `scope`: held here (unless deleted through another instance), or
    /// in Redis.
    pub async fn get(&self, scope: u64, id: &str) -> Option<Arc<Exchange>> {
        let k = key(scope, id);
        let now = now();
        let held = self.memory().get(k, now);
        let Some(link) = self.up() else {
            return held;
        };
        if held.is_some() {
            let cmd = redis::cmd("EXISTS").arg(gone_key(k)).clone();
            return match link.query::<i64>(Lane::Bulk, &cmd).await {
                Ok(1) => {
                    self.memory().remove(k);
                    None
                }
                _ => held,
            };
        }
        let mut pipe = redis::pipe();
        pipe.exists(gone_key(k)).get(redis_key(k));
        match link.pipe::<(i64, redis::Value)>(Lane::Bulk, &pipe).await {
            Ok((0, v)) => self.read(scope, k, &v, now),
            Ok(_) => None,
            Err(e) => {
                log::debug!("reading a stored response from redis: {e}");
                None
            }
        }
    }

    /// Holds a new exchange here: from now on this process finds it.
    pub fn keep(&self, e: Exchange) -> Arc<Exchange> {
        let k = key(e.scope, &e.id);
        let e = Arc::new(e);
        let mut m = self.memory();
        m.insert(k, e.clone(), true, now());
        self.gauges(&m);
        METRICS.responses_store.with_label_values(&["stored"]).inc();
        if self.link.is_some() {
            let mut unsent = self.unsent();
            // A long outage keeps at most what memory may hold; past it, Redis never gets
            // the rest (this process still has them while they last).
            if unsent.len() < self.conf.max_items {
                unsent.insert(k, e.clone());
            }
        }
        e
    }

    /// Writes a kept exchange to Redis; it stays unsent (written when Redis is back) if that
    /// fails.
    pub async fn share(&self, e: &Exchange) {
        let Some(link) = self.up() else { return };
        let k = key(e.scope, &e.id);
        let Ok(json) = serde_json::to_vec(e) else {
            return;
        };
        let cmd = redis::cmd("SET")
            .arg(redis_key(k))
            .arg(json)
            .arg("EX")
            .arg(self.ttl_left(e))
            .clone();
        match link.query::<()>(Lane::Bulk, &cmd).await {
            Ok(()) => {
                self.unsent().remove(&k);
            }
            Err(e) => {
                METRICS.responses_store.with_label_values(&["unsent"]).inc();
                log::debug!("writing a stored response to redis: {e}");
            }
        }
    }

    /// Keeps `e` and writes it to Redis, waiting at most `responses.hold_ms` for the write:
    /// the caller (a response's last chunk) goes on then, and a write still running finishes
    /// or is retried when Redis is back. For the hooks Pingora calls without `await`.
    pub fn keep_and_share(self: &Arc<Self>, e: Exchange) {
        let e = self.keep(e);
        if self.up().is_none() {
            return;
        }
        let (done, wait) = std::sync::mpsc::sync_channel::<()>(1);
        let store = self.clone();
        tokio::spawn(async move {
            store.share(&e).await;
            let _ = done.send(());
        });
        let hold = self.conf.hold;
        let can_block = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if hold.is_zero() || !can_block {
            return;
        }
        // The hook is synchronous: this thread waits (its other tasks move to the runtime's
        // other threads meanwhile) for a write that takes a round trip.
        let waited = tokio::task::block_in_place(|| wait.recv_timeout(hold));
        if waited.is_err() {
            METRICS
                .responses_store
                .with_label_values(&["hold_expired"])
                .inc();
        }
    }

    /// Forgets `id` of `scope` here and in Redis, leaving a tombstone there; whether it was
    /// stored.
    pub async fn delete(&self, scope: u64, id: &str) -> bool {
        let found = self.get(scope, id).await.is_some();
        let k = key(scope, id);
        {
            let mut m = self.memory();
            m.remove(k);
            self.gauges(&m);
        }
        self.unsent().remove(&k);
        if let (true, Some(link)) = (found, self.up()) {
            let mut pipe = redis::pipe();
            pipe.del(redis_key(k)).ignore();
            pipe.cmd("SET")
                .arg(gone_key(k))
                .arg(1)
                .arg("EX")
                .arg(self.conf.ttl.as_secs().max(1))
                .ignore();
            if let Err(e) = link.pipe::<()>(Lane::Bulk, &pipe).await {
                log::warn!("deleting a stored response in redis: {e}");
            }
        }
        found
    }

    /// Writes what Redis lacks: what was never sent and, after a reconnection (Redis may have
    /// restarted empty), everything made here and still held. In batches, one at a time.
    async fn resend(&self, everything: bool) -> Result<usize, crate::link::Failed> {
        let Some(link) = &self.link else {
            return Ok(0);
        };
        let now = now();
        let mut todo: HashMap<u64, Arc<Exchange>> = self.unsent().clone();
        if everything {
            todo.extend(self.memory().made_here(now));
        }
        let mut sent = 0;
        let all: Vec<(u64, Arc<Exchange>)> = todo.into_iter().collect();
        for batch in all.chunks(64) {
            let mut pipe = redis::pipe();
            for (k, e) in batch {
                let Ok(json) = serde_json::to_vec(&**e) else {
                    continue;
                };
                // Not over a newer write, nor over a deletion made meanwhile.
                pipe.cmd("SET")
                    .arg(redis_key(*k))
                    .arg(json)
                    .arg("EX")
                    .arg(self.ttl_left(e))
                    .arg("NX")
                    .ignore();
            }
            link.pipe::<()>(Lane::Bulk, &pipe).await?;
            let mut unsent = self.unsent();
            for (k, _) in batch {
                unsent.remove(k);
            }
            sent += batch.len();
        }
        Ok(sent)
    }
}

/// The background task that writes to Redis what it lacks, each time the link comes up.
pub struct Resender {
    pub store: Arc<Store>,
}

#[async_trait]
impl BackgroundService for Resender {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(link) = self.store.link.clone() else {
            return;
        };
        let mut status = link.status();
        let mut seen = None;
        loop {
            let generation = tokio::select! {
                g = crate::link::up(&mut status) => g,
                _ = shutdown.changed() => return,
            };
            if seen != Some(generation) {
                // The first connection finds Redis as other instances left it; a later one
                // may find it restarted.
                let everything = seen.is_some();
                match self.store.resend(everything).await {
                    Ok(0) => {}
                    Ok(n) => log::info!("{n} stored responses written to redis again"),
                    Err(e) => log::warn!("writing stored responses to redis again: {e}"),
                }
                seen = Some(generation);
            }
            tokio::select! {
                _ = status.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(5)) => {
                    // Writes that failed while the link stayed up.
                    if !self.store.unsent().is_empty() && link.is_up() {
                        let _ = self.store.resend(false).await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}
