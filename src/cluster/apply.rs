//! What another instance said, applied here: its pins, drains, replicas and prefilled prompts
//! to the local tables, and the peers' load to each replica.

use super::sync::ClusterSync;
use super::{Change, Peers, Table};
use crate::conf::{check_replica, ReplicaConf};
use crate::fleet::affinity::AffinityTable;

impl ClusterSync {
    pub(super) fn table(&self, t: Table) -> &AffinityTable {
        match t {
            Table::Affinity => &self.affinity,
            Table::Stored => &self.stored,
        }
    }

    /// Applies another instance's change (or what Redis holds) to the local state; not while
    /// a change of this instance to the same replica waits to be written (it will be the
    /// newer write, and the others will follow it).
    pub(super) async fn apply(&self, change: Change) {
        if let Some(subject) = change.subject() {
            if self.cluster.held.holds(&subject) {
                return;
            }
        }
        match change {
            Change::Pin {
                table,
                key,
                replica,
            } => {
                // The replica's own id when it is known (one copy for all its pins); kept
                // for one not found yet too (DNS finds it later).
                let id = self
                    .registry
                    .get(&replica)
                    .map_or(replica, |r| r.id.clone());
                self.table(table).record(key, &id);
            }
            Change::Drain { replica, draining } => {
                if let Some(r) = self.registry.get(&replica) {
                    if r.health.is_draining() != draining {
                        r.set_draining(draining);
                    }
                }
            }
            Change::Prefilled { replica, links } => {
                if let Some(r) = self.registry.get(&replica) {
                    r.cache.index.record(&links);
                }
            }
            Change::Replica { id, conf: None } => {
                self.registry.remove(&id);
                self.cluster.set_runtime(&id, None);
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
                let shared = json;
                // Resolving an address may block: not on this task.
                let checked = tokio::task::spawn_blocking(move || {
                    check_replica(&mut conf, "shared replica").map(|()| conf)
                })
                .await;
                // Checked against this instance's own allowed networks: the sender's may be wider.
                let checked = checked.map(|r| {
                    r.and_then(|conf| match conf.socket {
                        Some(s) => self.networks.check(s.ip()).map(|()| conf),
                        None => Ok(conf),
                    })
                });
                match checked {
                    Ok(Ok(conf)) => {
                        if self.registry.add(&conf, None).is_ok() {
                            self.cluster.set_runtime(&id, Some(&shared));
                        }
                    }
                    Ok(Err(e)) => {
                        log::error!("cluster: replica {id} from another instance not added: {e}")
                    }
                    Err(_) => {}
                }
            }
        }
    }

    /// The peers' load summed into each replica, and this instance's rank among them.
    pub(super) fn apply_peers(&self, peers: &Peers) {
        for r in self.registry.all().iter() {
            let (in_flight, waiting, queued) = peers.total(&r.id);
            r.set_peer_load(queued, waiting, in_flight);
        }
        self.registry.set_rank(peers.rank(&self.cluster.instance));
    }
}
