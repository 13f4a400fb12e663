//! The conf file: Pingora's own server keys at the top level, inferlb's in an `inferlb:` section.
//!
//! Parsed and validated once, at start (and by `-t`); the rest of the program receives a
//! [`Config`] it can trust. Unknown or bad keys are refused with the key named: Pingora alone
//! would silently ignore a misspelt key.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pingora_core::server::configuration::ServerConf;
use serde::Deserialize;
use serde_yaml::{Mapping, Value};

use crate::routing::Mode;

mod replica;

pub use replica::{check_replica, split_address, Discover, ReplicaConf};

/// Everything inferlb reads from its conf, validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// The client listener: TLS (offering h2 and http/1.1) when `tls` is set, else plain HTTP.
    pub listen: String,
    /// With `tls` set, a second listener for plain HTTP (inside a cluster, for probes).
    pub plain_listen: Option<String>,
    pub tls: Option<crate::tls::TlsConf>,
    /// HTTP/2 with prior knowledge on the plain listener(s).
    pub h2c: bool,
    pub admin_listen: String,
    pub replicas: Vec<ReplicaConf>,
    pub routing: Mode,
    pub health: HealthConf,
    pub upstream: UpstreamConf,
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub affinity_capacity: usize,
    pub spill_margin: Option<usize>,
    /// Where the affinity table is kept across upgrades and restarts.
    pub state_file: PathBuf,
    /// Client keys accepted on /v1/ paths (`Authorization: Bearer ...`); empty: no check.
    pub api_keys: Vec<String>,
    /// Request headers larger than this in total get 431.
    pub max_header_bytes: usize,
    pub access_log: crate::access::Format,
    /// A request header whose value pins a session to its first replica (lower case).
    pub session_header: Option<String>,
    /// Stored Responses ids remembered (LRU), each naming the replica that stores it.
    pub stored_responses_capacity: usize,
    /// How long to ask the replicas about a stored response id inferlb does not know.
    pub stored_lookup_timeout: Duration,
    /// How often each replica's `/metrics` is read for its load (`prefill_cost`).
    pub load_poll_interval: Duration,
    /// Shared routing state with other instances; `None`: this process alone.
    pub cluster: Option<ClusterConf>,
    pub discovery: DiscoveryConf,
    /// Overload protection; `None`: every request goes on, as before.
    pub overload: Option<crate::overload::OverloadConf>,
}

#[derive(Debug, Clone)]
pub struct ClusterConf {
    pub redis_url: String,
    pub instance_id: String,
    /// How long a shared pin lives in Redis without being renewed.
    pub pin_ttl: Duration,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    redis_url: String,
    #[serde(default)]
    instance_id: Option<String>,
    #[serde(default = "default_pin_ttl")]
    pin_ttl_seconds: f64,
}

fn default_pin_ttl() -> f64 {
    86_400.0
}

/// Where discovered replicas come from: how often, and which DNS server (None: the system's).
#[derive(Debug, Clone)]
pub struct DiscoveryConf {
    pub interval: Duration,
    pub nameserver: Option<SocketAddr>,
}

#[derive(Debug, Clone)]
pub struct HealthConf {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub failures: usize,
    pub successes: usize,
}

#[derive(Debug, Clone)]
pub struct UpstreamConf {
    pub connect_timeout: Duration,
    /// Longest silence while reading a response: it bounds time to first token (a cold
    /// prefill of a long prompt) and the gap between streamed tokens.
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    /// Below uvicorn's 5 s keep-alive, so a pooled connection is never used after vLLM closed it.
    pub idle_timeout: Duration,
    /// Trust and identity toward replicas behind TLS.
    pub tls: crate::tls::UpstreamTls,
}

