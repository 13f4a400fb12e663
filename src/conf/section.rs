//! The `inferlb:` section: parsed as written ([`RawSection`], with its defaults), then validated
//! once into the [`Config`] the rest of the program trusts. Every bad value is refused with its
//! key named (`inferlb.health.path: ...`); a replica entry is checked by `replica`, the
//! `overload:` part by `crate::conf::overload`, the `cluster:` part by `crate::conf::cluster`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Mode;
use super::{check_replica, seconds, Config, DiscoveryConf, HealthConf, ReplicaConf, UpstreamConf};

/// The `inferlb:` section as written; see the README for each key. Serialised only by the test
/// that checks docs/configuration.md against these keys and defaults (client keys redacted).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawSection {
    listen: String,
    plain_listen: Option<String>,
    tls: Option<crate::conf::tls::RawTls>,
    h2c: bool,
    admin_listen: String,
    replicas: Vec<ReplicaConf>,
    routing: Mode,
    health: RawHealth,
    upstream: RawUpstream,
    max_body_bytes: usize,
    body_read_timeout_seconds: f64,
    affinity_capacity: usize,
    spill_margin: usize,
    state_file: Option<PathBuf>,
    #[serde(serialize_with = "crate::conf::secrets::redact_each")]
    api_keys: Vec<String>,
    api_keys_file: Option<PathBuf>,
    api_keys_env: Option<String>,
    secrets_reload_interval_seconds: f64,
    max_header_bytes: usize,
    access_log: crate::telemetry::access::Format,
    session_header: Option<String>,
    stored_responses_capacity: usize,
    stored_lookup_timeout_seconds: f64,
    load_poll_interval_seconds: f64,
    cluster: Option<super::cluster::RawCluster>,
    discovery_interval_seconds: f64,
    discovery_nameserver: Option<String>,
    overload: Option<crate::conf::overload::RawOverload>,
    admin: Option<super::admin::RawAdmin>,
    forward_paths: Vec<String>,
    public_paths: Vec<String>,
    pd: crate::conf::pd::RawPd,
    responses: crate::conf::responses::RawResponses,
    tokenizers: std::collections::BTreeMap<String, PathBuf>,
}

