//! The replicas' own word on their caches, as vLLM publishes it: one subscriber per replica
//! whose conf names its KV event endpoints (`kv_events`, `kv_events_replay`), reading
//! `BlockStored`, `BlockRemoved` and `AllBlocksCleared` batches (ZMQ frames, msgpack;
//! decoded by `inferlb_kvevents`).
//!
//! What it does with them today: an `AllBlocksCleared` (a cache reset, or a restart between
//! two health checks) empties the replica's estimate at once, and each stream's state is kept
//! with a metric and one log line per transition. `live`: every batch since the publisher's
//! first was seen, gaps healed through the replay socket. `partial`: a gap the replay could not
//! heal (its buffer is finite and there is no snapshot), until the next `AllBlocksCleared`
//! starts the replica clean. `gone`: the publisher cannot be reached. The exact per-block
//! index the cost policy will read while a stream is live needs the prompt's token ids, which
//! need a tokenizer in the balancer; until then the estimate answers every lookup.
//!
//! Never on the request path: the sockets are read by background tasks that only clear an
//! index under its own lock.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use inferlb_kvevents::{decode_batch, parse_frames, replay_request, Batch, Event, END_SEQ};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::conf::KvEvents;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;
use crate::telemetry::metrics::METRICS;

/// How long a connect or one replay answer may take.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(2);
/// The most batches one replay is read for (vLLM's buffer holds 10,000 by default).
const MAX_REPLAY: usize = 20_000;
/// How often a subscriber checks that its replica is still in the registry while idle.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// A stream's state; the gauge `inferlb_kv_events_state` reads 0, 1, 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    Gone = 0,
    Partial = 1,
    Live = 2,
}

impl StreamState {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamState::Gone => "gone",
            StreamState::Partial => "partial",
            StreamState::Live => "live",
        }
    }
}

/// What a sequence of batches says of a stream, without sockets: the next sequence number
/// expected, and whether every batch since the publisher's first was seen. Pure.
#[derive(Debug, Default)]
pub struct Sequence {
    next: Option<i64>,
    complete: bool,
}

/// What to do with a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The expected one (or the first): apply it.
    Apply,
    /// Already seen (a replay overlapping the live stream): skip it.
    Seen,
    /// Batches `from..seq` were missed: replay them, then apply this one.
    Gap { from: i64 },
}

impl Sequence {
    /// A fresh stream, complete when its first batch is the publisher's first (sequence 0).
    pub fn step(&mut self, seq: i64) -> Step {
        match self.next {
            None => {
                self.complete = seq == 0;
                Step::Apply
            }
            Some(n) if seq < n => Step::Seen,
            Some(n) if seq == n => Step::Apply,
            Some(n) => Step::Gap { from: n },
        }
    }

    /// `seq` was applied.
    pub fn applied(&mut self, seq: i64) {
        self.next = Some(seq + 1);
    }

    /// A gap was not healed: what came before is not known whole.
    pub fn broken(&mut self) {
        self.complete = false;
    }

    /// The cache was cleared: nothing before matters.
    pub fn cleared(&mut self) {
        self.complete = true;
    }

    pub fn state(&self) -> StreamState {
        if self.complete {
            StreamState::Live
        } else {
            StreamState::Partial
        }
    }
}

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
async fn subscribe(replica: Weak<Replica>, ep: KvEvents) {
    let mut state = None;
    while let Some(r) = replica.upgrade() {
        let id = r.id.clone();
        drop(r);
        let mut sub = zeromq::SubSocket::new();
        let connected = tokio::time::timeout(SOCKET_TIMEOUT, sub.connect(&ep.publisher)).await;
        if !matches!(connected, Ok(Ok(()))) || sub.subscribe("").await.is_err() {
            transition(&id, &mut state, StreamState::Gone);
            tokio::time::sleep(IDLE_CHECK).await;
            continue;
        }
        let mut seq = Sequence::default();
        // What came before subscribing: the replay socket's buffer, from the first batch.
        if let Some(r) = replica.upgrade() {
            if let Some(batches) = replay(ep.replay.as_deref(), 0).await {
                for (s, b) in batches {
                    if seq.step(s) == Step::Apply {
                        apply(&r, &b, &mut seq);
                        seq.applied(s);
                    }
                }
            }
            transition(&id, &mut state, seq.state());
        }
        loop {
            let m = tokio::time::timeout(IDLE_CHECK, sub.recv()).await;
            let Some(r) = replica.upgrade() else { return };
            let m = match m {
                Err(_) => continue,
                Ok(Err(e)) => {
                    log::warn!("replica {id}: KV event stream ended: {e}");
                    transition(&id, &mut state, StreamState::Gone);
                    break;
                }
                Ok(Ok(m)) => m,
            };
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
                Step::Seen => continue,
                Step::Apply => {}
                Step::Gap { from } => {
                    if let Some(batches) = replay(ep.replay.as_deref(), from).await {
                        for (rs, b) in batches.into_iter().filter(|(rs, _)| *rs < s) {
                            if seq.step(rs) == Step::Apply {
                                apply(&r, &b, &mut seq);
                                seq.applied(rs);
                            }
                        }
                    }
                    if seq.step(s) != Step::Apply {
                        seq.broken();
                    }
                }
            }
            apply(&r, &batch, &mut seq);
            seq.applied(s);
            transition(&id, &mut state, seq.state());
        }
        tokio::time::sleep(IDLE_CHECK).await;
    }
}

