//! The replicas' own word on their caches, as vLLM publishes it: one subscriber per replica
//! whose conf names its KV event endpoints (`kv_events`, `kv_events_replay`), reading
//! `BlockStored`, `BlockRemoved` and `AllBlocksCleared` batches (ZMQ frames, msgpack;
//! decoded by `inferlb_kvevents`).
//!
//! Stored and removed blocks build the replica's exact block index
//! ([`crate::fleet::blocks`]), which the cost policy reads for a prompt whose token ids are
//! known while the stream is live. An `AllBlocksCleared` (a cache reset) or a publisher whose
//! sequence began again (a restart between two health checks) empties the block index and the
//! estimate at once, as does a restart read from the replica's `/metrics`
//! ([`crate::fleet::poll`]). Each stream's state is kept with a metric and one log line per
//! transition. `live`: every batch since the publisher's first was seen, gaps healed through
//! the replay socket. `partial`: joined after the publisher's first batch, or a gap the replay
//! could not heal (its buffer is finite and there is no snapshot), until the next
//! `AllBlocksCleared` starts the replica clean; the block index then may lack blocks the
//! replica holds (never stored while this process listened), and after a gap it may hold blocks
//! whose removal was missed, so it is emptied at the gap and only what is stored after counts.
//! `gone`: the publisher cannot be reached.
//!
//! The endpoints are the conf's, or (`kv_events: server_info`) those the replica names in its
//! own `GET /server_info` ([`server_info`], which reads it and parses it), read again before
//! each (re)connect.
//!
//! Never on the request path: the sockets are read by background tasks that change a
//! replica's indexes under their own locks.

mod restart;
mod sequence;
pub mod server_info;
mod sockets;
mod state;

pub use sequence::{Sequence, Standing, Step, StreamState};

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use inferlb_kvevents::{decode_batch, parse_frames, Batch, Event};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use zeromq::{Socket, SocketRecv};

use crate::conf::KvEvents;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;
use crate::telemetry::metrics::METRICS;
use restart::{renewed, restarted};
use sockets::{reachable, replay, stamps, standing, SOCKET_TIMEOUT};
use state::{resync, transition};

/// How often a subscriber checks that its replica is still in the registry while idle.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Starts and ends the subscribers as replicas with KV event endpoints come and go.
pub struct KvEventWatcher {
    pub registry: Arc<Registry>,
}

#[async_trait]
impl BackgroundService for KvEventWatcher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut running: HashMap<Arc<str>, (Weak<Replica>, tokio::task::JoinHandle<()>)> =
            HashMap::new();
        let mut tick = tokio::time::interval(IDLE_CHECK);
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tick.tick() => {}
            }
            let fleet = self.registry.all();
            running.retain(|id, (weak, task)| {
                let same = fleet
                    .iter()
                    .any(|r| &r.id == id && Weak::ptr_eq(weak, &Arc::downgrade(r)));
                if !same {
                    task.abort();
                }
                same && !task.is_finished()
            });
            for r in fleet.iter() {
                let Some(ep) = r.kv_events.clone() else {
                    continue;
                };
                if running.contains_key(&r.id) {
                    continue;
                }
                let weak = Arc::downgrade(r);
                let task = tokio::spawn(subscribe(weak.clone(), ep));
                running.insert(r.id.clone(), (weak, task));
            }
        }
        for (_, (_, task)) in running {
            task.abort();
        }
    }
}

