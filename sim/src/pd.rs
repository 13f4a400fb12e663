//! Prefill/decode disaggregation: the KV handover of vLLM's NixlConnector and of SGLang's
//! bootstrap protocol, as a replica with a KV connector speaks them (`--kv-role`,
//! `--pd-protocol`).
//!
//! What is modelled is what a router sees and what the KV costs, not the transport:
//!
//! - **vLLM** (`--pd-protocol vllm`, NixlConnector's pull mode). A request whose
//!   `kv_transfer_params` say `do_remote_decode: true` reaches a producer: it is prefilled as
//!   usual (its prompt enters this replica's prefix cache), generates its token, and its answer
//!   carries the top-level `kv_transfer_params` vLLM's `request_finished()` returns on a P node
//!   (`do_remote_prefill: true`, `remote_engine_id`, `remote_request_id`, `remote_host`,
//!   `remote_port`, `remote_block_ids`, `remote_num_tokens`, ...). The prompt's blocks are then
//!   held under a lease (`--kv-lease-seconds`) until a decode pulls them or the lease passes.
//!   A request whose params say `do_remote_prefill: true` reaches a consumer: it looks up how
//!   much of the prompt its own prefix cache holds, pulls only the rest from
//!   `remote_host:remote_port` (the side channel is `POST /sim/kv/pull` on the producer
//!   itself), waits the modelled transfer time, caches the prompt and decodes. A pull that
//!   fails (unknown or expired request id, producer gone) fails the request, as vLLM's default
//!   `kv_load_failure_policy: fail` does.
//!
//!   vLLM 0.33 hands over on `/v1/chat/completions`, `/v1/completions`, `/v1/responses` and
//!   `/v1/messages`, and so does the simulator. The prefill's `kv_transfer_params` are a
//!   top-level field of each answer (the completion, the Responses object, the Anthropic
//!   message). A failed pull is vLLM's GenerationError ("Internal server error"), in each
//!   API's shape: not streamed, a 500 with the OpenAI-style
//!   `{"error": {"type": "InternalServerError", "code": 500, ...}}` (chat, completions,
//!   Responses) or Anthropic's `{"type": "error", "error": {"type": "api_error", ...}}`.
//!   Streamed, chat sends its role chunk, the error object and `[DONE]`; completions the
//!   error object and `[DONE]`; Messages `message_start` then `event: error`; Responses
//!   `response.created` and `response.in_progress`, then the stream breaks off (vLLM turns its
//!   error object into a Responses event, which fails validation, so the body ends unfinished).
//! - **SGLang** (`--pd-protocol sglang`). The router adds `bootstrap_host`, `bootstrap_port`
//!   and `bootstrap_room` and sends the request to both legs at once. The producer prefills
//!   and marks the room ready on its bootstrap server (`--bootstrap-port`, the same
//!   `POST /sim/kv/pull`); the consumer waits there for the room (bounded by the lease), pulls
//!   what its own cache lacks and decodes. A `both` replica takes the prefill leg when
//!   `bootstrap_port` is its own bootstrap port, else the decode leg. A producer or consumer
//!   refuses a request with no `bootstrap_room` (400, SGLang's "Invalid request: Disaggregated
//!   request received without bootstrap room id."), on every API: an SGLang server in a
//!   disaggregation mode serves nothing whole.
//!
//! Every duration (transfer time, lease) is modelled time, divided by `--speed`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::engine::{Engine, Pinned};

/// SGLang's refusal of a request with no bootstrap room, on a server in a disaggregation mode.
pub const NO_ROOM: &str =
    "Invalid request: Disaggregated request received without bootstrap room id.";

/// Which side of a KV handover this replica's connector serves (vLLM's `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvRole {
    /// No KV connector: handover fields are ignored (and counted).
    None,
    /// Prefill side (vLLM's `kv_producer`, SGLang's `--disaggregation-mode prefill`).
    Producer,
    /// Decode side (vLLM's `kv_consumer`, SGLang's `--disaggregation-mode decode`).
    Consumer,
    /// Either side (vLLM's `kv_both`).
    Both,
}

