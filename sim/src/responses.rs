//! The OpenAI Responses API: `POST /v1/responses` (streamed and not), `GET` and `DELETE
//! /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, and the in-memory store that
//! `previous_response_id` reads, one per replica as vLLM keeps it.
//!
//! A continuation's prompt is the stored response's whole prompt (its instructions and input,
//! and before them its own previous ones) followed by its output, then the new input: what the
//! replica renders, so a conversation chained by id finds its history warm, as a chat
//! conversation resending its history does. The instructions in force are the request's own
//! when it gives some (they replace the previous ones, as OpenAI's do), else the previous
//! response's; sent again unchanged, they keep the whole prompt warm.
//!
//! With `--no-response-store` nothing is stored, as vLLM keeps nothing without
//! VLLM_ENABLE_RESPONSES_API_STORE. A `tool_choice` that forces a function makes the output one
//! `function_call` item instead of the message (see `forced_call`).
//!
//! With a KV connector (`--kv-role`, `--pd-protocol vllm`) a request's `kv_transfer_params`
//! make it a prefill or a decode leg of a handover, as on chat (see `pd`).

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lru::LruCache;
use serde_json::{json, Map, Value};

use crate::engine::token_text;
use crate::job::{
    cut, decode, finish, gate, kv_load_failed, named_sse, prefill, prefilled, seed_of,
    sse_response, tag, Decoded, Job, Leg, Usage, MAX_TOKENS,
};
use crate::render::{self, render_message, Bad, GENERATION_PROMPT};
use crate::{now_secs, App};

/// An error in OpenAI's shape.
fn oai_error(
    status: StatusCode,
    message: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
    (status, Json(body)).into_response()
}

fn bad_request(b: Bad) -> Response {
    let param = (!b.param.is_empty()).then_some(b.param.as_str());
    oai_error(StatusCode::BAD_REQUEST, &b.message, param, None)
}

fn not_found(id: &str, param: Option<&str>) -> Response {
    oai_error(
        StatusCode::NOT_FOUND,
        &format!("Response with id '{id}' not found."),
        param,
        None,
    )
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Status {
    InProgress,
    Completed,
    Cancelled,
    Failed,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Cancelled => "cancelled",
            Status::Failed => "failed",
        }
    }
}

/// One request of a conversation, rendered: what a continuation of it starts with. Turns are
/// shared: a conversation's history is its chain of parents, each held as long as a stored
/// response continues it.
pub struct Turn {
    /// The instructions in force, rendered first as the system message.
    instructions: Option<Arc<str>>,
    parent: Option<Arc<Turn>>,
    /// This request's input items and its output, rendered.
    text: String,
    /// Bytes this turn holds alone, counted in the store's budget while it lives.
    bytes: usize,
    live: Arc<AtomicUsize>,
}

impl Turn {
    /// The conversation up to and including this turn, without the instructions.
    fn history(&self) -> String {
        let mut parts = vec![self.text.as_str()];
        let mut up = self.parent.as_deref();
        while let Some(t) = up {
            parts.push(&t.text);
            up = t.parent.as_deref();
        }
        parts.into_iter().rev().collect()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::Relaxed);
        // Unlinks a long chain one turn at a time instead of recursing through it.
        let mut up = self.parent.take();
        while let Some(p) = up {
            up = match Arc::try_unwrap(p) {
                Ok(mut t) => t.parent.take(),
                Err(_) => None,
            };
        }
    }
}

struct Entry {
    /// The response object as last recorded.
    json: String,
    status: Status,
    /// Set once the response is over, for `previous_response_id`.
    turn: Option<Arc<Turn>>,
    cancel: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
}

impl Entry {
    fn set_json(&mut self, json: String) {
        self.live.fetch_add(json.len(), Ordering::Relaxed);
        self.live.fetch_sub(self.json.len(), Ordering::Relaxed);
        self.json = json;
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.live.fetch_sub(self.json.len(), Ordering::Relaxed);
    }
}

/// Why a `previous_response_id` cannot be continued.
enum Unusable {
    Missing,
    Status(Status),
}

/// The stored responses: least recently used go first, past a count or a byte budget.
pub struct Store {
    entries: Mutex<LruCache<String, Entry>>,
    /// Bytes of text held by entries and the turns they keep alive.
    live: Arc<AtomicUsize>,
    max_bytes: usize,
    /// Tells this process's ids apart from every other simulator's, restarts included.
    instance: u64,
    counter: AtomicU64,
}

impl Store {
    pub fn new(sim_id: &str, max_entries: usize, max_bytes: usize) -> Store {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let instance = xxhash_rust::xxh3::xxh3_64(
            format!("{sim_id}\0{}\0{started}", std::process::id()).as_bytes(),
        );
        Store {
            entries: Mutex::new(LruCache::new(
                NonZeroUsize::new(max_entries).unwrap_or(NonZeroUsize::MIN),
            )),
            live: Arc::new(AtomicUsize::new(0)),
            max_bytes,
            instance,
            counter: AtomicU64::new(0),
        }
    }

