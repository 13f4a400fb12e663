//! One replica's entry in the conf (or added through the admin API, or shared by another
//! instance) and its checks: id, address and scheme, SNI, cache size, discovery, data-parallel
//! ranks; its KV event endpoints are [`super::kv_events`]'.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use inferlb_kvevents::endpoint_for_rank;
use serde::Deserialize;

use super::kv_events::{check_kv_events, endpoint_port, KV_EVENTS_FROM_SERVER_INFO};
use crate::conf::pd::Role;
use crate::conf::secrets::{Redacted, Secret};

/// Serialised (for the other instances of a cluster, through Redis) without its key: only
/// where each instance reads it (`api_key_env`, `api_key_file`).
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConf {
    /// A stable name: metrics, logs, headers and the affinity table use it.
    pub id: String,
    /// host:port of the replica's OpenAI-compatible server; `https://host:port` for one
    /// behind TLS (`http://` is allowed and means plain).
    pub address: String,
    /// With `https://`: the name sent as SNI and checked against its certificate; default,
    /// the address's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    /// Connections to it are TLS (`address` is `https://`); set by validation.
    #[serde(skip)]
    pub tls: bool,
    /// Its key written in the conf: accepted, with a warning (it belongs in a file or the
    /// environment); refused by the admin API. Never serialised.
    #[serde(default, skip_serializing)]
    pub api_key: Option<Redacted>,
    /// The environment variable holding its key (read by each instance from its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// The file holding its key, read again when it changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// Sent to this replica as `Authorization: Bearer ...` in place of the client's: read by
    /// validation from whichever of the three is set.
    #[serde(skip)]
    pub key: Option<Arc<Secret>>,
    /// The models it serves; when omitted, learnt from its `/v1/models` by the health checks.
    #[serde(default)]
    pub models: Vec<String>,
    /// `address`, resolved once by validation.
    #[serde(skip)]
    pub socket: Option<SocketAddr>,
    /// Its prefix cache's capacity in tokens; when omitted, learnt from its `/metrics`.
    #[serde(default)]
    pub cache_tokens: Option<u64>,
    /// `dns`: `address` is a name for several replicas (a headless Service), re-resolved on an
    /// interval; each address becomes a replica `{id}-{ip}-{port}`.
    #[serde(default)]
    pub discover: Option<Discover>,
    /// Its part in its model's pool: `plain` (default), `prefill`, `decode` or `both`.
    #[serde(
        default,
        skip_serializing_if = "Role::is_plain",
        deserialize_with = "plain_if_null"
    )]
    pub role: Role,
    /// SGLang's protocol: the port of this prefill server's bootstrap server (its host is the
    /// address's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// vLLM's KV event publisher (`--kv-events-config`'s `endpoint`), `tcp://host:port`: its
    /// cache's stores, evictions and resets, read by a subscriber (`fleet::kv_events`). Or
    /// `server_info` ([`KV_EVENTS_FROM_SERVER_INFO`]): the endpoints the replica names in its
    /// own `GET /server_info`, read again at each reconnect (on a discover entry too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// Its replay socket (`replay_endpoint`), `tcp://host:port`: missed batches are asked
    /// for there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// With `discover: dns`: the port of each found replica's KV event publisher, on the
    /// replica's own address (every pod of a Service publishes on the same port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_port: Option<u16>,
    /// With `kv_events_port`: the port of each found replica's replay socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay_port: Option<u16>,
    /// vLLM's `--data-parallel-size` behind this one address (its internal load balancing):
    /// the entry stands for that many replicas, `{id}-dp{k}` for rank k, each with its own
    /// cache and load. Expanded by [`ReplicaConf::ranks`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u16>,
    /// The data-parallel rank this replica is: sent as `X-data-parallel-rank`, its `/metrics`
    /// samples those labelled `engine="{rank}"`. Set on each rank of a `data_parallel_size`
    /// entry; may be written on an entry (or an admin API addition) for one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_rank: Option<u16>,
}

/// The most data-parallel ranks one entry may stand for (vLLM's wide expert-parallel
/// deployments run a few hundred).
pub const MAX_DATA_PARALLEL: u16 = 1024;

