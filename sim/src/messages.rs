//! The Anthropic Messages API: `POST /v1/messages` (streamed and not) and
//! `POST /v1/messages/count_tokens`, with Anthropic's usage: `input_tokens` counts only the
//! prompt tokens not read from the cache, `cache_read_input_tokens` the ones that were (the
//! cache is automatic, as vLLM's: `cache_control` breakpoints change nothing).
//!
//! With a KV connector (`--kv-role`, `--pd-protocol vllm`) a request's `kv_transfer_params`
//! make it a prefill or a decode leg of a handover, as on chat (see `pd`).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::engine::tokens;
use crate::job::{
    decode, finish, gate, named_sse, prefill, prefilled, seed_of, sse_response, tag, Decoded, Job,
    Leg, Usage, MAX_TOKENS,
};
use crate::render::{self, Bad, GENERATION_PROMPT};
use crate::App;

/// An error in Anthropic's shape.
fn error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        400 => "invalid_request_error",
        404 => "not_found_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, Json(body)).into_response()
}

/// A parsed `POST /v1/messages`.
struct Request {
    model: String,
    prompt: String,
    max_tokens: usize,
    /// Whether `max_tokens` asked for more than the simulator ever generates.
    capped: bool,
    stream: bool,
    /// The request, for its `kv_transfer_params`.
    body: Map<String, Value>,
}

fn parse(body: &[u8], default_model: &str, need_max_tokens: bool) -> Result<Request, Bad> {
    let whole = |message: String| Bad {
        param: String::new(),
        message,
    };
    let v: Value =
        serde_json::from_slice(body).map_err(|e| whole(format!("invalid JSON body: {e}")))?;
    let Value::Object(obj) = v else {
        return Err(whole("the body must be a JSON object".into()));
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => default_model,
        Some(Value::String(m)) if m.is_empty() => default_model,
        Some(Value::String(m)) => m.as_str(),
        Some(_) => return Err(render::bad("model", "must be a string")),
    }
    .to_owned();
    let (max_tokens, capped) = match obj.get("max_tokens") {
        None | Some(Value::Null) if need_max_tokens => {
            return Err(Bad {
                param: "max_tokens".into(),
                message: "max_tokens: Field required".into(),
            })
        }
        None | Some(Value::Null) => (1, false),
        Some(v) => {
            let n = v
                .as_u64()
                .filter(|n| *n >= 1)
                .ok_or_else(|| render::bad("max_tokens", "must be a positive integer"))?
                as usize;
            (n.min(MAX_TOKENS), n > MAX_TOKENS)
        }
    };
    let mut prompt = render::anthropic(
        obj.get("system"),
        obj.get("messages").unwrap_or(&Value::Null),
    )?;
    prompt.push_str(GENERATION_PROMPT);
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(render::bad("stream", "must be a boolean")),
    };
    Ok(Request {
        model,
        prompt,
        max_tokens,
        capped,
        stream,
        body: obj,
    })
}

fn usage_json(u: &Usage, output: usize) -> Value {
    json!({
        "input_tokens": u.prompt - u.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached,
        "output_tokens": output,
    })
}

/// The request after checks common to both endpoints, or the error to answer.
fn checked(sim: &App, body: &[u8], need_max_tokens: bool) -> Result<Request, (StatusCode, String)> {
    if sim.unhealthy() {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is starting".into(),
        ));
    }
    let models = sim.models();
    let default_model = models.first().map(String::as_str).unwrap_or("");
    let req = parse(body, default_model, need_max_tokens)
        .map_err(|b| (StatusCode::BAD_REQUEST, b.message))?;
    if !models.contains(&req.model) {
        return Err((StatusCode::NOT_FOUND, format!("model: {}", req.model)));
    }
    Ok(req)
}

pub async fn count_tokens(State(sim): State<App>, body: Bytes) -> Response {
    match checked(&sim, &body, false) {
        Ok(req) => Json(json!({"input_tokens": tokens(req.prompt.as_bytes())})).into_response(),
        Err((status, message)) => error(status, &message),
    }
}

