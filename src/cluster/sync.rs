//! The background side of the cluster: writes this instance's changes to Redis in batches
//! ([`super::write`]), follows the others' on the link's channels, bootstraps from Redis every
//! time the link (re)connects, and shares each instance's load per replica. Everything goes
//! over the [`Link`]: its control lane, bounded at 1 s, and its bulk lane for saved indexes
//! and the deletion of what Redis keeps of a restarted replica. Nothing here is on the
//! request path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::sync::{mpsc, watch};

use super::records::records_every;
use super::restarts::{self, Followed};
use super::wire::{decode, encode_load, sender};
use super::write::{keep, BATCH};
use super::{Change, Cluster, LoadReport, Message, Peers, Table};
use crate::conf::netpolicy::Networks;
use crate::fleet::affinity::AffinityTable;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;
use crate::link::{Channel, Failed, Link, Status};

/// How often each instance publishes a snapshot of its load (changes go out as they happen),
/// and looks for replicas that arrived since (DNS, another instance) to adopt what Redis holds
/// for them.
const LOAD_EVERY: Duration = Duration::from_millis(250);
/// An instance silent this long is gone (it stopped or lost Redis): its load no longer counts.
pub(super) const LOAD_TTL: Duration = Duration::from_secs(2);
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

impl ClusterSync {
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
        // Replicas that restarted and whose old pins Redis may still hold: pins to them queued
        // meanwhile are not written (some name the lost cache), nor are theirs adopted.
        let (stale, counts) = self.stale().await?;
        let mut outage: Vec<Change> = std::mem::take(pending);
        outage.retain(|c| {
            !matches!(c, Change::Pin { table: Table::Affinity, replica, .. }
                if stale.contains_key(&**replica))
        });
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
        let adopted = self.bootstrap(&stale).await?;
        // Those known now are compared (below) and adopted (above); one found from here on
        // (or removed and added again under its id), at its next load snapshot.
        let fleet = self.registry.all();
        let mut known: HashMap<Arc<str>, Weak<Replica>> = fleet
            .iter()
            .map(|r| (r.id.clone(), Arc::downgrade(r)))
            .collect();
        self.unadopt_restarted(&counts, &fleet).await?;
        self.cluster.set_bootstrapped();
        log::info!("cluster: {adopted} pins adopted from redis");
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
                _ = self.cluster.held.wake.notified() => {
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
                        let seen = known.insert(r.id.clone(), Arc::downgrade(r));
                        if !seen.is_some_and(|w| w.ptr_eq(&Arc::downgrade(r))) {
                            restarts::compare_starts(
                                &self.link,
                                &self.restarts,
                                std::slice::from_ref(r),
                                &self.affinity,
                                true,
                            )
                            .await?;
                            self.adopt(r, None, None).await?;
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
        // Each replica's restarts when Redis was last lost (none before the first session).
        let mut restarts_at_outage: HashMap<Arc<str>, u64> = HashMap::new();
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
            // Pins queued while Redis was away to a replica that restarted meanwhile: some
            // name its lost cache.
            let fleet = self.registry.all();
            pending.retain(|c| match c {
                Change::Pin {
                    table: Table::Affinity,
                    replica,
                    ..
                } => fleet.iter().find(|r| r.id == *replica).is_none_or(|r| {
                    r.restarts() <= restarts_at_outage.get(replica).copied().unwrap_or(0)
                }),
                _ => true,
            });
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
                    restarts_at_outage = self
                        .registry
                        .all()
                        .iter()
                        .map(|r| (r.id.clone(), r.restarts()))
                        .collect();
                    // Peers' load is unknown now: count only what is seen here.
                    self.apply_peers(&Peers::default());
                    ended_on = Some(generation);
                }
            }
        }
    }
}