    /// A new id, `{prefix}_` and 32 hex digits, unique across simulator processes.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}_{:016x}{n:016x}", self.instance)
    }

    fn lock(&self) -> MutexGuard<'_, LruCache<String, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn shrink(&self, entries: &mut LruCache<String, Entry>) {
        while self.live.load(Ordering::Relaxed) > self.max_bytes && entries.len() > 1 {
            entries.pop_lru();
        }
    }

    fn turn(
        &self,
        instructions: Option<Arc<str>>,
        fresh_instructions: bool,
        parent: Option<Arc<Turn>>,
        text: String,
    ) -> Arc<Turn> {
        let mut bytes = text.len();
        if fresh_instructions {
            bytes += instructions.as_deref().map_or(0, str::len);
        }
        self.live.fetch_add(bytes, Ordering::Relaxed);
        Arc::new(Turn {
            instructions,
            parent,
            text,
            bytes,
            live: self.live.clone(),
        })
    }

    fn insert(&self, id: &str, json: String, cancel: Arc<AtomicBool>) {
        self.live.fetch_add(json.len(), Ordering::Relaxed);
        let entry = Entry {
            json,
            status: Status::InProgress,
            turn: None,
            cancel,
            live: self.live.clone(),
        };
        let mut entries = self.lock();
        entries.put(id.to_owned(), entry);
        self.shrink(&mut entries);
    }

    /// Records how a response ended; one deleted (or evicted) meanwhile stays gone.
    fn record(&self, id: &str, json: String, status: Status, turn: Option<Arc<Turn>>) {
        let mut entries = self.lock();
        if let Some(e) = entries.peek_mut(id) {
            e.set_json(json);
            e.status = status;
            e.turn = turn;
        }
        self.shrink(&mut entries);
    }

    fn get(&self, id: &str) -> Option<String> {
        self.lock().get(id).map(|e| e.json.clone())
    }

    fn delete(&self, id: &str) -> bool {
        self.lock().pop(id).is_some()
    }

    /// Cancels a response in progress (its generation stops at the next token); the object as
    /// it then stands.
    fn cancel(&self, id: &str) -> Option<String> {
        let mut entries = self.lock();
        let e = entries.get_mut(id)?;
        if e.status == Status::InProgress {
            e.cancel.store(true, Ordering::Relaxed);
            e.status = Status::Cancelled;
            if let Ok(mut v) = serde_json::from_str::<Value>(&e.json) {
                v["status"] = json!(Status::Cancelled.as_str());
                e.set_json(v.to_string());
            }
        }
        Some(e.json.clone())
    }

    fn continuation(&self, id: &str) -> Result<Arc<Turn>, Unusable> {
        let mut entries = self.lock();
        let e = entries.get(id).ok_or(Unusable::Missing)?;
        e.turn.clone().ok_or(Unusable::Status(e.status))
    }
}

/// A parsed `POST /v1/responses`.
struct Request {
    model: String,
    instructions: Option<String>,
    /// The input items, rendered.
    input: String,
    previous: Option<String>,
    max_tokens: usize,
    stream: bool,
    store: bool,
    background: bool,
    /// The function the request's `tool_choice` makes the model call, if it forces one.
    call: Option<String>,
    /// The request, for the fields the response object repeats.
    body: Map<String, Value>,
}

fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, Bad> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(render::bad(key, "must be a string")),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, Bad> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(render::bad(key, "must be a boolean")),
    }
}

fn parse(body: &[u8], default_model: &str, default_max: usize) -> Result<Request, Bad> {
    let v: Value = serde_json::from_slice(body).map_err(|e| Bad {
        param: String::new(),
        message: format!("invalid JSON body: {e}"),
    })?;
    let Value::Object(obj) = v else {
        return Err(Bad {
            param: String::new(),
            message: "the body must be a JSON object".into(),
        });
    };
    let model = opt_str(&obj, "model")?
        .filter(|m| !m.is_empty())
        .unwrap_or(default_model)
        .to_owned();
    let instructions = opt_str(&obj, "instructions")?.map(str::to_owned);
    let input = render::responses_input(obj.get("input").unwrap_or(&Value::Null))?;
    let previous = opt_str(&obj, "previous_response_id")?.map(str::to_owned);
    let max_tokens = match obj.get("max_output_tokens") {
        None | Some(Value::Null) => default_max,
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| render::bad("max_output_tokens", "must be a positive integer"))?
            as usize,
    }
    .min(MAX_TOKENS);
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    let store = opt_bool(&obj, "store")?.unwrap_or(true);
    let background = opt_bool(&obj, "background")?.unwrap_or(false);
    if obj
        .get("tools")
        .is_some_and(|t| !t.is_null() && !t.is_array())
    {
        return Err(render::bad("tools", "must be a list"));
    }
    let call = forced_call(&obj)?;
    Ok(Request {
        model,
        instructions,
        input,
        previous,
        max_tokens,
        stream,
        store,
        background,
        call,
        body: obj,
    })
}

/// The function a request must call: with `tool_choice` `"required"`, its first function
/// tool; with `{"type": "function", "name": X}`, X. Any other choice (`auto`, `none`, absent)
/// leaves the model to answer in a message, as does `required` among tools of other types
/// only. vLLM's errors for a choice its tools cannot meet.
fn forced_call(obj: &Map<String, Value>) -> Result<Option<String>, Bad> {
    let tools = obj
        .get("tools")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut functions = tools
        .iter()
        .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
        .filter_map(|t| t.get("name").and_then(Value::as_str));
    let refused = |message: &str| Bad {
        param: "tool_choice".into(),
        message: message.into(),
    };
    match obj.get("tool_choice") {
        Some(Value::String(c)) if c == "required" => {
            if tools.is_empty() {
                return Err(refused(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                ));
            }
            Ok(functions.next().map(str::to_owned))
        }
        Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            match c.get("name").and_then(Value::as_str) {
                Some(name) if functions.any(|f| f == name) => Ok(Some(name.to_owned())),
                _ => Err(refused(
                    "Tool choice 'function' not found in 'tools' parameter.",
                )),
            }
        }
        _ => Ok(None),
    }
}

