//! OpenAI chat and completions: the body parsed into a `Job` (tokenized when the replica has a
//! tokenizer), answered whole or streamed with `data: [DONE]`.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use inferlb_tokens::ModelTokens;
use serde_json::{json, Value};

use crate::engine;
use crate::job::{
    decode, finish, gate, kv_load_failed, prefill, prefilled, seed_of, sse, tag, Decoded, Job, Leg,
    Usage, MAX_TOKENS,
};
use crate::pd;
use crate::render::{content_text, render_message, GENERATION_PROMPT};
use crate::{error, now_secs, App};

pub(crate) fn parse_job(
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
pub(crate) fn tokenized(
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

pub(crate) async fn chat_completions(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    complete(sim, headers, body, true).await
}

pub(crate) async fn completions(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    complete(sim, headers, body, false).await
}

pub(crate) async fn complete(
    sim: App,
    headers: axum::http::HeaderMap,
    body: Bytes,
    chat: bool,
) -> Response {
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

pub(crate) fn usage_json(u: &Usage, completion: usize) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": completion,
        "total_tokens": u.prompt + completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    })
}

pub(crate) async fn whole_response(sim: App, job: Job, leg: Leg) -> Response {
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

pub(crate) async fn stream_response(
    sim: App,
    job: Job,
    leg: Leg,
    cut_after: Option<usize>,
) -> Response {
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