pub async fn create(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let req = match checked(&sim, &body, true) {
        Ok(r) => r,
        Err((status, message)) => return error(status, &message),
    };
    if sim.pd.refuses_whole(&req.body) {
        return error(StatusCode::BAD_REQUEST, crate::pd::NO_ROOM);
    }
    let leg = Leg::of(&sim, &headers, &req.body, true);
    let cut_after = match gate(&sim).await {
        Ok(c) => c,
        Err((status, message)) => return error(status, message),
    };
    sim.pd.count_leg(&leg.handover);
    let id = sim.responses.new_id("msg");
    // The simulated model says all it has to say in the tokens asked for: it ends its turn
    // there, unless the simulator's own limit stopped it first.
    let stop_reason = if req.capped { "max_tokens" } else { "end_turn" };
    let mut job = Job {
        chat: true,
        model: req.model,
        seed: seed_of(&req.prompt),
        prompt: req.prompt,
        max_tokens: req.max_tokens,
        stream: req.stream,
        include_usage: false,
        script: None,
        // With --tokenizer, the ids of the chat body vLLM makes of the request; else (or where
        // that conversion refuses it, an image say) the simulator's rendering.
        ids: sim
            .tokens
            .as_ref()
            .and_then(|t| t.messages_ids_within(&body, usize::MAX).ok())
            .map(|c| crate::engine::token_bytes(&c.ids.to_vec())),
    };
    leg.shape(&mut job);
    let resp = if job.stream {
        stream(sim.clone(), job, leg, id, stop_reason, cut_after)
    } else {
        whole(sim.clone(), job, leg, id, stop_reason).await
    };
    tag(&sim, &body, resp)
}

fn message(id: &str, job: &Job, content: Value, stop_reason: Value, usage: Value) -> Value {
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": usage,
    })
}

/// A decode leg's KV: pulled, or `false` when the pull failed.
async fn pull(sim: &App, job: &Job, leg: &Leg) -> bool {
    !leg.handover.is_decode()
        || sim
            .pd
            .fetch(&leg.handover, job.engine_prompt())
            .await
            .is_ok()
}

/// What vLLM says of a request whose KV could not be loaded (its GenerationError).
const KV_LOAD_FAILED: &str = "Internal server error";