impl KvRole {
    pub fn name(self) -> &'static str {
        match self {
            KvRole::None => "none",
            KvRole::Producer => "producer",
            KvRole::Consumer => "consumer",
            KvRole::Both => "both",
        }
    }
    fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }
    fn consumes(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }
}

/// Which handover protocol the requests speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PdProtocol {
    /// vLLM's NixlConnector: `kv_transfer_params` in the request and the prefill's answer.
    Vllm,
    /// SGLang's bootstrap: `bootstrap_host`, `bootstrap_port`, `bootstrap_room`.
    Sglang,
}

impl PdProtocol {
    pub fn name(self) -> &'static str {
        match self {
            PdProtocol::Vllm => "vllm",
            PdProtocol::Sglang => "sglang",
        }
    }
}

#[derive(Debug, Clone)]
pub struct PdConf {
    pub role: KvRole,
    pub protocol: PdProtocol,
    /// SGLang: the bootstrap server's port on a producer.
    pub bootstrap_port: Option<u16>,
    /// Modelled pull speed, tokens per second, before the speed factor.
    pub transfer_tokens_per_s: f64,
    /// How long a producer holds pulled-for blocks, already divided by the speed factor.
    pub lease: Duration,
    /// This replica's engine id (`remote_engine_id`).
    pub engine_id: String,
    /// The side channel's address: this replica's own listen host and port.
    pub host: String,
    pub port: u16,
}

/// What a request asks of this replica's connector.
#[derive(Debug, Clone, PartialEq)]
pub enum Handover {
    /// Served whole.
    None,
    /// vLLM prefill leg: answer with `kv_transfer_params`, hold the blocks under a lease.
    VllmPrefill,
    /// vLLM decode leg: pull from the remote.
    VllmDecode(Remote),
    /// SGLang prefill leg: mark the room ready.
    SglangPrefill { room: u64 },
    /// SGLang decode leg: wait for the room at the bootstrap server, pull.
    SglangDecode { host: String, port: u16, room: u64 },
}

impl Handover {
    pub fn is_prefill(&self) -> bool {
        matches!(self, Handover::VllmPrefill | Handover::SglangPrefill { .. })
    }
    pub fn is_decode(&self) -> bool {
        matches!(
            self,
            Handover::VllmDecode(_) | Handover::SglangDecode { .. }
        )
    }
}

/// The producer named by a vLLM decode request's `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
    pub num_tokens: usize,
}

/// A producer's prompt blocks, held for a decode to pull.
struct Lease {
    tokens: usize,
    pinned: Pinned,
    /// Tells the expiry task which grant it belongs to (a key can be granted again).
    serial: u64,
    /// When it was granted: a pull after its lease passed fails even if the expiry task has
    /// not run yet (a loaded machine may run the pull first).
    granted: Instant,
}

#[derive(Default)]
pub struct PdCounters {
    /// Requests that carried handover fields this replica ignored (no connector, or fields
    /// of the other protocol or role).
    pub handover_fields_seen: AtomicU64,
    pub handover_prefill_requests: AtomicU64,
    pub handover_decode_requests: AtomicU64,
    /// Pulls of at least one token that succeeded, and the tokens they moved.
    pub kv_pulls: AtomicU64,
    pub kv_tokens_transferred: AtomicU64,
    /// Handovers that failed (the pull, or waiting for the room).
    pub kv_pull_failures: AtomicU64,
    /// Producer side: leases granted, taken by a pull, expired.
    pub kv_leases_granted: AtomicU64,
    pub kv_leases_pulled: AtomicU64,
    pub kv_leases_expired: AtomicU64,
}

