//! What Redis keeps for the cluster, and reading it back: pins, drains, replicas added at
//! runtime and each replica's prefix index, adopted by an instance whenever it (re)connects;
//! and the index saves that let an instance that starts later know what the replicas hold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::restarts::{self, Followed};
use super::sync::ClusterSync;
use super::wire::encode;
use super::{Change, Subject, Table};
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;
use crate::link::{Channel, Failed, Lane, Link};
use crate::protocol::api::prompt::HASH_VERSION;

/// How often the lowest-ranked instance saves each changed prefix index to Redis, for
/// instances that start later.
const INDEX_EVERY: Duration = Duration::from_secs(10);
/// How often every instance looks for replicas that restarted, and rank 0 deletes what Redis
/// keeps of them.
const RESTARTS_EVERY: Duration = Duration::from_secs(1);
/// How long after a session starts the instances' ranks are known (an instance silent this
/// long is gone): the first look waits as long, lest every instance think itself rank 0.
const RANKED_AFTER: Duration = super::sync::LOAD_TTL;
/// The most recent links of a replica's index saved (12 bytes each).
const INDEX_SAVED_LINKS: usize = 16_384;

pub(super) fn pin_key(table: Table, key: u64) -> String {
    format!("inferlb:v{HASH_VERSION}:{}:{key:016x}", table.tag())
}

// The channels are the link's (`crate::link::Channel`). The keys of drains, replicas and
// tombstones hold no hashes and have kept their format, hence their names (see the link's
// versioning rule): what an older version wrote stands after an upgrade.
pub(super) fn drain_key(replica: &str) -> String {
    format!("inferlb:drain:{replica}")
}
pub(super) fn index_key(replica: &str) -> String {
    format!("inferlb:v{HASH_VERSION}:index:{replica}")
}
pub(super) fn replica_key(id: &str) -> String {
    format!("inferlb:replica:{id}")
}
/// A replica removed at runtime: its tombstone, the time of the removal (Unix ms). Kept
/// without expiry (one per id removed, deleted when the id is added again), so an instance
/// away for any time learns of the removal.
pub(super) fn removed_key(id: &str) -> String {
    format!("inferlb:removed:{id}")
}

/// Writes a replica's conf back when Redis holds neither it nor its tombstone (Redis lost
/// its data); a conf or tombstone another instance wrote meanwhile stands.
const REPUBLISH_REPLICA: &str = "if redis.call('EXISTS', KEYS[2]) == 0 \
     and redis.call('SET', KEYS[1], ARGV[1], 'NX') then redis.call('PUBLISH', ARGV[2], ARGV[3]) \
     end return 1";

/// A saved index: each link's hash and tokens, little-endian, 12 bytes a link.
fn links_to(links: &[(u64, u32)]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(links.len() * 12);
    for (hash, tokens) in links {
        bytes.extend_from_slice(&hash.to_le_bytes());
        bytes.extend_from_slice(&tokens.to_le_bytes());
    }
    bytes
}

/// The links of a saved index; a torn last link is left out.
fn links_from(bytes: &[u8]) -> Vec<(u64, u32)> {
    bytes
        .chunks_exact(12)
        .map(|c| {
            let (hash, tokens) = c.split_at(8);
            let hash = u64::from_le_bytes(hash.try_into().unwrap_or_default());
            (
                hash,
                u32::from_le_bytes(tokens.try_into().unwrap_or_default()),
            )
        })
        .collect()
}

