//! Every endpoint but the generation APIs: `/v1/models`, `/health`, `/metrics` (vLLM's names),
//! `/sim/stats`, vLLM's render endpoints and `/reset_prefix_cache`, the KV side channel, and the
//! test controls (`/sim/fault`, `/sim/echo`, `/sim/received`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::engine;
use crate::openai::parse_job;
use crate::pd::{self, Pd};
use crate::{error, now_secs, App, Fault, FaultRequest, FaultState, Sim};

pub(crate) async fn models(State(sim): State<App>) -> Response {
    let data: Vec<Value> = sim
        .models()
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": now_secs(), "owned_by": "inferlb-sim", "max_model_len": 131072}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// When this process started, in seconds since the Unix epoch: `process_start_time_seconds`,
/// which Python's Prometheus client (vLLM's, SGLang's) exports and which tells a restart.
static STARTED: OnceLock<f64> = OnceLock::new();

/// Notes the process's start; `main` calls it first.
pub(crate) fn note_start() -> f64 {
    *STARTED.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    })
}

pub(crate) async fn health(State(sim): State<App>) -> Response {
    if sim.unhealthy() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    StatusCode::OK.into_response()
}

/// `/metrics` in vLLM's names and shapes: the engine's gauges and counters with vLLM's
/// `engine` and `model_name` labels, and `vllm:cache_config_info`, the info-style gauge
/// (always 1) whose labels are vLLM's CacheConfig as strings (no `model_name`).
pub(crate) async fn metrics(State(sim): State<App>) -> Response {
    metrics_of(&[sim])
}

/// The `/metrics` page of a server whose engines are `sims` (one, or each data-parallel
/// rank's): every series once, with a sample per engine labelled `engine="k"`, as vLLM labels
/// them.
pub(crate) fn metrics_of(sims: &[App]) -> Response {
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
    let hidden = |name: &str| {
        name == "vllm:prompt_tokens_total" && sims.first().is_some_and(|s| s.args.no_prompt_counter)
    };
    for (name, kind, help, value) in series.into_iter().filter(|s| !hidden(s.0)) {
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
    // The server's, once (every rank is in one process).
    if sims.first().is_some_and(|s| !s.args.no_start_time) {
        body.push_str("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n");
        body.push_str("# TYPE process_start_time_seconds gauge\n");
        body.push_str(&format!("process_start_time_seconds {}\n", note_start()));
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

pub(crate) async fn render_chat(State(sim): State<App>, body: Bytes) -> Response {
    match rendered(&sim, &body, true) {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

/// A completions prompt renders as a list, one entry per prompt, as vLLM answers.
pub(crate) async fn render_completions(State(sim): State<App>, body: Bytes) -> Response {
    match rendered(&sim, &body, false) {
        Ok(v) => Json(json!([v])).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

/// vLLM's `POST /reset_prefix_cache`.
pub(crate) async fn reset_prefix_cache(State(sim): State<App>) -> Response {
    sim.engine.reset_prefix_cache();
    StatusCode::OK.into_response()
}

pub(crate) async fn stats(State(sim): State<App>) -> Response {
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
pub(crate) async fn kv_pull(State(pd): State<Arc<Pd>>, body: Bytes) -> Response {
    let (status, v) = pd::pull_handler(&pd, &body).await;
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(v),
    )
        .into_response()
}

pub(crate) async fn set_fault(State(sim): State<App>, Json(req): Json<FaultRequest>) -> Response {
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
pub(crate) async fn echo(
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
pub(crate) const RECEIVED_KEPT: usize = 64;

/// Keeps the body of every `POST /v1/*` request in the ring `GET /sim/received` reads, then
/// hands the request on unchanged.
pub(crate) async fn record_received(
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
pub(crate) struct ReceivedQuery {
    n: Option<usize>,
}

/// `GET /sim/received?n=K`: the last K (default 16, at most 64) bodies received on
/// `POST /v1/*`, oldest first, each as UTF-8 (lossily), for tests of what a proxy sent.
pub(crate) async fn received(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{client, serve};

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
}