pub struct Pd {
    pub conf: PdConf,
    engine: Arc<Engine>,
    /// Held blocks by `remote_request_id` (vLLM) or `room:N` (SGLang).
    leases: Mutex<HashMap<String, Lease>>,
    /// Wakes SGLang decodes waiting for a room.
    ready: Notify,
    next_serial: AtomicU64,
    next_block: AtomicU64,
    client: reqwest::Client,
    pub counters: PdCounters,
}

/// Why a handover failed: the message a client gets is vLLM's, this is for the log.
pub type PullError = String;

fn room_key(room: u64) -> String {
    format!("room:{room}")
}

fn as_u64(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

impl Pd {
    pub fn new(conf: PdConf, engine: Arc<Engine>) -> Arc<Pd> {
        Arc::new(Pd {
            conf,
            engine,
            leases: Mutex::new(HashMap::new()),
            ready: Notify::new(),
            next_serial: AtomicU64::new(0),
            next_block: AtomicU64::new(0),
            client: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .no_proxy()
                .build()
                .unwrap_or_default(),
            counters: PdCounters::default(),
        })
    }

    /// What the request body `obj` asks of this replica; counts fields it ignores.
    pub fn classify(&self, obj: &Map<String, Value>) -> Handover {
        let ktp = obj.get("kv_transfer_params").filter(|v| !v.is_null());
        let room = obj.get("bootstrap_room").filter(|v| !v.is_null());
        if ktp.is_none() && room.is_none() {
            return Handover::None;
        }
        let h = self.handover(ktp, room, obj);
        if h == Handover::None {
            self.counters
                .handover_fields_seen
                .fetch_add(1, Ordering::Relaxed);
        }
        h
    }

    fn handover(
        &self,
        ktp: Option<&Value>,
        room: Option<&Value>,
        obj: &Map<String, Value>,
    ) -> Handover {
        let role = self.conf.role;
        match self.conf.protocol {
            PdProtocol::Vllm => {
                let Some(p) = ktp.and_then(Value::as_object) else {
                    return Handover::None;
                };
                let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
                if flag("do_remote_decode") && role.produces() {
                    return Handover::VllmPrefill;
                }
                if flag("do_remote_prefill") && role.consumes() {
                    let s = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_owned);
                    let port = p.get("remote_port").and_then(as_u64);
                    if let (Some(engine_id), Some(request_id), Some(host), Some(port)) = (
                        s("remote_engine_id"),
                        s("remote_request_id"),
                        s("remote_host"),
                        port,
                    ) {
                        return Handover::VllmDecode(Remote {
                            engine_id,
                            request_id,
                            host,
                            port: port as u16,
                            num_tokens: p
                                .get("remote_num_tokens")
                                .and_then(as_u64)
                                .unwrap_or(u64::MAX)
                                .min(usize::MAX as u64)
                                as usize,
                        });
                    }
                }
                Handover::None
            }
            PdProtocol::Sglang => {
                let Some(room) = room.and_then(as_u64) else {
                    return Handover::None;
                };
                let port = obj.get("bootstrap_port").and_then(as_u64).map(|p| p as u16);
                let host = obj
                    .get("bootstrap_host")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                let own = port.is_some() && port == self.conf.bootstrap_port;
                let prefill = match role {
                    KvRole::Producer => true,
                    KvRole::Both => own,
                    _ => false,
                };
                if prefill {
                    return Handover::SglangPrefill { room };
                }
                match (role.consumes(), host, port) {
                    (true, Some(host), Some(port)) => Handover::SglangDecode { host, port, room },
                    _ => Handover::None,
                }
            }
        }
    }

    /// [`Pd::classify`] for the APIs only vLLM's connector hands over (Responses, Messages):
    /// SGLang's legs are served whole there, their fields counted as ignored.
    pub fn classify_vllm(&self, obj: &Map<String, Value>) -> Handover {
        match self.classify(obj) {
            Handover::SglangPrefill { .. } | Handover::SglangDecode { .. } => {
                self.counters
                    .handover_fields_seen
                    .fetch_add(1, Ordering::Relaxed);
                Handover::None
            }
            h => h,
        }
    }

    /// An SGLang server in a disaggregation mode (prefill or decode) refuses a request that
    /// names no bootstrap room, as SGLang's scheduler does (it cannot serve one whole): chat,
    /// completions, Responses and Messages alike, all of which reach its scheduler.
    pub fn refuses_whole(&self, obj: &Map<String, Value>) -> bool {
        self.conf.protocol == PdProtocol::Sglang
            && matches!(self.conf.role, KvRole::Producer | KvRole::Consumer)
            && obj.get("bootstrap_room").is_none_or(Value::is_null)
    }

    /// Counts a request taking part in a handover, per leg.
    pub fn count_leg(&self, h: &Handover) {
        let c = &self.counters;
        if h.is_prefill() {
            c.handover_prefill_requests.fetch_add(1, Ordering::Relaxed);
        } else if h.is_decode() {
            c.handover_decode_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Producer: holds `prompt`'s blocks under a lease keyed `key`, freed when pulled or when
    /// the lease passes. Returns the block ids (fake, but distinct while held).
    fn grant(self: &Arc<Self>, key: String, prompt: &[u8]) -> (usize, Vec<u64>) {
        let tokens = crate::engine::tokens(prompt);
        let pinned = self.engine.pin(prompt);
        let blocks = tokens.div_ceil(self.engine.conf.block_tokens.max(1)) as u64;
        let first = self.next_block.fetch_add(blocks, Ordering::Relaxed);
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let lease = Lease {
            tokens,
            pinned,
            serial,
            granted: Instant::now(),
        };
        let old = self
            .leases
            .lock()
            .ok()
            .and_then(|mut l| l.insert(key.clone(), lease));
        if let Some(old) = old {
            self.engine.unpin(old.pinned);
        }
        self.counters
            .kv_leases_granted
            .fetch_add(1, Ordering::Relaxed);
        self.ready.notify_waiters();
        let pd = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(pd.conf.lease).await;
            let expired = pd.leases.lock().ok().and_then(|mut l| match l.get(&key) {
                Some(x) if x.serial == serial => l.remove(&key),
                _ => None,
            });
            if let Some(lease) = expired {
                pd.engine.unpin(lease.pinned);
                pd.counters
                    .kv_leases_expired
                    .fetch_add(1, Ordering::Relaxed);
            }
        });
        (tokens, (first..first + blocks).collect())
    }

    /// Producer, vLLM: the prefill of `prompt` for request `request_id` is done; holds its
    /// blocks and returns the `kv_transfer_params` of the answer.
    pub fn vllm_prefilled(self: &Arc<Self>, request_id: &str, prompt: &[u8]) -> Value {
        let (tokens, blocks) = self.grant(request_id.to_owned(), prompt);
        let c = &self.conf;
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [blocks],
            "remote_engine_id": c.engine_id,
            "remote_request_id": request_id,
            "remote_host": c.host,
            "remote_port": c.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
        })
    }

    /// Producer, SGLang: the room's KV is ready.
    pub fn sglang_prefilled(self: &Arc<Self>, room: u64, prompt: &[u8]) {
        self.grant(room_key(room), prompt);
    }

    /// Producer: a decode takes the lease `key` (waiting up to `wait` for it to appear):
    /// the blocks are freed and their token count returned.
    pub async fn take(&self, key: &str, wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait.min(self.conf.lease);
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let lease = self.leases.lock().ok().and_then(|mut l| l.remove(key));
            if let Some(lease) = lease {
                self.engine.unpin(lease.pinned);
                if lease.granted.elapsed() >= self.conf.lease {
                    self.counters
                        .kv_leases_expired
                        .fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                self.counters
                    .kv_leases_pulled
                    .fetch_add(1, Ordering::Relaxed);
                return Some(lease.tokens);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// Leases held now.
    pub fn leases_held(&self) -> usize {
        self.leases.lock().map(|l| l.len()).unwrap_or(0)
    }

    /// The pull request a decode sends to the producer's side channel.
    async fn call(
        &self,
        host: &str,
        port: u16,
        body: Value,
        limit: Duration,
    ) -> Result<usize, PullError> {
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let url = format!("http://{host}:{port}/sim/kv/pull");
        let resp = self
            .client
            .post(&url)
            .timeout(limit + Duration::from_secs(2))
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let v: Value = resp.json().await.map_err(|e| format!("{url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{url}: {status}: {v}"));
        }
        v.get("tokens")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| format!("{url}: no `tokens` in {v}"))
    }

    /// Decode side: gets `prompt`'s KV for handover `h` (vLLM or SGLang), reusing what this
    /// replica's cache holds and pulling the rest with its modelled transfer time; the prompt
    /// is in this replica's cache afterwards. Returns the tokens pulled.
    pub async fn fetch(&self, h: &Handover, prompt: &[u8]) -> Result<usize, PullError> {
        let engine = &self.engine;
        let prompt_tokens = crate::engine::tokens(prompt);
        let local = engine.cached_prefix(prompt).min(prompt_tokens);
        let waiting = &engine.counters.waiting;
        waiting.fetch_add(1, Ordering::Relaxed);
        let result = self.pull(h, prompt_tokens, local).await;
        let result = match result {
            Ok(need) => {
                if need > 0 {
                    let secs = need as f64 / self.conf.transfer_tokens_per_s.max(1e-9);
                    tokio::time::sleep(engine.scaled(Duration::from_secs_f64(secs))).await;
                    let c = &self.counters;
                    c.kv_pulls.fetch_add(1, Ordering::Relaxed);
                    c.kv_tokens_transferred
                        .fetch_add(need as u64, Ordering::Relaxed);
                }
                engine.insert(prompt);
                Ok(need)
            }
            Err(e) => {
                self.counters
                    .kv_pull_failures
                    .fetch_add(1, Ordering::Relaxed);
                log::warn!("KV handover failed: {e}");
                Err(e)
            }
        };
        waiting.fetch_sub(1, Ordering::Relaxed);
        result
    }

    /// Asks the producer for the KV: the tokens to move (what it computed, up to the prompt,
    /// less what this replica holds).
    async fn pull(
        &self,
        h: &Handover,
        prompt_tokens: usize,
        local: usize,
    ) -> Result<usize, PullError> {
        match h {
            Handover::VllmDecode(r) => {
                let need = r.num_tokens.min(prompt_tokens).saturating_sub(local);
                let body = json!({
                    "remote_engine_id": r.engine_id,
                    "remote_request_id": r.request_id,
                    "tokens": need,
                });
                let got = self.call(&r.host, r.port, body, Duration::ZERO).await;
                if need == 0 {
                    // Nothing to read: the call only tells the producer to free its blocks,
                    // and its failure fails nothing (vLLM loads nothing then).
                    return Ok(0);
                }
                got.map(|_| need)
            }
            Handover::SglangDecode { host, port, room } => {
                let wait = self.conf.lease;
                let body = json!({"bootstrap_room": room, "wait_ms": wait.as_millis() as u64});
                let remote = self.call(host, *port, body, wait).await?;
                Ok(remote.min(prompt_tokens).saturating_sub(local))
            }
            _ => Ok(0),
        }
    }
}