/// The `inferlb:` section as written; see the README for each key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSection {
    listen: String,
    plain_listen: Option<String>,
    tls: Option<crate::tls::RawTls>,
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
    api_keys: Vec<String>,
    max_header_bytes: usize,
    access_log: crate::access::Format,
    session_header: Option<String>,
    stored_responses_capacity: usize,
    stored_lookup_timeout_seconds: f64,
    load_poll_interval_seconds: f64,
    cluster: Option<RawCluster>,
    discovery_interval_seconds: f64,
    discovery_nameserver: Option<String>,
    overload: Option<crate::overload::conf::RawOverload>,
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
            max_header_bytes: 64 * 1024,
            access_log: crate::access::Format::Kv,
            session_header: None,
            stored_responses_capacity: 100_000,
            stored_lookup_timeout_seconds: 2.0,
            load_poll_interval_seconds: 0.25,
            cluster: None,
            discovery_interval_seconds: 5.0,
            discovery_nameserver: None,
            overload: None,
        }
    }
}

#[derive(Debug, Deserialize)]
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

#[derive(Debug, Deserialize)]
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

/// The conf file, split into Pingora's part and inferlb's.
pub struct Loaded {
    pub server: ServerConf,
    pub inferlb: Config,
}

impl Config {
    /// What is valid but probably not meant, for `-t` and the start-up log.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = vec![];
        for (i, r) in self.replicas.iter().enumerate() {
            let earlier = self.replicas[..i]
                .iter()
                .find(|o| o.socket.is_some() && o.socket == r.socket);
            if let Some(o) = earlier {
                out.push(format!(
                    "inferlb.replicas[{i}].address: {:?} ({}) is the same server as replica {} ({:?}); \
                     each is health-checked and demoted on its own, but they share one cache",
                    r.address,
                    r.id,
                    o.id,
                    o.address
                ));
            }
        }
        out
    }
}

/// Reads and validates a conf file. `routing_env` is `$ROUTING`, which overrides the file.
pub fn load(path: &str, routing_env: Option<&str>) -> Result<Loaded, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    parse(&text, routing_env).map_err(|e| format!("{path}: {e}"))
}

pub fn parse(text: &str, routing_env: Option<&str>) -> Result<Loaded, String> {
    let mut top: Mapping = match serde_yaml::from_str(text).map_err(|e| e.to_string())? {
        Value::Mapping(m) => m,
        Value::Null => Mapping::new(),
        _ => return Err("the conf must be a YAML mapping".into()),
    };
    let section = top.remove("inferlb").unwrap_or(Value::Null);

    let known = pingora_keys();
    for key in top.keys() {
        let name = key.as_str().unwrap_or("<non-string key>");
        if !known.contains(name) {
            return Err(format!(
                "unknown key `{name}` (Pingora server keys and an `inferlb:` section are allowed)"
            ));
        }
    }
    let mut server: ServerConf = serde_path_to_error::deserialize(Value::Mapping(top))
        .map_err(|e| format!("{}: {}", e.path(), e.inner()))?;
    if server.version == 0 {
        server.version = 1;
    }
    if server.max_retries == 0 {
        return Err("`max_retries` must be at least 1: it is the number of attempts".into());
    }
    // Pingora's defaults are 300 s of grace and 5 s of shutdown; LLM streams need their own.
    server.grace_period_seconds.get_or_insert(120);
    server.graceful_shutdown_timeout_seconds.get_or_insert(10);

    let raw: RawSection = if section.is_null() {
        RawSection::default()
    } else {
        serde_path_to_error::deserialize(section).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                format!("inferlb: {inner}")
            } else {
                format!("inferlb.{path}: {inner}")
            }
        })?
    };
    let mut inferlb = validate(raw)?;
    if inferlb.state_file.as_os_str().is_empty() {
        // Beside the pid file: one per installation, and per test in the tests.
        let dir = std::path::Path::new(&server.pid_file)
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp"));
        inferlb.state_file = dir.join("inferlb-affinity.json");
    }
    if let Some(mode) = routing_env.filter(|s| !s.is_empty()) {
        inferlb.routing = mode.parse().map_err(|e| format!("ROUTING: {e}"))?;
    }
    Ok(Loaded { server, inferlb })
}