/// A function call's arguments, token by token: a short JSON object of words drawn from the
/// prompt's seed, `{"query": "w1 w2 w3"}` in 5 tokens (fewer words when `max_tokens` is
/// smaller, never fewer than 3 tokens: the object stays whole).
fn call_arguments(seed: u64, max_tokens: usize) -> Vec<String> {
    let words = max_tokens.saturating_sub(2).clamp(1, 3);
    let mut tokens = vec![r#"{"query": ""#.to_owned()];
    for i in 0..words {
        let w = token_text(seed, i).trim_end();
        tokens.push(if i == 0 {
            w.to_owned()
        } else {
            format!(" {w}")
        });
    }
    tokens.push(r#""}"#.to_owned());
    tokens
}

/// The function call a response makes instead of a message.
struct Call {
    id: String,
    call_id: String,
    name: String,
}

/// What every version of one response object shares.
struct Meta {
    id: String,
    msg_id: String,
    created_at: u64,
    model: String,
    instructions: Option<Arc<str>>,
    previous: Option<String>,
    store: bool,
    /// Set when the output is a function call rather than a message.
    call: Option<Call>,
    request: Map<String, Value>,
}

impl Meta {
    fn object(&self, status: Status, output: Value, usage: Value) -> Value {
        let echo = |key: &str, default: Value| {
            self.request
                .get(key)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(default)
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status.as_str(),
            "background": false,
            "error": null,
            "incomplete_details": null,
            "instructions": self.instructions.as_deref(),
            "max_output_tokens": echo("max_output_tokens", Value::Null),
            "max_tool_calls": null,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": echo("parallel_tool_calls", json!(true)),
            "previous_response_id": self.previous,
            "reasoning": echo("reasoning", json!({"effort": null, "summary": null})),
            "service_tier": "default",
            "store": self.store,
            "temperature": echo("temperature", json!(1.0)),
            "text": echo("text", json!({"format": {"type": "text"}})),
            "tool_choice": echo("tool_choice", json!("auto")),
            "tools": echo("tools", json!([])),
            "top_logprobs": 0,
            "top_p": echo("top_p", json!(1.0)),
            "truncation": echo("truncation", json!("disabled")),
            "usage": usage,
            "user": echo("user", Value::Null),
            "metadata": echo("metadata", json!({})),
        })
    }

    /// The output item: the message (its text, none while in progress) or the function call
    /// (its arguments so far).
    fn item(&self, status: &str, text: Option<&str>) -> Value {
        if let Some(c) = &self.call {
            return json!({"type": "function_call", "id": c.id, "call_id": c.call_id,
                          "name": c.name, "arguments": text.unwrap_or(""), "status": status});
        }
        let content = match text {
            Some(t) => json!([text_part(t)]),
            None => json!([]),
        };
        json!({"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content})
    }

    /// What the assistant said, as a continuation's prompt shows it.
    fn said(&self, reply: &str) -> String {
        match &self.call {
            Some(c) => render::tool_call(&c.name, reply),
            None => reply.to_owned(),
        }
    }

    /// The object once generation is over, and its status.
    fn finished(&self, how: Decoded, reply: &str, usage: &Usage, output: usize) -> (Value, Status) {
        let (status, item) = if how == Decoded::Cancelled {
            (Status::Cancelled, "incomplete")
        } else {
            (Status::Completed, "completed")
        };
        let output_items = json!([self.item(item, Some(reply))]);
        let usage = json!({
            "input_tokens": usage.prompt,
            "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt + output,
        });
        (self.object(status, output_items, usage), status)
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A stored response whose request runs: if the request ends without recording how it ended
/// (the client gone, the handler dropped), the store says it was cancelled.
struct Pending {
    sim: App,
    id: String,
    in_progress: Value,
    armed: bool,
}

impl Pending {
    fn record(mut self, obj: &Value, status: Status, turn: Option<Arc<Turn>>) {
        self.armed = false;
        self.sim
            .responses
            .record(&self.id, obj.to_string(), status, turn);
    }

    /// The request failed before it began: vLLM stores nothing of it.
    fn forget(mut self) {
        self.armed = false;
        self.sim.responses.delete(&self.id);
    }

    fn fail(self, message: &str) {
        let mut obj = self.in_progress.clone();
        obj["status"] = json!(Status::Failed.as_str());
        obj["error"] = json!({"code": "server_error", "message": message});
        self.record(&obj, Status::Failed, None);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.armed {
            let mut obj = self.in_progress.clone();
            obj["status"] = json!(Status::Cancelled.as_str());
            self.sim
                .responses
                .record(&self.id, obj.to_string(), Status::Cancelled, None);
        }
    }
}

/// One `POST /v1/responses` admitted to run.
struct Run {
    sim: App,
    job: Job,
    meta: Meta,
    parent: Option<Arc<Turn>>,
    fresh_instructions: bool,
    /// This request's input, rendered.
    input: String,
    cancel: Arc<AtomicBool>,
    pending: Option<Pending>,
    /// Its part in a KV handover.
    leg: Leg,
}

impl Run {
    /// The stored conversation after this request: its input and `reply`.
    fn turn(&self, reply: &str) -> Arc<Turn> {
        let mut text = self.input.clone();
        text.push_str(&render_message("assistant", &self.meta.said(reply)));
        self.sim.responses.turn(
            self.meta.instructions.clone(),
            self.fresh_instructions,
            self.parent.clone(),
            text,
        )
    }

    fn record(&mut self, obj: &Value, status: Status, reply: &str) {
        if let Some(p) = self.pending.take() {
            let turn = self.turn(reply);
            p.record(obj, status, Some(turn));
        }
    }

    /// A decode leg's KV: pulled, or `false` when the pull failed (the stored response is then
    /// forgotten).
    async fn pull(&mut self) -> bool {
        if !self.leg.handover.is_decode() {
            return true;
        }
        let pd = &self.sim.pd;
        if pd
            .fetch(&self.leg.handover, self.job.engine_prompt())
            .await
            .is_ok()
        {
            return true;
        }
        if let Some(p) = self.pending.take() {
            p.forget();
        }
        false
    }
}

pub async fn create(
    State(sim): State<App>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if sim.unhealthy() {
        return oai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is starting",
            None,
            None,
        );
    }
    let models = sim.models();
    let default_model = models.first().map(String::as_str).unwrap_or("");
    let req = match parse(&body, default_model, sim.args.default_max_tokens) {
        Ok(r) => r,
        Err(b) => return bad_request(b),
    };
    if !models.contains(&req.model) {
        return oai_error(
            StatusCode::NOT_FOUND,
            &format!("The model `{}` does not exist.", req.model),
            Some("model"),
            Some("model_not_found"),
        );
    }
    // Without a store (`--no-response-store`), vLLM refuses a background request that asks
    // to be stored, and silently stores nothing of any other; its empty store then knows no
    // `previous_response_id` and no id of `GET`/`DELETE`.
    let keeps_store = !sim.args.no_response_store;
    if req.store && req.background && !keeps_store {
        return oai_error(
            StatusCode::BAD_REQUEST,
            "This vLLM engine does not support `store=True` and therefore does not support \
             the background mode. To enable these features, set the environment variable \
             `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            Some("background"),
            None,
        );
    }
    let store = req.store && keeps_store;
    let parent = match &req.previous {
        None => None,
        Some(id) => match sim.responses.continuation(id) {
            Ok(t) => Some(t),
            Err(Unusable::Missing) => return not_found(id, Some("previous_response_id")),
            Err(Unusable::Status(s)) => {
                return oai_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "Previous response with id '{id}' has status '{}' and cannot be continued.",
                        s.as_str()
                    ),
                    Some("previous_response_id"),
                    None,
                )
            }
        },
    };
    // The instructions in force: the request's, else those of the response it continues.
    let inherited = parent.as_ref().and_then(|p| p.instructions.clone());
    let (instructions, fresh_instructions) = match (&req.instructions, inherited) {
        (Some(new), Some(old)) if *new == *old => (Some(old), false),
        (Some(new), _) => (Some(Arc::<str>::from(new.as_str())), true),
        (None, old) => (old, false),
    };
    let mut prompt = String::new();
    if let Some(i) = &instructions {
        prompt.push_str(&render_message("system", i));
    }
    if let Some(p) = &parent {
        prompt.push_str(&p.history());
    }
    prompt.push_str(&req.input);
    if prompt.is_empty() {
        return bad_request(Bad {
            param: "input".into(),
            message: "Missing required parameter: 'input'.".into(),
        });
    }
    prompt.push_str(GENERATION_PROMPT);
    if sim.pd.refuses_whole(&req.body) {
        return oai_error(StatusCode::BAD_REQUEST, crate::pd::NO_ROOM, None, None);
    }
    let leg = Leg::of(&sim, &headers, &req.body, true);
    let cut_after = match gate(&sim).await {
        Ok(c) => c,
        Err((status, message)) => return oai_error(status, message, None, None),
    };
    sim.pd.count_leg(&leg.handover);
    let seed = seed_of(&prompt);
    let (call, script) = match req.call {
        Some(name) => (
            Some(Call {
                id: sim.responses.new_id("fc"),
                call_id: sim.responses.new_id("call"),
                name,
            }),
            Some(call_arguments(seed, req.max_tokens)),
        ),
        None => (None, None),
    };
    let meta = Meta {
        id: sim.responses.new_id("resp"),
        msg_id: sim.responses.new_id("msg"),
        created_at: now_secs(),
        model: req.model.clone(),
        instructions,
        previous: req.previous.clone(),
        store,
        call,
        request: req.body,
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let in_progress = meta.object(Status::InProgress, json!([]), Value::Null);
    let pending = store.then(|| {
        sim.responses
            .insert(&meta.id, in_progress.to_string(), cancel.clone());
        Pending {
            sim: sim.clone(),
            id: meta.id.clone(),
            in_progress,
            armed: true,
        }
    });
    let mut job = Job {
        chat: true,
        model: req.model,
        seed,
        prompt,
        max_tokens: script.as_ref().map_or(req.max_tokens, Vec::len),
        stream: req.stream,
        include_usage: false,
        script,
        // With --tokenizer, the ids of the chat body vLLM makes of the request; else (or for a
        // continued response, whose history this store holds as text) the simulator's rendering.
        ids: sim
            .tokens
            .as_ref()
            .and_then(|t| t.responses_ids_within(&body, usize::MAX).ok())
            .map(|c| crate::engine::token_bytes(&c.ids.to_vec())),
    };
    leg.shape(&mut job);
    let run = Run {
        sim: sim.clone(),
        job,
        meta,
        parent,
        fresh_instructions,
        input: req.input,
        cancel,
        pending,
        leg,
    };
    let resp = if run.job.stream {
        stream(run, cut_after)
    } else {
        whole(run).await
    };
    tag(&sim, &body, resp)
}

async fn whole(mut run: Run) -> Response {
    let sim = run.sim.clone();
    if !run.pull().await {
        // vLLM's GenerationError, answered by its exception handler.
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(kv_load_failed())).into_response();
    }
    let (mut running, usage) = prefill(&sim, &run.job).await;
    let kv_transfer_params = prefilled(&sim, &run.job, &run.leg);
    let mut reply = String::new();
    let (how, n) = decode(
        &sim,
        &run.job,
        &mut running,
        None,
        Some(&run.cancel),
        None,
        |_| Bytes::new(),
        &mut reply,
    )
    .await;
    drop(running);
    finish(&sim, &run.job, &run.meta.said(&reply));
    let (mut obj, status) = run.meta.finished(how, &reply, &usage, n);
    if let Some(p) = kv_transfer_params {
        // A top-level field of the response object, as vLLM's `ResponsesResponse` has it.
        obj["kv_transfer_params"] = p;
    }
    run.record(&obj, status, &reply);
    Json(obj).into_response()
}

/// Numbers the events of one stream.
struct Events(u64);

impl Events {
    fn next(&mut self, kind: &str, mut data: Value) -> Bytes {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.0);
        self.0 += 1;
        named_sse(kind, &data)
    }
}

fn stream(mut run: Run, cut_after: Option<usize>) -> Response {
    let (tx, resp) = sse_response();
    tokio::spawn(async move {
        let sim = run.sim.clone();
        let mut events = Events(0);
        // Created at once, before the prefill, as OpenAI and vLLM announce it.
        let created = run.meta.object(Status::InProgress, json!([]), Value::Null);
        for kind in ["response.created", "response.in_progress"] {
            let ev = events.next(kind, json!({"response": created}));
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
        let pulled = tokio::select! {
            pulled = run.pull() => pulled,
            _ = tx.closed() => return,
        };
        if !pulled {
            // vLLM 0.33 means to send its error object as the next event, but that object is
            // no Responses event: validating it raises, and the stream ends there, without
            // the body's end (the two events above are all the client gets).
            cut(&tx, "KV load failed").await;
            return;
        }
        let (mut running, usage) = tokio::select! {
            done = prefill(&sim, &run.job) => done,
            _ = tx.closed() => return,
        };
        // The output item's events: a message's content part and text, or a function call's
        // arguments, as vLLM streams each.
        let call = run
            .meta
            .call
            .as_ref()
            .map(|c| (c.id.clone(), c.name.clone()));
        let item_id = call.as_ref().map_or(&run.meta.msg_id, |(id, _)| id).clone();
        let at = if call.is_some() {
            json!({"item_id": item_id, "output_index": 0})
        } else {
            json!({"item_id": item_id, "output_index": 0, "content_index": 0})
        };
        let with = |extra: Value| {
            let mut v = at.clone();
            if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
                v.extend(extra);
            }
            v
        };
        let mut opening = vec![events.next(
            "response.output_item.added",
            json!({"output_index": 0, "item": run.meta.item("in_progress", None)}),
        )];
        if call.is_none() {
            opening.push(events.next(
                "response.content_part.added",
                with(json!({"part": text_part("")})),
            ));
        }
        for ev in opening {
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
        let mut reply = String::new();
        let (how, n) = decode(
            &sim,
            &run.job,
            &mut running,
            cut_after,
            Some(&run.cancel),
            Some(&tx),
            |t| match call {
                Some(_) => events.next(
                    "response.function_call_arguments.delta",
                    with(json!({"delta": t})),
                ),
                None => events.next(
                    "response.output_text.delta",
                    with(json!({"delta": t, "logprobs": []})),
                ),
            },
            &mut reply,
        )
        .await;
        match how {
            Decoded::Gone => return,
            Decoded::Cut => {
                if let Some(p) = run.pending.take() {
                    p.fail("simulated stream cut");
                }
                return;
            }
            Decoded::Done | Decoded::Cancelled => {}
        }
        drop(running);
        finish(&sim, &run.job, &run.meta.said(&reply));
        let (obj, status) = run.meta.finished(how, &reply, &usage, n);
        run.record(&obj, status, &reply);
        if how == Decoded::Cancelled {
            return;
        }
        let mut closing = match &call {
            Some((_, name)) => vec![events.next(
                "response.function_call_arguments.done",
                with(json!({"arguments": reply, "name": name})),
            )],
            None => vec![
                events.next(
                    "response.output_text.done",
                    with(json!({"text": reply, "logprobs": []})),
                ),
                events.next(
                    "response.content_part.done",
                    with(json!({"part": text_part(&reply)})),
                ),
            ],
        };
        closing.push(events.next(
            "response.output_item.done",
            json!({"output_index": 0, "item": obj["output"][0]}),
        ));
        closing.push(events.next("response.completed", json!({"response": obj})));
        for ev in closing {
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
    });
    resp
}

pub async fn retrieve(State(sim): State<App>, Path(id): Path<String>) -> Response {
    match sim.responses.get(&id) {
        Some(json) => ([("content-type", "application/json")], json).into_response(),
        None => not_found(&id, None),
    }
}

pub async fn delete(State(sim): State<App>, Path(id): Path<String>) -> Response {
    if sim.responses.delete(&id) {
        Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response()
    } else {
        not_found(&id, None)
    }
}

pub async fn cancel(State(sim): State<App>, Path(id): Path<String>) -> Response {
    match sim.responses.cancel(&id) {
        Some(json) => ([("content-type", "application/json")], json).into_response(),
        None => not_found(&id, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_per_process_and_instance() {
        let a = Store::new("s0", 10, 1 << 20);
        let b = Store::new("s0", 10, 1 << 20);
        let (a1, a2, b1) = (a.new_id("resp"), a.new_id("resp"), b.new_id("resp"));
        assert_ne!(a1, a2);
        assert_ne!(a1, b1);
        assert!(a1.starts_with("resp_") && a1.len() == 5 + 32);
        assert!(a1[5..].chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_chain_keeps_its_history_and_the_byte_budget_evicts() {
        let s = Store::new("s", 10, 100);
        let t1 = s.turn(Some("sys".into()), true, None, "one ".into());
        let t2 = s.turn(
            t1.instructions.clone(),
            false,
            Some(t1.clone()),
            "two".into(),
        );
        assert_eq!(t2.history(), "one two");
        s.insert("a", "x".repeat(10), Arc::default());
        s.record("a", "y".repeat(10), Status::Completed, Some(t2.clone()));
        assert!(s.continuation("a").is_ok());
        drop((t1, t2));
        // The entry holds the chain: 3 + 4 + 3 bytes of turns and its 10 of JSON.
        assert_eq!(s.live.load(Ordering::Relaxed), 20);
        s.insert("b", "z".repeat(90), Arc::default());
        assert!(matches!(s.continuation("a"), Err(Unusable::Missing)));
        assert_eq!(
            s.live.load(Ordering::Relaxed),
            90,
            "evicting freed the chain"
        );
        assert!(s.delete("b"));
        assert_eq!(s.live.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn cancel_marks_only_a_response_in_progress() {
        let s = Store::new("s", 10, 1 << 20);
        let flag = Arc::new(AtomicBool::new(false));
        s.insert(
            "a",
            json!({"status": "in_progress"}).to_string(),
            flag.clone(),
        );
        assert!(s.cancel("a").unwrap().contains("\"cancelled\""));
        assert!(flag.load(Ordering::Relaxed));
        s.insert(
            "b",
            json!({"status": "in_progress"}).to_string(),
            Arc::default(),
        );
        s.record(
            "b",
            json!({"status": "completed"}).to_string(),
            Status::Completed,
            None,
        );
        assert!(s.cancel("b").unwrap().contains("\"completed\""));
        assert!(s.cancel("c").is_none());
    }
}

#[cfg(test)]
mod handover_tests {
    use serde_json::{json, Value};

    use crate::testkit::{client, count, events, prefill_params, serve, until};

    fn names(evs: &[(String, Value)]) -> Vec<&str> {
        evs.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The prefill leg a router sends for `body`, and the `kv_transfer_params` of its answer.
    async fn prefill(url: &str, body: &Value) -> Value {
        let mut leg = body.clone();
        leg["max_output_tokens"] = json!(1);
        leg["store"] = json!(false);
        leg["stream"] = json!(false);
        leg["kv_transfer_params"] = prefill_params();
        let resp = client()
            .post(format!("{url}/v1/responses"))
            .json(&leg)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let answer: Value = resp.json().await.unwrap();
        assert_eq!(answer["object"], "response");
        assert_eq!(answer["status"], "completed");
        answer["kv_transfer_params"].clone()
    }

    fn body() -> Value {
        json!({"model": "sim-model", "input": "Tell me about the long road north, slowly.",
               "max_output_tokens": 4})
    }

    #[tokio::test]
    async fn a_prefill_answers_with_its_params_and_a_streamed_decode_pulls_them() {
        let (p, p_url) = serve(&["--kv-role=producer"]).await;
        let (d, d_url) = serve(&["--kv-role=consumer"]).await;
        let params = prefill(&p_url, &body()).await;
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["remote_engine_id"], p.pd.conf.engine_id.as_str());
        assert_eq!(params["remote_port"], p.args.listen.port());
        let prompt_tokens = params["remote_num_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 0);
        assert_eq!(p.pd.leases_held(), 1, "the prefill holds its blocks");
        assert_eq!(count(&p.pd.counters.handover_prefill_requests), 1);

        let mut leg = body();
        leg["stream"] = json!(true);
        leg["kv_transfer_params"] = params;
        let resp = client()
            .post(format!("{d_url}/v1/responses"))
            .json(&leg)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let (evs, broken) = events(resp).await;
        assert!(!broken);
        let names = names(&evs);
        assert_eq!(names[..2], ["response.created", "response.in_progress"]);
        assert_eq!(names.last(), Some(&"response.completed"));
        let deltas = names
            .iter()
            .filter(|n| **n == "response.output_text.delta")
            .count();
        assert_eq!(deltas, 4);
        let c = &d.pd.counters;
        assert_eq!(count(&c.handover_decode_requests), 1);
        assert_eq!(count(&c.kv_pulls), 1);
        assert_eq!(count(&c.kv_tokens_transferred), prompt_tokens);
        assert_eq!(count(&c.kv_pull_failures), 0);
        assert_eq!(p.pd.leases_held(), 0, "the pull freed the lease");
        assert_eq!(count(&p.pd.counters.kv_leases_pulled), 1);
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
        let url = format!("{d_url}/v1/responses");

        let resp = client().post(&url).json(&leg).send().await.unwrap();
        assert_eq!(resp.status(), 500);
        let answer: Value = resp.json().await.unwrap();
        assert_eq!(
            answer,
            json!({"error": {"message": "Internal server error", "type": "InternalServerError",
                             "param": null, "code": 500}})
        );

        // Streamed: the two events sent before the engine's first output, then the stream
        // breaks off (vLLM's error object fails validation as a Responses event).
        leg["stream"] = json!(true);
        let resp = client().post(&url).json(&leg).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let (evs, broken) = events(resp).await;
        assert_eq!(names(&evs), ["response.created", "response.in_progress"]);
        assert!(broken, "the body ends without its end");
        assert_eq!(evs[1].1["sequence_number"], 1);
        // Nothing of the failed request is stored.
        let id = evs[0].1["response"]["id"].as_str().unwrap();
        let got = client()
            .get(format!("{url}/{id}"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(got, 404);

        let c = &d.pd.counters;
        assert_eq!(count(&c.handover_decode_requests), 2);
        assert_eq!(count(&c.kv_pull_failures), 2);
        assert_eq!(count(&c.kv_pulls), 0);
        assert_eq!(count(&d.engine.counters.generation_tokens), 0);
    }
}

/// `--no-response-store` and function calls forced by `tool_choice`.
#[cfg(test)]
mod store_and_call_tests {
    use serde_json::{json, Value};

    use crate::testkit::{client, count, events, serve};

    async fn post(url: &str, body: &Value) -> (u16, Value) {
        let resp = client()
            .post(format!("{url}/v1/responses"))
            .json(body)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    async fn status(req: reqwest::RequestBuilder) -> u16 {
        req.send().await.unwrap().status().as_u16()
    }

    fn tools() -> Value {
        json!([
            {"type": "web_search_preview"},
            {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
            {"type": "function", "name": "fetch", "parameters": {"type": "object"}},
        ])
    }

    /// The 404 of an id a store does not hold, without the id.
    fn without_id(mut v: Value) -> Value {
        let m = v["error"]["message"].as_str().unwrap().to_owned();
        let start = m.find('\'').unwrap();
        let end = m.rfind('\'').unwrap();
        v["error"]["message"] = json!(format!("{}{}", &m[..start], &m[end + 1..]));
        v
    }

    #[tokio::test]
    async fn without_a_store_nothing_is_kept_and_background_is_refused() {
        let (_, url) = serve(&["--no-response-store"]).await;
        let (_, on_url) = serve(&[]).await;
        for store in [json!(true), Value::Null] {
            let mut body = json!({"input": "Tell me of the hills.", "max_output_tokens": 3});
            if !store.is_null() {
                body["store"] = store;
            }
            let (code, r) = post(&url, &body).await;
            assert_eq!(code, 200);
            assert_eq!(r["store"], false, "store is turned off silently");
            assert_eq!(r["status"], "completed");
            let id = r["id"].as_str().unwrap();
            let at = format!("{url}/v1/responses/{id}");
            assert_eq!(status(client().get(&at)).await, 404);
            assert_eq!(status(client().delete(&at)).await, 404);
            assert_eq!(status(client().post(format!("{at}/cancel"))).await, 404);
            // Continuing it gets what an unknown id gets from a replica with a store.
            let next = json!({"input": "And then?", "previous_response_id": id});
            let (code, err) = post(&url, &next).await;
            assert_eq!(code, 404);
            assert_eq!(
                err["error"]["message"],
                format!("Response with id '{id}' not found.")
            );
            let (on_code, on_err) = post(&on_url, &next).await;
            assert_eq!((code, without_id(err)), (on_code, without_id(on_err)));
        }
        // The same request keeps its response where there is a store.
        let (_, r) = post(&on_url, &json!({"input": "Tell me of the hills."})).await;
        assert_eq!(r["store"], true);
        let at = format!("{on_url}/v1/responses/{}", r["id"].as_str().unwrap());
        assert_eq!(status(client().get(&at)).await, 200);

        let message = "This vLLM engine does not support `store=True` and therefore does not \
                       support the background mode. To enable these features, set the \
                       environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching \
                       the vLLM server.";
        for body in [
            json!({"input": "hi", "background": true}),
            json!({"input": "hi", "background": true, "store": true}),
        ] {
            let (code, err) = post(&url, &body).await;
            assert_eq!(code, 400);
            assert_eq!(
                err,
                json!({"error": {"message": message, "type": "invalid_request_error",
                                 "param": "background", "code": null}})
            );
        }
        let (code, _) = post(
            &url,
            &json!({"input": "hi", "background": true, "store": false}),
        )
        .await;
        assert_eq!(code, 200);
        // Streamed, the response objects say so too.
        let resp = client()
            .post(format!("{url}/v1/responses"))
            .json(&json!({"input": "hi", "stream": true}))
            .send()
            .await
            .unwrap();
        let (evs, broken) = events(resp).await;
        assert!(!broken);
        assert!(evs
            .iter()
            .all(|(_, d)| d["response"].is_null() || d["response"]["store"] == json!(false)));
        assert_eq!(evs.last().unwrap().0, "response.completed");
    }

    #[tokio::test]
    async fn a_forced_tool_choice_answers_with_one_function_call() {
        let (sim, url) = serve(&["--no-response-store"]).await;
        let body = json!({"input": "Find the weather in Oslo.", "tools": tools(),
                          "tool_choice": "required", "max_output_tokens": 50});
        let before = count(&sim.engine.counters.generation_tokens);
        let (code, r) = post(&url, &body).await;
        assert_eq!(code, 200, "{r}");
        let output = r["output"].as_array().unwrap();
        assert_eq!(output.len(), 1);
        let call = &output[0];
        assert_eq!(call["type"], "function_call");
        assert_eq!(call["name"], "lookup", "the first function tool");
        assert_eq!(call["status"], "completed");
        assert!(call["id"].as_str().unwrap().starts_with("fc_"));
        assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        let words = args["query"].as_str().unwrap();
        assert_eq!(words.split(' ').count(), 3, "{args}");
        // The arguments are what was generated: 5 tokens.
        assert_eq!(r["usage"]["output_tokens"], 5);
        assert_eq!(count(&sim.engine.counters.generation_tokens) - before, 5);

        // The same prompt calls with the same arguments, under new ids; another prompt's differ.
        let (_, again) = post(&url, &body).await;
        assert_eq!(again["output"][0]["arguments"], call["arguments"]);
        assert_ne!(again["output"][0]["id"], call["id"]);
        assert_ne!(again["output"][0]["call_id"], call["call_id"]);
        let mut other = body.clone();
        other["input"] = json!("Something else entirely, a long way from here.");
        let (_, other) = post(&url, &other).await;
        assert_ne!(other["output"][0]["arguments"], call["arguments"]);

        // A named function; a small max_output_tokens shortens the call, keeping it whole.
        let mut named = body.clone();
        named["tool_choice"] = json!({"type": "function", "name": "fetch"});
        named["max_output_tokens"] = json!(1);
        let (_, r) = post(&url, &named).await;
        assert_eq!(r["output"][0]["name"], "fetch");
        assert_eq!(r["usage"]["output_tokens"], 3);
        let args: Value =
            serde_json::from_str(r["output"][0]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["query"].is_string());

        // Any other choice answers with a message.
        for choice in [json!("auto"), json!("none"), Value::Null] {
            let mut b = body.clone();
            b["tool_choice"] = choice.clone();
            let (_, r) = post(&url, &b).await;
            assert_eq!(r["output"][0]["type"], "message", "{choice}");
            assert_eq!(r["usage"]["output_tokens"], 50);
        }
        let mut b = body.clone();
        b["tools"] = json!([{"type": "web_search_preview"}]);
        let (_, r) = post(&url, &b).await;
        assert_eq!(r["output"][0]["type"], "message", "no function tool");

        // Choices the tools cannot meet, refused as vLLM refuses them.
        let refused = [
            (
                json!({"input": "x", "tool_choice": "required"}),
                "Tool choice 'required' must be specified with 'tools' parameter.",
            ),
            (
                json!({"input": "x", "tools": tools(),
                       "tool_choice": {"type": "function", "name": "nope"}}),
                "Tool choice 'function' not found in 'tools' parameter.",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "function", "name": "lookup"}}),
                "Tool choice 'function' not found in 'tools' parameter.",
            ),
        ];
        for (b, message) in refused {
            let (code, err) = post(&url, &b).await;
            assert_eq!(code, 400, "{b}");
            assert_eq!(err["error"]["message"], message);
            assert_eq!(err["error"]["param"], "tool_choice");
        }
    }

    #[tokio::test]
    async fn a_streamed_function_call_has_the_events_of_vllm() {
        let (sim, url) = serve(&[]).await;
        let body = json!({"input": "Find the weather in Oslo.", "tools": tools(),
                          "tool_choice": {"type": "function", "name": "fetch"}, "stream": true});
        let before = count(&sim.engine.counters.generation_tokens);
        let resp = client()
            .post(format!("{url}/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let (evs, broken) = events(resp).await;
        assert!(!broken);
        let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
        let delta = "response.function_call_arguments.delta";
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                delta,
                delta,
                delta,
                delta,
                delta,
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (name, data)) in evs.iter().enumerate() {
            assert_eq!(data["type"], name.as_str());
            assert_eq!(data["sequence_number"], i);
        }
        let added = &evs[2].1;
        assert_eq!(added["output_index"], 0);
        assert_eq!(added["item"]["type"], "function_call");
        assert_eq!(added["item"]["status"], "in_progress");
        assert_eq!(added["item"]["arguments"], "");
        assert_eq!(added["item"]["name"], "fetch");
        let id = added["item"]["id"].clone();
        let streamed: String = evs[3..8]
            .iter()
            .map(|(_, d)| {
                assert_eq!(d["item_id"], id);
                assert_eq!(d["output_index"], 0);
                d["delta"].as_str().unwrap().to_owned()
            })
            .collect();
        let done = &evs[8].1;
        assert_eq!(done["arguments"], streamed.as_str());
        assert_eq!((&done["item_id"], &done["name"]), (&id, &json!("fetch")));
        let item = &evs[9].1["item"];
        let completed = &evs[10].1["response"];
        assert_eq!(completed["output"], json!([item]));
        assert_eq!(item["arguments"], streamed.as_str());
        assert_eq!(item["status"], "completed");
        assert_eq!(item["id"], id);
        assert_eq!(item["call_id"], added["item"]["call_id"]);
        assert_eq!(completed["status"], "completed");
        assert_eq!(completed["usage"]["output_tokens"], 5);
        assert_eq!(count(&sim.engine.counters.generation_tokens) - before, 5);
        // The same request unstreamed calls with the same arguments.
        let mut whole = body.clone();
        whole["stream"] = json!(false);
        let (_, r) = post(&url, &whole).await;
        assert_eq!(r["output"][0]["arguments"], streamed.as_str());
        // Stored: the call is what GET returns.
        let at = format!("{url}/v1/responses/{}", completed["id"].as_str().unwrap());
        let got: Value = client()
            .get(&at)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["output"], completed["output"]);
    }

    /// A chain continued by id renders the call as the same conversation resent in full does:
    /// the same prompt, so the continuation finds its history cached.
    #[tokio::test]
    async fn a_call_continued_by_id_is_the_conversation_sent_in_full() {
        let (sim, url) = serve(&["--block-tokens=4"]).await;
        let first = json!({"instructions": "Be brief.", "input": "Find the weather in Oslo.",
                           "tools": tools(), "tool_choice": "required"});
        let (_, r) = post(&url, &first).await;
        let call = r["output"][0].clone();
        assert_eq!(call["type"], "function_call");
        let output = json!({"type": "function_call_output", "call_id": call["call_id"],
                            "output": "{\"temp\": 3}"});
        let by_id = json!({"instructions": "Be brief.", "input": [output],
                           "previous_response_id": r["id"], "tools": tools()});
        let in_full = json!({"instructions": "Be brief.", "tools": tools(), "store": false,
                             "input": [{"role": "user", "content": "Find the weather in Oslo."},
                                       call, output]});
        let (_, a) = post(&url, &by_id).await;
        let (_, b) = post(&url, &in_full).await;
        assert_eq!(a["output"][0]["type"], "message", "tool_choice auto");
        assert_eq!(a["usage"]["input_tokens"], b["usage"]["input_tokens"]);
        assert_eq!(a["output"][0]["content"], b["output"][0]["content"]);
        let cached = a["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        // The first turn with its call, as the continuation's prompt begins.
        let turn = crate::render::render_message("system", "Be brief.")
            + &crate::render::responses_input(&json!([in_full["input"][0], call])).unwrap();
        let whole_blocks = (turn.len() / (4 * crate::engine::BYTES_PER_TOKEN) * 4) as u64;
        assert!(
            cached >= whole_blocks,
            "the first turn and its call are cached: {cached} < {whole_blocks}"
        );
        assert!(sim.engine.cached_prefix(turn.as_bytes()) as u64 >= whole_blocks);
    }
}
