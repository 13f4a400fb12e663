//! inferlb-sim: one simulated vLLM replica, for developing and measuring inferlb without a GPU.
//!
//! Serves, with timing from `engine`:
//! - OpenAI chat `POST /v1/chat/completions` and `POST /v1/completions` (streamed with
//!   `data: [DONE]` and not), `GET /v1/models`;
//! - the OpenAI Responses API (`responses`): `POST /v1/responses` (streamed as named events),
//!   `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, with a bounded
//!   in-memory store for `previous_response_id` (an unknown id is a 404, as vLLM answers), or
//!   none (`--no-response-store`, vLLM's default), and function calls forced by `tool_choice`;
//! - the Anthropic Messages API (`messages`): `POST /v1/messages` (streamed as Anthropic's
//!   events and not) and `POST /v1/messages/count_tokens`, usage split as Anthropic reports it;
//! - `/health`, `/metrics` (vLLM's names and shapes: `vllm:num_requests_running` and
//!   `_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total` and `_hits_total`
//!   in tokens, ..., and `vllm:cache_config_info`), `/sim/stats` (the same, plus what the engine
//!   knows that a router estimates: requests decoding, uncached prompt tokens still to prefill),
//!   `/sim/echo`, `/sim/received` (the last bodies posted to `/v1/*`), and a fault switch:
//!   `POST /sim/fault {"fault": "...", "seconds": s, "count": n}` (see `Fault`), which applies
//!   to every API alike, errors in each API's own shape.
//!
//! The engine (`engine`) times every request the same way whatever its API, under one of three
//! schedulers (`--scheduler`): `fcfs` (the default: one first-come-first-served prefill
//! resource, decoding apart from it), `chunked` (vLLM's chunked prefill: steps of at most
//! `--max-num-batched-tokens`, decodes first, then prefill chunks in arrival order) and
//! `prefill-first` (vLLM without chunked prefill: a waiting prompt is prefilled whole while
//! every running stream stalls). See the engine's docs for the rules.
//!
//! Prefill/decode disaggregation (`pd`, `--kv-role`, `--pd-protocol`): the KV handover of
//! vLLM's NixlConnector (`kv_transfer_params`, on chat, completions, Responses and Messages)
//! and SGLang's bootstrap rooms (on chat and completions), with `POST /sim/kv/pull` as the
//! side channel and its counters in `/sim/stats`.
//!
//! vLLM's KV events (`kvpub`, `--kv-events`, `--kv-events-replay`, `--kv-events-topic`): the
//! prefix cache's stores, evictions and resets (`POST /reset_prefix_cache`) as vLLM publishes
//! them, with the render endpoints vLLM's router calls (`POST /v1/chat/completions/render`,
//! `POST /v1/completions/render`) giving the same token ids (`engine::token_ids`).
//!
//! Every API renders its request into prompt text the same way (`render`): a conversation costs
//! the same prompt tokens, hits the prefix cache the same way and gets the same reply through
//! any of them, and they all count in `/sim/stats` and `/metrics`. A token is 4 bytes of that
//! text, unless `--tokenizer` gives a real tokenizer: chat and completions prompts are then
//! that tokenizer's ids, as vLLM computes them (`inferlb_tokens`; Responses and Messages
//! bodies through the chat body vLLM makes of them), and so are the blocks, the KV events, the
//! usage and the render endpoints' `token_ids`.

