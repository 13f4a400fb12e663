//! `GET /server_info` as vLLM or SGLang serves it (`--server-info`), with what clients read
//! there: SGLang's gateway a P/D worker's mode and bootstrap port, inferlb
//! (`kv_events: server_info`) the KV events config, in each engine's own form.
//! - vLLM (with `VLLM_SERVER_DEV_MODE=1`): `{"vllm_config": ...}`, the config as text, or
//!   with `?config_format=json` as JSON whose `kv_events_config` is an object
//!   (`enable_kv_cache_events`, `publisher`, `endpoint`, `replay_endpoint`, `topic`,
//!   `buffer_steps`); `parallel_config.data_parallel_size` beside it.
//! - SGLang: its server arguments at the top level, `kv_events_config` the JSON string given
//!   to `--kv-events-config` (null without), `dp_size`; also at `/get_server_info`, with
//!   `/model_info` and `/get_model_info`.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::pd::{KvRole, PdProtocol};
use crate::{App, Args};

/// Which engine's `/server_info` the simulator serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flavour {
    Vllm,
    Sglang,
}

/// `app` with the `/server_info` routes `args` ask for.
pub fn routes(app: Router<App>, args: &Args) -> Router<App> {
    let sglang_pd = args.pd_protocol == PdProtocol::Sglang && args.kv_role != KvRole::None;
    match args.server_info.or(sglang_pd.then_some(Flavour::Sglang)) {
        None => app,
        Some(Flavour::Vllm) => app.route("/server_info", get(vllm)),
        Some(Flavour::Sglang) => app
            .route("/server_info", get(sglang))
            .route("/get_server_info", get(sglang))
            .route("/model_info", get(model_info))
            .route("/get_model_info", get(model_info)),
    }
}

/// The `--kv-events-config` an engine would be started with to listen where this simulator
/// does (rank 0's; each rank adds its rank): the engines bind the publisher only on a
/// wildcard host (on any other they connect out), so its host is `*` here, whatever loopback
/// address the simulator binds; the replay endpoint as given (they bind it on any host).
fn kv_events_config(args: &Args) -> Option<Value> {
    let (_, port) = args.kv_events.as_deref()?.rsplit_once(':')?;
    Some(json!({
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{port}"),
        "replay_endpoint": args.kv_events_replay,
        "topic": args.kv_events_topic,
        "buffer_steps": args.kv_events_buffer,
    }))
}

async fn vllm(State(sim): State<App>, Query(q): Query<HashMap<String, String>>) -> Response {
    let args = &sim.args;
    let model = sim.models().first().cloned().unwrap_or_default();
    let kv_events = match kv_events_config(args) {
        Some(Value::Object(mut c)) => {
            c.insert("enable_kv_cache_events".into(), true.into());
            Value::Object(c)
        }
        _ => json!({"enable_kv_cache_events": false, "publisher": "null",
            "endpoint": "tcp://*:5557", "replay_endpoint": null}),
    };
    let config = if q.get("config_format").map(String::as_str) == Some("json") {
        json!({
            "model_config": {"model": model, "served_model_name": model},
            "cache_config": {"block_size": args.block_tokens, "enable_prefix_caching": true},
            "parallel_config": {"data_parallel_size": args.data_parallel_size},
            "kv_events_config": kv_events,
        })
    } else {
        Value::String(format!(
            "model={model:?}, data_parallel_size={}, kv_events_config={kv_events}",
            args.data_parallel_size
        ))
    };
    Json(json!({"vllm_config": config, "vllm_env": {}, "system_env": {}})).into_response()
}

/// SGLang's: what its gateway reads of a worker in P/D mode (its disaggregation mode, its
/// bootstrap port and its running window), and its KV events config.
async fn sglang(State(sim): State<App>) -> Response {
    let mode = match sim.pd.conf.role {
        KvRole::Producer => "prefill",
        KvRole::Consumer => "decode",
        _ => "null",
    };
    let args = &sim.args;
    let model = sim.models().first().cloned().unwrap_or_default();
    Json(json!({
        "model_path": model,
        "served_model_name": model,
        "tokenizer_path": null,
        "disaggregation_mode": mode,
        "disaggregation_bootstrap_port": sim.pd.conf.bootstrap_port,
        "max_running_requests": args.max_batch,
        "page_size": args.block_tokens,
        "dp_size": args.data_parallel_size,
        "kv_events_config": kv_events_config(args).map(|c| c.to_string()),
        "version": "inferlb-sim",
    }))
    .into_response()
}

async fn model_info(State(sim): State<App>) -> Response {
    let model = sim.models().first().cloned().unwrap_or_default();
    Json(json!({"model_path": model, "tokenizer_path": null, "is_generation": true}))
        .into_response()
}
