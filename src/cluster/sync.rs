//! The background side of the cluster: writes this instance's changes to Redis in batches,
//! follows the others' on a pub/sub channel, bootstraps from Redis on every (re)connect, and
//! shares each instance's load per replica. Nothing here is on the request path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use redis::aio::MultiplexedConnection;
use tokio::sync::mpsc;

use super::{decode, encode, Change, Cluster, Table};
use crate::affinity::AffinityTable;
use crate::api::prompt::HASH_VERSION;
use crate::config::{check_replica, ReplicaConf};
use crate::registry::Registry;

/// Every Redis round trip is bounded by this; slower counts as down.
const TIMEOUT: Duration = Duration::from_secs(1);
/// How often load is published and read.
const LOAD_EVERY: Duration = Duration::from_millis(250);
/// An instance's load expires this long after its last report (it stopped or lost Redis).
const LOAD_TTL_SECONDS: u64 = 2;
/// Changes written per round trip.
const BATCH: usize = 512;

pub struct ClusterSync {
    pub cluster: Arc<Cluster>,
    /// Taken once, when the service starts.
    pub changes: Mutex<Option<mpsc::Receiver<Change>>>,
    pub url: String,
    pub registry: Arc<Registry>,
    pub affinity: Arc<AffinityTable>,
    pub stored: Arc<AffinityTable>,
    pub pin_ttl: Duration,
}

fn pin_key(table: Table, key: u64) -> String {
    format!("inferlb:v{HASH_VERSION}:{}:{key:016x}", table.tag())
}
fn pins_channel() -> String {
    format!("inferlb:v{HASH_VERSION}:pins")
}
const DRAINS: &str = "inferlb:drains";
fn drain_key(replica: &str) -> String {
    format!("inferlb:drain:{replica}")
}
fn replica_key(id: &str) -> String {
    format!("inferlb:replica:{id}")
}
fn load_key(instance: &str) -> String {
    format!("inferlb:load:{instance}")
}

/// Writes a pin unless one is there, and announces it only then: the first writer wins.
const SET_NX_AND_PUBLISH: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) \
     then redis.call('PUBLISH', ARGV[3], ARGV[4]) end return 1";

type Failed = redis::RedisError;

async fn bounded<T>(
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, Failed> {
    match tokio::time::timeout(TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "redis did not answer in time",
        ))),
    }
}

impl ClusterSync {
    fn table(&self, t: Table) -> &AffinityTable {
        match t {
            Table::Affinity => &self.affinity,
            Table::Stored => &self.stored,
        }
    }

    /// Applies another instance's change (or what Redis holds) to the local state.
    async fn apply(&self, change: Change) {
        match change {
            Change::Pin {
                table,
                key,
                replica,
            } => {
                if let Some(r) = self.registry.get(&replica) {
                    self.table(table).record(key, &r.id);
                }
            }
            Change::Drain { replica, draining } => {
                if let Some(r) = self.registry.get(&replica) {
                    if r.is_draining() != draining {
                        r.set_draining(draining);
                    }
                }
            }
            Change::Replica { id, conf: None } => {
                self.registry.remove(&id);
            }
            Change::Replica {
                id,
                conf: Some(json),
            } => {
                if self.registry.get(&id).is_some() {
                    return;
                }
                let Ok(mut conf) = serde_json::from_str::<ReplicaConf>(&json) else {
                    return;
                };
                // Resolving an address may block: not on this task.
                let checked = tokio::task::spawn_blocking(move || {
                    check_replica(&mut conf, "shared replica").map(|()| conf)
                })
                .await;
                match checked {
                    Ok(Ok(conf)) => {
                        let _ = self.registry.add(&conf, None);
                    }
                    Ok(Err(e)) => log::warn!("cluster: replica {id} from another instance: {e}"),
                    Err(_) => {}
                }
            }
        }
    }