/// `POST /sim/kv/pull` on a producer (its main port and its bootstrap port): takes the lease
/// named by `remote_request_id` (vLLM, with `remote_engine_id` this replica's) or
/// `bootstrap_room` (SGLang, waiting up to `wait_ms` for the room to be ready), frees its
/// blocks and answers `{"tokens": n}`; 404 when there is no such lease.
pub async fn pull_handler(pd: &Pd, body: &[u8]) -> (u16, Value) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return (400, json!({"error": "invalid JSON"}));
    };
    let (key, wait) = if let Some(room) = v.get("bootstrap_room").and_then(as_u64) {
        let wait = v.get("wait_ms").and_then(Value::as_u64).unwrap_or(0);
        (room_key(room), Duration::from_millis(wait))
    } else {
        let id = v.get("remote_request_id").and_then(Value::as_str);
        let engine = v.get("remote_engine_id").and_then(Value::as_str);
        match (id, engine) {
            (Some(id), Some(e)) if e == pd.conf.engine_id => (id.to_owned(), Duration::ZERO),
            (Some(_), Some(e)) => {
                return (404, json!({"error": format!("unknown engine id {e}")}));
            }
            _ => {
                return (
                    400,
                    json!({"error": "needs remote_request_id and remote_engine_id"}),
                )
            }
        }
    };
    if !pd.conf.role.produces() {
        return (404, json!({"error": "this replica is no KV producer"}));
    }
    match pd.take(&key, wait).await {
        Some(tokens) => (200, json!({"tokens": tokens})),
        None => (404, json!({"error": format!("no KV held for {key}")})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConf, Scheduler};

    fn pd(role: KvRole, lease_ms: u64) -> Arc<Pd> {
        let engine = Arc::new(Engine::new(EngineConf {
            prefill_tokens_per_s: 1000.0,
            decode_interval: Duration::from_millis(10),
            max_batch: 4,
            block_tokens: 4,
            cache_tokens: 4000,
            speed: 1.0,
            scheduler: Scheduler::Fcfs,
            max_num_batched_tokens: 100,
        }));
        Pd::new(
            PdConf {
                role,
                protocol: PdProtocol::Vllm,
                bootstrap_port: None,
                transfer_tokens_per_s: 1000.0,
                lease: Duration::from_millis(lease_ms),
                engine_id: "e1".into(),
                host: "127.0.0.1".into(),
                port: 1,
            },
            engine,
        )
    }

    fn pull_body(id: &str) -> Vec<u8> {
        json!({"remote_engine_id": "e1", "remote_request_id": id, "tokens": 1})
            .to_string()
            .into_bytes()
    }

    #[tokio::test(start_paused = true)]
    async fn a_pulled_lease_is_freed_and_cannot_be_pulled_twice() {
        let p = pd(KvRole::Producer, 30_000);
        let prompt = vec![b'x'; 4 * 40]; // 40 tokens, 10 blocks
        let params = p.vllm_prefilled("r1", &prompt);
        assert_eq!(params["remote_num_tokens"], 40);
        assert_eq!(
            params["remote_block_ids"][0].as_array().map(Vec::len),
            Some(10)
        );
        assert_eq!(params["remote_request_id"], "r1");
        assert!(p.engine.kv_usage() > 0.0, "the lease holds the blocks");
        assert_eq!(
            pull_handler(&p, &pull_body("r1")).await,
            (200, json!({"tokens": 40}))
        );
        assert_eq!(p.engine.kv_usage(), 0.0, "freed on the pull");
        assert_eq!(p.leases_held(), 0);
        assert_eq!(pull_handler(&p, &pull_body("r1")).await.0, 404);
        assert_eq!(pull_handler(&p, &pull_body("nope")).await.0, 404);
        let c = &p.counters;
        assert_eq!(c.kv_leases_pulled.load(Ordering::Relaxed), 1);
        assert_eq!(c.kv_leases_expired.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_is_freed_and_its_pull_fails() {
        let p = pd(KvRole::Producer, 1000);
        p.vllm_prefilled("r1", &[b'x'; 160]);
        tokio::time::sleep(Duration::from_millis(999)).await;
        assert_eq!(p.leases_held(), 1, "still held within the lease");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(p.leases_held(), 0);
        assert_eq!(p.engine.kv_usage(), 0.0);
        assert_eq!(p.counters.kv_leases_expired.load(Ordering::Relaxed), 1);
        assert_eq!(pull_handler(&p, &pull_body("r1")).await.0, 404);
    }

    #[tokio::test(start_paused = true)]
    async fn an_sglang_decode_waits_for_its_room_and_gives_up_at_the_deadline() {
        let p = pd(KvRole::Producer, 1000);
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.take(&room_key(7), Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        p.sglang_prefilled(7, &[b'y'; 80]);
        assert_eq!(waiter.await.unwrap(), Some(20));
        let t0 = Instant::now();
        assert_eq!(p.take(&room_key(8), Duration::from_secs(5)).await, None);
        assert_eq!(
            Instant::now() - t0,
            Duration::from_millis(1000),
            "bounded by the lease"
        );
    }

    /// A producer's side channel on a loopback port, as main serves it.
    async fn serve(p: Arc<Pd>) -> u16 {
        let app = axum::Router::new().route(
            "/sim/kv/pull",
            axum::routing::post(|body: axum::body::Bytes| async move {
                let (status, v) = pull_handler(&p, &body).await;
                (
                    axum::http::StatusCode::from_u16(status).unwrap(),
                    axum::Json(v),
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        port
    }

    #[tokio::test]
    async fn a_decode_pulls_only_what_its_own_cache_lacks() {
        let producer = pd(KvRole::Producer, 30_000);
        let port = serve(producer.clone()).await;
        let consumer = pd(KvRole::Consumer, 30_000);
        let prompt = vec![b'z'; 4 * 100]; // 100 tokens, 25 blocks of 4
        consumer.engine.insert(&prompt[..4 * 60]); // the decode holds the first 60 tokens
        let params = producer.vllm_prefilled("r1", &prompt);
        let remote = |id: &str| {
            Handover::VllmDecode(Remote {
                engine_id: "e1".into(),
                request_id: id.into(),
                host: "127.0.0.1".into(),
                port,
                num_tokens: params["remote_num_tokens"].as_u64().unwrap() as usize,
            })
        };
        assert_eq!(consumer.fetch(&remote("r1"), &prompt).await, Ok(40));
        assert_eq!(
            consumer.engine.cached_prefix(&prompt),
            100,
            "cached after the pull"
        );
        let c = &consumer.counters;
        assert_eq!(c.kv_tokens_transferred.load(Ordering::Relaxed), 40);
        assert_eq!(c.kv_pulls.load(Ordering::Relaxed), 1);
        assert_eq!(producer.leases_held(), 0, "the pull freed the lease");
        // The lease is gone: a second decode of the same id fails (its cache misses).
        let other = vec![b'w'; 4 * 100];
        producer.vllm_prefilled("r2", &other);
        assert!(consumer.fetch(&remote("r1"), &other).await.is_err());
        assert_eq!(c.kv_pull_failures.load(Ordering::Relaxed), 1);
        assert_eq!(consumer.engine.counters.waiting.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn roles_and_protocols_decide_the_leg() {
        let obj = |v: Value| v.as_object().cloned().unwrap();
        let prefill = obj(json!({"kv_transfer_params": {"do_remote_decode": true}}));
        let decode = obj(json!({"kv_transfer_params": {
            "do_remote_prefill": true, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 9, "remote_num_tokens": 12}}));
        let plain = pd(KvRole::None, 1000);
        assert_eq!(plain.classify(&prefill), Handover::None);
        assert_eq!(plain.classify(&decode), Handover::None);
        assert_eq!(
            plain.counters.handover_fields_seen.load(Ordering::Relaxed),
            2
        );
        let both = pd(KvRole::Both, 1000);
        assert_eq!(both.classify(&prefill), Handover::VllmPrefill);
        assert!(
            matches!(both.classify(&decode), Handover::VllmDecode(r) if r.num_tokens == 12 && r.port == 9)
        );
        assert_eq!(
            pd(KvRole::Consumer, 1000).classify(&prefill),
            Handover::None
        );
        assert_eq!(
            both.classify(&obj(json!({"max_tokens": 3}))),
            Handover::None
        );
    }
}