impl Default for RawSection {
    fn default() -> Self {
        RawSection {
            listen: "0.0.0.0:7770".into(),
            plain_listen: None,
            tls: None,
            h2c: false,
            admin_listen: "127.0.0.1:7771".into(),
            replicas: vec![],
            routing: Mode::PrefillCost,
            health: RawHealth::default(),
            upstream: RawUpstream::default(),
            max_body_bytes: 32 * 1024 * 1024,
            body_read_timeout_seconds: 30.0,
            affinity_capacity: 100_000,
            spill_margin: 4,
            state_file: None,
            api_keys: vec![],
            api_keys_file: None,
            api_keys_env: None,
            secrets_reload_interval_seconds: 5.0,
            max_header_bytes: 64 * 1024,
            access_log: crate::telemetry::access::Format::Kv,
            session_header: None,
            stored_responses_capacity: 100_000,
            stored_lookup_timeout_seconds: 2.0,
            load_poll_interval_seconds: 0.25,
            cluster: None,
            discovery_interval_seconds: 5.0,
            discovery_nameserver: None,
            overload: None,
            admin: None,
            forward_paths: vec![],
            public_paths: vec![],
            pd: crate::conf::pd::RawPd::default(),
            responses: crate::conf::responses::RawResponses::default(),
            tokenizers: Default::default(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawHealth {
    path: String,
    interval_seconds: f64,
    timeout_seconds: f64,
    failures: usize,
    successes: usize,
}

impl Default for RawHealth {
    fn default() -> Self {
        RawHealth {
            path: "/health".into(),
            interval_seconds: 1.0,
            timeout_seconds: 1.0,
            failures: 2,
            successes: 1,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawUpstream {
    connect_timeout_seconds: f64,
    read_timeout_seconds: f64,
    write_timeout_seconds: f64,
    idle_timeout_seconds: f64,
    ca_file: Option<PathBuf>,
    client_cert_file: Option<PathBuf>,
    client_key_file: Option<PathBuf>,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            connect_timeout_seconds: 2.0,
            read_timeout_seconds: 300.0,
            write_timeout_seconds: 30.0,
            idle_timeout_seconds: 4.0,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
        }
    }
}

/// How often secret files are read again: as the TLS certificate's, 0.1 s to a day.
fn reload_interval(r: f64) -> Result<Duration, String> {
    if !(r.is_finite() && (0.1..=86_400.0).contains(&r)) {
        return Err(format!(
            "inferlb.secrets_reload_interval_seconds: {r} must be between 0.1 and 86400"
        ));
    }
    Ok(Duration::from_secs_f64(r))
}

fn upstream_tls(u: &RawUpstream) -> Result<crate::conf::tls::UpstreamTls, String> {
    let client = match (&u.client_cert_file, &u.client_key_file) {
        (None, None) => None,
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => {
            return Err("inferlb.upstream.client_cert_file and client_key_file go together".into())
        }
    };
    crate::conf::tls::UpstreamTls::load(u.ca_file.as_deref(), client, "inferlb.upstream")
}

/// Whether listeners on `a` and `b` would share a port: the same port on the same address,
/// or on any address when either is the unspecified one (0.0.0.0 or ::).
fn same_port(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

pub(super) fn validate(mut raw: RawSection) -> Result<Config, String> {
    let plain = raw.plain_listen.as_ref();
    let mut bound: Vec<(&str, SocketAddr)> = vec![];
    for (key, addr) in [
        ("listen", Some(&raw.listen)),
        ("admin_listen", Some(&raw.admin_listen)),
        ("plain_listen", plain),
    ] {
        let Some(addr) = addr else { continue };
        let at = addr
            .parse::<SocketAddr>()
            .map_err(|e| format!("inferlb.{key}: {addr:?} is not an ip:port ({e})"))?;
        // Two listeners on one port would each get some of the other's connections.
        if let Some((other, _)) = bound.iter().find(|(_, b)| same_port(*b, at)) {
            return Err(format!(
                "inferlb.{key}: {addr:?} is the port of `{other}`; each listener needs its own"
            ));
        }
        bound.push((key, at));
    }
    let admin_at = bound
        .iter()
        .find(|(k, _)| *k == "admin_listen")
        .map(|(_, a)| *a)
        .ok_or("inferlb.admin_listen: missing")?;
    let admin = super::admin::validate(raw.admin.take().unwrap_or_default(), admin_at)?;
    if plain.is_some() && raw.tls.is_none() {
        return Err("inferlb.plain_listen: only with `tls` (without it, `listen` is plain)".into());
    }
    if raw.replicas.is_empty() {
        return Err("inferlb.replicas: at least one replica (id and address) is needed".into());
    }
    let mut ids = BTreeSet::new();
    let mut replicas = Vec::with_capacity(raw.replicas.len());
    for (i, mut r) in std::mem::take(&mut raw.replicas).into_iter().enumerate() {
        let key = format!("inferlb.replicas[{i}]");
        check_replica(&mut r, &key)?;
        if let Some(socket) = r.socket {
            admin
                .allowed_networks
                .check(socket.ip())
                .map_err(|e| format!("{key}.address: {:?}: {e}", r.address))?;
        }
        // A data-parallel entry is a replica per rank; one found by DNS, per rank of each pod.
        let each = if r.discover.is_some() {
            vec![r]
        } else {
            r.ranks()
        };
        for r in each {
            if !ids.insert(r.id.clone()) {
                return Err(format!("{key}.id: {:?} is used twice", r.id));
            }
            replicas.push(r);
        }
    }
    raw.replicas = replicas;
    let h = &raw.health;
    if !h.path.starts_with('/') {
        return Err(format!(
            "inferlb.health.path: {:?} must start with '/'",
            h.path
        ));
    }
    let health = HealthConf {
        path: h.path.clone(),
        interval: seconds("health.interval_seconds", h.interval_seconds)?,
        timeout: seconds("health.timeout_seconds", h.timeout_seconds)?,
        failures: h.failures.max(1),
        successes: h.successes.max(1),
    };
    if health.interval > Duration::from_secs(2) {
        return Err(
            "inferlb.health.interval_seconds: at most 2 (a dead replica must be noticed quickly)"
                .into(),
        );
    }
    let u = &raw.upstream;
    let upstream = UpstreamConf {
        connect_timeout: seconds(
            "upstream.connect_timeout_seconds",
            u.connect_timeout_seconds,
        )?,
        read_timeout: seconds("upstream.read_timeout_seconds", u.read_timeout_seconds)?,
        write_timeout: seconds("upstream.write_timeout_seconds", u.write_timeout_seconds)?,
        idle_timeout: seconds("upstream.idle_timeout_seconds", u.idle_timeout_seconds)?,
        tls: upstream_tls(u)?,
    };
    let api_keys = crate::conf::keys::KeyList::new(
        &raw.api_keys,
        raw.api_keys_env.as_deref(),
        raw.api_keys_file.as_deref(),
        "inferlb",
    )?;
    if raw.max_body_bytes == 0 {
        return Err("inferlb.max_body_bytes must be positive".into());
    }
    if raw.affinity_capacity == 0 {
        return Err("inferlb.affinity_capacity must be positive".into());
    }
    if raw.stored_responses_capacity == 0 {
        return Err("inferlb.stored_responses_capacity must be positive".into());
    }
    let cluster = raw
        .cluster
        .as_ref()
        .map(super::cluster::validate)
        .transpose()?;
    let discovery = DiscoveryConf {
        interval: seconds("discovery_interval_seconds", raw.discovery_interval_seconds)?,
        nameserver: match raw.discovery_nameserver.as_deref() {
            None | Some("") => None,
            Some(ns) => Some(ns.parse::<SocketAddr>().map_err(|e| {
                format!("inferlb.discovery_nameserver: {ns:?} is not an ip:port ({e})")
            })?),
        },
    };
    let session_header = match raw.session_header.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(name) => match http::HeaderName::from_bytes(name.as_bytes()) {
            Ok(h) => Some(h.as_str().to_owned()),
            Err(_) => {
                return Err(format!(
                    "inferlb.session_header: {name:?} is not a valid header name"
                ))
            }
        },
    };
    let tls = raw
        .tls
        .map(crate::conf::tls::RawTls::validate)
        .transpose()?;
    let forward_paths = path_rules("forward_paths", &raw.forward_paths)?;
    let public_paths = path_rules("public_paths", &raw.public_paths)?;
    Ok(Config {
        listen: raw.listen,
        plain_listen: raw.plain_listen,
        tls,
        h2c: raw.h2c,
        admin_listen: raw.admin_listen,
        replicas: raw.replicas,
        routing: raw.routing,
        health,
        upstream,
        max_body_bytes: raw.max_body_bytes,
        body_read_timeout: seconds("body_read_timeout_seconds", raw.body_read_timeout_seconds)?,
        affinity_capacity: raw.affinity_capacity,
        spill_margin: (raw.spill_margin > 0).then_some(raw.spill_margin),
        state_file: raw.state_file.unwrap_or_default(),
        api_keys,
        secrets_reload_interval: reload_interval(raw.secrets_reload_interval_seconds)?,
        max_header_bytes: raw.max_header_bytes.max(1024),
        access_log: raw.access_log,
        session_header,
        stored_responses_capacity: raw.stored_responses_capacity,
        stored_lookup_timeout: seconds(
            "stored_lookup_timeout_seconds",
            raw.stored_lookup_timeout_seconds,
        )?,
        load_poll_interval: seconds("load_poll_interval_seconds", raw.load_poll_interval_seconds)?,
        cluster,
        discovery,
        overload: raw
            .overload
            .map(crate::conf::overload::validate)
            .transpose()?,
        admin,
        forward_paths,
        public_paths,
        pd: crate::conf::pd::validate(raw.pd)?,
        responses: crate::conf::responses::validate(raw.responses)?,
        tokenizers: tokenizers(raw.tokenizers)?,
    })
}

/// Model names and their tokenizer directories, both given.
fn tokenizers(
    dirs: std::collections::BTreeMap<String, PathBuf>,
) -> Result<std::collections::BTreeMap<String, PathBuf>, String> {
    for (model, dir) in &dirs {
        if model.is_empty() {
            return Err("inferlb.tokenizers: a model name is empty".into());
        }
        if dir.as_os_str().is_empty() {
            return Err(format!(
                "inferlb.tokenizers.{model}: the directory is empty"
            ));
        }
    }
    Ok(dirs)
}

fn path_rules(key: &str, paths: &[String]) -> Result<Vec<crate::protocol::edge::PathRule>, String> {
    paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            crate::protocol::edge::PathRule::parse(p)
                .map_err(|e| format!("inferlb.{key}[{i}]: {e}"))
        })
        .collect()
}
