//! A KV event publisher's sockets asked directly, apart from its stream: its replay socket
//! (the batches from a sequence number on, and what they say of where the publisher stands
//! against what was applied) and whether its port listens.

use std::time::Duration;

use bytes::Bytes;
use inferlb_kvevents::{decode_batch, parse_frames, replay_request, Batch, END_SEQ};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::sequence::{Sequence, Standing};

/// How long a connect or one replay answer may take.
pub(super) const SOCKET_TIMEOUT: Duration = Duration::from_secs(2);
/// The most batches one replay is read for (vLLM's buffer holds 10,000 by default).
const MAX_REPLAY: usize = 20_000;

/// Where a silent stream's publisher stands, asked of its replay socket from the last batch
/// applied on: the SUB socket does not notice a publisher that went away (see `subscribe`),
/// so without this a replica restarted between two reads would keep its old cache here until
/// `RESUBSCRIBE_AFTER`. `None` without a replay socket, an answer, or a batch applied.
pub(super) async fn standing(endpoint: Option<&str>, seq: &Sequence) -> Option<Standing> {
    let from = (seq.next()? - 1).max(0);
    let batches = replay(endpoint, from).await?;
    seq.standing(&stamps(&batches))
}

/// Each batch's (sequence number, timestamp).
pub(super) fn stamps(batches: &[(i64, Batch)]) -> Vec<(i64, f64)> {
    batches.iter().map(|(s, b)| (*s, b.ts)).collect()
}

/// Whether something listens on a `tcp://host:port` endpoint.
pub(super) async fn reachable(endpoint: &str) -> bool {
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return false;
    };
    matches!(
        tokio::time::timeout(SOCKET_TIMEOUT, tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// The batches from `from` on, as the replay socket has them; `None` when there is no replay
/// socket or it does not answer in time.
pub(super) async fn replay(endpoint: Option<&str>, from: i64) -> Option<Vec<(i64, Batch)>> {
    // The `zeromq` crate's DEALER panics (`todo!`) on a connection that fails mid-read: in a
    // task of its own, that is a replay that gave nothing, not a subscriber gone.
    let endpoint = endpoint?.to_string();
    tokio::spawn(replay_from(endpoint, from)).await.ok()?
}

async fn replay_from(endpoint: String, from: i64) -> Option<Vec<(i64, Batch)>> {
    let mut dealer = zeromq::DealerSocket::new();
    tokio::time::timeout(SOCKET_TIMEOUT, dealer.connect(&endpoint))
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
