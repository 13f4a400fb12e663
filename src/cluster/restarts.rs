//! A replica that restarted lost its cache, and what Redis keeps of it goes too: its affinity
//! pins and its saved prefix index. Each instance reads the restart from its own poll of the
//! replica's `/metrics` and drops its own pins ([`crate::fleet::poll`]); without this, an
//! instance that starts or reconnects later would adopt the old pins and index from Redis and
//! send those conversations back to a cold replica as if it held them.
//!
//! The state is Redis's, so that it outlives any one instance: the hash `inferlb:restarted:v1`
//! holds two process starts (Unix ms) per replica that restarted, each only ever raised:
//! `seen:{replica}` (the latest start any instance read as a restart) and `deleted:{replica}`
//! (the latest start after which the replica's pins and saved index went). Every instance
//! raises `seen` when it reads a restart (held here until Redis has it); the instance of rank
//! 0 deletes what Redis keeps of each replica whose `seen` is past its `deleted`, then raises
//! `deleted`; and every (re)connecting instance's bootstrap adopts neither the pins nor the
//! saved index of such a replica. A deletion cut short (Redis away, the session over, rank 0
//! gone) is done by the next rank 0.
//!
//! A restart no instance followed (it happened while none ran) is found from the starts read:
//! every instance raises the key `inferlb:started:v1:{replica}` to the start it reads, and one
//! that (re)connects compares its own with it ([`compare_starts`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::records::index_key;
use super::Table;
use crate::fleet::affinity::AffinityTable;
use crate::fleet::poll::{dropped_on_restart, plausible_start};
use crate::fleet::replica::Replica;
use crate::link::{Failed, Lane, Link};
use crate::protocol::api::prompt::HASH_VERSION;

/// Deletes each key of `KEYS` whose value is one of `ARGV` (replica ids); how many went. A
/// pin another instance moved to another replica meanwhile stands.
const DELETE_PINS_TO: &str = "local ids = {} for _, id in ipairs(ARGV) do ids[id] = true end \
     local n = 0 for _, k in ipairs(KEYS) do local v = redis.call('GET', k) \
     if v and ids[v] then redis.call('DEL', k) n = n + 1 end end return n";

/// Raises field `ARGV[1]` of hash `KEYS[1]` to `ARGV[2]` (a value that is not a number is
/// replaced).
const RAISE: &str = "local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) \
     if not v or v < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end \
     return 1";

/// Forgets the states of replicas `ARGV[2..]` settled (`seen` no later than `deleted`, or no
/// `seen`) before `ARGV[1]`, each checked here, so a `seen` raised since stands.
const PRUNE: &str = "local n = 0 for i = 2, #ARGV do local r = ARGV[i] \
     local s = tonumber(redis.call('HGET', KEYS[1], 'seen:' .. r)) or 0 \
     local d = tonumber(redis.call('HGET', KEYS[1], 'deleted:' .. r)) or 0 \
     if s <= d and d < tonumber(ARGV[1]) then \
     redis.call('HDEL', KEYS[1], 'seen:' .. r, 'deleted:' .. r) n = n + 1 end end return n";

/// The replicas' restart states, one hash: field `seen:{replica}` and field
/// `deleted:{replica}`.
const STATES: &str = "inferlb:restarted:v1";

/// A replica's latest process start any instance read (Unix ms), only ever raised. An
/// instance that starts, or comes back, compares it with its own read, so a restart that
/// happened while no instance followed the replica is found all the same.
fn start_key(replica: &str) -> String {
    format!("inferlb:started:v1:{replica}")
}

/// Raises key `KEYS[1]` to `ARGV[1]` (a value that is not a number is replaced), and keeps it
/// `ARGV[2]` seconds from now.
const RAISE_START: &str = "local v = tonumber(redis.call('GET', KEYS[1])) \
     if not v or v < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end \
     redis.call('EXPIRE', KEYS[1], ARGV[2]) return 1";

