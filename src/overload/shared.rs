//! Budgets shared by the instances of a cluster through Redis: each instance adds the tokens
//! its keys used to per-key, per-slice counters and publishes its requests in flight per key;
//! it reads back what the others used and counts it against the same budgets.
//!
//! Never on the request path: a task does it every [`EVERY`], on the link's budgets lane
//! ([`crate::link::Lane::Budgets`], each exchange bounded at 0.5 s). When the link is down (it
//! says so, once), each instance counts only its own use (the others' part is forgotten) until
//! it is back. Not for routing state (`crate::cluster` shares that).
//!
//! Keys: `inferlb:overload:v1:t:{key}:{slice}` (tokens, INCRBY, expiring after two windows) and
//! `inferlb:overload:v1:c:{key}` (a hash: instance → `requests:unix_ms`); `{key}` is the hash
//! of the client key, never the key itself; a slice is a tenth of `window_seconds` of wall
//! clock, so every instance must have the same window.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::budget::Remote;
use super::metrics::METRICS;
use super::Overload;
use crate::link::{Lane, Link};

const EVERY: Duration = Duration::from_millis(200);
/// Another instance's requests in flight count while its report is this fresh.
const FRESH_MS: u64 = 3_000;
const SLICES: u64 = 10;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn tokens_key(key: u64, slice: u64) -> String {
    format!("inferlb:overload:v1:t:{key:016x}:{slice}")
}

fn concurrency_key(key: u64) -> String {
    format!("inferlb:overload:v1:c:{key:016x}")
}

/// Where to share, and this instance's name there.
#[derive(Clone)]
pub struct Sharing {
    /// The link to the cluster's Redis, the one the cluster's state goes over.
    pub link: Arc<Link>,
    pub instance: String,
}

/// This instance's own part of each shared counter, so that what the others used is the
/// counter minus it.
#[derive(Default)]
struct Own {
    tokens: BTreeMap<(u64, u64), i64>,
}

/// Shares `overload`'s budgets until the process ends.
pub(super) async fn run(overload: Arc<Overload>, sharing: Sharing) {
    let slice_ms = (overload.conf.window.as_millis() as u64 / SLICES).max(1);
    let ttl = (overload.conf.window.as_secs() * 2).max(2);
    let mut own = Own::default();
    let mut down = false;
    loop {
        tokio::time::sleep(EVERY).await;
        let (pending, concurrency) = {
            let mut s = overload.lock();
            (s.budgets.take_pending(), s.budgets.concurrency())
        };
        if !sharing.link.is_up() {
            forget_others(&overload, &mut down);
            continue;
        }
        let now = now_ms();
        let slice = now / slice_ms;
        match exchange(
            &sharing.link,
            &sharing.instance,
            &pending,
            &concurrency,
            slice,
            ttl,
            now,
            &mut own,
        )
        .await
        {
            Ok(remote) => {
                if std::mem::take(&mut down) {
                    log::info!("overload budgets: shared through Redis again");
                }
                METRICS.shared.set(1);
                overload.lock().budgets.set_remote(remote);
            }
            Err(()) => {
                // What was not written is lost: each instance's count of its own stays exact,
                // the others see a little less of it.
                forget_others(&overload, &mut down);
            }
        }
        own.tokens.retain(|(_, s), _| *s + SLICES > slice);
    }
}

fn forget_others(overload: &Overload, down: &mut bool) {
    if !std::mem::replace(down, true) {
        // The link says the outage itself; this says what the budgets do about it, once.
        log::warn!("overload budgets: counting this instance's use only until Redis is back");
    }
    METRICS.shared.set(0);
    overload.lock().budgets.set_remote(HashMap::new());
}

/// Writes this instance's use, reads everyone's: the others' part by key.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    link: &Link,
    instance: &str,
    pending: &[(u64, i64)],
    concurrency: &[(u64, u32)],
    slice: u64,
    ttl: u64,
    now: u64,
    own: &mut Own,
) -> Result<HashMap<u64, Remote>, ()> {
    let mut pipe = redis::pipe();
    for (key, tokens) in pending {
        let k = tokens_key(*key, slice);
        pipe.cmd("INCRBY").arg(&k).arg(*tokens).ignore();
        pipe.cmd("EXPIRE").arg(&k).arg(ttl).ignore();
    }
    for (key, n) in concurrency {
        let k = concurrency_key(*key);
        pipe.cmd("HSET")
            .arg(&k)
            .arg(instance)
            .arg(format!("{n}:{now}"))
            .ignore();
        pipe.cmd("EXPIRE").arg(&k).arg(60).ignore();
    }
    // Read back every key this instance tracks: its window's slices and who has it in flight.
    let keys: Vec<u64> = concurrency.iter().map(|(k, _)| *k).collect();
    for key in &keys {
        let slices: Vec<String> = (slice + 1 - SLICES.min(slice + 1)..=slice)
            .map(|s| tokens_key(*key, s))
            .collect();
        pipe.cmd("MGET").arg(slices);
        pipe.cmd("HGETALL").arg(concurrency_key(*key));
    }
    type Read = (Vec<Option<i64>>, HashMap<String, String>);
    let read: Vec<Read> = if keys.is_empty() {
        link.pipe::<()>(Lane::Budgets, &pipe)
            .await
            .map_err(|_| ())?;
        vec![]
    } else {
        let flat: Vec<redis::Value> = link.pipe(Lane::Budgets, &pipe).await.map_err(|_| ())?;
        flat.chunks_exact(2)
            .map(|pair| {
                let totals: Vec<Option<i64>> =
                    redis::from_redis_value(pair[0].clone()).unwrap_or_default();
                let flying: HashMap<String, String> =
                    redis::from_redis_value(pair[1].clone()).unwrap_or_default();
                (totals, flying)
            })
            .collect()
    };
    for (key, tokens) in pending {
        *own.tokens.entry((*key, slice)).or_default() += tokens;
    }
    let first = slice + 1 - SLICES.min(slice + 1);
    let mut remote = HashMap::new();
    for (key, (totals, flying)) in keys.iter().zip(read) {
        let tokens: i64 = totals
            .iter()
            .zip(first..=slice)
            .map(|(t, s)| {
                let mine = own.tokens.get(&(*key, s)).copied().unwrap_or(0);
                t.unwrap_or(0).saturating_sub(mine).max(0)
            })
            .fold(0i64, i64::saturating_add);
        let concurrent: u32 = flying
            .iter()
            .filter(|(who, _)| who.as_str() != instance)
            .filter_map(|(_, v)| {
                let (n, at) = v.split_once(':')?;
                let at: u64 = at.parse().ok()?;
                (now.saturating_sub(at) < FRESH_MS).then(|| n.parse::<u32>().ok())?
            })
            .fold(0u32, u32::saturating_add);
        if tokens > 0 || concurrent > 0 {
            let r = Remote {
                tokens: tokens as u64,
                concurrent,
            };
            remote.insert(*key, r);
        }
    }
    Ok(remote)
}
