//! Several inferlb instances, one view: routing state shared through Redis (or Valkey).
//!
//! Shared: pins (affinity and session pins, stored Responses ids), each replica's prefix index
//! (what it prefilled), drains, replicas added at runtime, and each instance's load per replica
//! (requests in flight, requests waiting for a first byte and their uncached tokens), published
//! as it changes (changes close together go out as one message) and as a whole snapshot four
//! times a second. Each instance keeps its own tables and applies the others' updates; it bootstraps
//! from what Redis holds when it (re)connects. The request path never waits on Redis: it hands
//! changes to a bounded queue ([`Cluster::pin`] never blocks, a full queue drops the change and
//! counts it) and reads only local state. Everything goes over the one link to Redis
//! ([`crate::link`]). Redis down, slow or flapping: each instance goes on alone (the link logs
//! each transition once, and shows it in `inferlb_redis_up`; `inferlb_cluster_connected` is 1
//! while the cluster follows the others), and resyncs when the link is back.
//!
//! Pins may be lost (a full queue, or more than [`QUEUE`] changes during an outage: counted in
//! `inferlb_cluster_dropped_total`, and logged once per outage); a lost pin costs one cold
//! prefill. What an operator asked for is never lost: drains and replica adds and removes are
//! held apart ([`Cluster::drain`], [`Cluster::replica`]), written to Redis before the admin
//! call is answered (or answered "applied here only" after [`ACK_WAIT`]), and held and retried
//! until written; a later change to the same replica replaces an earlier one not yet written.
//!
//! Conflicts after an outage are settled by one rule, **the first writer wins**: pins made
//! while Redis was away are written with `SET NX` when it returns, so a pin another instance
//! already put there stands, and each instance then adopts what Redis holds.
//!
//! Replicas added at runtime and drains follow another rule, **the last change written to
//! Redis wins**, Redis's order of writes being the one order every instance agrees on:
//! - An instance writes the changes it holds first when it (re)connects, then adopts what Redis
//!   holds, so a change made here while Redis was away is the newest write: a drain, add or
//!   remove made on B while B was cut off stands over what A did to that replica meanwhile.
//! - Every write is announced, and each instance applies the announcements in the order Redis
//!   sends them, its own included, so its view of a replica ends at the last write.
//! - Until its own change to a replica is written, an instance ignores what the others say of
//!   that replica (it will overwrite it, and they will then follow it).
//! - A removal leaves a tombstone (`inferlb:removed:<id>`, the time of the removal) in the same
//!   atomic write that deletes the replica's conf; an add deletes the tombstone.
//! - A replica an instance merely holds (added at runtime, here or by another, and not changed
//!   here since) is reconciled at each bootstrap: a tombstone removes it here, a different conf
//!   in Redis replaces it, and it is written back (re-published) only when Redis holds neither
//!   (Redis lost its data), and then only if neither appeared meanwhile.
//! - Replicas of the conf file are the operator's: a bootstrap never removes them.
//!
//! Keys and channels that carry prompt hashes carry the hash version (`inferlb:v2:...`), so
//! instances of two versions during a rolling upgrade never read each other's hashes as their
//! own; the other channels carry their format's version (the link's versioning rule).

mod apply;
mod held;
mod peers;
mod records;
mod restarts;
mod sync;
mod wire;
mod write;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::protocol::api::prompt::Link;
use crate::telemetry::metrics::METRICS;

use held::Held;
pub(crate) use held::Subject;
pub use peers::{LoadReport, Peers};
pub use restarts::Followed;
pub use sync::ClusterSync;

/// Which shared table a pin belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// Prompt hashes and session keys → replica.
    Affinity,
    /// Stored Responses ids (hashed) → replica.
    Stored,
}

impl Table {
    fn tag(self) -> &'static str {
        match self {
            Table::Affinity => "a",
            Table::Stored => "s",
        }
    }
    fn from_tag(t: &str) -> Option<Table> {
        match t {
            "a" => Some(Table::Affinity),
            "s" => Some(Table::Stored),
            _ => None,
        }
    }
}