/// One replica's stream, for as long as the replica is in the registry.
///
/// The SUB socket of the `zeromq` crate neither reports nor heals a lost publisher, so each
/// second the stream is silent the publisher's port is probed (refused: `gone`, and
/// reconnected when it answers again) and its replay socket asked where it stands
/// ([`standing`]): one that began again is cleared at once, one whose batches this socket
/// missed is subscribed anew, and a stream silent for [`RESUBSCRIBE_AFTER`] is too; so is
/// one whose replica restarted by its `/metrics` (`renewed`), which the poll cleared.
/// Each (re)connect reads the replay socket from the publisher's first batch: a publisher
/// whose sequence went back restarted, so its cache is empty and the estimate is cleared;
/// otherwise the batches missed meanwhile are applied. What the first connect replays only
/// establishes where the stream stands: an old reset in the buffer clears nothing.
async fn subscribe(replica: Weak<Replica>, source: KvEvents) {
    let mut state = None;
    let mut seq = Sequence::default();
    let mut learnt = server_info::Learnt::default();
    // The restarts read from the replica's `/metrics` this stream followed (see `renewed`).
    let mut restarts = replica.upgrade().map_or(0, |r| r.restarts());
    while let Some(r) = replica.upgrade() {
        let id = r.id.clone();
        let ep = server_info::read(&r, &source, &mut learnt, SOCKET_TIMEOUT).await;
        drop(r);
        let Some(ep) = ep else {
            transition(&replica, &id, &mut state, StreamState::Gone);
            tokio::time::sleep(IDLE_CHECK).await;
            continue;
        };
        let mut sub = zeromq::SubSocket::new();
        let connected = tokio::time::timeout(SOCKET_TIMEOUT, sub.connect(&ep.publisher)).await;
        if !matches!(connected, Ok(Ok(()))) || sub.subscribe("").await.is_err() {
            transition(&replica, &id, &mut state, StreamState::Gone);
            tokio::time::sleep(IDLE_CHECK).await;
            continue;
        }
        if let Some(r) = replica.upgrade() {
            renewed(&r, &mut restarts, &mut seq);
            catch_up(&r, ep.replay.as_deref(), &mut seq).await;
            transition(&replica, &id, &mut state, seq.state());
            resync(&r, state, restarts);
        }
        // Since the last batch came; and where the stream stood when a probe last found its
        // publisher ahead of it.
        let mut quiet_since = Instant::now();
        let mut ahead_at = None;
        loop {
            let m = tokio::time::timeout(IDLE_CHECK, sub.recv()).await;
            let Some(r) = replica.upgrade() else { return };
            if renewed(&r, &mut restarts, &mut seq) {
                // Its publisher began again, on a stream this socket may never see.
                transition(&replica, &id, &mut state, StreamState::Partial);
                break;
            }
            let m = match m {
                Err(_) => {
                    if !reachable(&ep.publisher).await {
                        transition(&replica, &id, &mut state, StreamState::Gone);
                        break;
                    }
                    match standing(ep.replay.as_deref(), &seq).await {
                        Some(Standing::Restarted) => {
                            restarted(&r, &mut seq, "found while its stream was silent");
                            break;
                        }
                        Some(Standing::Lost) => {
                            log::info!("replica {id}: KV event stream lost; subscribing anew");
                            break;
                        }
                        // Batches this socket has not given: it may only lag; if it gave
                        // none by the next probe, it is dead.
                        Some(Standing::Ahead) if ahead_at == seq.next() => {
                            log::info!("replica {id}: KV event stream lost; subscribing anew");
                            break;
                        }
                        Some(Standing::Ahead) => ahead_at = seq.next(),
                        Some(Standing::Same) | None => {}
                    }
                    if quiet_since.elapsed() >= RESUBSCRIBE_AFTER {
                        break;
                    }
                    continue;
                }
                Ok(Err(e)) => {
                    log::warn!("replica {id}: KV event stream ended: {e}");
                    transition(&replica, &id, &mut state, StreamState::Gone);
                    break;
                }
                Ok(Ok(m)) => m,
            };
            quiet_since = Instant::now();
            let frames: Vec<Bytes> = m.into_vec();
            let parts: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
            let Ok((_, s, payload)) = parse_frames(&parts) else {
                continue;
            };
            let Ok(batch) = decode_batch(payload) else {
                METRICS
                    .kv_events
                    .with_label_values(&[&id, "undecodable"])
                    .inc();
                continue;
            };
            match seq.step(s) {
                // A publisher that restarted while subscribed begins again at 0: what it
                // held went with it.
                Step::Seen if s == 0 && seq.next().is_some_and(|n| n > 1) => {
                    restarted(&r, &mut seq, "its stream began again at 0");
                    if seq.step(s) != Step::Apply {
                        continue;
                    }
                }
                // Already applied (the replay overlapped the live stream).
                Step::Seen => continue,
                Step::Apply => {}
                Step::Gap { from } => {
                    if let Some(batches) = replay(ep.replay.as_deref(), from).await {
                        for (rs, b) in batches.into_iter().filter(|(rs, _)| *rs < s) {
                            if seq.step(rs) == Step::Apply {
                                apply(&r, &b, &mut seq, Replayed::New);
                                seq.applied(rs, b.ts);
                                count_batch(&r, "replayed");
                            }
                        }
                    }
                    if seq.step(s) != Step::Apply {
                        missed(&r, &mut seq);
                    }
                }
            }
            apply(&r, &batch, &mut seq, Replayed::New);
            seq.applied(s, batch.ts);
            count_batch(&r, "batches");
            transition(&replica, &id, &mut state, seq.state());
            resync(&r, state, restarts);
        }
        tokio::time::sleep(IDLE_CHECK).await;
    }
}