mod dp;
mod engine;
mod kvpub;
mod messages;
mod pd;
mod render;
mod responses;
mod server_info;
mod tls;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use clap::Parser;
use engine::{token_text, Engine, EngineConf, Scheduler};
use inferlb_tokens::ModelTokens;
use pd::{Handover, KvRole, Pd, PdConf, PdProtocol};
use render::{content_text, render_message, GENERATION_PROMPT};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "A simulated vLLM replica: OpenAI endpoints, prefix cache, prefill/decode timing, faults"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// This replica's name, returned in the `x-sim-replica` header.
    #[arg(long, default_value = "sim")]
    id: String,
    /// Model name served (comma-separated for several).
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Prefill throughput in tokens/s (a 90k-token cold prompt takes 90000/this seconds).
    #[arg(long, default_value_t = 30000.0)]
    prefill_tokens_per_s: f64,
    /// Milliseconds between generated tokens of one request.
    #[arg(long, default_value_t = 20.0)]
    decode_interval_ms: f64,
    /// Requests in the engine at once (vLLM's max_num_seqs): in `fcfs`, admitted (queued for
    /// prefill, prefilling or decoding); in the stepped schedulers, running (prefilling or
    /// decoding). The rest wait.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Tokens per prefix-cache block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// Prefix-cache capacity in tokens (vLLM's num_gpu_blocks × block size).
    #[arg(long, default_value_t = 1_000_000)]
    cache_tokens: usize,
    /// How prefill and decode share the engine: `fcfs` (one first-come-first-served prefill
    /// resource, decoding apart), `chunked` (vLLM's chunked-prefill steps: decodes first, then
    /// prefill chunks, within --max-num-batched-tokens a step) or `prefill-first` (steps where
    /// waiting prompts are prefilled whole, stalling decodes, as vLLM without chunked prefill).
    #[arg(long, value_enum, default_value_t = Scheduler::Fcfs)]
    scheduler: Scheduler,
    /// Tokens one step may carry (decodes and prefill chunks), in the stepped schedulers.
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Divides every duration (10 = ten times faster than the modelled engine).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Tokens generated when a request sets no max_tokens.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: usize,
    /// Slow start: refuse connections for this many seconds (a vLLM process loading).
    #[arg(long, default_value_t = 0.0)]
    refuse_for: f64,
    /// Slow start: then answer /health (and requests) with 503 for this many seconds.
    #[arg(long, default_value_t = 0.0)]
    unhealthy_for: f64,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (least recently
    /// used go first).
    #[arg(long, default_value_t = 10_000)]
    response_store_entries: usize,
    /// ... and at most this many MiB of their text.
    #[arg(long, default_value_t = 1024)]
    response_store_mib: usize,
    /// Keep no Responses store, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE: `store` is
    /// turned off in every request, any `previous_response_id` and `GET`/`DELETE
    /// /v1/responses/{id}` answer 404, and `background` with `store` true is refused (400).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    no_response_store: bool,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// With --tls-cert: require a client certificate signed by this CA (mTLS).
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<std::path::PathBuf>,
    /// The KV connector's side in prefill/decode disaggregation (vLLM's kv_role): `none` (no
    /// connector: handover fields in requests are ignored, and counted in /sim/stats as
    /// `handover_fields_seen`), `producer` (prefill), `consumer` (decode) or `both`.
    #[arg(long, value_enum, default_value_t = KvRole::None)]
    kv_role: KvRole,
    /// The handover protocol: `vllm` (NixlConnector's `kv_transfer_params`) or `sglang`
    /// (`bootstrap_host`/`bootstrap_port`/`bootstrap_room`).
    #[arg(long, value_enum, default_value_t = PdProtocol::Vllm)]
    pd_protocol: PdProtocol,
    /// SGLang, producer side: also listen on this port (the host of --listen) as the
    /// bootstrap server.
    #[arg(long)]
    bootstrap_port: Option<u16>,
    /// Modelled KV pull speed in tokens/s (a decode pulling N tokens waits N/this seconds).
    #[arg(long, default_value_t = 500_000.0)]
    kv_transfer_tokens_per_s: f64,
    /// How long a producer holds a finished prefill's blocks for a decode to pull them
    /// (vLLM's kv_lease_duration), in modelled seconds (divided by --speed); also how long an
    /// SGLang decode waits for its room.
    #[arg(long, default_value_t = 30.0)]
    kv_lease_seconds: f64,
    /// Publish vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB
    /// socket bound here, e.g. `tcp://127.0.0.1:5557` (vLLM's `--kv-events-config` endpoint).
    #[arg(long)]
    kv_events: Option<String>,
    /// The replay ROUTER socket for missed batches, e.g. `tcp://127.0.0.1:5558`.
    #[arg(long, requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// The topic frame of every event message (vLLM's default: empty).
    #[arg(long, default_value = inferlb_kvevents::DEFAULT_TOPIC)]
    kv_events_topic: String,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = inferlb_kvevents::DEFAULT_BUFFER_STEPS)]
    kv_events_buffer: usize,
    /// For tests: these sequence numbers are kept for replay but never published, as a
    /// subscriber whose queue was full (ZMQ's high-water mark) misses them: a gap to heal.
    #[arg(long, value_delimiter = ',', requires = "kv_events")]
    kv_events_withhold: Vec<u64>,
    /// Count real tokens: a model's tokenizer directory (`tokenizer.json`, and
    /// `tokenizer_config.json` with its `chat_template`), loaded at start. A chat completions
    /// prompt is then the body rendered with the template as vLLM renders it, tokenized; a
    /// completions prompt is its text tokenized (with the tokenizer's special tokens), or a
    /// list of token ids as it is. The prefix cache, KV events, `usage` and the render
    /// endpoints count those ids, and a reply joins the cache as its text tokenized. Responses
    /// and Messages bodies are written as the chat body vLLM makes of them first; one the
    /// conversion refuses (a continued response, images) keeps the simulator's rendering (4
    /// bytes a token). Without it, every API's token is 4 bytes of the simulator's rendering.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// vLLM's `--data-parallel-size` with its internal load balancing: this many engines
    /// behind the one address, each with its own prefix cache, batch and (with --kv-events)
    /// publisher and replay socket on the configured port plus its rank. A request's
    /// `X-data-parallel-rank` header picks its engine (400 when it names none); without it,
    /// the least loaded takes it. `/metrics` labels each engine's samples `engine="k"`;
    /// `/sim/stats` and `/sim/fault` are the header's rank's (rank 0's without);
    /// `/reset_prefix_cache` resets every engine. The Responses store is the server's, shared.
    /// Not with --kv-role.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// Which engine's `GET /server_info` to serve, with the KV events config (--kv-events)
    /// in its form: vLLM's (`VLLM_SERVER_DEV_MODE=1`; JSON with `?config_format=json`) or
    /// SGLang's (`kv_events_config` as its flag's JSON string). Default: SGLang's with
    /// `--pd-protocol sglang` and a --kv-role (what its gateway reads in P/D mode), else none.
    #[arg(long, value_enum)]
    server_info: Option<server_info::Flavour>,
    /// A YAML file with any of these keys (flags given on the command line win).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
}

/// A fault a test can switch on with `POST /sim/fault`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
enum Fault {
    #[default]
    None,
    /// Close the listening socket for `seconds`: connections are refused.
    Refuse,
    /// Accept the request and never answer.
    Hang,
    /// Drop the connection after reading the request, before any byte of a response.
    Reset,
    /// Answer 500 / 503 with an OpenAI-format error.
    Error500,
    Error503,
    /// Stream a few tokens, then cut the connection.
    CutStream,
    /// Slow start from now: refuse for `seconds`, then /health fails for `unhealthy_seconds`.
    Restart,
}

#[derive(Debug, Deserialize)]
struct FaultRequest {
    fault: Fault,
    /// How many requests it applies to (omitted: all until switched off).
    count: Option<u64>,
    #[serde(default)]
    seconds: f64,
    #[serde(default)]
    unhealthy_seconds: f64,
}

struct FaultState {
    fault: Fault,
    remaining: Option<u64>,
}

struct Sim {
    args: Args,
    engine: Arc<Engine>,
    fault: Mutex<FaultState>,
    unhealthy_until: Mutex<Instant>,
    listener_ctl: tokio::sync::mpsc::UnboundedSender<Duration>,
    /// The Responses API's stored responses (the server's: every data-parallel rank's).
    responses: Arc<responses::Store>,
    /// Its data-parallel rank (0 when there is one engine).
    rank: usize,
    /// The KV connector (prefill/decode disaggregation).
    pd: Arc<Pd>,
    /// Request ids given when the client sends no X-Request-Id.
    next_request: std::sync::atomic::AtomicU64,
    /// The last bodies received on `POST /v1/*`, oldest first: `GET /sim/received`.
    received: Mutex<VecDeque<(String, Bytes)>>,
    /// `--tokenizer`: the model's tokenizer and chat template.
    tokens: Option<ModelTokens>,
}