/// A change this instance made, to be shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Pin {
        table: Table,
        key: u64,
        replica: Arc<str>,
    },
    Drain {
        replica: Arc<str>,
        draining: bool,
    },
    /// A replica added through the admin API (its conf entry as JSON), or removed (`None`).
    Replica {
        id: String,
        conf: Option<String>,
    },
    /// A replica prefilled a prompt sent from here: its index records the prompt's links.
    Prefilled {
        replica: Arc<str>,
        links: Vec<Link>,
    },
}

/// A message from another instance, as read off the link's channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Change(Change),
    /// Its load on each replica named, as it is now: the whole fleet (`snapshot`, replicas
    /// not named carry none), or the replicas whose load changed since it last said.
    Load {
        snapshot: bool,
        replicas: Vec<(String, LoadReport)>,
    },
}

/// Where an operator's change stands when the admin call is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Written to Redis: the other instances have it or adopt it when they reconnect.
    Cluster,
    /// Applied here only (Redis away or slow): held, and written when Redis answers.
    Local,
}

/// How long an admin call waits for its change to be written to Redis.
pub const ACK_WAIT: Duration = Duration::from_secs(1);

/// The request path's handle: queue changes, never wait.
pub struct Cluster {
    pub instance: String,
    /// `instance#nonce`, a nonce per process: what its messages are signed with, so that two
    /// processes given the same `instance_id` notice each other.
    sender: String,
    tx: mpsc::Sender<Change>,
    /// Signalled when this instance's load on a replica changed.
    load: tokio::sync::Notify,
    connected: AtomicBool,
    /// What Redis held was adopted at least once since the start.
    bootstrapped: AtomicBool,
    /// Drains and replica changes not yet written; never dropped.
    held: Held,
    /// Replicas added at runtime (here or by another instance) that this instance has, with
    /// their conf as shared: what a bootstrap reconciles with Redis.
    runtime: Mutex<HashMap<String, String>>,
    /// Changes were dropped during this outage, and that was logged.
    drops_logged: AtomicBool,
    /// The link the state goes over (None in tests of the handle alone).
    link: Option<Arc<crate::link::Link>>,
}

/// Changes queued while Redis is slow or away; past this they are dropped (and counted).
const QUEUE: usize = 65_536;

impl Cluster {
    /// The handle and the receiving end for [`ClusterSync`], whose changes go over `link`.
    pub fn new(
        instance: String,
        link: Option<Arc<crate::link::Link>>,
    ) -> (Arc<Cluster>, mpsc::Receiver<Change>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        METRICS.cluster_connected.set(0);
        let nonce = {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(&std::process::id().to_le_bytes());
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            h.update(&now.map_or(0, |d| d.as_nanos()).to_le_bytes());
            static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            h.update(&MADE.fetch_add(1, Ordering::Relaxed).to_le_bytes());
            h.digest()
        };
        let c = Cluster {
            sender: format!("{instance}#{nonce:016x}"),
            instance,
            tx,
            load: tokio::sync::Notify::new(),
            connected: AtomicBool::new(false),
            bootstrapped: AtomicBool::new(false),
            held: Held::default(),
            runtime: Mutex::new(HashMap::new()),
            drops_logged: AtomicBool::new(false),
            link,
        };
        (Arc::new(c), rx)
    }

    /// The link to the cluster's Redis, which the shared budgets use too.
    pub fn link(&self) -> Option<&Arc<crate::link::Link>> {
        self.link.as_ref()
    }

    pub fn pin(&self, table: Table, key: u64, replica: &Arc<str>) {
        self.send(Change::Pin {
            table,
            key,
            replica: replica.clone(),
        });
    }

    /// A replica drained or undrained through this instance's admin API (already applied
    /// here): shared, and never lost.
    pub async fn drain(&self, replica: &Arc<str>, draining: bool) -> Applied {
        self.hold(Change::Drain {
            replica: replica.clone(),
            draining,
        })
        .await
    }

