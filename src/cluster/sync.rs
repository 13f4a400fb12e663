//! The background side of the cluster: writes this instance's changes to Redis in batches,
//! follows the others' on the link's channels, bootstraps from Redis every time the link
//! (re)connects, and shares each instance's load per replica. Everything goes over the
//! [`Link`]: its control lane, bounded at 1 s, and its bulk lane for saved indexes. Nothing
//! here is on the request path.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::sync::{mpsc, watch};

use super::records::{drain_key, pin_key, records_every, removed_key, replica_key};
use super::restarts::Followed;
use super::wire::{decode, encode, encode_load, sender};
use super::{Change, Cluster, LoadReport, Message, Peers};
use crate::conf::netpolicy::Networks;
use crate::fleet::affinity::AffinityTable;
use crate::fleet::registry::Registry;
use crate::link::{Channel, Failed, Lane, Link, Status};

/// How often each instance publishes a snapshot of its load (changes go out as they happen),
/// and looks for replicas that arrived since (DNS, another instance) to adopt what Redis holds
/// for them.
const LOAD_EVERY: Duration = Duration::from_millis(250);
/// An instance silent this long is gone (it stopped or lost Redis): its load no longer counts.
const LOAD_TTL: Duration = Duration::from_secs(2);
/// Changes written per round trip.
const BATCH: usize = 512;
/// The channels the cluster follows.
const CHANNELS: [Channel; 3] = [Channel::Pins, Channel::Replicas, Channel::Load];

pub struct ClusterSync {
    pub cluster: Arc<Cluster>,
    /// Taken once, when the service starts.
    pub changes: Mutex<Option<mpsc::Receiver<Change>>>,
    /// The link to the cluster's Redis (its keeper runs apart).
    pub link: Arc<Link>,
    pub registry: Arc<Registry>,
    pub affinity: Arc<AffinityTable>,
    pub stored: Arc<AffinityTable>,
    pub pin_ttl: Duration,
    /// Where a replica shared by another instance may be (this instance's
    /// `admin.allowed_networks`): one outside is never added here, so not even a health check
    /// reaches it.
    pub networks: Networks,
    /// The replicas' restarts this instance has followed, across sessions.
    pub restarts: Arc<Mutex<Followed>>,
}

/// Writes a pin unless one is there, and announces it only then: the first writer wins.
const SET_NX_AND_PUBLISH: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) \
     then redis.call('PUBLISH', ARGV[3], ARGV[4]) end return 1";

/// A replica added: its conf, no tombstone; one atomic write.
const ADD_REPLICA: &str = "redis.call('SET', KEYS[1], ARGV[1]) redis.call('DEL', KEYS[2]) \
     redis.call('PUBLISH', ARGV[2], ARGV[3]) return 1";
/// A replica removed: no conf, a tombstone with the time of the removal; one atomic write.
const REMOVE_REPLICA: &str = "redis.call('DEL', KEYS[1]) redis.call('SET', KEYS[2], ARGV[1]) \
     redis.call('PUBLISH', ARGV[2], ARGV[3]) return 1";