type App = Arc<Sim>;

impl Sim {
    /// The fault for this request, consuming one use of a counted fault.
    fn take_fault(&self) -> Fault {
        let Ok(mut f) = self.fault.lock() else {
            return Fault::None;
        };
        match f.remaining {
            Some(0) => Fault::None,
            Some(n) => {
                f.remaining = Some(n - 1);
                f.fault
            }
            None => f.fault,
        }
    }

    fn unhealthy(&self) -> bool {
        self.unhealthy_until
            .lock()
            .map(|u| Instant::now() < *u)
            .unwrap_or(false)
    }

    fn models(&self) -> Vec<String> {
        self.args
            .model
            .split(',')
            .map(|m| m.trim().to_owned())
            .collect()
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    let kind = if status.is_client_error() {
        "BadRequestError"
    } else {
        "InternalServerError"
    };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The most tokens one reply has, whatever the request asks for.
const MAX_TOKENS: usize = 100_000;

/// A parsed completion request, chat or not.
struct Job {
    chat: bool,
    model: String,
    prompt: String,
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
    seed: u64,
    /// The tokens to generate when they are not the seed's words (a function call's
    /// arguments); `max_tokens` is then their count.
    script: Option<Vec<String>>,
    /// With `--tokenizer`: the prompt's token ids, 4 bytes each (`engine::token_bytes`).
    /// `prompt` stays the simulator's rendering, which seeds the reply.
    ids: Option<Vec<u8>>,
}

impl Job {
    /// The prompt as the engine and the KV handover take it: the tokenizer's ids when there
    /// are, else the rendered text (`engine::token_ids` reads either as ids).
    fn engine_prompt(&self) -> &[u8] {
        self.ids.as_deref().unwrap_or(self.prompt.as_bytes())
    }
}

fn parse_job(
    body: &[u8],
    chat: bool,
    default_max: usize,
    tokens: Option<&ModelTokens>,
) -> Result<(Job, serde_json::Map<String, Value>), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let Value::Object(obj) = v else {
        return Err("the body must be a JSON object".into());
    };
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let prompt = if chat {
        let msgs = obj
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("`messages` must be a list")?;
        if msgs.is_empty() {
            return Err("`messages` must not be empty".into());
        }
        let mut text = String::new();
        for m in msgs {
            let m = m.as_object().ok_or("each message must be an object")?;
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or("each message needs a `role`")?;
            text.push_str(&render_message(
                role,
                &content_text(m.get("content").unwrap_or(&Value::Null)),
            ));
        }
        text.push_str(GENERATION_PROMPT);
        text
    } else {
        match obj.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) => a.iter().map(content_text).collect::<Vec<_>>().join(""),
            _ => return Err("`prompt` must be a string or a list".into()),
        }
    };
    let max_tokens = obj
        .get("max_completion_tokens")
        .or_else(|| obj.get("max_tokens"))
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .unwrap_or(default_max)
        .min(MAX_TOKENS);
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let seed = seed_of(&prompt);
    let ids = tokens
        .map(|t| tokenized(t, body, &obj, &prompt, chat))
        .transpose()?
        .map(|ids| engine::token_bytes(&ids));
    let job = Job {
        chat,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        seed,
        script: None,
        ids,
    };
    Ok((job, obj))
}

/// A request's prompt as the tokenizer's ids, as vLLM computes them: a chat body rendered with
/// the model's template; a completions prompt of token ids as it is, else its `text` tokenized.
fn tokenized(
    t: &ModelTokens,
    body: &[u8],
    obj: &serde_json::Map<String, Value>,
    text: &str,
    chat: bool,
) -> Result<Vec<u32>, String> {
    if chat {
        return t
            .chat_ids(body)
            .map(|c| c.ids.to_vec())
            .map_err(|e| e.to_string());
    }
    if let Some(Value::Array(a)) = obj.get("prompt") {
        let ids: Option<Vec<u32>> = a
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect();
        if let Some(ids) = ids.filter(|ids| !ids.is_empty()) {
            return Ok(inferlb_tokens::token_prompt(&ids).to_vec());
        }
    }
    t.prompt_ids(text).map_err(|e| e.to_string())
}

async fn chat_completions(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    complete(sim, headers, body, true).await
}

async fn completions(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    complete(sim, headers, body, false).await
}

/// A request's part in a KV handover.
struct Leg {
    handover: Handover,
    /// The request id (X-Request-Id when given, as vLLM takes it): a vLLM prefill's lease is
    /// held under it.
    request_id: String,
}

impl Leg {
    /// What the request body `obj` asks of this replica's connector. `vllm_only` is for the
    /// APIs only vLLM hands over (Responses, Messages): SGLang's fields are ignored there, and
    /// counted as ignored.
    fn of(
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
    fn shape(&self, job: &mut Job) {
        match self.handover {
            Handover::VllmPrefill => job.stream = false,
            Handover::SglangPrefill { .. } => job.max_tokens = job.max_tokens.min(1),
            _ => {}
        }
    }
}

async fn complete(sim: App, headers: axum::http::HeaderMap, body: Bytes, chat: bool) -> Response {
    if sim.unhealthy() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine is starting");
    }
    let (mut job, obj) = match parse_job(
        &body,
        chat,
        sim.args.default_max_tokens,
        sim.tokens.as_ref(),
    ) {
        Ok(j) => j,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    if sim.pd.refuses_whole(&obj) {
        return error(StatusCode::BAD_REQUEST, pd::NO_ROOM);
    }
    let leg = Leg::of(&sim, &headers, &obj, false);
    leg.shape(&mut job);
    if !job.model.is_empty() && !sim.models().contains(&job.model) {
        return error(
            StatusCode::NOT_FOUND,
            &format!("The model `{}` does not exist.", job.model),
        );
    }
    let cut_after = match gate(&sim).await {
        Ok(cut_after) => cut_after,
        Err((status, message)) => return error(status, message),
    };
    sim.pd.count_leg(&leg.handover);
    let resp = if job.stream {
        stream_response(sim.clone(), job, leg, cut_after).await
    } else {
        whole_response(sim.clone(), job, leg).await
    };
    tag(&sim, &body, resp)
}

/// Applies the switched-on fault to a request that is about to run: `Err` is the error to
/// answer (each API in its own shape), `Ok` the token before which a stream is cut, if it is.
/// Counts the request when it runs. A hang never returns; a reset drops the connection.
async fn gate(sim: &Sim) -> Result<Option<usize>, (StatusCode, &'static str)> {
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
    Ok((fault == Fault::CutStream).then_some(3usize))
}

/// The headers every answer to a request that ran carries.
fn tag(sim: &Sim, body: &[u8], mut resp: Response) -> Response {
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
struct ResetFault;

struct Usage {
    prompt: usize,
    cached: usize,
}

/// Prefill: the engine admits the request, finds its cached prefix and pays for the rest;
/// returns when the first token is out. The request leaves the engine when the `Seq` drops.
async fn prefill<'a>(sim: &'a Sim, job: &Job) -> (engine::Seq<'a>, Usage) {
    let (seq, prompt, cached) = sim
        .engine
        .prefill(job.engine_prompt(), job.max_tokens)
        .await;
    (seq, Usage { prompt, cached })
}

/// After generation the reply enters the cache, as the next turn's history will contain it:
/// with a tokenizer, the prompt's ids and the reply's text tokenized.
fn finish(sim: &Sim, job: &Job, reply: &str) {
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

fn usage_json(u: &Usage, completion: usize) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": completion,
        "total_tokens": u.prompt + completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    })
}

