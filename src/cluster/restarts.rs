//! A replica that restarted lost its cache, and what Redis keeps of it goes too: its affinity
//! pins and its saved prefix index. Each instance reads the restart from its own poll of the
//! replica's `/metrics` and drops its own pins ([`crate::fleet::poll`]); without this, an
//! instance that starts or reconnects later would adopt the old pins and index from Redis and
//! send those conversations back to a cold replica as if it held them.
//!
//! Every instance follows the restarts it sees: each is pending until Redis says what it kept
//! of the replica was deleted since that start (`inferlb:restarted:v1:{replica}`, the latest
//! start whose records went). The lowest-ranked instance (rank 0, which also saves the
//! indexes) does the deleting; the others wait for the key, and meanwhile adopt neither the
//! replica's pins nor its saved index from Redis. A deletion cut short (Redis away, the session
//! over, rank 0 gone) stays pending, on every instance, until one finishes it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

use super::records::index_key;
use super::Table;
use crate::fleet::replica::Replica;
use crate::link::{Failed, Lane, Link};
use crate::protocol::api::prompt::HASH_VERSION;

/// Deletes each key of `KEYS` whose value is one of `ARGV` (replica ids); how many went. A
/// pin another instance moved to another replica meanwhile stands.
const DELETE_PINS_TO: &str = "local ids = {} for _, id in ipairs(ARGV) do ids[id] = true end \
     local n = 0 for _, k in ipairs(KEYS) do local v = redis.call('GET', k) \
     if v and ids[v] then redis.call('DEL', k) n = n + 1 end end return n";

/// Records that what Redis kept of a replica was deleted after its start `ARGV[1]`, unless a
/// later start is recorded; expires after `ARGV[2]` seconds, with the pins it speaks of.
const SETTLED: &str = "local v = tonumber(redis.call('GET', KEYS[1])) \
     if not v or v < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) \
     end return 1";

/// The latest start of `replica` whose pins and saved index went from Redis.
fn settled_key(replica: &str) -> String {
    format!("inferlb:restarted:v1:{replica}")
}

/// The restarts this instance follows.
#[derive(Debug, Default)]
pub struct Followed {
    /// Each replica's restart count as last seen, for that replica (one removed and added
    /// again under its id is another, whose count starts at 0).
    seen: HashMap<Arc<str>, (Weak<Replica>, u64)>,
    /// Replica → the start (Unix ms) after which what Redis keeps of it is stale, until Redis
    /// says it was deleted.
    pending: HashMap<Arc<str>, u64>,
}

impl Followed {
    /// Follows `fleet`'s restarts: each one found since the last call is pending.
    pub(super) fn follow(&mut self, fleet: &[Arc<Replica>]) {
        for r in fleet {
            let now = r.restarts();
            let before = match self.seen.get(&r.id) {
                Some((w, n)) if w.ptr_eq(&Arc::downgrade(r)) => *n,
                _ => 0,
            };
            if now > before {
                self.pending.insert(r.id.clone(), r.started_ms());
            }
            self.seen.insert(r.id.clone(), (Arc::downgrade(r), now));
        }
        let ids: HashSet<&Arc<str>> = fleet.iter().map(|r| &r.id).collect();
        self.seen.retain(|id, _| ids.contains(id));
        self.pending.retain(|id, _| ids.contains(id));
    }

    /// Whether what Redis keeps of `replica` may be from before its restart.
    pub(super) fn is_pending(&self, replica: &str) -> bool {
        self.pending.contains_key(replica)
    }

    /// The restarts pending, each with its start.
    fn pending(&self) -> Vec<(Arc<str>, u64)> {
        self.pending.iter().map(|(r, s)| (r.clone(), *s)).collect()
    }

    /// What Redis kept of `replica` was deleted after `start`: settled, unless it restarted
    /// again meanwhile.
    fn settled(&mut self, replica: &str, start: u64) {
        if self.pending.get(replica).is_some_and(|s| *s <= start) {
            self.pending.remove(replica);
        }
    }
}

