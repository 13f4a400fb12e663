//! Several inferlb instances, one view: routing state shared through Redis (or Valkey).
//!
//! Shared: pins (affinity and session pins, stored Responses ids), drains, and each
//! instance's load per replica. Each instance keeps its own tables and applies the others'
//! updates; it bootstraps from what Redis holds when it (re)connects. The request path never
//! waits on Redis: it hands changes to a bounded queue ([`Cluster::pin`] never blocks, a full
//! queue drops the change and counts it) and reads only local state. Redis down, slow or
//! flapping: each instance goes on alone, logs each transition once, shows it in
//! `inferlb_cluster_connected`, and resyncs when Redis is back.
//!
//! Conflicts after an outage are settled by one rule, **the first writer wins**: pins made
//! while Redis was away are written with `SET NX` when it returns, so a pin another instance
//! already put there stands, and each instance then adopts what Redis holds.
//!
//! Keys carry the prompt hash version (`inferlb:v2:...`), so instances of two versions during
//! a rolling upgrade never read each other's hashes as their own.

mod sync;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::metrics::METRICS;

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
}

/// The request path's handle: queue changes, never wait.
pub struct Cluster {
    pub instance: String,
    tx: mpsc::Sender<Change>,
    connected: AtomicBool,
    /// What Redis held was adopted at least once since the start.
    bootstrapped: AtomicBool,
}

/// Changes queued while Redis is slow or away; past this they are dropped (and counted).
const QUEUE: usize = 65_536;

impl Cluster {
    /// The handle and the receiving end for [`ClusterSync`].
    pub fn new(instance: String) -> (Arc<Cluster>, mpsc::Receiver<Change>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        METRICS.cluster_connected.set(0);
        let c = Cluster {
            instance,
            tx,
            connected: AtomicBool::new(false),
            bootstrapped: AtomicBool::new(false),
        };
        (Arc::new(c), rx)
    }

    pub fn pin(&self, table: Table, key: u64, replica: &Arc<str>) {
        self.send(Change::Pin {
            table,
            key,
            replica: replica.clone(),
        });
    }

    pub fn drain(&self, replica: &Arc<str>, draining: bool) {
        self.send(Change::Drain {
            replica: replica.clone(),
            draining,
        });
    }

    /// A replica added (its checked conf entry) or removed through this instance's admin API.
    pub fn replica(&self, id: &str, conf: Option<&crate::config::ReplicaConf>) {
        let conf = conf.and_then(|c| serde_json::to_string(c).ok());
        self.send(Change::Replica {
            id: id.to_string(),
            conf,
        });
    }

    fn send(&self, change: Change) {
        if self.tx.try_send(change).is_err() {
            METRICS.cluster_dropped.inc();
        }
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

    /// Records a transition; true when it is one (to log it once).
    fn set_connected(&self, up: bool) -> bool {
        METRICS.cluster_connected.set(up as i64);
        self.connected.swap(up, Ordering::Relaxed) != up
    }
}

/// The default instance id: host name and pid.
pub fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}-{}", std::process::id())
}

/// A message on the updates channel: `instance|kind|...`; pure, so both ends are tested here.
pub fn encode(instance: &str, change: &Change) -> String {
    match change {
        Change::Pin {
            table,
            key,
            replica,
        } => format!("{instance}|pin|{}|{key:016x}|{replica}", table.tag()),
        Change::Drain { replica, draining } => {
            format!("{instance}|drain|{}|{replica}", u8::from(*draining))
        }
        Change::Replica { id, conf } => {
            format!("{instance}|replica|{id}|{}", conf.as_deref().unwrap_or(""))
        }
    }
}

/// The sender and the change of a message, or None for anything else.
pub fn decode(message: &str) -> Option<(&str, Change)> {
    if let Some(rest) = message.split_once("|replica|") {
        let (instance, rest) = (rest.0, rest.1);
        let (id, conf) = rest.split_once('|')?;
        let change = Change::Replica {
            id: id.to_string(),
            conf: (!conf.is_empty()).then(|| conf.to_string()),
        };
        return (!instance.contains('|') && !id.is_empty()).then_some((instance, change));
    }
    let mut f = message.split('|');
    let instance = f.next()?;
    let change = match (f.next()?, f.next()?, f.next()?, f.next()) {
        ("pin", table, key, Some(replica)) => Change::Pin {
            table: Table::from_tag(table)?,
            key: u64::from_str_radix(key, 16).ok()?,
            replica: Arc::from(replica),
        },
        ("drain", flag, replica, None) => Change::Drain {
            replica: Arc::from(replica),
            draining: flag == "1",
        },
        _ => return None,
    };
    f.next().is_none().then_some((instance, change))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_ignored() {
        let changes = [
            Change::Pin {
                table: Table::Affinity,
                key: 0xdead_beef_0000_0001,
                replica: Arc::from("gpu0"),
            },
            Change::Pin {
                table: Table::Stored,
                key: 7,
                replica: Arc::from("gpu-1.b"),
            },
            Change::Drain {
                replica: Arc::from("gpu1"),
                draining: true,
            },
            Change::Drain {
                replica: Arc::from("gpu1"),
                draining: false,
            },
            Change::Replica {
                id: "gpu2".into(),
                conf: Some(r#"{"id":"gpu2","address":"10.0.0.7:8000","api_key":"a|b"}"#.into()),
            },
            Change::Replica {
                id: "gpu2".into(),
                conf: None,
            },
        ];
        for c in changes {
            let m = encode("host-1", &c);
            assert_eq!(decode(&m), Some(("host-1", c)), "{m}");
        }
        for bad in [
            "",
            "x",
            "a|pin|z|1|r",
            "a|pin|a|zz|r",
            "a|drain|1",
            "a|pin|a|1|r|extra",
            "a|nope|1|2",
        ] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_full_queue_drops_and_never_blocks() {
        let (c, mut rx) = Cluster::new("i".into());
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
}