/// How long a start written stands before it is written again, at most (and at most half
/// `pin_ttl`). Its key lives twice `pin_ttl`, so it outlives every pin to the replica: they
/// expire `pin_ttl` after their last write, by an instance that knows the replica and so
/// writes the key too.
const START_REFRESH: Duration = Duration::from_secs(3600);

/// The restarts this instance reads, until Redis has them.
#[derive(Debug, Default)]
pub struct Followed {
    /// Each replica's restarts read from a start, as last seen, for that replica (one removed
    /// and added again under its id is another, whose count starts at 0).
    seen: HashMap<Arc<str>, (Weak<Replica>, u64)>,
    /// Replica → its latest start read as a restart, not yet raised in Redis.
    unraised: HashMap<Arc<str>, u64>,
    /// Replica → the start last written to its key, and when.
    written: HashMap<Arc<str>, (u64, Instant)>,
    /// The replicas whose start was compared with Redis's ([`compare_starts`]): only theirs
    /// are written, lest a first read written first hide a restart no instance followed.
    compared: HashMap<Arc<str>, Weak<Replica>>,
}

impl Followed {
    /// Follows `fleet`'s restarts: each one found from a later start since the last call
    /// waits to be raised. (One read from a counter has no start to raise: each instance
    /// reads it itself.)
    fn follow(&mut self, fleet: &[Arc<Replica>]) {
        for r in fleet {
            self.note(r);
        }
        let ids: HashSet<&Arc<str>> = fleet.iter().map(|r| &r.id).collect();
        self.seen.retain(|id, _| ids.contains(id));
        self.unraised.retain(|id, _| ids.contains(id));
        self.written.retain(|id, _| ids.contains(id));
        self.compared.retain(|id, _| ids.contains(id));
    }

    /// Follows one replica's restarts (see [`Followed::follow`]).
    fn note(&mut self, r: &Arc<Replica>) {
        // The count first: whoever reads a count reads its start, or a later one.
        let now = r.restarts_by_start();
        let before = match self.seen.get(&r.id) {
            Some((w, n)) if w.ptr_eq(&Arc::downgrade(r)) => *n,
            _ => 0,
        };
        if now > before {
            self.unraised.insert(r.id.clone(), r.started_ms());
        }
        self.seen.insert(r.id.clone(), (Arc::downgrade(r), now));
    }

    /// The starts of `fleet` to write to their keys, at `now`: each one known, when it moved
    /// since it was last written, or was written `refresh` ago.
    fn starts_due(
        &self,
        fleet: &[Arc<Replica>],
        now: Instant,
        refresh: Duration,
    ) -> Vec<(Arc<str>, u64)> {
        fleet
            .iter()
            .map(|r| (r, r.started_ms()))
            .filter(|(r, start)| {
                *start > 0
                    && self
                        .compared
                        .get(&r.id)
                        .is_some_and(|w| w.ptr_eq(&Arc::downgrade(r)))
                    && self.written.get(&r.id).is_none_or(|(w, at)| {
                        w != start || now.saturating_duration_since(*at) >= refresh
                    })
            })
            .map(|(r, start)| (r.id.clone(), start))
            .collect()
    }

    /// Redis keeps `kept` as `replica`'s start: some instance read it, and raised `seen` for
    /// it if it was a restart; a restart read here at or before it is not raised again (its
    /// pair may be settled and forgotten since, and raising it again would delete the pins
    /// made since, which are good).
    /// Unless this instance wrote it: a start can be written here between its read and
    /// its restart's count, before the restart waits to be raised.
    fn known(&mut self, replica: &str, kept: u64) {
        if self.written.get(replica).is_some_and(|(w, _)| *w == kept) {
            return;
        }
        if self.unraised.get(replica).is_some_and(|s| *s <= kept) {
            self.unraised.remove(replica);
        }
    }

    /// `replica`'s restart at `start` is in Redis: raised, unless it restarted again since.
    fn raised(&mut self, replica: &str, start: u64) {
        if self.unraised.get(replica).is_some_and(|s| *s <= start) {
            self.unraised.remove(replica);
        }
    }
}