/// Follows `fleet`'s restarts, and settles those pending: the ones Redis says were dealt with;
/// and on rank 0 (`delete`) the rest, by deleting what Redis keeps of them. The replicas whose
/// records this call deleted, and how many pins went.
pub(super) async fn settle(
    link: &Link,
    followed: &Mutex<Followed>,
    fleet: &[Arc<Replica>],
    delete: bool,
    ttl: u64,
) -> Result<(Vec<Arc<str>>, u64), Failed> {
    let pending = match followed.lock() {
        Ok(mut f) => {
            f.follow(fleet);
            f.pending()
        }
        Err(_) => return Ok((Vec::new(), 0)),
    };
    if pending.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let mut get = redis::cmd("MGET");
    for (r, _) in &pending {
        get.arg(settled_key(r));
    }
    let done: Vec<Option<u64>> = link.query(Lane::Bulk, &get).await?;
    let mut left = Vec::new();
    for ((r, start), done) in pending.into_iter().zip(done) {
        match done {
            Some(d) if d >= start => {
                if let Ok(mut f) = followed.lock() {
                    f.settled(&r, d);
                }
            }
            _ => left.push((r, start)),
        }
    }
    if !delete || left.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let ids: Vec<Arc<str>> = left.iter().map(|(r, _)| r.clone()).collect();
    let pins = forget(link, &ids).await?;
    for (r, start) in &left {
        let mut set = redis::cmd("EVAL");
        set.arg(SETTLED)
            .arg(1)
            .arg(settled_key(r))
            .arg(*start)
            .arg(ttl);
        link.query::<()>(Lane::Bulk, &set).await?;
        if let Ok(mut f) = followed.lock() {
            f.settled(r, *start);
        }
    }
    Ok((ids, pins))
}

/// Deletes what Redis keeps of `replicas`' caches: their saved indexes, and the affinity pins
/// to them (one scan of the pins for all, as the bootstrap's, a thousand keys a round trip).
/// A pin made to one of them after its restart and before this goes too: one cold turn for
/// an instance that adopts pins meanwhile, no wrong route. Pins of stored Responses ids stay:
/// the balancer's store resends their history itself, and a replica's own store went with
/// its process wherever the id is sent. How many pins went.
async fn forget(link: &Link, replicas: &[Arc<str>]) -> Result<u64, Failed> {
    let mut del = redis::cmd("DEL");
    for r in replicas {
        del.arg(index_key(r));
    }
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
            eval.arg(DELETE_PINS_TO).arg(keys.len()).arg(&keys);
            for r in replicas {
                eval.arg(&**r);
            }
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

    /// Restarts each replica counted, one call after another → what is pending: each restart
    /// once, settled only by a deletion after its start, and a replica removed, or removed
    /// and added again, is another.
    #[test]
    fn each_restart_is_pending_until_settled_and_a_replica_gone_is_forgotten() {
        let reg = crate::fleet::registry::test_registry(&["a", "b"]);
        let fleet = reg.all();
        let replica = |name: &str| fleet.iter().find(|r| &*r.id == name).expect("replica");
        let pending = |f: &Followed| {
            let mut p: Vec<(String, u64)> = f
                .pending()
                .iter()
                .map(|(r, s)| (r.to_string(), *s))
                .collect();
            p.sort();
            p
        };
        let mut f = Followed::default();
        f.follow(&fleet);
        assert!(pending(&f).is_empty(), "no restart yet");
        replica("a").started(1_000);
        replica("b").started(1_000);
        f.follow(&fleet);
        assert!(pending(&f).is_empty(), "a first start is none");
        replica("a").started(2_000);
        f.follow(&fleet);
        f.follow(&fleet);
        assert_eq!(pending(&f), [("a".to_string(), 2_000)]);
        assert!(f.is_pending("a") && !f.is_pending("b"));
        f.settled("a", 1_500);
        assert!(f.is_pending("a"), "deleted before its start: still stale");
        replica("a").started(3_000);
        replica("b").started(3_000);
        f.follow(&fleet);
        f.settled("a", 2_000);
        assert_eq!(
            pending(&f),
            [("a".to_string(), 3_000), ("b".to_string(), 3_000)],
            "restarted again: the older deletion does not settle it"
        );
        f.settled("a", 3_000);
        f.settled("b", 4_000);
        assert!(pending(&f).is_empty());

        // Removed: no longer followed. Added again under its id, it is another replica,
        // whose first restart is one however many the first counted.
        replica("b").started(5_000);
        let only_a: Vec<Arc<Replica>> = vec![replica("a").clone()];
        f.follow(&only_a);
        assert!(pending(&f).is_empty() && f.seen.len() == 1);
        let again = crate::fleet::registry::test_registry(&["a", "b"]);
        let b2 = again
            .all()
            .iter()
            .find(|r| &*r.id == "b")
            .cloned()
            .expect("b");
        let with_b2 = vec![replica("a").clone(), b2.clone()];
        f.follow(&with_b2);
        b2.started(1_000);
        b2.started(2_000);
        f.follow(&with_b2);
        assert_eq!(pending(&f), [("b".to_string(), 2_000)]);
    }
}
