//! A replica's KV event endpoints in its conf entry: the publisher and replay socket it names
//! (`tcp://host:port`), or `server_info` (read from the replica), and their checks.

use super::ReplicaConf;

/// `kv_events: server_info`: a replica's event endpoints are those its `GET /server_info`
/// names (vLLM's, with `VLLM_SERVER_DEV_MODE=1`, or SGLang's).
pub const KV_EVENTS_FROM_SERVER_INFO: &str = "server_info";

/// A replica's KV event endpoints, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoints {
    pub publisher: String,
    pub replay: Option<String>,
}

/// Where a replica's KV events are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvents {
    /// The endpoints the conf names.
    At(KvEndpoints),
    /// The endpoints the replica's `GET /server_info` names, for its rank
    /// (`fleet::kv_events::server_info`).
    ServerInfo,
}

impl ReplicaConf {
    /// Where its KV events are read, when they are (checked by [`super::check_replica`]).
    pub fn kv_events(&self) -> Option<KvEvents> {
        let publisher = self.kv_events.clone()?;
        Some(if publisher == KV_EVENTS_FROM_SERVER_INFO {
            KvEvents::ServerInfo
        } else {
            KvEvents::At(KvEndpoints {
                publisher,
                replay: self.kv_events_replay.clone(),
            })
        })
    }

    /// Whether its event endpoints are read from its `/server_info`.
    pub(super) fn learns_kv_events(&self) -> bool {
        self.kv_events.as_deref() == Some(KV_EVENTS_FROM_SERVER_INFO)
    }
}

/// Checks the KV event endpoints of entry `key`: named, or read from the replica, not both;
/// ports only for a discover entry; a replay socket only with its publisher.
pub(super) fn check_kv_events(r: &ReplicaConf, key: &str) -> Result<(), String> {
    if r.learns_kv_events() {
        let fixed = [
            ("kv_events_replay", r.kv_events_replay.is_some()),
            ("kv_events_port", r.kv_events_port.is_some()),
            ("kv_events_replay_port", r.kv_events_replay_port.is_some()),
        ];
        if let Some((name, _)) = fixed.iter().find(|(_, set)| *set) {
            return Err(format!(
                "{key}.{name}: with kv_events: server_info the replica names its endpoints itself"
            ));
        }
    } else if let Some(e) = &r.kv_events {
        check_zmq_endpoint(e)
            .map_err(|m| format!("{key}.kv_events: {m} (or server_info: read from the replica)"))?;
        if r.discover.is_some() {
            return Err(format!(
                "{key}.kv_events: one publisher cannot be every replica a discover entry finds; give kv_events_port, or kv_events: server_info"
            ));
        }
    }
    if let Some(e) = &r.kv_events_replay {
        check_zmq_endpoint(e).map_err(|m| format!("{key}.kv_events_replay: {m}"))?;
        if r.kv_events.is_none() {
            return Err(format!(
                "{key}.kv_events_replay: a replay socket without kv_events, the publisher"
            ));
        }
    }
    for (name, port) in [
        ("kv_events_port", r.kv_events_port),
        ("kv_events_replay_port", r.kv_events_replay_port),
    ] {
        match port {
            Some(0) => return Err(format!("{key}.{name}: 0 is not a port")),
            Some(_) if r.discover.is_none() => {
                return Err(format!(
                    "{key}.{name}: only for a discover entry (one replica names its endpoint in kv_events)"
                ))
            }
            _ => {}
        }
    }
    if r.kv_events_replay_port.is_some() && r.kv_events_port.is_none() {
        return Err(format!(
            "{key}.kv_events_replay_port: a replay socket without kv_events_port, the publisher"
        ));
    }
    Ok(())
}

/// `tcp://host:port`, as ZMQ names a TCP endpoint.
fn check_zmq_endpoint(e: &str) -> Result<(), String> {
    let rest = e
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{e:?} is not tcp://host:port"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{e:?} has no port"))?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    if host.is_empty() || host == "*" || !port_ok {
        return Err(format!("{e:?} is not tcp://host:port"));
    }
    Ok(())
}

/// The port of a `tcp://host:port` endpoint.
pub(super) fn endpoint_port(e: &str) -> Option<u16> {
    e.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    /// Only `tcp://host:port` names a KV event endpoint: no other scheme, no wildcard host (a
    /// bind address, not one to connect to), no port 0 or none.
    #[test]
    fn kv_event_endpoints_are_tcp_host_and_port() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://vllm-0.vllm:5557",
            "tcp://[::1]:5557",
        ] {
            assert_eq!(super::check_zmq_endpoint(ok), Ok(()), "{ok}");
        }
        for bad in [
            "127.0.0.1:5557",
            "ipc:///tmp/kv",
            "tcp://*:5557",
            "tcp://:5557",
            "tcp://host",
            "tcp://host:0",
            "tcp://host:99999",
            "",
        ] {
            assert!(super::check_zmq_endpoint(bad).is_err(), "{bad}");
        }
    }
}
