//! vLLM's KV event publisher for the simulator: the engine hands each step's events to a
//! [`Sink`] (never blocking: a full channel drops the batch and counts it), and [`run`] sends
//! them as vLLM does, on a ZMQ PUB socket, keeping the last batches for the replay ROUTER socket.
//! The wire format is `inferlb-kvevents`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use inferlb_kvevents::{encode_batch, frames, parse_replay_request, replay_end, Batch, Event};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches queued for the publisher before the engine starts dropping them.
const QUEUE: usize = 4096;

/// The engine's side: one call per step.
pub struct Sink {
    tx: mpsc::Sender<Vec<Event>>,
    pub dropped: AtomicU64,
    pub sent: AtomicU64,
}

impl Sink {
    pub fn new() -> (Sink, mpsc::Receiver<Vec<Event>>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let sink = Sink {
            tx,
            dropped: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        };
        (sink, rx)
    }

    pub fn send(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        match self.tx.try_send(events) {
            Ok(()) => self.sent.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.dropped.fetch_add(1, Ordering::Relaxed),
        };
    }
}

pub struct PublisherConf {
    /// `tcp://host:port` for the PUB socket (bound, as vLLM binds a `*` endpoint).
    pub endpoint: String,
    /// The replay ROUTER socket's endpoint, if any.
    pub replay: Option<String>,
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer: usize,
    /// Sequence numbers kept for replay but not published (a subscriber's gap, for tests).
    pub withhold: Vec<u64>,
}

/// Binds the sockets (so the caller knows they are up), then publishes until the engine's
/// side is dropped.
pub async fn start(
    conf: PublisherConf,
    mut rx: mpsc::Receiver<Vec<Event>>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let mut pub_sock = zeromq::PubSocket::new();
    pub_sock
        .bind(&conf.endpoint)
        .await
        .map_err(|e| format!("--kv-events {}: {e}", conf.endpoint))?;
    let mut replay = match &conf.replay {
        Some(ep) => {
            let mut s = zeromq::RouterSocket::new();
            s.bind(ep)
                .await
                .map_err(|e| format!("--kv-events-replay {ep}: {e}"))?;
            Some(s)
        }
        None => None,
    };
    Ok(tokio::spawn(async move {
        let mut seq: u64 = 0;
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(conf.buffer.min(1024));
        loop {
            tokio::select! {
                events = rx.recv() => {
                    let Some(events) = events else { return };
                    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                    let batch = Batch { ts, events, data_parallel_rank: Some(0), skipped: 0 };
                    let payload = Bytes::from(encode_batch(&batch));
                    let [topic, seq_bytes] = head(&conf.topic, seq);
                    let msg = ZmqMessage::try_from(vec![topic, seq_bytes, payload.clone()]);
                    if let (Ok(msg), false) = (msg, conf.withhold.contains(&seq)) {
                        // A subscriber whose queue is full misses it, as with vLLM's high-water mark.
                        let _ = pub_sock.send(msg).await;
                    }
                    if buffer.len() == conf.buffer.max(1) {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                    seq += 1;
                }
                req = next_request(&mut replay) => {
                    let (Some(sock), Ok(req)) = (replay.as_mut(), req) else { continue };
                    let frames: Vec<&[u8]> = req.iter().map(|b| b.as_ref()).collect();
                    let Some(start) = parse_replay_request(&frames) else {
                        log::warn!("kv events: a replay request of {} frames, not [identity, empty, seq]", frames.len());
                        continue;
                    };
                    let id = req.get(0).cloned().unwrap_or_default();
                    for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                        let [topic, seq_bytes] = head(&conf.topic, *s);
                        let reply = vec![id.clone(), Bytes::new(), topic, seq_bytes, payload.clone()];
                        if let Ok(m) = ZmqMessage::try_from(reply) {
                            let _ = sock.send(m).await;
                        }
                    }
                    let mut end: Vec<Bytes> = vec![id];
                    end.extend(replay_end().into_iter().map(Bytes::from));
                    if let Ok(m) = ZmqMessage::try_from(end) {
                        let _ = sock.send(m).await;
                    }
                }
            }
        }
    }))
}

/// A batch's topic and sequence frames (its payload is shared with the replay buffer).
fn head(topic: &str, seq: u64) -> [Bytes; 2] {
    let [t, s, _] = frames(topic, seq, Vec::new());
    [Bytes::from(t), Bytes::from(s)]
}

async fn next_request(replay: &mut Option<zeromq::RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}
