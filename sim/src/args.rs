//! The simulator's flags (a YAML `--config` file's keys read as flags before the real ones)
//! and the tokenizer they name.

use std::net::SocketAddr;

use clap::Parser;
use inferlb_tokens::ModelTokens;

use crate::engine::Scheduler;
use crate::pd::{KvRole, PdProtocol};
use crate::server_info;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "A simulated vLLM replica: OpenAI endpoints, prefix cache, prefill/decode timing, faults"
)]
pub(crate) struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub(crate) listen: SocketAddr,
    /// This replica's name, returned in the `x-sim-replica` header.
    #[arg(long, default_value = "sim")]
    pub(crate) id: String,
    /// Model name served (comma-separated for several).
    #[arg(long, default_value = "sim-model")]
    pub(crate) model: String,
    /// Prefill throughput in tokens/s (a 90k-token cold prompt takes 90000/this seconds).
    #[arg(long, default_value_t = 30000.0)]
    pub(crate) prefill_tokens_per_s: f64,
    /// Milliseconds between generated tokens of one request.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) decode_interval_ms: f64,
    /// Requests in the engine at once (vLLM's max_num_seqs): in `fcfs`, admitted (queued for
    /// prefill, prefilling or decoding); in the stepped schedulers, running (prefilling or
    /// decoding). The rest wait.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_batch: usize,
    /// Tokens per prefix-cache block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_tokens: usize,
    /// Prefix-cache capacity in tokens (vLLM's num_gpu_blocks × block size).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) cache_tokens: usize,
    /// How prefill and decode share the engine: `fcfs` (one first-come-first-served prefill
    /// resource, decoding apart), `chunked` (vLLM's chunked-prefill steps: decodes first, then
    /// prefill chunks, within --max-num-batched-tokens a step) or `prefill-first` (steps where
    /// waiting prompts are prefilled whole, stalling decodes, as vLLM without chunked prefill).
    #[arg(long, value_enum, default_value_t = Scheduler::Fcfs)]
    pub(crate) scheduler: Scheduler,
    /// Tokens one step may carry (decodes and prefill chunks), in the stepped schedulers.
    #[arg(long, default_value_t = 8192)]
    pub(crate) max_num_batched_tokens: usize,
    /// Divides every duration (10 = ten times faster than the modelled engine).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) speed: f64,
    /// Tokens generated when a request sets no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub(crate) default_max_tokens: usize,
    /// Leave `process_start_time_seconds` out of `/metrics`, as vLLM with several API servers
    /// (Prometheus' multiprocess mode) or llama.cpp do: a restart is not told there.
    #[arg(long)]
    pub(crate) no_start_time: bool,
    /// Leave the counters a restart sets back (`vllm:prompt_tokens_total`) out of `/metrics`
    /// too: with `--no-start-time`, the page tells no restart at all.
    #[arg(long)]
    pub(crate) no_prompt_counter: bool,
    /// Slow start: refuse connections for this many seconds (a vLLM process loading).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) refuse_for: f64,
    /// Slow start: then answer /health (and requests) with 503 for this many seconds.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) unhealthy_for: f64,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (least recently
    /// used go first).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) response_store_entries: usize,
    /// ... and at most this many MiB of their text.
    #[arg(long, default_value_t = 1024)]
    pub(crate) response_store_mib: usize,
    /// Keep no Responses store, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE: `store` is
    /// turned off in every request, any `previous_response_id` and `GET`/`DELETE
    /// /v1/responses/{id}` answer 404, and `background` with `store` true is refused (400).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub(crate) no_response_store: bool,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    pub(crate) tls_key: Option<std::path::PathBuf>,
    /// With --tls-cert: require a client certificate signed by this CA (mTLS).
    #[arg(long, requires = "tls_cert")]
    pub(crate) tls_client_ca: Option<std::path::PathBuf>,
    /// The KV connector's side in prefill/decode disaggregation (vLLM's kv_role): `none` (no
    /// connector: handover fields in requests are ignored, and counted in /sim/stats as
    /// `handover_fields_seen`), `producer` (prefill), `consumer` (decode) or `both`.
    #[arg(long, value_enum, default_value_t = KvRole::None)]
    pub(crate) kv_role: KvRole,
    /// The handover protocol: `vllm` (NixlConnector's `kv_transfer_params`) or `sglang`
    /// (`bootstrap_host`/`bootstrap_port`/`bootstrap_room`).
    #[arg(long, value_enum, default_value_t = PdProtocol::Vllm)]
    pub(crate) pd_protocol: PdProtocol,
    /// SGLang, producer side: also listen on this port (the host of --listen) as the
    /// bootstrap server.
    #[arg(long)]
    pub(crate) bootstrap_port: Option<u16>,
    /// Modelled KV pull speed in tokens/s (a decode pulling N tokens waits N/this seconds).
    #[arg(long, default_value_t = 500_000.0)]
    pub(crate) kv_transfer_tokens_per_s: f64,
    /// How long a producer holds a finished prefill's blocks for a decode to pull them
    /// (vLLM's kv_lease_duration), in modelled seconds (divided by --speed); also how long an
    /// SGLang decode waits for its room.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) kv_lease_seconds: f64,
    /// Publish vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB
    /// socket bound here, e.g. `tcp://127.0.0.1:5557` (vLLM's `--kv-events-config` endpoint).
    #[arg(long)]
    pub(crate) kv_events: Option<String>,
    /// The replay ROUTER socket for missed batches, e.g. `tcp://127.0.0.1:5558`.
    #[arg(long, requires = "kv_events")]
    pub(crate) kv_events_replay: Option<String>,
    /// The topic frame of every event message (vLLM's default: empty).
    #[arg(long, default_value = inferlb_kvevents::DEFAULT_TOPIC)]
    pub(crate) kv_events_topic: String,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = inferlb_kvevents::DEFAULT_BUFFER_STEPS)]
    pub(crate) kv_events_buffer: usize,
    /// For tests: these sequence numbers are kept for replay but never published, as a
    /// subscriber whose queue was full (ZMQ's high-water mark) misses them: a gap to heal.
    #[arg(long, value_delimiter = ',', requires = "kv_events")]
    pub(crate) kv_events_withhold: Vec<u64>,
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
    pub(crate) tokenizer: Option<std::path::PathBuf>,
    /// vLLM's `--data-parallel-size` with its internal load balancing: this many engines
    /// behind the one address, each with its own prefix cache, batch and (with --kv-events)
    /// publisher and replay socket on the configured port plus its rank. A request's
    /// `X-data-parallel-rank` header picks its engine (400 when it names none); without it,
    /// the least loaded takes it. `/metrics` labels each engine's samples `engine="k"`;
    /// `/sim/stats` and `/sim/fault` are the header's rank's (rank 0's without);
    /// `/reset_prefix_cache` resets every engine. The Responses store is the server's, shared.
    /// Not with --kv-role.
    #[arg(long, default_value_t = 1)]
    pub(crate) data_parallel_size: usize,
    /// Which engine's `GET /server_info` to serve, with the KV events config (--kv-events)
    /// in its form: vLLM's (`VLLM_SERVER_DEV_MODE=1`; JSON with `?config_format=json`) or
    /// SGLang's (`kv_events_config` as its flag's JSON string). Default: SGLang's with
    /// `--pd-protocol sglang` and a --kv-role (what its gateway reads in P/D mode), else none.
    #[arg(long, value_enum)]
    pub(crate) server_info: Option<server_info::Flavour>,
    /// A YAML file with any of these keys (flags given on the command line win).
    #[arg(long)]
    pub(crate) config: Option<std::path::PathBuf>,
}

pub(crate) fn load_args() -> Result<Args, String> {
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
pub(crate) fn load_tokens(args: &Args) -> Result<Option<ModelTokens>, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
