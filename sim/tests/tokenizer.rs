//! `inferlb-sim --tokenizer DIR`, the real binary with a tokenizer trained at test time
//! (`inferlb_tokens::fixture`): its render endpoints, its usage and its KV events carry the ids
//! `inferlb_tokens` computes for the same bodies, as the balancer computes them; a directory
//! that is not a tokenizer stops it at start.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use inferlb_harness::{free_port, Sim};
use inferlb_kvevents::{decode_batch, parse_frames, replay_request, Event, END_SEQ};
use inferlb_tokens::{fixture, ModelTokens};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Small blocks, so the fixture's short prompts span several.
const BLOCK: usize = 4;

/// A tokenizer directory under `dir`, and the same tokenizer loaded here.
fn tokenizer(dir: &Path) -> (String, ModelTokens) {
    let tok = dir.join("tokenizer");
    std::fs::create_dir_all(&tok).expect("tokenizer dir");
    fixture::write_dir(&tok, fixture::CHATML_TOOLS).expect("fixture tokenizer");
    let t = ModelTokens::from_dir(&tok).expect("the fixture loads");
    (tok.to_str().expect("a UTF-8 path").to_owned(), t)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("client")
}

/// A chat body with a system prompt, a tool and two turns: the template renders all of them.
fn chat_body() -> Value {
    json!({"model": "sim-model", "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather like today in Paris?"},
            {"role": "assistant", "content": "The weather in Paris is sunny."},
            {"role": "user", "content": "And the lazy dog? ".repeat(6)},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]})
}

async fn post(http: &reqwest::Client, url: String, body: &Value) -> Value {
    http.post(url)
        .json(body)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .expect("a 200")
        .json()
        .await
        .expect("JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token_ids")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("an id")).expect("a u32"))
        .collect()
}

fn whole_blocks(n: usize) -> usize {
    n / BLOCK * BLOCK
}

#[tokio::test]
async fn the_render_endpoints_answer_the_tokenizers_ids() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (tok, t) = tokenizer(dir.path());
    let sim = Sim::start(dir.path(), "r", &["--tokenizer", &tok]);
    let http = client();

    let body = chat_body();
    let rendered = post(&http, sim.url("/v1/chat/completions/render"), &body).await;
    let want = t
        .chat_ids(body.to_string().as_bytes())
        .expect("the body renders")
        .ids
        .to_vec();
    assert!(!want.is_empty());
    assert_eq!(
        ids(&rendered["token_ids"]),
        want,
        "chat: the template's ids"
    );

    let text = "The quick brown fox jumps over the lazy dog.";
    let rendered = post(
        &http,
        sim.url("/v1/completions/render"),
        &json!({"model": "sim-model", "prompt": text}),
    )
    .await;
    let want = t.prompt_ids(text).expect("the text tokenizes");
    assert_eq!(
        ids(&rendered[0]["token_ids"]),
        want,
        "completions: the text's ids"
    );

    let given = [7u32, 1, 599, 42];
    let rendered = post(
        &http,
        sim.url("/v1/completions/render"),
        &json!({"model": "sim-model", "prompt": given}),
    )
    .await;
    assert_eq!(
        ids(&rendered[0]["token_ids"]),
        given,
        "token ids pass as they are"
    );

    // A body that is not a chat is the client's error.
    let r = http
        .post(sim.url("/v1/chat/completions/render"))
        .json(&json!({"model": "sim-model", "messages": "not a list"}))
        .send()
        .await
        .expect("render");
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn usage_counts_the_ids_and_a_repeat_hits_their_whole_blocks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (tok, t) = tokenizer(dir.path());
    let block = BLOCK.to_string();
    let sim = Sim::start(
        dir.path(),
        "u",
        &[
            "--tokenizer",
            &tok,
            "--block-tokens",
            &block,
            "--speed",
            "10",
        ],
    );
    let http = client();
    let body = chat_body();
    let n = t
        .chat_ids(body.to_string().as_bytes())
        .expect("the body renders")
        .ids
        .len();

    let first = post(&http, sim.url("/v1/chat/completions"), &body).await;
    assert_eq!(first["usage"]["prompt_tokens"], json!(n));
    assert_eq!(
        first["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(0)
    );
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .expect("a reply");
    assert!(!reply.is_empty(), "the reply is text");

    let again = post(&http, sim.url("/v1/chat/completions"), &body).await;
    assert_eq!(again["usage"]["prompt_tokens"], json!(n));
    // The prompt's leading whole blocks; its last token is always computed.
    let cached = whole_blocks(n).min(n - 1);
    assert!(cached > 0);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(cached)
    );
    assert_eq!(again["choices"][0]["message"]["content"], json!(reply));

    // A completions prompt counts its ids too.
    let text = "A balancer routes requests to replicas.";
    let done = post(
        &http,
        sim.url("/v1/completions"),
        &json!({"model": "sim-model", "prompt": text, "max_tokens": 2}),
    )
    .await;
    let want = t.prompt_ids(text).expect("the text tokenizes").len();
    assert_eq!(done["usage"]["prompt_tokens"], json!(want));
}