    /// Writes this instance's changes; `first_writer_wins` after an outage.
    async fn write(
        &self,
        conn: &mut MultiplexedConnection,
        changes: &[Change],
        first_writer_wins: bool,
    ) -> Result<(), Failed> {
        let ttl = self.pin_ttl.as_secs().max(1);
        let mut pipe = redis::pipe();
        for c in changes {
            let message = encode(&self.cluster.instance, c);
            match c {
                Change::Pin {
                    table,
                    key,
                    replica,
                } if first_writer_wins => {
                    pipe.cmd("EVAL")
                        .arg(SET_NX_AND_PUBLISH)
                        .arg(1)
                        .arg(pin_key(*table, *key))
                        .arg(&**replica)
                        .arg(ttl)
                        .arg(pins_channel())
                        .arg(message)
                        .ignore();
                }
                Change::Pin {
                    table,
                    key,
                    replica,
                } => {
                    pipe.cmd("SET")
                        .arg(pin_key(*table, *key))
                        .arg(&**replica)
                        .arg("EX")
                        .arg(ttl)
                        .ignore();
                    pipe.cmd("PUBLISH")
                        .arg(pins_channel())
                        .arg(message)
                        .ignore();
                }
                Change::Drain { replica, draining } => {
                    if *draining {
                        pipe.cmd("SET").arg(drain_key(replica)).arg(1).ignore();
                    } else {
                        pipe.cmd("DEL").arg(drain_key(replica)).ignore();
                    }
                    pipe.cmd("PUBLISH").arg(DRAINS).arg(message).ignore();
                }
                Change::Replica { id, conf } => {
                    match conf {
                        Some(c) => pipe.cmd("SET").arg(replica_key(id)).arg(c).ignore(),
                        None => pipe.cmd("DEL").arg(replica_key(id)).ignore(),
                    };
                    pipe.cmd("PUBLISH").arg(DRAINS).arg(message).ignore();
                }
            }
        }
        bounded(pipe.query_async::<()>(conn)).await
    }

    /// Every key matching `pattern`, at most `limit`.
    async fn scan(
        conn: &mut MultiplexedConnection,
        pattern: &str,
        limit: usize,
    ) -> Result<Vec<String>, Failed> {
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = bounded(
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(conn),
            )
            .await?;
            keys.extend(batch);
            cursor = next;
            if cursor == 0 || keys.len() >= limit {
                keys.truncate(limit);
                return Ok(keys);
            }
        }
    }

    /// Adopts what Redis holds: pins of this hash version, and drains.
    async fn bootstrap(&self, conn: &mut MultiplexedConnection) -> Result<usize, Failed> {
        let mut adopted = 0;
        for table in [Table::Affinity, Table::Stored] {
            let pattern = format!("inferlb:v{HASH_VERSION}:{}:*", table.tag());
            let keys = Self::scan(conn, &pattern, 1_000_000).await?;
            for chunk in keys.chunks(500) {
                let values: Vec<Option<String>> =
                    bounded(redis::cmd("MGET").arg(chunk).query_async(conn)).await?;
                for (k, v) in chunk.iter().zip(values) {
                    let key = k
                        .rsplit(':')
                        .next()
                        .and_then(|h| u64::from_str_radix(h, 16).ok());
                    if let (Some(key), Some(replica)) = (key, v) {
                        self.apply(Change::Pin {
                            table,
                            key,
                            replica: Arc::from(replica),
                        })
                        .await;
                        adopted += 1;
                    }
                }
            }
        }
        // Replicas added at runtime, before their pins and drains.
        let added = Self::scan(conn, "inferlb:replica:*", 100_000).await?;
        for chunk in added.chunks(500) {
            let values: Vec<Option<String>> =
                bounded(redis::cmd("MGET").arg(chunk).query_async(conn)).await?;
            for (k, conf) in chunk.iter().zip(values) {
                let id = k.trim_start_matches("inferlb:replica:").to_string();
                if conf.is_some() {
                    self.apply(Change::Replica { id, conf }).await;
                }
            }
        }
        let drained = Self::scan(conn, "inferlb:drain:*", 100_000).await?;
        for r in self.registry.all().iter() {
            let draining = drained.contains(&drain_key(&r.id));
            self.apply(Change::Drain {
                replica: r.id.clone(),
                draining,
            })
            .await;
        }
        Ok(adopted)
    }

    /// One connected session, until Redis fails or the process stops (`Ok`).
    async fn session(
        &self,
        rx: &mut mpsc::Receiver<Change>,
        pending: &mut Vec<Change>,
        shutdown: &mut ShutdownWatch,
    ) -> Result<(), Failed> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = bounded(client.get_multiplexed_async_connection()).await?;
        let mut pubsub = bounded(client.get_async_pubsub()).await?;
        bounded(pubsub.subscribe(&[pins_channel().as_str(), DRAINS])).await?;
        if self.cluster.set_connected(true) {
            log::warn!("cluster: connected to redis as {}", self.cluster.instance);
        }
        // What was changed here while Redis was away: the first writer wins.
        let outage: Vec<Change> = std::mem::take(pending);
        for chunk in outage.chunks(BATCH) {
            self.write(&mut conn, chunk, true).await?;
        }
        let adopted = self.bootstrap(&mut conn).await?;
        self.cluster.set_bootstrapped();
        log::info!("cluster: {adopted} pins adopted from redis");
        let mut messages = pubsub.into_on_message();
        let mut load = Aborting(tokio::spawn(share_load_every(
            self.registry.clone(),
            self.cluster.instance.clone(),
            conn.clone(),
        )));
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return Ok(()),
                m = messages.next() => {
                    let Some(m) = m else {
                        return Err(redis::RedisError::from(std::io::Error::other("subscription closed")));
                    };
                    let payload: String = m.get_payload().unwrap_or_default();
                    if let Some((from, change)) = decode(&payload) {
                        if from != self.cluster.instance {
                            self.apply(change).await;
                        }
                    }
                }
                n = rx.recv_many(&mut batch, BATCH) => {
                    if n == 0 {
                        return Ok(());
                    }
                    if let Err(e) = self.write(&mut conn, &batch, false).await {
                        pending.append(&mut batch);
                        return Err(e);
                    }
                    batch.clear();
                }
                failed = &mut load.0 => {
                    return Err(failed.unwrap_or_else(|_| {
                        redis::RedisError::from(std::io::Error::other("load sharing stopped"))
                    }));
                }
            }
        }
    }
}