impl ClusterSync {
    /// Writes this instance's changes; `first_writer_wins` after an outage.
    async fn write(&self, changes: &[Change], first_writer_wins: bool) -> Result<(), Failed> {
        let ttl = self.pin_ttl.as_secs().max(1);
        let mut pipe = redis::pipe();
        for c in changes {
            let message = encode(self.cluster.sender(), c);
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
                        .arg(Channel::Pins.name())
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
                        .arg(Channel::Pins.name())
                        .arg(message)
                        .ignore();
                }
                Change::Drain { replica, draining } => {
                    if *draining {
                        pipe.cmd("SET").arg(drain_key(replica)).arg(1).ignore();
                    } else {
                        pipe.cmd("DEL").arg(drain_key(replica)).ignore();
                    }
                    pipe.cmd("PUBLISH")
                        .arg(Channel::Replicas.name())
                        .arg(message)
                        .ignore();
                }
                Change::Replica { id, conf } => {
                    let (script, value) = match conf {
                        Some(c) => (ADD_REPLICA, c.clone()),
                        None => {
                            let now = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0, |d| d.as_millis());
                            (REMOVE_REPLICA, now.to_string())
                        }
                    };
                    pipe.cmd("EVAL")
                        .arg(script)
                        .arg(2)
                        .arg(replica_key(id))
                        .arg(removed_key(id))
                        .arg(value)
                        .arg(Channel::Replicas.name())
                        .arg(message)
                        .ignore();
                }
                Change::Prefilled { .. } => {
                    pipe.cmd("PUBLISH")
                        .arg(Channel::Pins.name())
                        .arg(message)
                        .ignore();
                }
            }
        }
        if pipe.is_empty() {
            return Ok(());
        }
        self.link.pipe(Lane::Control, &pipe).await
    }

    /// Publishes this instance's load on each replica whose load changed since `published`
    /// says, or on every replica (`full`: a snapshot, which also says it is alive).
    async fn publish_load(
        &self,
        published: &mut HashMap<Arc<str>, LoadReport>,
        full: bool,
    ) -> Result<(), Failed> {
        let mut now: Vec<(String, LoadReport)> = Vec::new();
        for r in self.registry.all().iter() {
            let (queued_tokens, waiting) = r.local_prefill();
            let load = LoadReport {
                in_flight: r.in_flight() as i64,
                waiting: waiting as i64,
                queued_tokens: queued_tokens as i64,
            };
            if full || published.get(&r.id) != Some(&load) {
                published.insert(r.id.clone(), load);
                now.push((r.id.to_string(), load));
            }
        }
        if now.is_empty() && !full {
            return Ok(());
        }
        let message = encode_load(self.cluster.sender(), full, &now);
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(Channel::Load.name()).arg(message);
        self.link.query(Channel::Load.lane(), &publish).await
    }

    /// One session on the link's connections of `generation`, until Redis fails, the link
    /// reconnects (what was said meanwhile is missed: a new session bootstraps again) or the
    /// process stops (`Ok`).
    async fn session(
        &self,
        generation: u64,
        status: &mut watch::Receiver<Status>,
        rx: &mut mpsc::Receiver<Change>,
        pending: &mut Vec<Change>,
        shutdown: &mut ShutdownWatch,
    ) -> Result<(), Failed> {
        let mut messages = self.link.subscribe(&CHANNELS).await?;
        self.cluster.set_connected(true);
        // What was changed here while Redis was away: the first writer wins. When Redis fails
        // again meanwhile, what is not written yet is kept for the next time.
        let mut outage: Vec<Change> = std::mem::take(pending);
        let mut written = 0;
        while written < outage.len() {
            let end = (written + BATCH).min(outage.len());
            if let Err(e) = self.write(&outage[written..end], true).await {
                pending.extend(outage.drain(written..));
                return Err(e);
            }
            written = end;
        }
        // The drains and replica changes made here meanwhile: the newest writes (see the rule
        // in the module above), before what Redis holds is adopted.
        self.write_held().await?;
        let adopted = self.bootstrap().await?;
        self.cluster.set_bootstrapped();
        log::info!("cluster: {adopted} pins adopted from redis");
        let mut known: HashSet<Arc<str>> =
            self.registry.all().iter().map(|r| r.id.clone()).collect();
        // The others' load, followed for as long as this session lasts; this instance's, as
        // last published.
        let mut peers = Peers::default();
        let mut published = HashMap::new();
        let mut snapshot = tokio::time::interval(LOAD_EVERY);
        snapshot.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut saver = Aborting(tokio::spawn(records_every(
            self.registry.clone(),
            self.link.clone(),
            self.pin_ttl,
            self.restarts.clone(),
        )));
        let mut batch = Vec::with_capacity(BATCH);
        let mut twin_seen = false;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return Ok(()),
                s = status.changed() => {
                    let now = *status.borrow();
                    if s.is_err() || !now.up || now.generation != generation {
                        return Err(Failed::Down);
                    }
                }
                m = messages.next() => {
                    let (_, payload) = m?;
                    let decoded = decode(&payload).map(|(from, m)| (from, sender(from).0, m));
                    match decoded {
                        // Another process signing with this instance's id: said once.
                        Some((from, id, _))
                            if id == self.cluster.instance
                                && from != self.cluster.sender()
                                && !twin_seen =>
                        {
                            twin_seen = true;
                            log::error!(
                                "cluster: another inferlb process uses instance_id {id:?}: each \
                                 ignores the other's updates; give every instance its own \
                                 cluster.instance_id (or leave it unset)"
                            );
                        }
                        // This process's own messages: its drains and replica changes are
                        // applied again, in Redis's order, so that another instance's older
                        // change of that replica, received before, does not stand over them.
                        Some((_, id, Message::Change(c)))
                            if id == self.cluster.instance && c.subject().is_some() =>
                        {
                            self.apply(c).await
                        }
                        Some((_, id, _)) if id == self.cluster.instance => {}
                        Some((_, _, Message::Change(change))) => self.apply(change).await,
                        Some((_, from, Message::Load { snapshot, replicas })) => {
                            if snapshot {
                                peers.snapshot(from, replicas, Instant::now());
                            } else {
                                peers.update(from, replicas, Instant::now());
                            }
                            self.apply_peers(&peers);
                        }
                        None => {}
                    }
                }
                _ = self.cluster.held_wake.notified() => {
                    self.write_held().await?;
                }
                n = rx.recv_many(&mut batch, BATCH) => {
                    if n == 0 {
                        return Ok(());
                    }
                    self.write_or_keep(&mut batch, pending).await?;
                }
                _ = self.cluster.load.notified() => {
                    self.publish_load(&mut published, false).await?;
                }
                _ = snapshot.tick() => {
                    self.publish_load(&mut published, true).await?;
                    if peers.expire(Instant::now(), LOAD_TTL) {
                        self.apply_peers(&peers);
                    }
                    self.registry.set_rank(peers.rank(&self.cluster.instance));
                    for r in self.registry.all().iter() {
                        if known.insert(r.id.clone()) {
                            self.adopt(r, None).await?;
                        }
                    }
                }
                failed = &mut saver.0 => {
                    return Err(failed.unwrap_or_else(|_| {
                        Failed::Broken("index saving stopped".into())
                    }));
                }
            }
        }
    }

    /// Writes the drains and replica changes held, and lets go of those written; on an error
    /// they stay held, for the next session.
    async fn write_held(&self) -> Result<(), Failed> {
        let held = self.cluster.held();
        for chunk in held.chunks(BATCH) {
            let changes: Vec<Change> = chunk.iter().map(|(_, c)| c.clone()).collect();
            self.write(&changes, false).await?;
            let seqs: Vec<u64> = chunk.iter().map(|(s, _)| *s).collect();
            self.cluster.written(&seqs);
        }
        Ok(())
    }

    /// Writes `batch` and empties it; when Redis fails, keeps what must outlive the outage.
    async fn write_or_keep(
        &self,
        batch: &mut Vec<Change>,
        pending: &mut Vec<Change>,
    ) -> Result<(), Failed> {
        let written = self.write(batch, false).await;
        if written.is_err() {
            self.cluster.dropped(keep(pending, batch.drain(..)));
        }
        batch.clear();
        written
    }
}