impl ReplicaConf {
    /// The entry of one replica a discover entry found at `socket`: the entry's scheme and
    /// SNI (its DNS name), and its event ports on that replica's address.
    pub fn found_at(&self, id: String, socket: SocketAddr) -> ReplicaConf {
        let on_it =
            |port: Option<u16>| port.map(|p| format!("tcp://{}", SocketAddr::new(socket.ip(), p)));
        ReplicaConf {
            id,
            address: if self.tls {
                format!("https://{socket}")
            } else {
                socket.to_string()
            },
            socket: Some(socket),
            discover: None,
            kv_events: if self.learns_kv_events() {
                self.kv_events.clone()
            } else {
                on_it(self.kv_events_port)
            },
            kv_events_replay: on_it(self.kv_events_replay_port),
            kv_events_port: None,
            kv_events_replay_port: None,
            ..self.clone()
        }
    }

    /// The replicas this entry stands for: itself, or with `data_parallel_size: n`, one per
    /// rank: `{id}-dp{k}` with `data_parallel_rank: k` and every event endpoint (or port)
    /// offset by k, as vLLM's rank k binds its publisher and replay socket on the configured
    /// port plus k (`server_info` stays: the rank's offset is taken when the endpoints are
    /// read). Checked by [`check_replica`]: no offset port passes 65535.
    pub fn ranks(&self) -> Vec<ReplicaConf> {
        let n = match self.data_parallel_size {
            Some(n) if n > 1 => n,
            _ => {
                return vec![ReplicaConf {
                    data_parallel_size: None,
                    ..self.clone()
                }]
            }
        };
        (0..n)
            .map(|k| ReplicaConf {
                id: format!("{}-dp{k}", self.id),
                data_parallel_size: None,
                data_parallel_rank: Some(k),
                kv_events: match self.kv_events.as_deref() {
                    Some(KV_EVENTS_FROM_SERVER_INFO) => self.kv_events.clone(),
                    e => e.and_then(|e| endpoint_for_rank(e, k.into()).ok()),
                },
                kv_events_replay: self
                    .kv_events_replay
                    .as_deref()
                    .and_then(|e| endpoint_for_rank(e, k.into()).ok()),
                kv_events_port: self.kv_events_port.and_then(|p| p.checked_add(k)),
                kv_events_replay_port: self.kv_events_replay_port.and_then(|p| p.checked_add(k)),
                ..self.clone()
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Discover {
    Dns,
}

/// `role: null` (or absent) is `plain`.
fn plain_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
    Ok(Option::<Role>::deserialize(d)?.unwrap_or_default())
}

/// Checks one replica entry (of the conf, `key` naming it, or added through the admin API)
/// and resolves its address once; an entry discovered by DNS is resolved later.
pub fn check_replica(r: &mut ReplicaConf, key: &str) -> Result<(), String> {
    use std::net::ToSocketAddrs;
    let valid_id = !r.id.is_empty()
        && r.id.len() <= 128
        && r.id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !valid_id {
        return Err(format!(
            "{key}.id: {:?} must be non-empty letters, digits, '-', '_' or '.'",
            r.id
        ));
    }
    if let Some(t) = r.cache_tokens {
        if !(1024..=1_000_000_000).contains(&t) {
            return Err(format!(
                "{key}.cache_tokens: {t} is not a cache size (1024 to 1e9 tokens)"
            ));
        }
    }
    check_kv_events(r, key)?;
    match (r.data_parallel_size, r.data_parallel_rank) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "{key}: data_parallel_size (an entry for every rank) or data_parallel_rank (one rank), not both"
            ))
        }
        (Some(n), None) if n == 0 || n > MAX_DATA_PARALLEL => {
            return Err(format!(
                "{key}.data_parallel_size: {n} is not a number of ranks (1 to {MAX_DATA_PARALLEL})"
            ))
        }
        (None, Some(k)) if k >= MAX_DATA_PARALLEL => {
            return Err(format!(
                "{key}.data_parallel_rank: {k} is not a rank (0 to {})",
                MAX_DATA_PARALLEL - 1
            ))
        }
        _ => {}
    }
    if let Some(n) = r.data_parallel_size.filter(|n| *n > 1) {
        if !r.role.is_plain() {
            return Err(format!(
                "{key}.data_parallel_size: a data-parallel replica takes no part in prefill/decode disaggregation here; list its ranks' servers one by one"
            ));
        }
        let last = n - 1;
        let ports = [
            ("kv_events", r.kv_events.as_deref().and_then(endpoint_port)),
            (
                "kv_events_replay",
                r.kv_events_replay.as_deref().and_then(endpoint_port),
            ),
            ("kv_events_port", r.kv_events_port),
            ("kv_events_replay_port", r.kv_events_replay_port),
        ];
        for (name, port) in ports {
            if port.is_some_and(|p| p.checked_add(last).is_none()) {
                return Err(format!(
                    "{key}.{name}: rank {last} publishes on this port plus {last}, past 65535"
                ));
            }
        }
    }
    if r.data_parallel_rank.is_some() && !r.role.is_plain() {
        return Err(format!(
            "{key}.data_parallel_rank: a data-parallel replica takes no part in prefill/decode disaggregation here"
        ));
    }
    if r.bootstrap_port == Some(0) {
        return Err(format!("{key}.bootstrap_port: 0 is not a port"));
    }
    if r.bootstrap_port.is_some() && !r.role.prefills() {
        return Err(format!(
            "{key}.bootstrap_port: only a prefill (or both) replica has a bootstrap server"
        ));
    }
    r.key = match (&r.api_key, &r.api_key_env, &r.api_key_file) {
        (None, None, None) => None,
        (Some(k), None, None) => Some(Secret::literal(&k.0)),
        (None, Some(name), None) => {
            Some(Secret::from_env(name).map_err(|e| format!("{key}.api_key_env: {e}"))?)
        }
        (None, None, Some(path)) => {
            Some(Secret::from_file(path).map_err(|e| format!("{key}.api_key_file: {e}"))?)
        }
        _ => {
            return Err(format!(
                "{key}: one of api_key, api_key_env and api_key_file, not several"
            ))
        }
    };
    let (tls, host_port) = split_address(&r.address).map_err(|e| format!("{key}.address: {e}"))?;
    r.tls = tls;
    if tls && r.sni.is_none() {
        let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
        r.sni = Some(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
        );
    }
    if let Some(sni) = &r.sni {
        if !tls {
            return Err(format!("{key}.sni: only for an https:// address"));
        }
        if sni.is_empty() || rustls_pki_types::ServerName::try_from(sni.as_str()).is_err() {
            return Err(format!(
                "{key}.sni: {sni:?} is not a host name or IP address"
            ));
        }
    }
    if r.discover.is_some() {
        // Found later, and again and again: a name with no address yet is fine.
        let host_port = host_port.rsplit_once(':');
        if !host_port.is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) {
            return Err(format!(
                "{key}.address: {:?} must be host:port to discover by DNS",
                r.address
            ));
        }
        return Ok(());
    }
    match host_port.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(socket)) => {
            r.socket = Some(socket);
            Ok(())
        }
        _ => Err(format!(
            "{key}.address: {:?} is not a reachable host:port",
            r.address
        )),
    }
}