/// Raises `seen` in Redis for each restart of `fleet` this instance read since, and each
/// replica's start key to the start read here (`ttl`: the pins' time to live, in seconds).
pub(super) async fn raise(
    link: &Link,
    followed: &Mutex<Followed>,
    fleet: &[Arc<Replica>],
    ttl: u64,
) -> Result<(), Failed> {
    let (unraised, starts) = match followed.lock() {
        Ok(mut f) => {
            f.follow(fleet);
            let unraised: Vec<(Arc<str>, u64)> =
                f.unraised.iter().map(|(r, s)| (r.clone(), *s)).collect();
            let refresh =
                START_REFRESH.min(Duration::from_secs(ttl / 2).max(Duration::from_secs(1)));
            (unraised, f.starts_due(fleet, Instant::now(), refresh))
        }
        Err(_) => return Ok(()),
    };
    for (r, start) in unraised {
        raise_field(link, "seen", &r, start).await?;
        if let Ok(mut f) = followed.lock() {
            f.raised(&r, start);
        }
    }
    for (r, start) in starts {
        let mut eval = redis::cmd("EVAL");
        eval.arg(RAISE_START)
            .arg(1)
            .arg(start_key(&r))
            .arg(start)
            .arg(ttl.saturating_mul(2));
        link.query::<()>(Lane::Control, &eval).await?;
        if let Ok(mut f) = followed.lock() {
            f.written.insert(r, (start, Instant::now()));
        }
    }
    Ok(())
}

/// At a session's start, or when a replica becomes known later (`adopted`: what Redis keeps
/// of it was adopted already), each replica's start as Redis keeps it against this
/// instance's own:
/// - not read here yet: taken as the first read ([`Replica::seed_start`]), so that a later
///   start read next counts as a restart, one no instance followed, and drops what was adopted
///   of the replica then;
/// - read here later than any instance wrote: a restart no instance followed (this one read
///   it first): `seen` is raised for it, so what Redis keeps of the replica is neither adopted
///   nor kept (what was adopted already goes: its pins and estimate here);
/// - known here earlier than Redis keeps (a start from the state file, or read before an
///   outage): the replica restarted since, and another instance followed that. It is counted
///   here, its pins here dropped, and not raised again.
///
/// Their starts are written again afterwards (Redis may have lost them).
pub(super) async fn compare_starts(
    link: &Link,
    followed: &Mutex<Followed>,
    fleet: &[Arc<Replica>],
    affinity: &AffinityTable,
    adopted: bool,
) -> Result<(), Failed> {
    if fleet.is_empty() {
        return Ok(());
    }
    let mut get = redis::cmd("MGET");
    for r in fleet {
        get.arg(start_key(&r.id));
    }
    let kept: Vec<Option<String>> = link.query(Lane::Control, &get).await?;
    let kept: Vec<(&Arc<Replica>, u64)> = fleet
        .iter()
        .zip(kept)
        .filter_map(|(r, k)| Some((r, k?.parse::<u64>().ok()?)))
        .filter(|(_, k)| plausible_start(*k))
        .collect();
    for (r, kept) in &kept {
        if r.seed_start(*kept) {
            continue;
        }
        let mine = r.started_ms();
        if mine > *kept {
            log::warn!(
                "replica {}: restarted while no instance followed it (redis keeps an earlier \
                 process start than its /metrics gives): what redis keeps of it is not adopted",
                r.id
            );
            raise_field(link, "seen", &r.id, mine).await?;
            if adopted {
                unadopt(affinity, r);
            }
        } else if mine < *kept && r.started(*kept) {
            let why = "since this instance last read it: redis keeps a later process start";
            dropped_on_restart(affinity, r, why);
        }
    }
    if let Ok(mut f) = followed.lock() {
        for r in fleet {
            f.note(r);
        }
        for (r, kept) in &kept {
            f.known(&r.id, *kept);
        }
        for r in fleet {
            f.written.remove(&r.id);
            f.compared.insert(r.id.clone(), Arc::downgrade(r));
        }
    }
    Ok(())
}

