//! A replica's KV event endpoints as it names them over HTTP (`kv_events: server_info`), so
//! that no port is written twice, once in the engine's flags and once in inferlb's conf.
//!
//! Two engines answer `GET /server_info` with their KV events config:
//! - vLLM, when started with `VLLM_SERVER_DEV_MODE=1`: with `?config_format=json`, its config
//!   as JSON, whose `vllm_config.kv_events_config` holds `enable_kv_cache_events`, `publisher`
//!   (`zmq`), `endpoint` and `replay_endpoint`. Without dev mode the path answers 404, and
//!   without `config_format=json` the config is text; both are reported, not guessed at.
//! - SGLang (`/server_info`, or `/get_server_info` before it had that): its server
//!   arguments, whose `kv_events_config` is the JSON string given to `--kv-events-config`
//!   (`publisher`, `endpoint`, `replay_endpoint`), or null.
//!
//! The engines bind the publisher only on a wildcard host (`*` or `::`; on any other address
//! they connect out to a subscriber that binds, which inferlb is not), and the replay socket
//! always: so the publisher's host must be a wildcard, read as the replica's own address, and
//! the replay's a wildcard or that address. `*` and `0.0.0.0` bind IPv4 only (ZMQ without
//! `ZMQ_IPV6`), so an IPv6 replica needs `::`. A rank's sockets are on the ports plus its rank,
//! as both engines bind them: the conf's rank, else the one vLLM reports
//! (`parallel_config.data_parallel_rank`, a rank behind its own API server). A host other than
//! the replica's own is refused: a replica names its own sockets, never where else inferlb
//! should connect.
//!
//! [`read`] asks the replica before each (re)connect and keeps what it named last;
//! [`endpoints`] parses an answer, pure.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde_json::Value;

use crate::conf::{KvEndpoints, KvEvents};
use crate::fleet::replica::Replica;

/// The paths asked, in turn on a 404: vLLM's JSON form (SGLang ignores the query), then the
/// older SGLang's.
pub const PATHS: [&str; 2] = ["/server_info?config_format=json", "/get_server_info"];

/// What the subscriber learnt from a replica's `/server_info`.
#[derive(Default)]
pub struct Learnt {
    /// The endpoints last read, and logged.
    good: Option<KvEndpoints>,
    /// The reasons logged since (each once).
    logged: std::collections::HashSet<String>,
    /// Reads that failed in a row: the next is put off longer (1 s doubling to 32 s).
    failures: u32,
}

/// The endpoints to (re)connect to, each read given `timeout`: the conf's, or those the replica's `/server_info` names
/// now. When the replica does not answer it, the endpoints read last stand (their own probe
/// tells whether they listen); an answer that names none ends them. Logged when they change,
/// and each reason they cannot be read once until they can.
pub async fn read(
    r: &Replica,
    source: &KvEvents,
    learnt: &mut Learnt,
    timeout: Duration,
) -> Option<KvEndpoints> {
    if let KvEvents::At(ep) = source {
        return Some(ep.clone());
    }
    let rank = r.endpoint.data_parallel_rank;
    let mut answer = Err("its /server_info did not answer".to_string());
    for path in PATHS {
        match crate::fleet::probe::get(r, path, timeout).await {
            Some((200, body)) => {
                answer = Ok(endpoints(&body, r.endpoint.socket.ip(), rank));
                break;
            }
            Some((404, _)) => {
                answer = Err(
                    "it serves neither /server_info nor /get_server_info (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"
                        .to_string(),
                );
            }
            Some((status, _)) => {
                answer = Err(format!("its /server_info answered {status}"));
                break;
            }
            None => break,
        }
    }
    let now = match answer {
        Ok(named) => named,
        // Unanswered: what it named before stands.
        Err(m) if learnt.good.is_some() => {
            if learnt.logged.insert(m.clone()) {
                log::warn!(
                    "replica {}: {m}; its KV events are read where it named them last",
                    r.id
                );
            }
            return learnt.good.clone();
        }
        Err(m) => Err(m),
    };
    match now {
        Ok(ep) => {
            if learnt.good.as_ref() != Some(&ep) {
                log::info!(
                    "replica {}: KV events on {} (replay: {}), as its /server_info names them",
                    r.id,
                    ep.publisher,
                    ep.replay.as_deref().unwrap_or("none")
                );
            }
            learnt.logged.clear();
            learnt.failures = 0;
            learnt.good = Some(ep.clone());
            Some(ep)
        }
        Err(m) => {
            if learnt.logged.insert(m.clone()) {
                log::warn!("replica {}: its KV events are not read: {m}", r.id);
            }
            learnt.good = None;
            learnt.failures = learnt.failures.saturating_add(1);
            tokio::time::sleep(Duration::from_secs(1 << learnt.failures.min(6)) / 2).await;
            None
        }
    }
}

/// Which engine's form an answer takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Vllm,
    Sglang,
}