/// The error a decode answers when its KV could not be loaded: vLLM's, for a request that
/// ends with finish_reason `error` (kv_load_failure_policy `fail`).
fn kv_load_failed() -> Value {
    json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}})
}

/// The prefill leg's part once its prompt is computed: an SGLang room is ready; a vLLM
/// prefill's blocks are leased and its answer's `kv_transfer_params` returned.
fn prefilled(sim: &Sim, job: &Job, leg: &Leg) -> Option<Value> {
    match leg.handover {
        Handover::SglangPrefill { room } => {
            sim.pd.sglang_prefilled(room, job.engine_prompt());
            None
        }
        Handover::VllmPrefill => Some(sim.pd.vllm_prefilled(&leg.request_id, job.engine_prompt())),
        _ => None,
    }
}

async fn whole_response(sim: App, job: Job, leg: Leg) -> Response {
    if leg.handover.is_decode()
        && sim
            .pd
            .fetch(&leg.handover, job.engine_prompt())
            .await
            .is_err()
    {
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(kv_load_failed())).into_response();
    }
    let (mut running, usage) = prefill(&sim, &job).await;
    let kv_transfer_params = prefilled(&sim, &job, &leg);
    let mut reply = String::new();
    decode(
        &sim,
        &job,
        &mut running,
        None,
        None,
        None,
        |_| Bytes::new(),
        &mut reply,
    )
    .await;
    drop(running);
    finish(&sim, &job, &reply);
    let id = format!("cmpl-{:016x}", job.seed ^ now_secs());
    let choice = if job.chat {
        json!({"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": reply, "finish_reason": "length"})
    };
    let mut answer = json!({
        "id": id,
        "object": if job.chat { "chat.completion" } else { "text_completion" },
        "created": now_secs(),
        "model": job.model,
        "choices": [choice],
        "usage": usage_json(&usage, job.max_tokens),
    });
    if let Some(p) = kv_transfer_params {
        answer["kv_transfer_params"] = p;
    }
    Json(answer).into_response()
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A server-sent event with a name, as the Responses and Messages APIs send them.
fn named_sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The sending half of a streamed body.
type Tx = tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>;

/// A streamed answer whose body `tx` feeds.
fn sse_response() -> (Tx, Response) {
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
enum Decoded {
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
async fn decode(
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
async fn cut(tx: &Tx, why: &str) {
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
fn seed_of(prompt: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(prompt.as_bytes())
}

async fn stream_response(sim: App, job: Job, leg: Leg, cut_after: Option<usize>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let id = format!("cmpl-{:016x}", job.seed ^ now_secs());
        let fetched = if leg.handover.is_decode() {
            tokio::select! {
                r = sim.pd.fetch(&leg.handover, job.engine_prompt()) => r.is_ok(),
                _ = tx.closed() => return,
            }
        } else {
            true
        };
        if !fetched {
            // As vLLM streams a request whose KV load failed: the chat role chunk (sent with
            // the first output), then the error as one event, then the end of the stream.
            if job.chat {
                let role = json!({
                    "id": id, "created": now_secs(), "model": job.model,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}],
                });
                let _ = tx.send(Ok(sse(&role))).await;
            }
            let _ = tx.send(Ok(sse(&kv_load_failed()))).await;
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
            return;
        }
        // The request is aborted as soon as the client is gone, even during prefill, as vLLM
        // aborts a request whose connection closed.
        let (mut running, usage) = tokio::select! {
            done = prefill(&sim, &job) => done,
            _ = tx.closed() => return,
        };
        prefilled(&sim, &job, &leg);
        let created = now_secs();
        let chunk = |delta: Value, finish: Value| {
            let choice = if job.chat {
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish})
            };
            json!({
                "id": id, "created": created, "model": job.model,
                "object": if job.chat { "chat.completion.chunk" } else { "text_completion" },
                "choices": [choice],
            })
        };
        if job.chat
            && tx
                .send(Ok(sse(&chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                ))))
                .await
                .is_err()
        {
            return;
        }
        let mut reply = String::new();
        let (how, _) = decode(
            &sim,
            &job,
            &mut running,
            cut_after,
            None,
            Some(&tx),
            |t| sse(&chunk(json!({"content": t}), Value::Null)),
            &mut reply,
        )
        .await;
        if how != Decoded::Done {
            return;
        }
        drop(running);
        finish(&sim, &job, &reply);
        let _ = tx.send(Ok(sse(&chunk(json!({}), json!("length"))))).await;
        if job.include_usage {
            let mut last = chunk(json!({}), Value::Null);
            last["choices"] = json!([]);
            last["usage"] = usage_json(&usage, job.max_tokens);
            let _ = tx.send(Ok(sse(&last))).await;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed"))
}

