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
//!   in tokens, ..., `vllm:cache_config_info`, and `process_start_time_seconds` as Python's
//!   Prometheus client gives it), `/sim/stats` (the same, plus what the engine
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
//!
//! Rooms: `args` (the flags), `job` (what every API shares: the request as the engine sees it,
//! the gate, prefill, the streamed decode), the APIs (`openai`, `responses`, `messages`), and
//! `endpoints` (everything else a replica serves); this file holds the replica's state, its
//! router and `main`.

mod args;
mod dp;
mod endpoints;
mod engine;
mod job;
mod kvpub;
mod messages;
mod openai;
mod pd;
mod render;
mod responses;
mod server_info;
mod tls;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use args::{load_args, load_tokens, Args};
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use endpoints::{
    echo, health, kv_pull, metrics, models, received, record_received, render_chat,
    render_completions, reset_prefix_cache, set_fault, stats, RECEIVED_KEPT,
};
use engine::{Engine, EngineConf};
use inferlb_tokens::ModelTokens;
use job::ResetFault;
use openai::{chat_completions, completions};
use pd::{KvRole, Pd, PdConf};
use serde::Deserialize;
use serde_json::json;
use tokio::time::Instant;

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
    /// Send a stream's header, then cut the connection once its prefill is done, before the
    /// first token (an engine lost during a prefill, after its server began the answer).
    CutBeforeToken,
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
    endpoints::note_start();
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
    use std::sync::atomic::Ordering;

    use clap::Parser;
    use serde_json::Value;

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