/// Drops what was adopted from Redis of `r`, which restarted since: its pins here, and its
/// estimate (the block index is the new process's events' since). How many pins went.
pub(super) fn unadopt(affinity: &AffinityTable, r: &Replica) -> usize {
    let pins = affinity.forget_replica(&r.id);
    r.cache.index.clear();
    pins
}

async fn raise_field(link: &Link, field: &str, replica: &str, start: u64) -> Result<(), Failed> {
    let mut eval = redis::cmd("EVAL");
    eval.arg(RAISE)
        .arg(1)
        .arg(STATES)
        .arg(format!("{field}:{replica}"))
        .arg(start);
    link.query(Lane::Control, &eval).await
}

/// The replicas' restart states as Redis holds them.
#[derive(Debug, Default)]
pub(super) struct States {
    /// Replica → the start since which its pins and saved index in Redis may be stale
    /// (`seen` past `deleted`), whether this instance knows the replica or not (added at
    /// runtime, found by another's DNS).
    pub(super) stale: HashMap<String, u64>,
    /// Replicas settled (`seen` no later than `deleted`), with their `deleted` start: gone
    /// from Redis once that is older than the pins it speaks of.
    settled: Vec<(String, u64)>,
}

/// Reads the replicas' restart states (one hash, a pair of fields a replica that restarted).
pub(super) async fn states(link: &Link) -> Result<States, Failed> {
    let mut get = redis::cmd("HGETALL");
    get.arg(STATES);
    let fields: HashMap<String, String> = link.query(Lane::Control, &get).await?;
    let number = |v: Option<&String>| v.and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let mut states = States::default();
    let replicas: HashSet<&str> = fields
        .keys()
        .filter_map(|f| f.strip_prefix("seen:").or(f.strip_prefix("deleted:")))
        .collect();
    for replica in replicas {
        let (seen, deleted) = (
            number(fields.get(&format!("seen:{replica}"))),
            number(fields.get(&format!("deleted:{replica}"))),
        );
        if seen > deleted {
            states.stale.insert(replica.to_string(), seen);
        } else {
            states.settled.push((replica.to_string(), deleted));
        }
    }
    Ok(states)
}

/// Deletes what Redis keeps of the stale replicas of `states`, then records that in Redis; and
/// forgets the states settled before `expired_ms` (Unix ms: their pins expired since). How many
/// pins went.
pub(super) async fn settle(link: &Link, states: &States, expired_ms: u64) -> Result<u64, Failed> {
    let old: Vec<&str> = states
        .settled
        .iter()
        .filter(|(_, deleted)| *deleted < expired_ms)
        .map(|(r, _)| r.as_str())
        .collect();
    if !old.is_empty() {
        let mut prune = redis::cmd("EVAL");
        prune
            .arg(PRUNE)
            .arg(1)
            .arg(STATES)
            .arg(expired_ms)
            .arg(&old);
        link.query::<()>(Lane::Control, &prune).await?;
    }
    if states.stale.is_empty() {
        return Ok(0);
    }
    let ids: Vec<&str> = states.stale.keys().map(String::as_str).collect();
    let pins = forget(link, &ids).await?;
    for (r, start) in &states.stale {
        raise_field(link, "deleted", r, *start).await?;
    }
    Ok(pins)
}

