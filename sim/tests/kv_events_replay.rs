//! The simulator's KV event sockets, read by a real ZMQ client (the `zeromq` crate's SUB and
//! DEALER sockets): a replay from sequence 0 returns the batches sent before anyone subscribed,
//! then the end marker; the stored blocks carry the token ids the render endpoint gives; a
//! prefix-cache reset arrives live as AllBlocksCleared, under the configured topic.

use std::time::Duration;

use bytes::Bytes;
use inferlb_harness::{free_port, Sim};
use inferlb_kvevents::{decode_batch, parse_frames, replay_request, Event, END_SEQ};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn frames(m: &ZmqMessage) -> Vec<Vec<u8>> {
    m.iter().map(|b| b.to_vec()).collect()
}

#[tokio::test]
async fn replay_live_and_render_agree() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (ev, replay) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    let sim = Sim::start(
        dir.path(),
        "a",
        &["--block-tokens", "16", "--speed", "10", "--kv-events", &ev]
            .into_iter()
            .chain(["--kv-events-replay", &replay, "--kv-events-topic", "kv"])
            .collect::<Vec<_>>(),
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("client");
    let body = json!({"model": "sim-model", "max_tokens": 2,
        "messages": [{"role": "user", "content": "tell me about caches ".repeat(20)}]});
    let r = http
        .post(sim.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("chat");
    assert_eq!(r.status(), 200);
    let rendered: Value = http
        .post(sim.url("/v1/chat/completions/render"))
        .json(&body)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .expect("render")
        .json()
        .await
        .expect("JSON");
    let tokens: Vec<u32> = rendered["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect();

    // Replay from 0: the startup clear, then the prompt's blocks, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay).await.expect("replay connect");
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&replay_request(0)),
    ])
    .expect("a message");
    dealer.send(req).await.expect("replay request");
    let mut got = Vec::new();
    for _ in 0..10 {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("a replay answer in time")
            .expect("a message");
        let f = frames(&m);
        let parts: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        let (topic, seq, payload) = parse_frames(&parts).expect("replay frames");
        if seq == END_SEQ {
            break;
        }
        assert_eq!(topic, b"kv");
        got.push((seq, decode_batch(payload).expect("a batch")));
    }
    // 0: the startup clear; 1: the prompt's blocks at prefill; 2: the conversation with its
    // reply, cached when the answer is done (its new blocks chained to the prompt's).
    let seqs: Vec<i64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![0, 1, 2]);
    assert_eq!(got[0].1.events, vec![Event::AllBlocksCleared]);
    let Event::BlockStored(stored) = &got[1].1.events[0] else {
        panic!("a BlockStored: {:?}", got[1].1);
    };
    let full = tokens.len() / 16 * 16;
    assert_eq!(
        (stored.block_size, stored.block_hashes.len()),
        (16, full / 16)
    );
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(
        stored.token_ids,
        tokens[..full],
        "the events' tokens are the render's"
    );
    assert_eq!(got[1].1.data_parallel_rank, Some(0));
    let Event::BlockStored(reply) = &got[2].1.events[0] else {
        panic!("a BlockStored: {:?}", got[2].1);
    };
    assert_eq!(reply.parent_block_hash.as_ref(), stored.block_hashes.last());

    // Live: a reset arrives as AllBlocksCleared, the next seq, under the topic.
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&ev).await.expect("sub connect");
    sub.subscribe("kv").await.expect("subscribe");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = http
        .post(sim.url("/reset_prefix_cache"))
        .send()
        .await
        .expect("reset");
    assert_eq!(r.status(), 200);
    let m = tokio::time::timeout(Duration::from_secs(5), sub.recv())
        .await
        .expect("a live batch in time")
        .expect("a message");
    let f = frames(&m);
    let parts: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
    let (topic, seq, payload) = parse_frames(&parts).expect("live frames");
    assert_eq!((topic, seq), (&b"kv"[..], 3));
    assert_eq!(
        decode_batch(payload).expect("a batch").events,
        vec![Event::AllBlocksCleared]
    );
}
