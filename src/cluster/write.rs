//! Writing this instance's changes to Redis: pins (with `SET NX` after an outage, the first
//! writer winning), drains, replicas added and removed (each with its announcement, in one
//! atomic script where it has two keys), and the prompts prefilled here; and keeping what
//! must outlive an outage.

use super::records::{drain_key, pin_key, removed_key, replica_key};
use super::sync::ClusterSync;
use super::wire::encode;
use super::Change;
use crate::link::{Channel, Failed, Lane};

/// Changes written per round trip.
pub(super) const BATCH: usize = 512;

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
    pub(super) async fn write(
        &self,
        changes: &[Change],
        first_writer_wins: bool,
    ) -> Result<(), Failed> {
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

    /// Writes the drains and replica changes held, and lets go of those written; on an error
    /// they stay held, for the next session.
    pub(super) async fn write_held(&self) -> Result<(), Failed> {
        let held = self.cluster.held.all();
        for chunk in held.chunks(BATCH) {
            let changes: Vec<Change> = chunk.iter().map(|(_, c)| c.clone()).collect();
            self.write(&changes, false).await?;
            let seqs: Vec<u64> = chunk.iter().map(|(s, _)| *s).collect();
            self.cluster.held.written(&seqs);
        }
        Ok(())
    }

    /// Writes `batch` and empties it; when Redis fails, keeps what must outlive the outage.
    pub(super) async fn write_or_keep(
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
pub(super) fn keep(pending: &mut Vec<Change>, changes: impl Iterator<Item = Change>) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Cluster, Table};
    use crate::telemetry::metrics::METRICS;
    use std::sync::Arc;

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