/// A stream silent this long is subscribed anew (see [`subscribe`]).
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(10);

/// After a (re)connect: what the replay socket holds, against what was applied. The newest
/// batch applied is asked for again: a publisher that no longer has it, or has another batch
/// under its number, restarted (its sequence begins at 0 again), so its cache is empty.
async fn catch_up(r: &Replica, endpoint: Option<&str>, seq: &mut Sequence) {
    let Some(next) = seq.next() else {
        // The first connect: the blocks the buffer holds build the block index, but an old
        // reset in it clears no estimate (what was sent since is in the estimate).
        if let Some(batches) = replay(endpoint, 0).await {
            // Whole if it holds the publisher's first batch, or from a reset in it on.
            seq.joined(batches.first().is_some_and(|(s, _)| *s == 0));
            for (s, b) in &batches {
                apply(r, b, seq, Replayed::Old);
                seq.applied(*s, b.ts);
                count_batch(r, "replayed");
            }
        }
        return;
    };
    let Some(batches) = replay(endpoint, (next - 1).max(0)).await else {
        // Batches may have been missed meanwhile, and cannot be asked for.
        missed(r, seq);
        return;
    };
    if seq.standing(&stamps(&batches)) == Some(Standing::Restarted) {
        restarted(r, seq, "found on reconnect");
        for (s, b) in replay(endpoint, 0).await.unwrap_or_default() {
            if seq.step(s) != Step::Seen {
                apply(r, &b, seq, Replayed::New);
                seq.applied(s, b.ts);
                count_batch(r, "replayed");
            }
        }
        // What it holds now was all announced since it started.
        seq.cleared();
        return;
    }
    for (s, b) in batches {
        match seq.step(s) {
            Step::Seen => {}
            Step::Apply => {
                apply(r, &b, seq, Replayed::New);
                seq.applied(s, b.ts);
                count_batch(r, "replayed");
            }
            Step::Gap { .. } => {
                missed(r, seq);
                apply(r, &b, seq, Replayed::New);
                seq.applied(s, b.ts);
                count_batch(r, "replayed");
            }
        }
    }
}

/// Whether a batch is news, or the buffer a first connect found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replayed {
    New,
    Old,
}

/// One batch's events on the replica's cache model.
fn apply(r: &Replica, batch: &Batch, seq: &mut Sequence, replayed: Replayed) {
    // Only a replica whose conf names its events has a subscriber, and a block index.
    let Some(blocks) = &r.cache.blocks else {
        return;
    };
    let (mut stored, mut untrusted, mut removed) = (0, 0, 0);
    for e in &batch.events {
        match e {
            Event::BlockStored(b) => {
                let a = blocks.stored(b);
                stored += a.stored;
                untrusted += a.untrusted;
            }
            Event::BlockRemoved(b) => removed += blocks.removed(b).removed,
            Event::AllBlocksCleared => {
                match replayed {
                    Replayed::New => {
                        r.cache.clear();
                        log::info!(
                            "replica {}: its cache was cleared (KV events); its estimate too",
                            r.id
                        );
                    }
                    Replayed::Old => blocks.clear(),
                }
                seq.cleared();
                METRICS
                    .kv_events
                    .with_label_values(&[&r.id, "cleared"])
                    .inc();
            }
        }
    }
    for (kind, n) in [
        ("stored", stored),
        ("untrusted", untrusted),
        ("removed", removed),
    ] {
        if n > 0 {
            METRICS
                .kv_events
                .with_label_values(&[&r.id, kind])
                .inc_by(n);
        }
    }
    METRICS
        .kv_blocks
        .with_label_values(&[&r.id])
        .set(i64::try_from(blocks.size().0).unwrap_or(i64::MAX));
}

/// A batch applied, as it came: `batches` from the stream, `replayed` from the replay socket.
fn count_batch(r: &Replica, how: &str) {
    METRICS.kv_events.with_label_values(&[&r.id, how]).inc();
}

/// Batches were missed and cannot be had: removals among them may be unknown, so the block
/// index forgets all it held, and counts again from what is stored next.
fn missed(r: &Replica, seq: &mut Sequence) {
    seq.broken();
    if let Some(b) = &r.cache.blocks {
        b.clear();
    }
}