/// Keeps pins made while Redis is away, at most [`super::QUEUE`], to write when it is back;
/// returns how many were dropped past that. Prompts prefilled meanwhile are not kept (each may
/// be large), nor counted: the others learn what the replicas hold again as requests flow.
/// (Drains and replica changes are not queued here: they are held apart, never dropped.)
fn keep(pending: &mut Vec<Change>, changes: impl Iterator<Item = Change>) -> u64 {
    let mut dropped = 0;
    for c in changes {
        if matches!(c, Change::Prefilled { .. }) {
            continue;
        }
        if pending.len() < super::QUEUE {
            pending.push(c);
        } else {
            dropped += 1;
        }
    }
    dropped
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
        self.registry.listen(self.cluster.clone());
        let mut pending: Vec<Change> = Vec::new();
        let mut status = self.link.status();
        let mut batch = Vec::with_capacity(BATCH);
        // A session that ended while the link stayed up (Redis refused a command): the next
        // one waits, from 250 ms to 2 s. The link's own outages have the link's backoff.
        let mut backoff = Duration::from_millis(250);
        let mut ended_on: Option<u64> = None;
        loop {
            // Until the link is up, what is changed here is kept, bounded, to write then.
            let generation = loop {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    g = crate::link::up(&mut status) => break g,
                    n = rx.recv_many(&mut batch, BATCH) => {
                        if n == 0 {
                            return;
                        }
                        self.cluster.dropped(keep(&mut pending, batch.drain(..)));
                    }
                }
            };
            if ended_on == Some(generation) {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            } else {
                backoff = Duration::from_millis(250);
            }
            match self
                .session(
                    generation,
                    &mut status,
                    &mut rx,
                    &mut pending,
                    &mut shutdown,
                )
                .await
            {
                Ok(()) => return,
                Err(e) => {
                    // The link said the outage (once); a refusal is the cluster's to say.
                    if !e.is_outage() {
                        log::warn!("cluster: {e}; starting over");
                    }
                    self.cluster.set_connected(false);
                    // Peers' load is unknown now: count only what is seen here.
                    self.apply_peers(&Peers::default());
                    ended_on = Some(generation);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Table;
    use crate::telemetry::metrics::METRICS;

    /// A flood of pins during an outage: the first [`super::super::QUEUE`] are kept, the rest
    /// dropped and counted (prefilled prompts are neither).
    #[test]
    fn pins_past_the_outage_bound_are_dropped_and_counted() {
        let (cluster, _rx) = Cluster::new("i".into(), None);
        let r: Arc<str> = Arc::from("gpu0");
        let pin = |key| Change::Pin {
            table: Table::Affinity,
            key,
            replica: r.clone(),
        };
        let flood = super::super::QUEUE as u64 + 1000;
        let prefilled = Change::Prefilled {
            replica: r.clone(),
            links: vec![],
        };
        let changes = (0..flood).map(pin).chain(std::iter::once(prefilled));
        let mut pending = Vec::new();
        let before = METRICS.cluster_dropped.get();
        let dropped = keep(&mut pending, changes);
        cluster.dropped(dropped);
        assert_eq!((pending.len(), dropped), (super::super::QUEUE, 1000));
        assert_eq!(pending.last(), Some(&pin(super::super::QUEUE as u64 - 1)));
        // Other tests may count drops at the same time: at least these.
        assert!(METRICS.cluster_dropped.get() - before >= 1000);
        // Later ones, in the same outage, are counted too.
        assert_eq!(keep(&mut pending, (0..5).map(pin)), 5);
    }
}