impl ClusterSync {
    /// Every key matching `pattern`, at most `limit`.
    pub(super) async fn scan(&self, pattern: &str, limit: usize) -> Result<Vec<String>, Failed> {
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000);
            let (next, batch): (u64, Vec<String>) = self.link.query(Lane::Control, &scan).await?;
            keys.extend(batch);
            cursor = next;
            if cursor == 0 || keys.len() >= limit {
                keys.truncate(limit);
                return Ok(keys);
            }
        }
    }

    /// The replicas that restarted while what Redis keeps of them may be older (this
    /// instance's restarts raised first), each with its start: their pins are neither
    /// adopted nor written from here, nor their saved index adopted. And each replica's
    /// restart count before that was raised: one that moves past it later, before the
    /// bootstrap is over, was not raised in time ([`ClusterSync::unadopt_restarted`]).
    pub(super) async fn stale(
        &self,
    ) -> Result<(HashMap<String, u64>, Vec<(Arc<Replica>, u64)>), Failed> {
        let fleet = self.registry.all();
        restarts::compare_starts(&self.link, &self.restarts, &fleet, &self.affinity, false).await?;
        let counts = fleet.iter().map(|r| (r.clone(), r.restarts())).collect();
        let ttl = self.pin_ttl.as_secs().max(1);
        restarts::raise(&self.link, &self.restarts, &fleet, ttl).await?;
        Ok((restarts::states(&self.link).await?.stale, counts))
    }

    /// Drops what the bootstrap adopted of each replica whose restart was read while it ran
    /// (`counts`: each one's restart count before): its pins and saved index are of the
    /// process before. Often the first read after [`restarts::compare_starts`] took Redis's
    /// start as the first. Then compares the starts of the replicas of `fleet` the bootstrap
    /// added (added at runtime by another instance), as the others' were before.
    pub(super) async fn unadopt_restarted(
        &self,
        counts: &[(Arc<Replica>, u64)],
        fleet: &[Arc<Replica>],
    ) -> Result<(), Failed> {
        for (r, before) in counts {
            if r.restarts() > *before {
                let pins = restarts::unadopt(&self.affinity, r);
                log::info!(
                    "cluster: replica {} restarted while this instance adopted what redis \
                     keeps: {pins} pins to it and its saved index dropped",
                    r.id
                );
            }
        }
        let added: Vec<Arc<Replica>> = fleet
            .iter()
            .filter(|r| !counts.iter().any(|(c, _)| Arc::ptr_eq(c, r)))
            .cloned()
            .collect();
        restarts::compare_starts(&self.link, &self.restarts, &added, &self.affinity, true).await
    }

    /// Adopts what Redis holds: pins of this hash version (but the affinity pins to a
    /// replica `stale`, restarted since they were made), replicas added at runtime, and for
    /// each replica its drain and saved index.
    pub(super) async fn bootstrap(&self, stale: &HashMap<String, u64>) -> Result<usize, Failed> {
        let mut adopted = 0;
        for table in [Table::Affinity, Table::Stored] {
            let pattern = format!("inferlb:v{HASH_VERSION}:{}:*", table.tag());
            let keys = self.scan(&pattern, 1_000_000).await?;
            for chunk in keys.chunks(500) {
                let values: Vec<Option<String>> = self
                    .link
                    .query(Lane::Control, redis::cmd("MGET").arg(chunk))
                    .await?;
                for (k, v) in chunk.iter().zip(values) {
                    let key = k
                        .rsplit(':')
                        .next()
                        .and_then(|h| u64::from_str_radix(h, 16).ok());
                    if let (Some(key), Some(replica)) = (key, v) {
                        if table == Table::Affinity && stale.contains_key(&replica) {
                            continue;
                        }
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
        let added = self.scan("inferlb:replica:*", 100_000).await?;
        let mut shared: HashMap<String, String> = HashMap::new();
        for chunk in added.chunks(500) {
            let values: Vec<Option<String>> = self
                .link
                .query(Lane::Control, redis::cmd("MGET").arg(chunk))
                .await?;
            for (k, conf) in chunk.iter().zip(values) {
                if let Some(conf) = conf {
                    let id = k.trim_start_matches("inferlb:replica:").to_string();
                    shared.insert(id, conf);
                }
            }
        }
        let removed = self.scan("inferlb:removed:*", 100_000).await?;
        self.reconcile(&shared, |id| removed.contains(&removed_key(id)))
            .await?;
        for (id, conf) in shared {
            self.apply(Change::Replica {
                id,
                conf: Some(conf),
            })
            .await;
        }
        let drained = self.scan("inferlb:drain:*", 100_000).await?;
        for r in self.registry.all().iter() {
            let restarted = stale.contains_key(&*r.id);
            self.adopt(
                r,
                Some(drained.contains(&drain_key(&r.id))),
                Some(restarted),
            )
            .await?;
        }
        Ok(adopted)
    }

    /// The replicas added at runtime that this instance has, against what Redis holds (`shared`
    /// confs, tombstones): removed here when removed meanwhile, dropped here when Redis holds
    /// another conf (adopted next), written back when Redis holds nothing of them. The rule
    /// is in the module's comment; replicas of the conf file are never touched.
    async fn reconcile(
        &self,
        shared: &HashMap<String, String>,
        removed: impl Fn(&str) -> bool,
    ) -> Result<(), Failed> {
        for (id, ours) in self.cluster.runtime() {
            if self.cluster.held.holds(&Subject::Replica(id.clone())) {
                continue;
            }
            match shared.get(&id) {
                Some(theirs) if *theirs == ours => {}
                Some(_) => {
                    log::warn!("cluster: replica {id} was changed meanwhile: adopting the new one");
                    self.registry.remove(&id);
                    self.cluster.set_runtime(&id, None);
                }
                None if removed(&id) => {
                    log::warn!("cluster: replica {id} was removed meanwhile: removing it here");
                    self.registry.remove(&id);
                    self.cluster.set_runtime(&id, None);
                }
                None => {
                    let message = encode(
                        self.cluster.sender(),
                        &Change::Replica {
                            id: id.clone(),
                            conf: Some(ours.clone()),
                        },
                    );
                    let mut eval = redis::cmd("EVAL");
                    eval.arg(REPUBLISH_REPLICA)
                        .arg(2)
                        .arg(replica_key(&id))
                        .arg(removed_key(&id))
                        .arg(&ours)
                        .arg(Channel::Replicas.name())
                        .arg(message);
                    self.link.query::<()>(Lane::Control, &eval).await?;
                }
            }
        }
        Ok(())
    }

    /// Adopts what Redis holds for one replica: whether it is drained (`drained`, or asked
    /// here), and its saved index when its own is empty (a fuller one is fresher than a
    /// save) and it did not restart since that save may have been made (`stale`, or asked
    /// here). Also for a replica found after the bootstrap (DNS, another instance).
    pub(super) async fn adopt(
        &self,
        r: &Replica,
        drained: Option<bool>,
        stale: Option<bool>,
    ) -> Result<(), Failed> {
        let draining = match drained {
            Some(d) => d,
            None => {
                let mut exists = redis::cmd("EXISTS");
                exists.arg(drain_key(&r.id));
                self.link.query(Lane::Control, &exists).await?
            }
        };
        self.apply(Change::Drain {
            replica: r.id.clone(),
            draining,
        })
        .await;
        if r.cache.index.size().0 == 0 {
            let stale = match stale {
                Some(s) => s,
                None => restarts::states(&self.link)
                    .await?
                    .stale
                    .contains_key(&*r.id),
            };
            if stale {
                return Ok(());
            }
            let mut get = redis::cmd("GET");
            get.arg(index_key(&r.id));
            let saved: Option<Vec<u8>> = self.link.query(Lane::Bulk, &get).await?;
            r.cache
                .index
                .restore(&links_from(&saved.unwrap_or_default()));
        }
        Ok(())
    }
}

/// While this instance has the lowest id of the cluster (rank 0): every [`INDEX_EVERY`], saves
/// the recent links of each replica's index that changed since its last save; every
/// [`RESTARTS_EVERY`], deletes what Redis keeps of the replicas that restarted
/// ([`super::restarts`]; every instance follows the restarts). The first round waits until
/// the others' load snapshots say who is rank 0. Saves and the pins' scan go on the link's
/// bulk lane, so a slow one never holds back pins, drains or load; the restart states are
/// small reads and writes on the control lane. Returns the error that stopped it.
pub(super) async fn records_every(
    registry: Arc<Registry>,
    link: Arc<Link>,
    ttl: Duration,
    followed: Arc<Mutex<Followed>>,
) -> Failed {
    let ttl = ttl.as_secs().max(1);
    let mut saved: HashMap<Arc<str>, u64> = HashMap::new();
    let start = tokio::time::Instant::now();
    let mut save = tokio::time::interval_at(start + INDEX_EVERY, INDEX_EVERY);
    save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut restarts = tokio::time::interval_at(start + RANKED_AFTER, RESTARTS_EVERY);
    restarts.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = save.tick() => {
                if registry.rank() != 0 {
                    continue;
                }
                if let Err(e) = save_indexes(&registry, &link, ttl, &mut saved).await {
                    return e;
                }
            }
            _ = restarts.tick() => {
                // The saved index of a replica deleted is saved again once this instance's own
                // index of it changes: emptied, once it reads the restart itself.
                match forget_restarted(&registry, &link, &followed, ttl).await {
                    Ok(()) => {}
                    Err(e) if e.is_outage() => return e,
                    Err(e) => log::warn!("cluster: forgetting restarted replicas: {e}"),
                }
            }
        }
    }
}

/// Raises the restarts this instance read; on rank 0, deletes what Redis keeps of every
/// replica stale since a restart, and says so.
async fn forget_restarted(
    registry: &Registry,
    link: &Link,
    followed: &Mutex<Followed>,
    ttl: u64,
) -> Result<(), Failed> {
    restarts::raise(link, followed, &registry.all(), ttl).await?;
    if registry.rank() != 0 {
        return Ok(());
    }
    let states = restarts::states(link).await?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let pins = restarts::settle(link, &states, now_ms.saturating_sub(ttl * 1000)).await?;
    if !states.stale.is_empty() {
        let mut names: Vec<String> = states.stale.into_keys().collect();
        names.sort();
        log::warn!(
            "cluster: deleted from redis what it kept of restarted replica {}: saved index \
             and {pins} pins",
            names.join(", ")
        );
    }
    Ok(())
}

/// Saves the index of each replica whose index changed since `saved` says.
async fn save_indexes(
    registry: &Registry,
    link: &Link,
    ttl: u64,
    saved: &mut HashMap<Arc<str>, u64>,
) -> Result<(), Failed> {
    for r in registry.all().iter() {
        let records = r.cache.index.records();
        if records == 0 || saved.get(&r.id) == Some(&records) {
            continue;
        }
        let bytes = links_to(&r.cache.index.recent(INDEX_SAVED_LINKS));
        let mut set = redis::cmd("SET");
        set.arg(index_key(&r.id)).arg(bytes).arg("EX").arg(ttl);
        match link.query::<()>(Lane::Bulk, &set).await {
            Ok(()) => {
                saved.insert(r.id.clone(), records);
            }
            Err(e) if e.is_outage() => return Err(e),
            // Slow or refused: this replica's index waits for the next round.
            Err(e) => log::warn!("cluster: saving the index of {}: {e}", r.id),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_index_reads_back_and_a_torn_one_loses_only_its_last_link() {
        let links = vec![(u64::MAX, 1), (0, u32::MAX), (0x0123_4567_89ab_cdef, 256)];
        let bytes = links_to(&links);
        assert_eq!(bytes.len(), 36);
        assert_eq!(links_from(&bytes), links);
        assert_eq!(links_from(&bytes[..30]), links[..2]);
        assert!(links_from(&[]).is_empty());
    }
}