    /// A replica added (its checked conf entry) or removed through this instance's admin API
    /// (already applied here): shared, and never lost.
    pub async fn replica(&self, id: &str, conf: Option<&crate::conf::ReplicaConf>) -> Applied {
        let conf = conf.and_then(|c| serde_json::to_string(c).ok());
        self.set_runtime(id, conf.as_deref());
        self.hold(Change::Replica {
            id: id.to_string(),
            conf,
        })
        .await
    }

    /// Holds `change` until it is written (replacing a held one of the same subject), and
    /// waits up to [`ACK_WAIT`] for that while Redis is connected.
    async fn hold(&self, change: Change) -> Applied {
        let written = self.held.hold(change);
        if !self.is_connected() {
            return Applied::Local;
        }
        match tokio::time::timeout(ACK_WAIT, written).await {
            Ok(Ok(())) => Applied::Cluster,
            _ => Applied::Local,
        }
    }

    /// Records a replica added at runtime that this instance has (`conf`), or its removal.
    pub(crate) fn set_runtime(&self, id: &str, conf: Option<&str>) {
        if let Ok(mut r) = self.runtime.lock() {
            match conf {
                Some(c) => r.insert(id.to_string(), c.to_string()),
                None => r.remove(id),
            };
        }
    }

    /// The replicas added at runtime that this instance has, with their shared conf.
    pub(crate) fn runtime(&self) -> Vec<(String, String)> {
        self.runtime.lock().map_or_else(
            |_| Vec::new(),
            |r| r.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        )
    }

    /// This instance's load on some replica changed: the sync task publishes the loads that
    /// changed, at once or together with the next changes if it is busy. Nothing is queued,
    /// so pins always have the room.
    pub fn load_changed(&self) {
        self.load.notify_one();
    }

    /// `replica` prefilled the prompt `links`, sent from here. Not queued while Redis is away:
    /// an outage's prompts stay in this instance's index alone.
    pub fn prefilled(&self, replica: &Arc<str>, links: &[Link]) {
        if !self.is_connected() {
            return;
        }
        self.send(Change::Prefilled {
            replica: replica.clone(),
            links: links.to_vec(),
        });
    }

    fn send(&self, change: Change) {
        if self.tx.try_send(change).is_err() {
            self.dropped(1);
        }
    }

    /// What this process signs its messages with.
    pub fn sender(&self) -> &str {
        &self.sender
    }

    /// Whether the shared state was adopted since the start (readiness).
    pub fn is_bootstrapped(&self) -> bool {
        self.bootstrapped.load(Ordering::Relaxed)
    }

    fn set_bootstrapped(&self) {
        self.bootstrapped.store(true, Ordering::Relaxed);
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Records whether the cluster follows the others now; true when that changed. The
    /// link logs its own transitions: nothing is logged here.
    fn set_connected(&self, up: bool) -> bool {
        METRICS.cluster_connected.set(up as i64);
        let changed = self.connected.swap(up, Ordering::Relaxed) != up;
        if changed && !up {
            // A new outage: its first dropped change is logged again.
            self.drops_logged.store(false, Ordering::Relaxed);
        }
        changed
    }

    /// Counts `n` changes dropped (not shared) and logs the first of each outage.
    fn dropped(&self, n: u64) {
        if n == 0 {
            return;
        }
        METRICS.cluster_dropped.inc_by(n);
        if !self.drops_logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "cluster: more than {QUEUE} changes wait for redis (away or slow): pins are \
                 dropped, not shared (counted in inferlb_cluster_dropped_total); drains and \
                 replica changes are kept"
            );
        }
    }
}

/// The fleet's changes reach the other instances through the cluster.
impl crate::fleet::events::Listener for Cluster {
    fn load_changed(&self) {
        Cluster::load_changed(self);
    }

    fn prefilled(&self, replica: &Arc<str>, links: &[Link]) {
        Cluster::prefilled(self, replica, links);
    }
}

#[cfg(test)]
mod tests {
    use super::wire::{decode, encode, sender};
    use super::*;