/// Publishes this instance's load per replica and reads the others'.
async fn share_load(
    registry: &Registry,
    instance: &str,
    conn: &mut MultiplexedConnection,
) -> Result<(), Failed> {
    let mine = load_key(instance);
    let mut pipe = redis::pipe();
    for r in registry.all().iter() {
        let (queued, waiting) = r.local_prefill();
        let value = format!("{queued} {waiting} {}", r.in_flight());
        pipe.cmd("HSET").arg(&mine).arg(&*r.id).arg(value).ignore();
    }
    pipe.cmd("EXPIRE").arg(&mine).arg(LOAD_TTL_SECONDS).ignore();
    bounded(pipe.query_async::<()>(conn)).await?;
    let mut total: HashMap<String, (u64, u64, u64)> = HashMap::new();
    for key in ClusterSync::scan(conn, "inferlb:load:*", 10_000).await? {
        if key == mine {
            continue;
        }
        let fields: HashMap<String, String> =
            bounded(redis::cmd("HGETALL").arg(&key).query_async(conn)).await?;
        for (replica, value) in fields {
            let mut n = value.split(' ').map(|v| v.parse::<u64>().unwrap_or(0));
            let t = total.entry(replica).or_default();
            t.0 += n.next().unwrap_or(0);
            t.1 += n.next().unwrap_or(0);
            t.2 += n.next().unwrap_or(0);
        }
    }
    for r in registry.all().iter() {
        let (queued, waiting, in_flight) = total.get(&*r.id).copied().unwrap_or_default();
        r.set_peer_load(queued, waiting, in_flight);
    }
    Ok(())
}

/// [`share_load`] every [`LOAD_EVERY`] on a clone of the multiplexed connection (same socket),
/// until a round fails (that error is what it returns). A task apart from the pins and drains:
/// the loop that sends them never waits for a load round to finish, though Redis still answers
/// the socket's commands in order.
async fn share_load_every(
    registry: Arc<Registry>,
    instance: String,
    mut conn: MultiplexedConnection,
) -> Failed {
    let mut tick = tokio::time::interval(LOAD_EVERY);
    loop {
        tick.tick().await;
        if let Err(e) = share_load(&registry, &instance, &mut conn).await {
            return e;
        }
    }
}

/// A task that is stopped when its session ends, however it ends.
struct Aborting<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Aborting<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[async_trait]
impl BackgroundService for ClusterSync {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(mut rx) = self.changes.lock().ok().and_then(|mut c| c.take()) else {
            return;
        };
        let mut pending: Vec<Change> = Vec::new();
        let mut backoff = Duration::from_millis(250);
        loop {
            match self.session(&mut rx, &mut pending, &mut shutdown).await {
                Ok(()) => return,
                Err(e) => {
                    if self.cluster.set_connected(false) {
                        log::warn!("cluster: redis unreachable ({e}); going on alone, retrying");
                        backoff = Duration::from_millis(250);
                    }
                    // Peers' load is unknown now: count only what is seen here.
                    self.registry
                        .all()
                        .iter()
                        .for_each(|r| r.set_peer_load(0, 0, 0));
                }
            }
            // Keep what is changed meanwhile, bounded, to write when Redis is back.
            while let Ok(c) = rx.try_recv() {
                if pending.len() < super::QUEUE {
                    pending.push(c);
                }
            }
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}