/// One batch's events on the replica's cache model.
fn apply(r: &Replica, batch: &Batch, seq: &mut Sequence) {
    for e in &batch.events {
        let kind = match e {
            Event::BlockStored(_) => "stored",
            Event::BlockRemoved(_) => "removed",
            Event::AllBlocksCleared => {
                r.cache.index.clear();
                seq.cleared();
                log::info!(
                    "replica {}: its cache was cleared (KV events); its estimate too",
                    r.id
                );
                "cleared"
            }
        };
        METRICS.kv_events.with_label_values(&[&r.id, kind]).inc();
    }
}

/// The batches from `from` on, as the replay socket has them; `None` when there is no replay
/// socket or it does not answer in time.
async fn replay(endpoint: Option<&str>, from: i64) -> Option<Vec<(i64, Batch)>> {
    let endpoint = endpoint?;
    let mut dealer = zeromq::DealerSocket::new();
    tokio::time::timeout(SOCKET_TIMEOUT, dealer.connect(endpoint))
        .await
        .ok()?
        .ok()?;
    let start = u64::try_from(from).ok()?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&replay_request(start)),
    ])
    .ok()?;
    dealer.send(request).await.ok()?;
    let mut got = Vec::new();
    for _ in 0..MAX_REPLAY {
        let m = tokio::time::timeout(SOCKET_TIMEOUT, dealer.recv())
            .await
            .ok()?
            .ok()?;
        let frames: Vec<Bytes> = m.into_vec();
        let parts: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
        let (_, seq, payload) = parse_frames(&parts).ok()?;
        if seq == END_SEQ {
            return Some(got);
        }
        if let Ok(b) = decode_batch(payload) {
            got.push((seq, b));
        }
    }
    Some(got)
}

/// Logs and counts a change of a stream's state, once.
fn transition(id: &str, state: &mut Option<StreamState>, to: StreamState) {
    if *state == Some(to) {
        return;
    }
    let from = state.map_or("none", StreamState::as_str);
    match to {
        StreamState::Live => log::info!("replica {id}: KV event stream live (was {from})"),
        _ => log::warn!(
            "replica {id}: KV event stream {} (was {from}): its prefixes come from the estimate",
            to.as_str()
        ),
    }
    METRICS
        .kv_events_state
        .with_label_values(&[id])
        .set(to as i64);
    *state = Some(to);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (sequence numbers seen, in order) → the steps and the final state
    #[test]
    fn a_stream_is_live_only_when_seen_whole() {
        let rows: &[(&[i64], &[Step], StreamState)] = &[
            (
                &[0, 1, 2],
                &[Step::Apply, Step::Apply, Step::Apply],
                StreamState::Live,
            ),
            // joined late, no replay: what came before is unknown
            (&[5, 6], &[Step::Apply, Step::Apply], StreamState::Partial),
            (
                &[0, 1, 1],
                &[Step::Apply, Step::Apply, Step::Seen],
                StreamState::Live,
            ),
            (
                &[0, 3],
                &[Step::Apply, Step::Gap { from: 1 }],
                StreamState::Live,
            ),
        ];
        for (seqs, want, state) in rows {
            let mut s = Sequence::default();
            let mut steps = vec![];
            for &q in seqs.iter() {
                let step = s.step(q);
                if step != Step::Seen {
                    s.applied(q);
                }
                steps.push(step);
            }
            assert_eq!(&steps, want, "{seqs:?}");
            assert_eq!(s.state(), *state, "{seqs:?}");
        }
        let mut s = Sequence::default();
        s.step(7);
        s.applied(7);
        assert_eq!(s.state(), StreamState::Partial);
        s.cleared();
        assert_eq!(s.state(), StreamState::Live, "a clear starts it clean");
        s.broken();
        assert_eq!(s.state(), StreamState::Partial, "an unhealed gap");
    }
}