async fn models(State(sim): State<App>) -> Response {
    let data: Vec<Value> = sim
        .models()
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": now_secs(), "owned_by": "inferlb-sim", "max_model_len": 131072}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(sim): State<App>) -> Response {
    if sim.unhealthy() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    StatusCode::OK.into_response()
}

/// `/metrics` in vLLM's names and shapes: the engine's gauges and counters with vLLM's
/// `engine` and `model_name` labels, and `vllm:cache_config_info`, the info-style gauge
/// (always 1) whose labels are vLLM's CacheConfig as strings (no `model_name`).
async fn metrics(State(sim): State<App>) -> Response {
    metrics_of(&[sim])
}

/// The `/metrics` page of a server whose engines are `sims` (one, or each data-parallel
/// rank's): every series once, with a sample per engine labelled `engine="k"`, as vLLM labels
/// them.
fn metrics_of(sims: &[App]) -> Response {
    type Value = fn(&Sim) -> String;
    fn count(c: &std::sync::atomic::AtomicU64) -> String {
        c.load(Ordering::Relaxed).to_string()
    }
    let series: [(&str, &str, &str, Value); 8] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            |s| count(&s.engine.counters.running),
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            |s| count(&s.engine.counters.waiting),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            |s| s.engine.kv_usage().to_string(),
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            |s| count(&s.engine.counters.prompt_tokens),
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            |s| count(&s.engine.counters.cached_tokens),
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            |s| count(&s.engine.counters.prompt_tokens),
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            |s| count(&s.engine.counters.generation_tokens),
        ),
        (
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            |s| count(&s.engine.counters.requests),
        ),
    ];
    let mut body = String::new();
    for (name, kind, help, value) in series {
        body.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for sim in sims {
            let model = sim.models().first().cloned().unwrap_or_default();
            body.push_str(&format!(
                "{name}{{engine=\"{}\",model_name=\"{model}\"}} {}\n",
                sim.rank,
                value(sim)
            ));
        }
    }
    body.push_str(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n",
    );
    for sim in sims {
        let conf = &sim.engine.conf;
        body.push_str(&format!(
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",\
             cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",engine=\"{}\",gpu_memory_utilization=\"0.9\",\
             is_attention_free=\"False\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{}\",\
             num_gpu_blocks_override=\"None\",sliding_window=\"None\",swap_space_bytes=\"0\"}} 1\n",
            conf.block_tokens,
            sim.rank,
            sim.engine.num_blocks(),
        ));
    }
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

/// The simulator's own counters as JSON, for tests and the bench: besides the gauges of
/// `/metrics`, what a routing policy estimates, as the engine knows it: `decoding` (running
/// requests past their prefill) and `prefill_backlog_tokens` (uncached prompt tokens admitted
/// and not prefilled yet); `prefix_cache_usage` is how full the prefix cache is.
/// vLLM's render endpoints (what its router calls in `kv_aware` mode): the prompt as token ids,
/// rendered as the completion endpoints render it, so they name the blocks the KV events name.
/// The answer is the part of vLLM's `GenerateRequest` a router reads.
fn rendered(sim: &Sim, body: &[u8], chat: bool) -> Result<Value, String> {
    let (job, _) = parse_job(body, chat, sim.args.default_max_tokens, sim.tokens.as_ref())?;
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    let n = sim.next_request.fetch_add(1, Ordering::Relaxed);
    Ok(json!({
        "request_id": format!("{prefix}-{}-{n}", sim.args.id),
        "token_ids": engine::token_ids(job.engine_prompt()),
        "model": job.model,
        "sampling_params": {"max_tokens": job.max_tokens},
        "stream": job.stream,
    }))
}

async fn render_chat(State(sim): State<App>, body: Bytes) -> Response {
    match rendered(&sim, &body, true) {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

/// A completions prompt renders as a list, one entry per prompt, as vLLM answers.
async fn render_completions(State(sim): State<App>, body: Bytes) -> Response {
    match rendered(&sim, &body, false) {
        Ok(v) => Json(json!([v])).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

/// vLLM's `POST /reset_prefix_cache`.
async fn reset_prefix_cache(State(sim): State<App>) -> Response {
    sim.engine.reset_prefix_cache();
    StatusCode::OK.into_response()
}

async fn stats(State(sim): State<App>) -> Response {
    let c = &sim.engine.counters;
    let p = &sim.pd.counters;
    Json(json!({
        "id": sim.args.id,
        "dp_rank": sim.rank,
        "requests": c.requests.load(Ordering::Relaxed),
        "scheduler": sim.engine.conf.scheduler.name(),
        "running": c.running.load(Ordering::Relaxed),
        "waiting": c.waiting.load(Ordering::Relaxed),
        "decoding": c.decoding.load(Ordering::Relaxed),
        "prefill_backlog_tokens": sim.engine.prefill_backlog(),
        "kv_cache_usage": sim.engine.kv_usage(),
        "prefix_cache_usage": sim.engine.cache_usage(),
        "prompt_tokens": c.prompt_tokens.load(Ordering::Relaxed),
        "cached_tokens": c.cached_tokens.load(Ordering::Relaxed),
        "generation_tokens": c.generation_tokens.load(Ordering::Relaxed),
        "kv_role": sim.pd.conf.role.name(),
        "pd_protocol": sim.pd.conf.protocol.name(),
        "engine_id": sim.pd.conf.engine_id,
        "handover_fields_seen": p.handover_fields_seen.load(Ordering::Relaxed),
        "handover_prefill_requests": p.handover_prefill_requests.load(Ordering::Relaxed),
        "handover_decode_requests": p.handover_decode_requests.load(Ordering::Relaxed),
        "kv_pulls": p.kv_pulls.load(Ordering::Relaxed),
        "kv_pull_failures": p.kv_pull_failures.load(Ordering::Relaxed),
        "kv_tokens_transferred": p.kv_tokens_transferred.load(Ordering::Relaxed),
        "kv_leases_granted": p.kv_leases_granted.load(Ordering::Relaxed),
        "kv_leases_pulled": p.kv_leases_pulled.load(Ordering::Relaxed),
        "kv_leases_expired": p.kv_leases_expired.load(Ordering::Relaxed),
        "kv_leases_held": sim.pd.leases_held(),
        "kv_event_batches_sent": sim.engine.events().map_or(0, |e| e.sent.load(Ordering::Relaxed)),
        "kv_event_batches_dropped": sim.engine.events().map_or(0, |e| e.dropped.load(Ordering::Relaxed)),
    }))
    .into_response()
}

/// `POST /sim/kv/pull`: the KV side channel a decode replica calls (see `pd`).
async fn kv_pull(State(pd): State<Arc<Pd>>, body: Bytes) -> Response {
    let (status, v) = pd::pull_handler(&pd, &body).await;
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(v),
    )
        .into_response()
}

async fn set_fault(State(sim): State<App>, Json(req): Json<FaultRequest>) -> Response {
    match req.fault {
        Fault::Refuse => {
            let _ = sim
                .listener_ctl
                .send(Duration::from_secs_f64(req.seconds.max(0.0)));
        }
        Fault::Restart => {
            if let Ok(mut u) = sim.unhealthy_until.lock() {
                *u = Instant::now()
                    + Duration::from_secs_f64((req.seconds + req.unhealthy_seconds).max(0.0));
            }
            let _ = sim
                .listener_ctl
                .send(Duration::from_secs_f64(req.seconds.max(0.0)));
        }
        _ => {
            if let Ok(mut f) = sim.fault.lock() {
                *f = FaultState {
                    fault: req.fault,
                    remaining: req.count,
                };
            }
        }
    }
    Json(json!({"ok": true})).into_response()
}

/// The request as the simulator received it, for tests of what a proxy forwards.
async fn echo(
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
) -> Response {
    let headers: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                json!(String::from_utf8_lossy(v.as_bytes())),
            )
        })
        .collect();
    Json(json!({"method": method.as_str(), "uri": uri.to_string(), "headers": headers}))
        .into_response()
}

