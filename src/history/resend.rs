//! Writing to Redis what it lacks, each time the link comes up: what was not sent, deletions
//! made while it was down, and after a restart of Redis everything made here.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use super::{gone_key, lock, now, redis_key, Store};
use crate::link::{Lane, Link};
use crate::protocol::conversation::Exchange;

impl Store {
    /// Writes what Redis lacks: deletions first, then what was never sent and, when Redis
    /// restarted (`everything`), every exchange made here and still held; an exchange with a
    /// tombstone is not brought back. In batches, one at a time.
    async fn resend(&self, everything: bool) -> Result<usize, crate::link::Failed> {
        let Some(link) = &self.link else {
            return Ok(0);
        };
        let gone: Vec<u64> = lock(&self.unsent_gone).iter().copied().collect();
        for k in gone {
            link.pipe::<()>(Lane::Bulk, &self.tombstone(k)).await?;
            lock(&self.unsent_gone).remove(&k);
        }
        let now = now();
        let unsent: Vec<u64> = lock(&self.unsent).iter().copied().collect();
        let mut todo: Vec<(u64, Arc<Exchange>)> = self.memory(|m| {
            unsent
                .iter()
                .filter_map(|k| m.peek(*k, now).map(|e| (*k, e)))
                .collect()
        });
        if everything {
            let mine = self.memory(|m| m.made_here(now));
            let known: HashSet<u64> = todo.iter().map(|(k, _)| *k).collect();
            todo.extend(mine.into_iter().filter(|(k, _)| !known.contains(k)));
        }
        let mut sent = 0;
        // Batches of about 4 MiB: each must land within the bulk lane's bound.
        let mut batches: Vec<Vec<(u64, Vec<u8>)>> = vec![];
        let mut bytes = 0;
        for (k, e) in todo {
            let Ok(json) = serde_json::to_vec(&*e) else {
                continue;
            };
            if batches.is_empty() || bytes + json.len() > 4 << 20 {
                batches.push(vec![]);
                bytes = 0;
            }
            bytes += json.len();
            if let Some(b) = batches.last_mut() {
                b.push((k, json));
            }
        }
        for batch in batches {
            let mut exists = redis::pipe();
            for (k, _) in &batch {
                exists.exists(gone_key(*k));
            }
            let deleted: Vec<i64> = link.pipe(Lane::Bulk, &exists).await?;
            let mut pipe = redis::pipe();
            let mut sets = 0;
            for ((k, json), gone) in batch.iter().zip(deleted) {
                if gone == 1 {
                    continue;
                }
                pipe.cmd("SET")
                    .arg(redis_key(*k))
                    .arg(json.as_slice())
                    .arg("EX")
                    .arg(self.ttl())
                    .arg("NX")
                    .ignore();
                sets += 1;
            }
            if sets > 0 {
                link.pipe::<()>(Lane::Bulk, &pipe).await?;
            }
            let mut unsent = lock(&self.unsent);
            for (k, _) in &batch {
                unsent.remove(k);
            }
            sent += sets;
        }
        // What memory evicted before it could be written is gone for Redis too.
        {
            let m = lock(&self.memory);
            lock(&self.unsent).retain(|k| m.peek(*k, now).is_some());
        }
        Ok(sent)
    }
}

/// The `run_id` of the Redis server: it changes when Redis restarts (and may be empty).
async fn run_id(link: &Link) -> Result<String, crate::link::Failed> {
    let info: String = link
        .query(Lane::Bulk, redis::cmd("INFO").arg("server"))
        .await?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .unwrap_or("")
        .trim()
        .to_owned())
}

/// The background task that writes to Redis what it lacks, each time the link comes up.
pub struct Resender {
    pub store: Arc<Store>,
}

#[async_trait]
impl BackgroundService for Resender {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(link) = self.store.link.clone() else {
            return;
        };
        let mut status = link.status();
        let mut seen: Option<u64> = None;
        let mut server: Option<String> = None;
        loop {
            let generation = tokio::select! {
                g = crate::link::up(&mut status) => g,
                _ = shutdown.changed() => return,
            };
            if seen != Some(generation) {
                // A user Redis refuses INFO (an ACL without @dangerous): no restart is seen, but
                // what was not sent is still written.
                let id = match run_id(&link).await {
                    Err(crate::link::Failed::Refused(e)) => {
                        log::warn!("redis refuses INFO ({e}): a restart of redis is not detected, and exchanges made before it are not written again");
                        Ok(String::new())
                    }
                    other => other,
                };
                let done = match id {
                    Ok(id) => {
                        // Another server than the last one seen: it may have come back empty.
                        let restarted = server.as_ref().is_some_and(|s| *s != id);
                        match self.store.resend(restarted).await {
                            Ok(n) => {
                                if n > 0 {
                                    log::info!("{n} stored responses written to redis");
                                }
                                server = Some(id);
                                true
                            }
                            Err(e) => {
                                log::warn!("writing stored responses to redis: {e}");
                                false
                            }
                        }
                    }
                    Err(e) => {
                        log::warn!("asking redis for its run_id: {e}");
                        false
                    }
                };
                if done {
                    seen = Some(generation);
                }
            }
            tokio::select! {
                _ = status.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    // Writes that failed while the link stayed up, and a resend that failed.
                    let pending = !lock(&self.store.unsent).is_empty()
                        || !lock(&self.store.unsent_gone).is_empty();
                    if seen == Some(generation) && pending && link.is_up() {
                        let _ = self.store.resend(false).await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}