/// The endpoints an answer of `GET /server_info` names, for the replica at `ip` serving
/// data-parallel rank `rank` (None: the conf names none). Pure.
pub fn endpoints(body: &[u8], ip: IpAddr, rank: Option<u16>) -> Result<KvEndpoints, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("its /server_info is not JSON: {e}"))?;
    let (form, config, reported_rank) = match v.get("vllm_config") {
        Some(Value::String(_)) => {
            return Err("its /server_info gave vLLM's config as text, not JSON".into())
        }
        Some(c) => (
            Form::Vllm,
            c.get("kv_events_config"),
            c.pointer("/parallel_config/data_parallel_rank")
                .and_then(Value::as_u64),
        ),
        None => (Form::Sglang, v.get("kv_events_config"), None),
    };
    // SGLang's is the JSON string of its flag.
    let parsed;
    let config = match config {
        Some(Value::String(s)) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| format!("its kv_events_config is not JSON: {e}"))?;
            &parsed
        }
        Some(c @ Value::Object(_)) => c,
        _ => {
            return Err(
                "its /server_info has no kv_events_config: it publishes no KV events".into(),
            )
        }
    };
    // vLLM publishes only when enabled; SGLang's publisher defaults to none ("null").
    if form == Form::Vllm && config.get("enable_kv_cache_events") != Some(&Value::Bool(true)) {
        return Err("its KV events are off (enable_kv_cache_events is not true)".into());
    }
    match config.get("publisher").and_then(Value::as_str) {
        Some("zmq") => {}
        None if form == Form::Vllm => {}
        other => {
            return Err(format!(
                "its KV event publisher is {}, not zmq",
                other.unwrap_or("null (unset)")
            ))
        }
    }
    let rank = match rank {
        Some(k) => k,
        None => u16::try_from(reported_rank.unwrap_or(0))
            .map_err(|_| "its data_parallel_rank is not a rank".to_string())?,
    };
    let publisher = match config.get("endpoint").and_then(Value::as_str) {
        Some(e) => on_replica(e, ip, rank, Socket::Publisher)?,
        None => return Err("its kv_events_config has no endpoint".into()),
    };
    let replay = match config.get("replay_endpoint") {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) if e.is_empty() => None,
        Some(Value::String(e)) => Some(on_replica(e, ip, rank, Socket::Replay)?),
        Some(other) => return Err(format!("its replay_endpoint {other} is not an endpoint")),
    };
    Ok(KvEndpoints { publisher, replay })
}

/// Which of the two sockets an endpoint names: the engines bind the publisher only on a
/// wildcard host, the replay socket on any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Socket {
    Publisher,
    Replay,
}