#[tokio::test]
async fn the_stored_blocks_carry_the_ids() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (tok, t) = tokenizer(dir.path());
    let (ev, replay) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    let block = BLOCK.to_string();
    let sim = Sim::start(
        dir.path(),
        "e",
        &[
            "--tokenizer",
            &tok,
            "--block-tokens",
            &block,
            "--speed",
            "10",
        ]
        .into_iter()
        .chain(["--kv-events", &ev, "--kv-events-replay", &replay])
        .collect::<Vec<_>>(),
    );
    let http = client();
    let body = chat_body();
    let prompt = t
        .chat_ids(body.to_string().as_bytes())
        .expect("the body renders")
        .ids
        .to_vec();
    let answer = post(&http, sim.url("/v1/chat/completions"), &body).await;
    let reply = answer["choices"][0]["message"]["content"]
        .as_str()
        .expect("a reply");

    // Every batch so far, from the replay socket: no subscriber can miss them.
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
        let f: Vec<Vec<u8>> = m.iter().map(|b| b.to_vec()).collect();
        let parts: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        let (_, seq, payload) = parse_frames(&parts).expect("replay frames");
        if seq == END_SEQ {
            break;
        }
        got.push(decode_batch(payload).expect("a batch").events);
    }
    // The startup clear, the prompt's blocks at prefill, the conversation with its reply.
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[0], vec![Event::AllBlocksCleared]);
    let [Event::BlockStored(stored)] = &got[1][..] else {
        panic!("one BlockStored: {:?}", got[1]);
    };
    let full = whole_blocks(prompt.len());
    assert_eq!(stored.block_size as usize, BLOCK);
    assert_eq!(stored.block_hashes.len(), full / BLOCK);
    assert_eq!(
        stored.token_ids,
        prompt[..full],
        "the prompt's whole blocks"
    );

    // The reply joins the cache as its text tokenized, after the prompt's ids.
    let mut all = prompt.clone();
    all.extend(
        t.tokenizer()
            .encode(reply, false)
            .expect("the reply tokenizes")
            .get_ids(),
    );
    let [Event::BlockStored(turn)] = &got[2][..] else {
        panic!("one BlockStored: {:?}", got[2]);
    };
    assert_eq!(turn.parent_block_hash.as_ref(), stored.block_hashes.last());
    assert_eq!(turn.token_ids, all[full..whole_blocks(all.len())]);
}

#[test]
fn a_directory_without_a_tokenizer_stops_it_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(inferlb_harness::bin("inferlb-sim"))
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--tokenizer")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn inferlb-sim");
    let limit = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("inferlb-sim kept running with a bad --tokenizer");
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("stderr");
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("--tokenizer") && err.contains("tokenizer.json"),
        "names the flag and the file: {err}"
    );
}