/// How many request bodies `GET /sim/received` can show.
const RECEIVED_KEPT: usize = 64;

/// Keeps the body of every `POST /v1/*` request in the ring `GET /sim/received` reads, then
/// hands the request on unchanged.
async fn record_received(
    State(sim): State<App>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() != axum::http::Method::POST || !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    // Read as the handlers read it: the same body limit, the same answer past it.
    let request = axum::extract::Request::from_parts(parts.clone(), body);
    let body = match <Bytes as axum::extract::FromRequest<()>>::from_request(request, &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
    {
        let mut ring = sim.received.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECEIVED_KEPT {
            ring.pop_front();
        }
        ring.push_back((path, body.clone()));
    }
    next.run(axum::extract::Request::from_parts(parts, Body::from(body)))
        .await
}

#[derive(Debug, Deserialize)]
struct ReceivedQuery {
    n: Option<usize>,
}

/// `GET /sim/received?n=K`: the last K (default 16, at most 64) bodies received on
/// `POST /v1/*`, oldest first, each as UTF-8 (lossily), for tests of what a proxy sent.
async fn received(
    State(sim): State<App>,
    axum::extract::Query(q): axum::extract::Query<ReceivedQuery>,
) -> Response {
    let n = q.n.unwrap_or(16).min(RECEIVED_KEPT);
    let ring = sim.received.lock().unwrap_or_else(|e| e.into_inner());
    let items: Vec<Value> = ring
        .iter()
        .skip(ring.len().saturating_sub(n))
        .map(|(path, body)| json!({"path": path, "body": String::from_utf8_lossy(body)}))
        .collect();
    Json(json!({"received": items})).into_response()
}

fn load_args() -> Result<Args, String> {
    let args = Args::parse();
    let Some(path) = args.config.clone() else {
        return Ok(args);
    };
    // Keys of the YAML file become flags placed before the real ones, so the command line wins.
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let map: serde_yaml::Mapping =
        serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut argv: Vec<String> = vec!["inferlb-sim".into()];
    for (k, v) in map {
        let key = k.as_str().ok_or("keys must be strings")?.replace('_', "-");
        let val = match v {
            serde_yaml::Value::String(s) => s,
            other => serde_yaml::to_string(&other)
                .map_err(|e| e.to_string())?
                .trim()
                .to_owned(),
        };
        argv.push(format!("--{key}={val}"));
    }
    argv.extend(std::env::args().skip(1));
    Args::try_parse_from(argv).map_err(|e| e.to_string())
}

/// `--tokenizer`'s directory loaded, or what is wrong with it.
fn load_tokens(args: &Args) -> Result<Option<ModelTokens>, String> {
    let Some(dir) = &args.tokenizer else {
        return Ok(None);
    };
    let t =
        ModelTokens::from_dir(dir).map_err(|e| format!("--tokenizer {}: {e}", dir.display()))?;
    // A base model's directory still serves completions; chat requests get this error.
    if let Err(e @ inferlb_tokens::Error::NoTemplate { .. }) = t.render_chat(br#"{"messages": []}"#)
    {
        eprintln!("inferlb-sim: --tokenizer {}: {e}", dir.display());
    }
    Ok(Some(t))
}

/// The replica `args` describe, its engine started; `listener_ctl` closes its listener for a
/// while (the `refuse` fault).
/// One engine's replica state: `rank` is its data-parallel rank, `responses` the server's
/// store when another rank made it.
fn replica(
    args: &Args,
    listener_ctl: tokio::sync::mpsc::UnboundedSender<Duration>,
    events: Option<Arc<kvpub::Sink>>,
    tokens: Option<ModelTokens>,
    rank: usize,
    responses: Option<Arc<responses::Store>>,
) -> App {
    let mut engine = Engine::new(EngineConf {
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_interval: Duration::from_secs_f64(args.decode_interval_ms / 1000.0),
        max_batch: args.max_batch,
        block_tokens: args.block_tokens.max(1),
        cache_tokens: args.cache_tokens,
        speed: if args.speed > 0.0 { args.speed } else { 1.0 },
        scheduler: args.scheduler,
        max_num_batched_tokens: args.max_num_batched_tokens.max(1),
    });
    if let Some(sink) = events {
        // A replica starts empty, and says so, as vLLM does on a fresh start.
        sink.send(vec![inferlb_kvevents::Event::AllBlocksCleared]);
        engine.set_events(sink);
    }
    let engine = Arc::new(engine);
    engine.start();
    let speed = if args.speed > 0.0 { args.speed } else { 1.0 };
    // vLLM's engine ids are random per process; this one also names the replica.
    let nonce = xxhash_rust::xxh3::xxh3_64(
        format!(
            "{}{:?}{}{rank}",
            std::process::id(),
            SystemTime::now(),
            args.listen
        )
        .as_bytes(),
    );
    let pd = Pd::new(
        PdConf {
            role: args.kv_role,
            protocol: args.pd_protocol,
            bootstrap_port: args.bootstrap_port,
            transfer_tokens_per_s: args.kv_transfer_tokens_per_s,
            lease: Duration::from_secs_f64((args.kv_lease_seconds / speed).max(0.0)),
            engine_id: format!("{}-{:08x}", args.id, nonce as u32),
            host: args.listen.ip().to_string(),
            port: args.listen.port(),
        },
        engine.clone(),
    );
    let refuse_for = Duration::from_secs_f64(args.refuse_for.max(0.0));
    Arc::new(Sim {
        engine,
        fault: Mutex::new(FaultState {
            fault: Fault::None,
            remaining: None,
        }),
        unhealthy_until: Mutex::new(
            Instant::now() + refuse_for + Duration::from_secs_f64(args.unhealthy_for.max(0.0)),
        ),
        listener_ctl,
        responses: responses.unwrap_or_else(|| {
            Arc::new(responses::Store::new(
                &args.id,
                args.response_store_entries,
                args.response_store_mib.saturating_mul(1 << 20),
            ))
        }),
        rank,
        pd,
        next_request: std::sync::atomic::AtomicU64::new(0),
        received: Mutex::new(VecDeque::with_capacity(RECEIVED_KEPT)),
        tokens,
        args: args.clone(),
    })
}

/// The replica's routes on its main port.
fn router(sim: &App) -> Router {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completions))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/sim/stats", get(stats))
        .route("/sim/fault", post(set_fault))
        .route("/sim/echo", axum::routing::any(echo))
        .route("/sim/received", get(received));
    server_info::routes(app, &sim.args)
        .with_state(sim.clone())
        .route("/sim/kv/pull", post(kv_pull).with_state(sim.pd.clone()))
        .layer(axum::middleware::from_fn_with_state(
            sim.clone(),
            record_received,
        ))
}

