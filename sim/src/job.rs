//! What every API shares: a request as the engine sees it (`Job`), its P/D leg, the gate and
//! the fault switch, prefill and finish, the streamed decode and its SSE framing.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::engine::{self, token_text};
use crate::pd::Handover;
use crate::{error, Fault, Sim};

/// The most tokens one reply has, whatever the request asks for.
pub(crate) const MAX_TOKENS: usize = 100_000;

/// A parsed completion request, chat or not.
pub(crate) struct Job {
    pub(crate) chat: bool,
    pub(crate) model: String,
    pub(crate) prompt: String,
    pub(crate) max_tokens: usize,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) seed: u64,
    /// The tokens to generate when they are not the seed's words (a function call's
    /// arguments); `max_tokens` is then their count.
    pub(crate) script: Option<Vec<String>>,
    /// With `--tokenizer`: the prompt's token ids, 4 bytes each (`engine::token_bytes`).
    /// `prompt` stays the simulator's rendering, which seeds the reply.
    pub(crate) ids: Option<Vec<u8>>,
}

impl Job {
    /// The prompt as the engine and the KV handover take it: the tokenizer's ids when there
    /// are, else the rendered text (`engine::token_ids` reads either as ids).
    pub(crate) fn engine_prompt(&self) -> &[u8] {
        self.ids.as_deref().unwrap_or(self.prompt.as_bytes())
    }
}

/// A request's part in a KV handover.
pub(crate) struct Leg {
    pub(crate) handover: Handover,
    /// The request id (X-Request-Id when given, as vLLM takes it): a vLLM prefill's lease is
    /// held under it.
    pub(crate) request_id: String,
}

impl Leg {
    /// What the request body `obj` asks of this replica's connector. `vllm_only` is for the
    /// APIs only vLLM hands over (Responses, Messages): SGLang's fields are ignored there, and
    /// counted as ignored.
    pub(crate) fn of(
        sim: &Sim,
        headers: &axum::http::HeaderMap,
        obj: &serde_json::Map<String, Value>,
        vllm_only: bool,
    ) -> Leg {
        let handover = if vllm_only {
            sim.pd.classify_vllm(obj)
        } else {
            sim.pd.classify(obj)
        };
        let request_id = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_else(|| {
                let n = sim.next_request.fetch_add(1, Ordering::Relaxed);
                format!("{}-{n}", sim.pd.conf.engine_id)
            });
        Leg {
            handover,
            request_id,
        }
    }

    /// Fits `job` to the leg: a vLLM prefill leg answers whole (the router asks for no
    /// stream), with its params; an SGLang prefill server computes the prompt and its first
    /// token only.
    pub(crate) fn shape(&self, job: &mut Job) {
        match self.handover {
            Handover::VllmPrefill => job.stream = false,
            Handover::SglangPrefill { .. } => job.max_tokens = job.max_tokens.min(1),
            _ => {}
        }
    }
}

/// Applies the switched-on fault to a request that is about to run: `Err` is the error to
/// answer (each API in its own shape), `Ok` the token before which a stream is cut, if it is.
/// Counts the request when it runs. A hang never returns; a reset drops the connection.
pub(crate) async fn gate(sim: &Sim) -> Result<Option<usize>, (StatusCode, &'static str)> {
    let fault = sim.take_fault();
    match fault {
        Fault::Hang => std::future::pending::<()>().await,
        Fault::Reset => {
            // Dropping the connection task: the client sees the connection close with no response.
            std::panic::panic_any(ResetFault)
        }
        Fault::Error500 => {
            return Err((StatusCode::INTERNAL_SERVER_ERROR, "simulated engine error"))
        }
        Fault::Error503 => return Err((StatusCode::SERVICE_UNAVAILABLE, "simulated overload")),
        _ => {}
    }
    sim.engine.counters.requests.fetch_add(1, Ordering::Relaxed);
    Ok(match fault {
        Fault::CutStream => Some(3),
        Fault::CutBeforeToken => Some(0),
        _ => None,
    })
}

/// The headers every answer to a request that ran carries.
pub(crate) fn tag(sim: &Sim, body: &[u8], mut resp: Response) -> Response {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&sim.args.id) {
        h.insert("x-sim-replica", v);
    }
    h.insert("x-sim-dp-rank", HeaderValue::from(sim.rank));
    // Lets a test check that the body arrived intact, whatever the balancer did with it.
    h.insert("x-sim-body-bytes", HeaderValue::from(body.len()));
    if let Ok(v) = HeaderValue::from_str(&format!("{:016x}", xxhash_rust::xxh3::xxh3_64(body))) {
        h.insert("x-sim-body-hash", v);
    }
    resp
}

/// Marks the panic a `Reset` fault uses to drop a connection (not a bug).
pub(crate) struct ResetFault;