/// Deletes what Redis keeps of `replicas`' caches: their saved indexes, and the affinity pins
/// to them (one scan of the pins for all, as the bootstrap's, a thousand keys a round trip).
/// A pin made to one of them after its restart and before this goes too: one cold turn for
/// an instance that adopts pins meanwhile, no wrong route. Pins of stored Responses ids stay:
/// the balancer's store resends their history itself, and a replica's own store went with
/// its process wherever the id is sent. How many pins went.
async fn forget(link: &Link, replicas: &[&str]) -> Result<u64, Failed> {
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
            eval.arg(DELETE_PINS_TO)
                .arg(keys.len())
                .arg(&keys)
                .arg(replicas);
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

    /// Restarts each replica counted, one call after another → what waits to be raised: each
    /// restart once, until raised at or after its start; a replica removed is forgotten, and
    /// one added again under its id is another, in place of the first or after it.
    #[test]
    fn each_restart_waits_to_be_raised_and_a_replica_added_again_is_another() {
        let reg = crate::fleet::registry::test_registry(&["a", "b"]);
        let fleet = reg.all();
        let replica = |name: &str| fleet.iter().find(|r| &*r.id == name).expect("replica");
        let unraised = |f: &Followed| {
            let mut p: Vec<(String, u64)> = f
                .unraised
                .iter()
                .map(|(r, s)| (r.to_string(), *s))
                .collect();
            p.sort();
            p
        };
        let mut f = Followed::default();
        f.follow(&fleet);
        assert!(unraised(&f).is_empty(), "no restart yet");
        replica("a").started(1_000);
        replica("b").started(1_000);
        f.follow(&fleet);
        assert!(unraised(&f).is_empty(), "a first start is none");
        replica("a").started(2_000);
        f.follow(&fleet);
        f.follow(&fleet);
        assert_eq!(unraised(&f), [("a".to_string(), 2_000)]);
        f.raised("a", 1_500);
        assert_eq!(unraised(&f).len(), 1, "an older start raised: still waits");
        replica("a").started(3_000);
        replica("b").started(3_000);
        f.follow(&fleet);
        f.raised("a", 2_000);
        assert_eq!(
            unraised(&f),
            [("a".to_string(), 3_000), ("b".to_string(), 3_000)],
            "restarted again: the older raise does not do"
        );
        // Redis keeps an earlier start of a: not known there yet; its own, or a later one:
        // another instance read it, and raised it if it was a restart.
        f.known("a", 2_999);
        assert_eq!(unraised(&f).len(), 2);
        f.known("a", 3_000);
        f.raised("b", 4_000);
        assert!(unraised(&f).is_empty());

        // Added again under its id, in place of the first (no call between): another
        // replica, whose first restart is one however many the first counted.
        let again = crate::fleet::registry::test_registry(&["b"]);
        let b2 = again.all().first().cloned().expect("b");
        let with_b2 = vec![replica("a").clone(), b2.clone()];
        b2.started(1_000);
        b2.started(2_000);
        f.follow(&with_b2);
        assert_eq!(unraised(&f), [("b".to_string(), 2_000)]);
        // Removed: no longer followed.
        f.follow(&[replica("a").clone()]);
        assert!(unraised(&f).is_empty() && f.seen.len() == 1);
    }

    /// A restart read from a counter has no start to raise; a start Redis keeps is known
    /// there, unless this instance wrote it itself (it may have, before the restart's count).
    #[test]
    fn a_counted_restart_is_not_raised_and_a_start_written_here_is_not_known_there() {
        let reg = crate::fleet::registry::test_registry(&["c", "d"]);
        let fleet = reg.all();
        let (c, d) = (&fleet[0], &fleet[1]);
        let mut f = Followed::default();
        c.counted(100);
        d.started(1_000);
        f.follow(&fleet);
        assert!(c.counted(5), "a restart");
        f.follow(&fleet);
        assert!(f.unraised.is_empty(), "no start to raise");

        d.started(2_000);
        f.follow(&fleet);
        let now = Instant::now();
        assert!(
            f.starts_due(&fleet, now, START_REFRESH).is_empty(),
            "not compared yet"
        );
        f.compared.insert(d.id.clone(), Arc::downgrade(d));
        let due = f.starts_due(&fleet, now, START_REFRESH);
        assert_eq!(due, [(d.id.clone(), 2_000)]);
        f.written.insert(d.id.clone(), (2_000, now));
        assert!(f.starts_due(&fleet, now, START_REFRESH).is_empty());
        let later = now + START_REFRESH;
        assert_eq!(
            f.starts_due(&fleet, later, START_REFRESH).len(),
            1,
            "refreshed"
        );
        f.known("d", 2_000);
        assert_eq!(
            f.unraised.get("d"),
            Some(&2_000),
            "written here: still to raise"
        );
        f.written.clear();
        f.known("d", 2_000);
        assert!(f.unraised.is_empty(), "another instance's: known there");
    }
}