#[tokio::main]
async fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = match load_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("inferlb-sim: {e}");
            std::process::exit(2);
        }
    };
    // The Reset fault panics on purpose to drop its connection; keep that quiet.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<ResetFault>().is_none() {
            default_hook(info);
        }
    }));
    let tokens = match load_tokens(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("inferlb-sim: {e}");
            std::process::exit(2);
        }
    };
    let (ctl_tx, mut ctl_rx) = tokio::sync::mpsc::unbounded_channel::<Duration>();
    let refuse_for = Duration::from_secs_f64(args.refuse_for.max(0.0));
    if args.data_parallel_size == 0 || (args.data_parallel_size > 1 && args.kv_role != KvRole::None)
    {
        eprintln!("inferlb-sim: --data-parallel-size is 1 or more, and more than 1 only without --kv-role");
        std::process::exit(2);
    }
    let mut ranks = Vec::with_capacity(args.data_parallel_size);
    let mut first_tokens = tokens;
    for rank in 0..args.data_parallel_size {
        let events = match &args.kv_events {
            None => None,
            Some(endpoint) => {
                let (sink, rx) = kvpub::Sink::new();
                // vLLM's rank k binds its publisher and replay socket on the port plus k.
                let for_rank = |e: &str| {
                    inferlb_kvevents::endpoint_for_rank(e, rank as u32).unwrap_or_else(|err| {
                        eprintln!("inferlb-sim: --kv-events: {err}");
                        std::process::exit(2);
                    })
                };
                let conf = kvpub::PublisherConf {
                    endpoint: for_rank(endpoint),
                    replay: args.kv_events_replay.as_deref().map(for_rank),
                    topic: args.kv_events_topic.clone(),
                    buffer: args.kv_events_buffer,
                    withhold: args.kv_events_withhold.clone(),
                };
                if let Err(e) = kvpub::start(conf, rx).await {
                    eprintln!("inferlb-sim: {e}");
                    std::process::exit(1);
                }
                Some(Arc::new(sink))
            }
        };
        let tokens = if rank == 0 {
            first_tokens.take()
        } else {
            load_tokens(&args).ok().flatten()
        };
        let store = ranks.first().map(|r: &App| r.responses.clone());
        ranks.push(replica(&args, ctl_tx.clone(), events, tokens, rank, store));
    }
    drop(ctl_tx);
    let sim = ranks[0].clone();
    let pd = sim.pd.clone();
    if let (Some(port), true) = (
        args.bootstrap_port,
        matches!(args.kv_role, KvRole::Producer | KvRole::Both),
    ) {
        // SGLang's bootstrap server: where decodes wait for their room.
        let addr = SocketAddr::new(args.listen.ip(), port);
        let listener = match bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("inferlb-sim: cannot listen on {addr} (bootstrap): {e}");
                std::process::exit(1);
            }
        };
        let bootstrap = Router::new()
            .route("/sim/kv/pull", post(kv_pull))
            .route("/health", get(|| async { StatusCode::OK }))
            .with_state(pd.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, bootstrap).await;
        });
    }
    let app = if ranks.len() > 1 {
        dp::router(ranks)
    } else {
        router(&sim)
    };

    let tls = match &args.tls_cert {
        None => None,
        Some(cert) => {
            let key = args.tls_key.as_deref().unwrap_or(cert);
            match tls::acceptor(cert, key, args.tls_client_ca.as_deref()) {
                Ok(a) => Some(a),
                Err(e) => {
                    eprintln!("inferlb-sim: TLS: {e}");
                    std::process::exit(2);
                }
            }
        }
    };
    // The listener loop: closing it is how "refuse connections" is simulated.
    let mut pause = refuse_for;
    loop {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let listener = match bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("inferlb-sim: cannot listen on {}: {e}", args.listen);
                std::process::exit(1);
            }
        };
        eprintln!("inferlb-sim {} listening on {}", args.id, args.listen);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = match &tls {
            Some(acceptor) => {
                tokio::spawn(tls::serve(listener, acceptor.clone(), app.clone(), stop_rx))
            }
            None => {
                // Token events are small writes: without TCP_NODELAY each waits for a delayed
                // ACK.
                let listener = listener.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                let serve = axum::serve(listener, app.clone()).with_graceful_shutdown(async {
                    let _ = stop_rx.await;
                });
                tokio::spawn(async move {
                    let _ = serve.await;
                })
            }
        };
        match ctl_rx.recv().await {
            Some(d) => {
                // Give the control request's own response a moment to leave.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = stop_tx.send(());
                // Closing the socket is what matters; in-flight connections are left to finish.
                drop(server);
                pause = d;
            }
            None => {
                let _ = server.await;
                return;
            }
        }
    }
}