pub(crate) struct Usage {
    pub(crate) prompt: usize,
    pub(crate) cached: usize,
}

/// Prefill: the engine admits the request, finds its cached prefix and pays for the rest;
/// returns when the first token is out. The request leaves the engine when the `Seq` drops.
pub(crate) async fn prefill<'a>(sim: &'a Sim, job: &Job) -> (engine::Seq<'a>, Usage) {
    let (seq, prompt, cached) = sim
        .engine
        .prefill(job.engine_prompt(), job.max_tokens)
        .await;
    (seq, Usage { prompt, cached })
}

/// After generation the reply enters the cache, as the next turn's history will contain it:
/// with a tokenizer, the prompt's ids and the reply's text tokenized.
pub(crate) fn finish(sim: &Sim, job: &Job, reply: &str) {
    if let (Some(ids), Some(t)) = (&job.ids, &sim.tokens) {
        let reply_ids = t
            .tokenizer()
            .encode(reply, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default();
        let mut all = ids.clone();
        all.extend(engine::token_bytes(&reply_ids));
        sim.engine.insert(&all);
        return;
    }
    let mut text = job.prompt.clone();
    text.push_str(reply);
    if job.chat {
        text.push('\n');
    }
    sim.engine.insert(text.as_bytes());
}

/// The error a decode answers when its KV could not be loaded: vLLM's, for a request that
/// ends with finish_reason `error` (kv_load_failure_policy `fail`).
pub(crate) fn kv_load_failed() -> Value {
    json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}})
}

/// The prefill leg's part once its prompt is computed: an SGLang room is ready; a vLLM
/// prefill's blocks are leased and its answer's `kv_transfer_params` returned.
pub(crate) fn prefilled(sim: &Sim, job: &Job, leg: &Leg) -> Option<Value> {
    match leg.handover {
        Handover::SglangPrefill { room } => {
            sim.pd.sglang_prefilled(room, job.engine_prompt());
            None
        }
        Handover::VllmPrefill => Some(sim.pd.vllm_prefilled(&leg.request_id, job.engine_prompt())),
        _ => None,
    }
}

pub(crate) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A server-sent event with a name, as the Responses and Messages APIs send them.
pub(crate) fn named_sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The sending half of a streamed body.
pub(crate) type Tx = tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>;

/// A streamed answer whose body `tx` feeds.
pub(crate) fn sse_response() -> (Tx, Response) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let resp = Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed"));
    (tx, resp)
}

/// How decoding a reply ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decoded {
    /// Every token was generated.
    Done,
    /// `cancel` was set: the reply so far stands.
    Cancelled,
    /// The `cut_stream` fault cut the connection.
    Cut,
    /// The client went away.
    Gone,
}

/// Generates `job.max_tokens` tokens into `reply` after the prefill: the first at once, the
/// rest as the engine's scheduler lets `seq` have them. When streaming, `event` turns each
/// token into the bytes sent. Returns how it ended and how many tokens were generated.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn decode(
    sim: &Sim,
    job: &Job,
    seq: &mut engine::Seq<'_>,
    cut_after: Option<usize>,
    cancel: Option<&std::sync::atomic::AtomicBool>,
    tx: Option<&Tx>,
    mut event: impl FnMut(&str) -> Bytes,
    reply: &mut String,
) -> (Decoded, usize) {
    for i in 0..job.max_tokens {
        seq.next_token().await;
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return (Decoded::Cancelled, i);
        }
        if let (Some(tx), true) = (tx, cut_after == Some(i)) {
            cut(tx, "simulated stream cut").await;
            return (Decoded::Cut, i);
        }
        let t = match &job.script {
            Some(s) => s.get(i).map_or("", String::as_str),
            None => token_text(job.seed, i),
        };
        reply.push_str(t);
        sim.engine
            .counters
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
        if let Some(tx) = tx {
            if tx.send(Ok(event(t))).await.is_err() {
                return (Decoded::Gone, i + 1);
            }
        }
    }
    (Decoded::Done, job.max_tokens)
}

/// Breaks a streamed body after what was sent: the connection ends without the body's end,
/// as a server's does when its stream raises after the first bytes.
pub(crate) async fn cut(tx: &Tx, why: &str) {
    // What was sent must reach the client first: the server drops whatever it has not
    // written yet when the body fails, and at high speed it would still be queued.
    let limit = Instant::now() + Duration::from_millis(200);
    while tx.capacity() < tx.max_capacity() && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let _ = tx.send(Err(std::io::Error::other(why.to_owned()))).await;
}

/// The prompt's seed: the same prompt gets the same reply, whichever API it came through.
pub(crate) fn seed_of(prompt: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(prompt.as_bytes())
}