    #[test]
    fn a_sender_names_its_instance_and_its_process() {
        let (a, b) = (
            Cluster::new("lb-a".into(), None).0,
            Cluster::new("lb-a".into(), None).0,
        );
        assert_eq!(
            (sender(a.sender()).0, sender(b.sender()).0),
            ("lb-a", "lb-a")
        );
        assert_ne!(a.sender(), b.sender(), "two processes of one id differ");
        let change = Change::Drain {
            replica: Arc::from("gpu0"),
            draining: true,
        };
        let m = encode(a.sender(), &change);
        assert_eq!(decode(&m), Some((a.sender(), Message::Change(change))));
        assert_eq!(sender("no-nonce"), ("no-nonce", ""));
    }

    #[test]
    fn a_full_queue_drops_and_never_blocks() {
        let (c, mut rx) = Cluster::new("i".into(), None);
        let r: Arc<str> = Arc::from("gpu0");
        for k in 0..(QUEUE as u64 + 10) {
            c.pin(Table::Affinity, k, &r);
        }
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, QUEUE);
    }

    /// Drains and replica changes are held apart from the pins, never dropped: a later change
    /// of a replica replaces an earlier one not yet written, and an admin call hears whether
    /// its change was written.
    #[tokio::test]
    async fn operator_changes_are_held_until_written_and_the_latest_per_replica_wins() {
        let (c, mut rx) = Cluster::new("i".into(), None);
        let (gpu0, gpu1): (Arc<str>, Arc<str>) = (Arc::from("gpu0"), Arc::from("gpu1"));
        // Pins fill the queue: the operator's changes do not go there.
        for k in 0..QUEUE as u64 {
            c.pin(Table::Affinity, k, &gpu0);
        }
        // Not connected: applied here only, at once.
        assert_eq!(c.drain(&gpu0, true).await, Applied::Local);
        assert_eq!(c.replica("gpu2", None).await, Applied::Local);
        assert_eq!(c.drain(&gpu1, true).await, Applied::Local);
        assert_eq!(c.drain(&gpu0, false).await, Applied::Local);
        let changes: Vec<Change> = c.held.all().into_iter().map(|(_, c)| c).collect();
        let drain = |r: &Arc<str>, draining| Change::Drain {
            replica: r.clone(),
            draining,
        };
        let removal = Change::Replica {
            id: "gpu2".into(),
            conf: None,
        };
        assert_eq!(
            changes,
            vec![removal.clone(), drain(&gpu1, true), drain(&gpu0, false)]
        );
        assert!(c.held.holds(&Subject::Drain("gpu0".into())));
        assert!(!c.held.holds(&Subject::Drain("gpu2".into())));
        let mut pins = 0;
        while rx.try_recv().is_ok() {
            pins += 1;
        }
        assert_eq!(pins, QUEUE);

        // Connected: the call waits for the write.
        c.set_connected(true);
        let writer = {
            let c = c.clone();
            let undrained = drain(&gpu1, false);
            tokio::spawn(async move {
                let write = async {
                    loop {
                        c.held.wake.notified().await;
                        let held = c.held.all();
                        if held.iter().any(|(_, h)| *h == undrained) {
                            // The earlier drain of gpu1 was replaced.
                            assert_eq!(held.len(), 3);
                            let seqs: Vec<u64> = held.iter().map(|(s, _)| *s).collect();
                            c.held.written(&seqs);
                            return;
                        }
                    }
                };
                tokio::time::timeout(Duration::from_secs(5), write)
                    .await
                    .is_ok()
            })
        };
        assert_eq!(c.drain(&gpu1, false).await, Applied::Cluster);
        assert!(writer.await.unwrap_or(false));
        assert!(c.held.all().is_empty());
        // Not written within the wait: applied here only, and still held.
        assert_eq!(c.drain(&gpu1, true).await, Applied::Local);
        assert_eq!(c.held.all().len(), 1);
    }

    #[test]
    fn drops_are_logged_once_per_outage() {
        let (c, _rx) = Cluster::new("i".into(), None);
        c.set_connected(true);
        c.dropped(0);
        assert!(!c.drops_logged.load(Ordering::Relaxed));
        c.dropped(3);
        assert!(c.drops_logged.load(Ordering::Relaxed));
        c.set_connected(false);
        assert!(!c.drops_logged.load(Ordering::Relaxed), "a new outage");
    }
}
