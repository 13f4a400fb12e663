//! A replica that restarted lost its cache, and what Redis keeps of it goes too: its affinity
//! pins and its saved prefix index. Each instance reads the restart from its own poll of the
//! replica's `/metrics` and drops its own pins ([`crate::fleet::poll`]); without this, an
//! instance that starts or reconnects later would adopt the old pins and index from Redis and
//! send those conversations back to a cold replica as if it held them.
//!
//! Every instance follows the restarts it has seen; the lowest-ranked one (rank 0, which
//! also saves the indexes) deletes what Redis keeps of each new one. Following them outside
//! rank 0 too means that an instance that becomes rank 0 later does not delete again what
//! its predecessor deleted, with the pins made since.

use std::collections::HashMap;
use std::sync::Arc;

use super::records::index_key;
use crate::fleet::replica::Replica;
use crate::link::{Failed, Lane, Link};
use crate::protocol::api::prompt::HASH_VERSION;

use super::Table;

/// Deletes each key of `KEYS` whose value is `ARGV[1]`; how many went. A pin another
/// instance moved to another replica meanwhile stands.
const DELETE_IF_TO: &str = "local n = 0 for _, k in ipairs(KEYS) do \
     if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) n = n + 1 end end return n";

/// The restart count of each replica as last seen (a replica not seen yet counts 0: its
/// count is this process's, from its start).
#[derive(Debug, Default)]
pub struct Followed(HashMap<Arc<str>, u64>);

impl Followed {
    /// The replicas of `fleet` that restarted since the last call, now followed.
    pub(super) fn moved<'f>(&mut self, fleet: &'f [Arc<Replica>]) -> Vec<&'f Arc<Replica>> {
        let mut moved = Vec::new();
        for r in fleet {
            let now = r.restarts();
            let seen = self.0.insert(r.id.clone(), now).unwrap_or(0);
            // Fewer than seen: another replica of that id (removed, then added again).
            if now > seen {
                moved.push(r);
            }
        }
        self.0.retain(|id, _| fleet.iter().any(|r| r.id == *id));
        moved
    }
}

/// Deletes what Redis keeps of `replica`'s cache: its saved index, and the affinity pins to
/// it (a scan of the pins, as the bootstrap's, a thousand keys per round trip). A pin made
/// to it after its restart and before this goes too: one cold turn for an instance that
/// adopts pins meanwhile, no wrong route. Pins of stored Responses ids stay: the balancer's
/// store resends their history itself, and a replica's own store went with its process
/// wherever the id is sent. How many pins went.
pub(super) async fn forget(link: &Link, replica: &str) -> Result<u64, Failed> {
    let mut del = redis::cmd("DEL");
    del.arg(index_key(replica));
    link.query::<()>(Lane::Bulk, &del).await?;
    let pattern = format!("inferlb:v{HASH_VERSION}:{}:*", Table::Affinity.tag());
    let mut cursor: u64 = 0;
    let mut gone = 0;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, keys): (u64, Vec<String>) = link.query(Lane::Bulk, &scan).await?;
        if !keys.is_empty() {
            let mut eval = redis::cmd("EVAL");
            eval.arg(DELETE_IF_TO)
                .arg(keys.len())
                .arg(&keys)
                .arg(replica);
            gone += link.query::<u64>(Lane::Bulk, &eval).await?;
        }
        cursor = next;
        if cursor == 0 {
            return Ok(gone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (restarts each replica has counted, per call) → the replicas given as moved.
    #[test]
    fn each_restart_is_given_once_and_a_replica_gone_is_forgotten() {
        let reg = crate::fleet::registry::test_registry(&["a", "b"]);
        let fleet = reg.all();
        let ids = |moved: Vec<&Arc<Replica>>| -> Vec<String> {
            moved.iter().map(|r| r.id.to_string()).collect()
        };
        let mut followed = Followed::default();
        assert!(followed.moved(&fleet).is_empty(), "no restart yet");
        let start = |name: &str, ms: u64| {
            let r = fleet.iter().find(|r| &*r.id == name).expect("replica");
            r.started(ms);
        };
        start("a", 1_000);
        start("b", 1_000);
        assert!(followed.moved(&fleet).is_empty(), "a first start is none");
        start("a", 2_000);
        assert_eq!(ids(followed.moved(&fleet)), ["a"]);
        assert!(followed.moved(&fleet).is_empty(), "given once");
        start("a", 3_000);
        start("b", 3_000);
        assert_eq!(ids(followed.moved(&fleet)), ["a", "b"]);
        // A replica removed is no longer followed.
        let only_b: Vec<Arc<Replica>> = fleet.iter().filter(|r| &*r.id == "b").cloned().collect();
        assert!(followed.moved(&only_b).is_empty());
        assert_eq!(followed.0.len(), 1);
    }
}