async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    // Rebinding right after closing must not fail on TIME_WAIT.
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// What the API tests share: replicas on free loopback ports, a client, streams read as events.
#[cfg(test)]
mod testkit {
    use super::*;

    /// A replica with `flags` (and a fast engine) serving on a free loopback port: its state
    /// and its base URL. It lives as long as the test's runtime.
    pub async fn serve(flags: &[&str]) -> (App, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut argv: Vec<String> = vec![
            "inferlb-sim".into(),
            format!("--listen={addr}"),
            "--prefill-tokens-per-s=1000000".into(),
            "--decode-interval-ms=1".into(),
        ];
        argv.extend(flags.iter().map(|f| f.to_string()));
        let args = Args::try_parse_from(argv).unwrap();
        let (ctl, _) = tokio::sync::mpsc::unbounded_channel();
        let tokens = load_tokens(&args).unwrap();
        let sim = replica(&args, ctl, None, tokens, 0, None);
        let app = router(&sim);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (sim, format!("http://{addr}"))
    }

    pub fn client() -> reqwest::Client {
        reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
    }

    /// Waits for `done`, checking every few milliseconds for at most 5 s.
    pub async fn until(what: &str, done: impl Fn() -> bool) {
        let limit = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < limit, "gave up waiting for {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A streamed answer's events (name, data), and whether its body broke off.
    pub async fn events(resp: reqwest::Response) -> (Vec<(String, Value)>, bool) {
        let mut resp = resp;
        let mut text = Vec::new();
        let broken = loop {
            match resp.chunk().await {
                Ok(Some(c)) => text.extend_from_slice(&c),
                Ok(None) => break false,
                Err(_) => break true,
            }
        };
        let text = String::from_utf8(text).unwrap();
        let events = text
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = Value::Null;
                for line in e.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        name = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data = serde_json::from_str(v).unwrap();
                    }
                }
                (name, data)
            })
            .collect();
        (events, broken)
    }

    /// The `kv_transfer_params` a router puts in a vLLM prefill leg.
    pub fn prefill_params() -> Value {
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    }

    pub fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod received_tests {
    use super::testkit::{client, serve};
    use super::*;

    async fn received(url: &str, query: &str) -> Vec<(String, String)> {
        let v: Value = client()
            .get(format!("{url}/sim/received{query}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["received"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["path"].as_str().unwrap().to_owned(),
                    e["body"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn the_last_bodies_posted_to_the_api_are_shown_as_sent() {
        let (_, url) = serve(&[]).await;
        let c = client();
        // As a balancer might write it: its own spacing and key order, kept byte for byte.
        let chat = r#"{ "messages":[{"role":"user","content":"hi"}],  "max_tokens":2 }"#;
        let resp = c
            .post(format!("{url}/v1/chat/completions"))
            .body(chat)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-sim-body-bytes"], chat.len().to_string());
        // Not UTF-8, and refused by the handler: still shown, lossily.
        let bad: &[u8] = b"{\"input\": \"caf\xff\"";
        let resp = c
            .post(format!("{url}/v1/responses"))
            .body(bad)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        // Neither a GET nor a POST outside /v1/ is recorded.
        c.get(format!("{url}/v1/models")).send().await.unwrap();
        c.post(format!("{url}/sim/fault"))
            .json(&json!({"fault": "none"}))
            .send()
            .await
            .unwrap();
        let got = received(&url, "").await;
        assert_eq!(
            got,
            [
                ("/v1/chat/completions".to_owned(), chat.to_owned()),
                (
                    "/v1/responses".to_owned(),
                    "{\"input\": \"caf\u{fffd}\"".to_owned()
                ),
            ]
        );
        assert_eq!(received(&url, "?n=1").await, got[1..]);
        assert!(received(&url, "?n=0").await.is_empty());
    }

    #[tokio::test]
    async fn the_ring_keeps_the_last_64_and_shows_16_unless_asked() {
        let (_, url) = serve(&[]).await;
        let c = client();
        for i in 0..70 {
            let resp = c
                .post(format!("{url}/v1/completions"))
                .body(format!(r#"{{"prompt":"p{i}","max_tokens":1}}"#))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
        }
        let body = |i: usize| format!(r#"{{"prompt":"p{i}","max_tokens":1}}"#);
        let all = received(&url, "?n=1000").await;
        assert_eq!(all.len(), 64);
        let want: Vec<(String, String)> = (6..70)
            .map(|i| ("/v1/completions".to_owned(), body(i)))
            .collect();
        assert_eq!(all, want, "oldest first");
        assert_eq!(received(&url, "").await, want[48..]);
        assert_eq!(received(&url, "?n=3").await, want[61..]);
        let resp = c
            .get(format!("{url}/sim/received?n=x"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
    }

    #[test]
    fn no_response_store_is_a_switch_a_config_file_can_set() {
        let parse = |flags: &[&str]| {
            let argv = std::iter::once("inferlb-sim").chain(flags.iter().copied());
            Args::try_parse_from(argv).unwrap().no_response_store
        };
        assert!(!parse(&[]));
        assert!(parse(&["--no-response-store"]));
        // How `load_args` passes `no_response_store: true` from YAML.
        assert!(parse(&["--no-response-store=true"]));
        assert!(!parse(&["--no-response-store=false"]));
        assert!(parse(&["--no-response-store", "--id=x"]));
    }
}