/// The top-level keys Pingora's ServerConf understands, read off its own serialisation.
fn pingora_keys() -> BTreeSet<String> {
    match serde_yaml::to_value(ServerConf::default()) {
        Ok(Value::Mapping(m)) => m
            .keys()
            .filter_map(|k| k.as_str().map(str::to_owned))
            .collect(),
        _ => BTreeSet::new(),
    }
}

fn seconds(key: &str, v: f64) -> Result<Duration, String> {
    if v.is_finite() && v > 0.0 && v < 1e7 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(format!(
            "inferlb.{key} must be a positive number of seconds, got {v}"
        ))
    }
}

fn upstream_tls(u: &RawUpstream) -> Result<crate::tls::UpstreamTls, String> {
    let client = match (&u.client_cert_file, &u.client_key_file) {
        (None, None) => None,
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => {
            return Err("inferlb.upstream.client_cert_file and client_key_file go together".into())
        }
    };
    crate::tls::UpstreamTls::load(u.ca_file.as_deref(), client, "inferlb.upstream")
}

fn validate(raw: RawSection) -> Result<Config, String> {
    let plain = raw.plain_listen.as_ref();
    for (key, addr) in [
        ("listen", Some(&raw.listen)),
        ("admin_listen", Some(&raw.admin_listen)),
        ("plain_listen", plain),
    ] {
        let Some(addr) = addr else { continue };
        addr.parse::<SocketAddr>()
            .map_err(|e| format!("inferlb.{key}: {addr:?} is not an ip:port ({e})"))?;
    }
    if plain.is_some() && raw.tls.is_none() {
        return Err("inferlb.plain_listen: only with `tls` (without it, `listen` is plain)".into());
    }
    if plain.is_some_and(|p| *p == raw.listen || *p == raw.admin_listen) {
        return Err("inferlb.plain_listen: must differ from `listen` and `admin_listen`".into());
    }
    if raw.replicas.is_empty() {
        return Err("inferlb.replicas: at least one replica (id and address) is needed".into());
    }
    let mut raw = raw;
    let mut ids = BTreeSet::new();
    for (i, r) in raw.replicas.iter_mut().enumerate() {
        let key = format!("inferlb.replicas[{i}]");
        check_replica(r, &key)?;
        if !ids.insert(r.id.clone()) {
            return Err(format!("{key}.id: {:?} is used twice", r.id));
        }
    }
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
    if raw.api_keys.iter().any(|k| k.len() < 8) {
        return Err("inferlb.api_keys: each key must be at least 8 characters".into());
    }
    if raw.max_body_bytes == 0 {
        return Err("inferlb.max_body_bytes must be positive".into());
    }
    if raw.affinity_capacity == 0 {
        return Err("inferlb.affinity_capacity must be positive".into());
    }
    if raw.stored_responses_capacity == 0 {
        return Err("inferlb.stored_responses_capacity must be positive".into());
    }
    let cluster = match &raw.cluster {
        None => None,
        Some(c) => {
            if let Err(e) = redis::Client::open(c.redis_url.as_str()) {
                return Err(format!("inferlb.cluster.redis_url: {:?}: {e}", c.redis_url));
            }
            let instance_id = match c.instance_id.as_deref().map(str::trim) {
                None | Some("") => crate::cluster::default_instance_id(),
                Some(id) if id.contains(['|', '#']) || id.contains(char::is_whitespace) => {
                    return Err(format!(
                        "inferlb.cluster.instance_id: {id:?} may not contain '|', '#' or spaces"
                    ))
                }
                Some(id) => id.to_string(),
            };
            Some(ClusterConf {
                redis_url: c.redis_url.clone(),
                instance_id,
                pin_ttl: seconds("cluster.pin_ttl_seconds", c.pin_ttl_seconds)?,
            })
        }
    };
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
    let tls = raw.tls.map(crate::tls::RawTls::validate).transpose()?;
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
        api_keys: raw.api_keys,
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
            .map(crate::overload::conf::validate)
            .transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
threads: 2
grace_period_seconds: 30
inferlb:
  listen: 127.0.0.1:7770
  replicas:
    - {id: gpu0, address: 127.0.0.1:8001}
    - {id: gpu1, address: 127.0.0.1:8002}
  routing: affinity
  health: {interval_seconds: 0.5}
";

    #[test]
    fn a_good_conf_loads_with_defaults_filled_in() {
        let l = parse(GOOD, None).expect("test fixture");
        assert_eq!(l.server.threads, 2);
        assert_eq!(l.server.grace_period_seconds, Some(30));
        assert_eq!(l.server.graceful_shutdown_timeout_seconds, Some(10));
        assert_eq!(l.inferlb.routing, Mode::Affinity);
        assert_eq!(l.inferlb.replicas[1].id, "gpu1");
        assert_eq!(l.inferlb.health.interval, Duration::from_millis(500));
        assert_eq!(l.inferlb.health.path, "/health");
    }

    #[test]
    fn routing_env_overrides_the_file() {
        let l = parse(GOOD, Some("roundrobin")).expect("test fixture");
        assert_eq!(l.inferlb.routing, Mode::RoundRobin);
        let e = parse(GOOD, Some("fastest")).err().expect("test fixture");
        assert!(e.contains("ROUTING") && e.contains("fastest"), "{e}");
    }

    #[test]
    fn bad_keys_are_named() {
        let cases = [
            (GOOD.replace("threads", "thread"), "`thread`"),
            (
                GOOD.replace("routing: affinity", "routng: affinity"),
                "routng",
            ),
            (
                GOOD.replace("routing: affinity", "routing: fastest"),
                "fastest",
            ),
            (
                GOOD.replace("interval_seconds: 0.5", "interval_seconds: 5"),
                "interval_seconds",
            ),
            (GOOD.replace("{id: gpu1,", "{id: gpu0,"), "replicas[1].id"),
            (
                GOOD.replace("127.0.0.1:8002", "nowhere"),
                "replicas[1].address",
            ),
            (
                GOOD.replace("address: 127.0.0.1:8001", "addr: 127.0.0.1:8001"),
                "addr",
            ),
            (
                GOOD.replace("listen: 127.0.0.1:7770", "listen: 7770"),
                "inferlb.listen",
            ),
            (format!("{GOOD}  max_body_bytes: lots\n"), "max_body_bytes"),
            (format!("max_retries: 0\n{GOOD}"), "max_retries"),
            (
                format!("{GOOD}  session_header: \"x session\"\n"),
                "session_header",
            ),
            (
                format!("{GOOD}  stored_responses_capacity: 0\n"),
                "stored_responses_capacity",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"http://x\"}}\n"),
                "cluster.redis_url",
            ),
            (
                format!(
                    "{GOOD}  cluster: {{redis_url: \"redis://127.0.0.1\", instance_id: \"a|b\"}}\n"
                ),
                "cluster.instance_id",
            ),
            (
                format!("{GOOD}  cluster: {{redis_ur: \"redis://127.0.0.1\"}}\n"),
                "redis_ur",
            ),
            (
                GOOD.replace("8002}", "8002, cache_tokens: 0}"),
                "replicas[1].cache_tokens",
            ),
            (
                GOOD.replace("8001}", "8001, cache_tokens: 99999999999999}"),
                "replicas[0].cache_tokens",
            ),
            (
                format!("{GOOD}  stored_lookup_timeout_seconds: -1\n"),
                "stored_lookup_timeout_seconds",
            ),
        ];
        for (text, needle) in cases {
            let e = parse(&text, None)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
    }

    #[test]
    fn two_replicas_on_one_address_are_valid_with_a_warning() {
        let l = parse(&GOOD.replace("8002", "8001"), None).expect("valid");
        let w = l.inferlb.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("replicas[1]") && w[0].contains("gpu0"),
            "{w:?}"
        );
        assert!(parse(GOOD, None)
            .expect("valid")
            .inferlb
            .warnings()
            .is_empty());
    }

    #[test]
    fn replicas_are_required() {
        let e = parse("inferlb: {}", None).err().expect("test fixture");
        assert!(e.contains("inferlb.replicas"), "{e}");
    }
}