/// A replica address's scheme and `host:port`: `host:port` and `http://host:port` are plain,
/// `https://host:port` is TLS.
pub fn split_address(address: &str) -> Result<(bool, &str), String> {
    let (tls, rest) = if let Some(rest) = address.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = address.strip_prefix("http://") {
        (false, rest)
    } else if address.contains("://") {
        return Err(format!(
            "{address:?}: only http:// and https:// are understood"
        ));
    } else {
        (false, address)
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err(format!(
            "{address:?}: a replica is host:port, without a path"
        ));
    }
    Ok((tls, rest))
}

#[cfg(test)]
mod tests {
    fn entry(discover: bool, port: Option<u16>, replay: Option<u16>) -> super::ReplicaConf {
        super::ReplicaConf {
            id: "vllm".into(),
            address: "vllm.test:8000".into(),
            discover: discover.then_some(super::Discover::Dns),
            kv_events_port: port,
            kv_events_replay_port: replay,
            ..Default::default()
        }
    }

    /// A discover entry names its replicas' event ports; each replica found gets them on its
    /// own address, and none of the entry's discovery.
    #[test]
    fn a_discover_entry_gives_each_replica_it_finds_its_event_endpoints() {
        let mut e = entry(true, Some(5557), Some(5558));
        super::check_replica(&mut e, "replicas[0]").expect("valid");
        let found = e.found_at(
            "vllm-10.0.0.7-8000".into(),
            "10.0.0.7:8000".parse().unwrap(),
        );
        assert_eq!(found.address, "10.0.0.7:8000");
        assert_eq!(found.discover, None);
        assert_eq!(found.kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(
            found.kv_events_replay.as_deref(),
            Some("tcp://10.0.0.7:5558")
        );
        assert_eq!(
            (found.kv_events_port, found.kv_events_replay_port),
            (None, None)
        );
        let v6 = e.found_at("v6".into(), "[fd00::7]:8000".parse().unwrap());
        assert_eq!(v6.kv_events.as_deref(), Some("tcp://[fd00::7]:5557"));
        let mut plain = entry(true, None, None);
        super::check_replica(&mut plain, "replicas[0]").expect("valid");
        let found = plain.found_at("p".into(), "10.0.0.8:8000".parse().unwrap());
        assert_eq!((found.kv_events, found.kv_events_replay), (None, None));
        let mut tls = super::ReplicaConf {
            address: "https://vllm.test:8443".into(),
            ..entry(true, Some(5557), None)
        };
        super::check_replica(&mut tls, "replicas[0]").expect("valid");
        let found = tls.found_at("t".into(), "10.0.0.9:8443".parse().unwrap());
        assert_eq!(found.address, "https://10.0.0.9:8443");
        assert_eq!(found.sni.as_deref(), Some("vllm.test"));
    }

    #[test]
    fn event_ports_are_for_discover_entries_with_a_publisher_and_not_zero() {
        for (e, says) in [
            (entry(false, Some(5557), None), "only for a discover entry"),
            (entry(true, Some(0), None), "0 is not a port"),
            (entry(true, Some(5557), Some(0)), "0 is not a port"),
            (entry(true, None, Some(5558)), "without kv_events_port"),
        ] {
            let mut e = e;
            let err = super::check_replica(&mut e, "replicas[0]").expect_err(says);
            assert!(err.contains(says), "{err}");
        }
    }

    /// `kv_events: server_info` stands alone (the replica names both sockets), holds on a
    /// discover entry's replicas and on each rank, and is read from the replica.
    #[test]
    fn server_info_names_the_event_endpoints_on_every_replica_and_rank_it_stands_for() {
        let learning = |discover: bool| super::ReplicaConf {
            kv_events: Some("server_info".into()),
            // One replica's address resolves; a discover entry's is a DNS name.
            address: if discover {
                "vllm.test:8000"
            } else {
                "127.0.0.1:8000"
            }
            .into(),
            ..entry(discover, None, None)
        };
        for discover in [false, true] {
            let mut e = learning(discover);
            super::check_replica(&mut e, "replicas[0]").expect("valid");
            assert_eq!(e.kv_events(), Some(crate::conf::KvEvents::ServerInfo));
        }
        let mut found = learning(true).found_at("f".into(), "10.0.0.7:8000".parse().unwrap());
        super::check_replica(&mut found, "replicas[0]").expect("valid");
        assert_eq!(found.kv_events(), Some(crate::conf::KvEvents::ServerInfo));
        let dp = super::ReplicaConf {
            data_parallel_size: Some(2),
            ..learning(false)
        };
        let ranks: Vec<_> = dp
            .ranks()
            .iter()
            .map(|r| (r.data_parallel_rank, r.kv_events()))
            .collect();
        assert_eq!(
            ranks,
            [
                (Some(0), Some(crate::conf::KvEvents::ServerInfo)),
                (Some(1), Some(crate::conf::KvEvents::ServerInfo))
            ]
        );
        for (e, name) in [
            (
                super::ReplicaConf {
                    kv_events_replay: Some("tcp://127.0.0.1:5558".into()),
                    ..learning(false)
                },
                "kv_events_replay",
            ),
            (
                super::ReplicaConf {
                    kv_events_port: Some(5557),
                    ..learning(true)
                },
                "kv_events_port",
            ),
        ] {
            let mut e = e;
            let err = super::check_replica(&mut e, "replicas[0]").expect_err(name);
            assert!(
                err.contains(name) && err.contains("names its endpoints"),
                "{err}"
            );
        }
        let mut fixed = super::ReplicaConf {
            kv_events: Some("tcp://*:5557".into()),
            ..learning(false)
        };
        let err = super::check_replica(&mut fixed, "replicas[0]").expect_err("a bind address");
        assert!(err.contains("server_info"), "{err}");
    }

    /// A data-parallel entry is one replica per rank: ids `{id}-dp{k}`, the rank set, each
    /// event endpoint (or, found by DNS, port) on its port plus the rank, as vLLM binds them.
    #[test]
    fn a_data_parallel_entry_is_a_replica_per_rank_on_offset_event_ports() {
        let mut e = super::ReplicaConf {
            id: "dsv3".into(),
            address: "127.0.0.1:8000".into(),
            data_parallel_size: Some(3),
            kv_events: Some("tcp://127.0.0.1:5557".into()),
            kv_events_replay: Some("tcp://[::1]:6557".into()),
            ..Default::default()
        };
        super::check_replica(&mut e, "replicas[0]").expect("valid");
        let ranks = e.ranks();
        let got: Vec<_> = ranks
            .iter()
            .map(|r| {
                (
                    r.id.as_str(),
                    r.data_parallel_rank,
                    r.data_parallel_size,
                    r.kv_events.as_deref().unwrap_or(""),
                    r.kv_events_replay.as_deref().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "dsv3-dp0",
                    Some(0),
                    None,
                    "tcp://127.0.0.1:5557",
                    "tcp://[::1]:6557"
                ),
                (
                    "dsv3-dp1",
                    Some(1),
                    None,
                    "tcp://127.0.0.1:5558",
                    "tcp://[::1]:6558"
                ),
                (
                    "dsv3-dp2",
                    Some(2),
                    None,
                    "tcp://127.0.0.1:5559",
                    "tcp://[::1]:6559"
                ),
            ]
        );
        assert!(ranks.iter().all(|r| r.socket == e.socket));
        // Found by DNS: each pod's ranks, on the pod's address.
        let mut d = super::ReplicaConf {
            data_parallel_size: Some(2),
            ..entry(true, Some(5557), Some(5600))
        };
        super::check_replica(&mut d, "replicas[0]").expect("valid");
        let pod = d.found_at(
            "vllm-10.0.0.7-8000".into(),
            "10.0.0.7:8000".parse().unwrap(),
        );
        let got: Vec<_> = pod
            .ranks()
            .into_iter()
            .map(|r| {
                (
                    r.id,
                    r.kv_events.unwrap_or_default(),
                    r.kv_events_replay.unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "vllm-10.0.0.7-8000-dp0".into(),
                    "tcp://10.0.0.7:5557".into(),
                    "tcp://10.0.0.7:5600".into()
                ),
                (
                    "vllm-10.0.0.7-8000-dp1".into(),
                    "tcp://10.0.0.7:5558".into(),
                    "tcp://10.0.0.7:5601".into()
                ),
            ]
        );
        // One rank (or none): the entry itself, no rank.
        for size in [None, Some(1)] {
            let mut one = super::ReplicaConf {
                data_parallel_size: size,
                ..entry(false, None, None)
            };
            one.address = "127.0.0.1:8000".into();
            super::check_replica(&mut one, "replicas[0]").expect("valid");
            let ranks = one.ranks();
            assert_eq!(ranks.len(), 1);
            assert_eq!(
                (ranks[0].id.as_str(), ranks[0].data_parallel_rank),
                ("vllm", None)
            );
        }
    }

    #[test]
    fn data_parallel_sizes_and_ranks_are_checked() {
        let base = || super::ReplicaConf {
            id: "dp".into(),
            address: "127.0.0.1:8000".into(),
            ..Default::default()
        };
        for (e, says) in [
            (
                super::ReplicaConf {
                    data_parallel_size: Some(2),
                    data_parallel_rank: Some(1),
                    ..base()
                },
                "not both",
            ),
            (
                super::ReplicaConf {
                    data_parallel_size: Some(0),
                    ..base()
                },
                "is not a number of ranks",
            ),
            (
                super::ReplicaConf {
                    data_parallel_size: Some(1025),
                    ..base()
                },
                "is not a number of ranks",
            ),
            (
                super::ReplicaConf {
                    data_parallel_rank: Some(1024),
                    ..base()
                },
                "is not a rank",
            ),
            (
                super::ReplicaConf {
                    data_parallel_size: Some(4),
                    kv_events: Some("tcp://127.0.0.1:65533".into()),
                    ..base()
                },
                "past 65535",
            ),
            (
                super::ReplicaConf {
                    data_parallel_size: Some(2),
                    role: crate::conf::pd::Role::Decode,
                    ..base()
                },
                "prefill/decode",
            ),
        ] {
            let mut e = e;
            let err = super::check_replica(&mut e, "replicas[0]").expect_err(says);
            assert!(err.contains(says), "{err}");
        }
        let mut edge = super::ReplicaConf {
            data_parallel_size: Some(3),
            kv_events: Some("tcp://127.0.0.1:65533".into()),
            ..base()
        };
        super::check_replica(&mut edge, "replicas[0]").expect("65533 + 2 is a port");
    }
}