/// A bound endpoint (`tcp://host:port`) as a connectable one on the replica at `ip`, on the
/// port plus `rank`.
fn on_replica(endpoint: &str, ip: IpAddr, rank: u16, socket: Socket) -> Result<String, String> {
    let shifted = inferlb_kvevents::endpoint_for_rank(endpoint, rank.into())
        .map_err(|e| format!("its KV events {e}"))?;
    let Some((host, port)) = shifted
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
    else {
        return Err(format!(
            "its KV events endpoint {endpoint:?} is not tcp://host:port"
        ));
    };
    let port: u16 = match port.parse() {
        Ok(p) if p > 0 => p,
        _ => {
            return Err(format!(
                "its KV events endpoint {endpoint:?} has no fixed port"
            ))
        }
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ipv4_only = matches!(host, "*" | "0.0.0.0");
    let wildcard = ipv4_only || host == "::";
    let own = host.parse::<IpAddr>().is_ok_and(|h| h == ip);
    if socket == Socket::Publisher && !(host == "*" || host == "::") {
        return Err(format!(
            "its KV events endpoint {endpoint:?} is not a wildcard (* or ::): on any other host the engine connects out instead of listening"
        ));
    }
    if !(wildcard || own) {
        return Err(format!(
            "its KV events endpoint {endpoint:?} is not on its own address {ip}"
        ));
    }
    if ipv4_only && ip.is_ipv6() {
        return Err(format!(
            "its KV events endpoint {endpoint:?} listens on IPv4 only, and its address {ip} is IPv6 (bind :: for both)"
        ));
    }
    Ok(format!("tcp://{}", SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vllm(kv: Value) -> Vec<u8> {
        vllm_ranked(kv, 0)
    }

    fn vllm_ranked(kv: Value, rank: u64) -> Vec<u8> {
        json!({"vllm_config": {"model_config": {"model": "m"}, "kv_events_config": kv,
            "parallel_config": {"data_parallel_size": 4, "data_parallel_rank": rank}},
            "vllm_env": {}, "system_env": {}})
        .to_string()
        .into_bytes()
    }

    fn sglang(kv: Option<&str>) -> Vec<u8> {
        json!({"model_path": "m", "kv_events_config": kv, "dp_size": 1})
            .to_string()
            .into_bytes()
    }

    fn on(endpoint: &str, replay: Value) -> Value {
        json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay, "topic": ""})
    }

    #[test]
    fn each_engine_names_its_sockets_on_its_own_address_for_each_rank() {
        let ip: IpAddr = "10.0.0.7".parse().unwrap();
        let v6: IpAddr = "fd00::7".parse().unwrap();
        let both = |p: &str, r: Option<&str>| {
            Ok(KvEndpoints {
                publisher: p.to_string(),
                replay: r.map(str::to_string),
            })
        };
        let wild = on("tcp://*:5557", json!("tcp://*:5558"));
        let sg = r#"{"publisher": "zmq", "endpoint": "tcp://*:5557"}"#;
        type Case = (Vec<u8>, IpAddr, Option<u16>, Result<KvEndpoints, String>);
        let cases: Vec<Case> = vec![
            (
                vllm(wild.clone()),
                ip,
                None,
                both("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5558")),
            ),
            (
                vllm(wild.clone()),
                ip,
                Some(3),
                both("tcp://10.0.0.7:5560", Some("tcp://10.0.0.7:5561")),
            ),
            // A rank behind its own API server: the rank it reports.
            (
                vllm_ranked(wild.clone(), 2),
                ip,
                None,
                both("tcp://10.0.0.7:5559", Some("tcp://10.0.0.7:5560")),
            ),
            // The conf's rank wins over the server's (one server, every rank behind it).
            (
                vllm_ranked(wild.clone(), 2),
                ip,
                Some(1),
                both("tcp://10.0.0.7:5558", Some("tcp://10.0.0.7:5559")),
            ),
            (
                vllm(on("tcp://[::]:5557", json!("tcp://[fd00::7]:5558"))),
                v6,
                Some(1),
                both("tcp://[fd00::7]:5558", Some("tcp://[fd00::7]:5559")),
            ),
            (
                vllm(on("tcp://*:5557", json!("tcp://10.0.0.7:6000"))),
                ip,
                None,
                both("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:6000")),
            ),
            (
                sglang(Some(sg)),
                ip,
                None,
                both("tcp://10.0.0.7:5557", None),
            ),
            (
                sglang(Some(sg)),
                ip,
                Some(2),
                both("tcp://10.0.0.7:5559", None),
            ),
            (
                vllm(on("tcp://*:6000", Value::Null)),
                ip,
                None,
                both("tcp://10.0.0.7:6000", None),
            ),
        ];
        for (i, (body, ip, rank, want)) in cases.into_iter().enumerate() {
            assert_eq!(endpoints(&body, ip, rank), want, "case {i}");
        }
    }

    #[test]
    fn what_names_no_usable_socket_of_its_own_is_refused_with_the_reason() {
        let ip: IpAddr = "10.0.0.7".parse().unwrap();
        let v6: IpAddr = "fd00::7".parse().unwrap();
        let cases: Vec<(Vec<u8>, IpAddr, &str)> = vec![
            (b"<html>".to_vec(), ip, "not JSON"),
            (
                json!({"vllm_config": "VllmConfig(...)"})
                    .to_string()
                    .into_bytes(),
                ip,
                "as text",
            ),
            (sglang(None), ip, "publishes no KV events"),
            (
                vllm(json!({"enable_kv_cache_events": false, "publisher": "null",
                    "endpoint": "tcp://*:5557"})),
                ip,
                "are off",
            ),
            (
                vllm(json!({"publisher": "zmq", "endpoint": "tcp://*:5557"})),
                ip,
                "are off",
            ),
            (
                vllm(json!({"enable_kv_cache_events": true, "publisher": "nats",
                    "endpoint": "tcp://*:5557"})),
                ip,
                "not zmq",
            ),
            // SGLang's publisher defaults to none.
            (
                sglang(Some(r#"{"endpoint": "tcp://*:5557"}"#)),
                ip,
                "not zmq",
            ),
            (
                vllm(json!({"enable_kv_cache_events": true, "publisher": "zmq"})),
                ip,
                "no endpoint",
            ),
            (sglang(Some("{not json")), ip, "not JSON"),
            // Any host but a wildcard: the engine's publisher connects out.
            (
                vllm(on("tcp://10.0.0.7:5557", Value::Null)),
                ip,
                "not a wildcard",
            ),
            (
                vllm(on("tcp://0.0.0.0:5557", Value::Null)),
                ip,
                "not a wildcard",
            ),
            (
                vllm(on("tcp://*:5557", json!("tcp://10.9.9.9:5558"))),
                ip,
                "not on its own address",
            ),
            (vllm(on("tcp://*:5557", Value::Null)), v6, "IPv4 only"),
            (
                vllm(on("ipc:///tmp/kv", Value::Null)),
                ip,
                "tcp://host:port",
            ),
            (
                vllm(on("inproc://cache", Value::Null)),
                ip,
                "tcp://host:port",
            ),
            (vllm(on("tcp://*:0", Value::Null)), ip, "no fixed port"),
            (
                vllm_ranked(on("tcp://*:65535", Value::Null), 1),
                ip,
                "past port 65535",
            ),
            (vllm(on("tcp://*:5557", json!(5558))), ip, "not an endpoint"),
        ];
        for (body, ip, says) in cases {
            let err = endpoints(&body, ip, None).expect_err(says);
            assert!(err.contains(says), "{says}: {err}");
        }
    }
}
