//! A replica's KV event endpoints as it names them over HTTP (`kv_events: server_info`), so
//! that no port is written twice, once in the engine's flags and once in inferlb's conf.
//!
//! Two engines answer `GET /server_info` with their KV events config:
//! - vLLM, when started with `VLLM_SERVER_DEV_MODE=1`: with `?config_format=json`, its config
//!   as JSON, whose `vllm_config.kv_events_config` holds `enable_kv_cache_events`, `publisher`
//!   (`zmq`), `endpoint` and `replay_endpoint`. Without dev mode the path answers 404, and
//!   without `config_format=json` the config is text; both are reported, not guessed at.
//! - SGLang, always: its server arguments, whose `kv_events_config` is the JSON string given
//!   to `--kv-events-config` (`publisher`, `endpoint`, `replay_endpoint`), or null.
//!
//! The endpoints are bind addresses (`tcp://*:5557` as often as not): a wildcard host is the
//! replica's own address, and a rank's sockets are on the ports plus its rank, as both engines
//! bind them. A host other than the replica's own is refused: a replica names its own sockets,
//! never where else inferlb should connect.

use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

use crate::conf::KvEndpoints;

/// The path asked: vLLM's JSON form; SGLang ignores the query.
pub const PATH: &str = "/server_info?config_format=json";

/// The endpoints an answer of `GET /server_info` names, for the replica at `ip` serving
/// data-parallel rank `rank` (0 without data parallelism). Pure.
pub fn endpoints(body: &[u8], ip: IpAddr, rank: u16) -> Result<KvEndpoints, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("its /server_info is not JSON: {e}"))?;
    let config = match v.get("vllm_config") {
        Some(Value::String(_)) => {
            return Err("its /server_info gave vLLM's config as text, not JSON".into())
        }
        Some(c) => c.get("kv_events_config"),
        None => v.get("kv_events_config"),
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
    if config.get("enable_kv_cache_events") == Some(&Value::Bool(false)) {
        return Err("its KV events are off (enable_kv_cache_events: false)".into());
    }
    match config.get("publisher").and_then(Value::as_str) {
        None | Some("zmq") => {}
        Some(other) => return Err(format!("its KV event publisher is {other:?}, not zmq")),
    }
    let publisher = match config.get("endpoint").and_then(Value::as_str) {
        Some(e) => on_replica(e, ip, rank)?,
        None => return Err("its kv_events_config has no endpoint".into()),
    };
    let replay = match config.get("replay_endpoint") {
        None | Some(Value::Null) => None,
        Some(Value::String(e)) if e.is_empty() => None,
        Some(Value::String(e)) => Some(on_replica(e, ip, rank)?),
        Some(other) => return Err(format!("its replay_endpoint {other} is not an endpoint")),
    };
    Ok(KvEndpoints { publisher, replay })
}

/// A bound endpoint (`tcp://host:port`) as a connectable one on the replica at `ip`, on the
/// port plus `rank`.
fn on_replica(endpoint: &str, ip: IpAddr, rank: u16) -> Result<String, String> {
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
    let wildcard = matches!(host, "" | "*" | "0.0.0.0" | "::");
    let own = host.parse::<IpAddr>().is_ok_and(|h| h == ip);
    if !(wildcard || own) {
        return Err(format!(
            "its KV events endpoint {endpoint:?} is not on its own address {ip}"
        ));
    }
    Ok(format!("tcp://{}", SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vllm(kv: Value) -> Vec<u8> {
        json!({"vllm_config": {"model_config": {"model": "m"}, "kv_events_config": kv},
            "vllm_env": {}, "system_env": {}})
        .to_string()
        .into_bytes()
    }

    fn sglang(kv: Option<&str>) -> Vec<u8> {
        json!({"model_path": "m", "kv_events_config": kv, "dp_size": 1})
            .to_string()
            .into_bytes()
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
        let on = json!({"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""});
        let sg = r#"{"publisher": "zmq", "endpoint": "tcp://0.0.0.0:5557"}"#;
        type Case = (Vec<u8>, IpAddr, u16, Result<KvEndpoints, String>);
        let cases: Vec<Case> = vec![
            (
                vllm(on.clone()),
                ip,
                0,
                both("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5558")),
            ),
            (
                vllm(on.clone()),
                ip,
                3,
                both("tcp://10.0.0.7:5560", Some("tcp://10.0.0.7:5561")),
            ),
            (
                vllm(on.clone()),
                v6,
                1,
                both("tcp://[fd00::7]:5558", Some("tcp://[fd00::7]:5559")),
            ),
            (sglang(Some(sg)), ip, 0, both("tcp://10.0.0.7:5557", None)),
            (sglang(Some(sg)), ip, 2, both("tcp://10.0.0.7:5559", None)),
            (
                vllm(json!({"endpoint": "tcp://10.0.0.7:6000", "replay_endpoint": null})),
                ip,
                0,
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
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"<html>".to_vec(), "not JSON"),
            (
                json!({"vllm_config": "VllmConfig(...)"})
                    .to_string()
                    .into_bytes(),
                "as text",
            ),
            (sglang(None), "publishes no KV events"),
            (
                vllm(json!({"enable_kv_cache_events": false, "publisher": "null",
                    "endpoint": "tcp://*:5557"})),
                "are off",
            ),
            (
                vllm(json!({"publisher": "nats", "endpoint": "tcp://*:5557"})),
                "not zmq",
            ),
            (vllm(json!({"publisher": "zmq"})), "no endpoint"),
            (sglang(Some("{not json")), "not JSON"),
            (
                vllm(json!({"endpoint": "tcp://10.9.9.9:5557"})),
                "not on its own address",
            ),
            (
                vllm(json!({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://evil:5558"})),
                "not on its own address",
            ),
            (vllm(json!({"endpoint": "ipc:///tmp/kv"})), "tcp://"),
            (
                vllm(json!({"endpoint": "inproc://cache"})),
                "tcp://host:port",
            ),
            (vllm(json!({"endpoint": "tcp://*:0"})), "no fixed port"),
            (
                vllm(json!({"endpoint": "tcp://*:65535"})),
                "past port 65535",
            ),
            (
                vllm(json!({"endpoint": "tcp://*:5557", "replay_endpoint": 5558})),
                "not an endpoint",
            ),
        ];
        for (body, says) in cases {
            let rank = if says == "past port 65535" { 1 } else { 0 };
            let err = endpoints(&body, ip, rank).expect_err(says);
            assert!(err.contains(says), "{says}: {err}");
        }
    }
}