async fn whole(sim: App, job: Job, leg: Leg, id: String, stop_reason: &str) -> Response {
    if !pull(&sim, &job, &leg).await {
        return error(StatusCode::INTERNAL_SERVER_ERROR, KV_LOAD_FAILED);
    }
    let (mut running, usage) = prefill(&sim, &job).await;
    let kv_transfer_params = prefilled(&sim, &job, &leg);
    let mut reply = String::new();
    let (_, n) = decode(
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
    let mut answer = message(
        &id,
        &job,
        json!([{"type": "text", "text": reply}]),
        json!(stop_reason),
        usage_json(&usage, n),
    );
    if let Some(p) = kv_transfer_params {
        // A top-level field of the message, as vLLM's `AnthropicMessagesResponse` has it.
        answer["kv_transfer_params"] = p;
    }
    Json(answer).into_response()
}

fn event(kind: &str, data: Value) -> Bytes {
    let mut data = match data {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    data.insert("type".into(), json!(kind));
    named_sse(kind, &Value::Object(data))
}

fn stream(
    sim: App,
    job: Job,
    leg: Leg,
    id: String,
    stop_reason: &'static str,
    cut_after: Option<usize>,
) -> Response {
    let (tx, resp) = sse_response();
    tokio::spawn(async move {
        let pulled = tokio::select! {
            pulled = pull(&sim, &job, &leg) => pulled,
            _ = tx.closed() => return,
        };
        if !pulled {
            // As vLLM streams it: `message_start` for the first (failed) output, then the
            // error event, and the stream ends (no `message_stop`).
            let usage = json!({"input_tokens": tokens(job.engine_prompt()), "output_tokens": 0});
            let start = message(&id, &job, json!([]), Value::Null, usage);
            let failed = json!({"error": {"type": "api_error", "message": KV_LOAD_FAILED}});
            for ev in [
                event("message_start", json!({"message": start})),
                event("error", failed),
            ] {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            return;
        }
        let (mut running, usage) = tokio::select! {
            done = prefill(&sim, &job) => done,
            _ = tx.closed() => return,
        };
        let start = message(&id, &job, json!([]), Value::Null, usage_json(&usage, 1));
        let opening = [
            event("message_start", json!({"message": start})),
            event(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", json!({})),
        ];
        for ev in opening {
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
        let mut reply = String::new();
        let (how, n) = decode(
            &sim,
            &job,
            &mut running,
            cut_after,
            None,
            Some(&tx),
            |t| {
                event(
                    "content_block_delta",
                    json!({"index": 0, "delta": {"type": "text_delta", "text": t}}),
                )
            },
            &mut reply,
        )
        .await;
        if how != Decoded::Done {
            return;
        }
        drop(running);
        finish(&sim, &job, &reply);
        let closing = [
            event("content_block_stop", json!({"index": 0})),
            event(
                "message_delta",
                json!({"delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": n}}),
            ),
            event("message_stop", json!({})),
        ];
        for ev in closing {
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
    });
    resp
}

#[cfg(test)]
mod handover_tests {
    use serde_json::{json, Value};

    use crate::testkit::{client, count, events, prefill_params, serve, until};

    /// The prefill leg a router sends for `body`, and the `kv_transfer_params` of its answer.
    async fn prefill(url: &str, body: &Value) -> Value {
        let mut leg = body.clone();
        leg["max_tokens"] = json!(1);
        leg["stream"] = json!(false);
        leg["kv_transfer_params"] = prefill_params();
        let resp = client()
            .post(format!("{url}/v1/messages"))
            .json(&leg)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let answer: Value = resp.json().await.unwrap();
        assert_eq!(answer["type"], "message");
        answer["kv_transfer_params"].clone()
    }

    fn body() -> Value {
        json!({"model": "sim-model", "max_tokens": 5,
               "messages": [{"role": "user", "content": "Tell me about the long road north."}]})
    }

    #[tokio::test]
    async fn a_prefill_answers_with_its_params_and_a_decode_pulls_only_what_it_lacks() {
        let (p, p_url) = serve(&["--kv-role=producer"]).await;
        let (d, d_url) = serve(&["--kv-role=consumer", "--block-tokens=4"]).await;
        // The decode replica holds the conversation's first turn already: it is served there
        // whole, and the handed-over request is its next turn.
        let first = body();
        let r = client()
            .post(format!("{d_url}/v1/messages"))
            .json(&first)
            .send()
            .await
            .unwrap();
        let reply: Value = r.json().await.unwrap();
        let mut next = first.clone();
        next["messages"] = json!([
            first["messages"][0],
            {"role": "assistant", "content": reply["content"][0]["text"]},
            {"role": "user", "content": "And then what happened on the way?"},
        ]);
        let mut prompt = crate::render::anthropic(None, &next["messages"]).unwrap();
        prompt.push_str(crate::render::GENERATION_PROMPT);
        let cached = d.engine.cached_prefix(prompt.as_bytes()) as u64;
        assert!(cached > 0, "the first turn is cached");
        let params = prefill(&p_url, &next).await;
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["remote_engine_id"], p.pd.conf.engine_id.as_str());
        assert_eq!(params["remote_host"], "127.0.0.1");
        assert_eq!(params["remote_port"], p.args.listen.port());
        assert_eq!(p.pd.leases_held(), 1, "the prefill holds its blocks");
        assert_eq!(count(&p.pd.counters.handover_prefill_requests), 1);
        let prompt_tokens = params["remote_num_tokens"].as_u64().unwrap();
        assert_eq!(
            prompt_tokens,
            crate::engine::tokens(prompt.as_bytes()) as u64
        );

        let mut leg = next;
        leg["kv_transfer_params"] = params;
        let resp = client()
            .post(format!("{d_url}/v1/messages"))
            .json(&leg)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let answer: Value = resp.json().await.unwrap();
        assert_eq!(answer["type"], "message");
        assert!(answer.get("kv_transfer_params").is_none());
        assert_eq!(answer["usage"]["output_tokens"], 5);
        let c = &d.pd.counters;
        assert_eq!(count(&c.handover_decode_requests), 1);
        assert_eq!(count(&c.kv_pulls), 1);
        assert_eq!(
            count(&c.kv_tokens_transferred),
            prompt_tokens - cached,
            "only what the decode's cache lacked"
        );
        assert_eq!(
            answer["usage"]["cache_read_input_tokens"],
            prompt_tokens / 4 * 4,
            "the prompt's whole blocks are cached after the pull"
        );
        assert_eq!(p.pd.leases_held(), 0);
    }

    #[tokio::test]
    async fn a_decode_of_an_expired_lease_fails_as_vllm_answers_it() {
        let (p, p_url) = serve(&["--kv-role=producer", "--kv-lease-seconds=0.02"]).await;
        let (d, d_url) = serve(&["--kv-role=consumer"]).await;
        let params = prefill(&p_url, &body()).await;
        until("the lease to expire", || {
            count(&p.pd.counters.kv_leases_expired) == 1
        })
        .await;
        let mut leg = body();
        leg["kv_transfer_params"] = params;
        let url = format!("{d_url}/v1/messages");
        let failed = json!({"type": "error",
                            "error": {"type": "api_error", "message": "Internal server error"}});

        let resp = client().post(&url).json(&leg).send().await.unwrap();
        assert_eq!(resp.status(), 500);
        assert_eq!(resp.json::<Value>().await.unwrap(), failed);

        // Streamed: message_start for the first (failed) output, the error event, the end.
        leg["stream"] = json!(true);
        let resp = client().post(&url).json(&leg).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let (evs, broken) = events(resp).await;
        assert!(!broken);
        let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["message_start", "error"]);
        let start = &evs[0].1["message"];
        assert_eq!(start["content"], json!([]));
        assert_eq!(start["usage"]["output_tokens"], 0);
        assert_eq!(evs[1].1, failed);

        let c = &d.pd.counters;
        assert_eq!(count(&c.handover_decode_requests), 2);
        assert_eq!(count(&c.kv_pull_failures), 2);
        assert_eq!(count(&c.kv_pulls), 0);
        assert_eq!(count(&d.engine.counters.generation_tokens), 0);
    }
}
