//! The conf file: Pingora's own server keys at the top level, inferlb's in an `inferlb:` section.
//!
//! Parsed and validated once, at start (and by `-t`); the rest of the program receives a
//! [`Config`] it can trust. Unknown or bad keys are refused with the key named: Pingora alone
//! would silently ignore a misspelt key.
//!
//! Here: the validated types, the split of the file into Pingora's `ServerConf` (its keys
//! checked, inferlb's defaults for it) and the `inferlb:` section, which `section` parses and
//! validates; one replica entry's checks are in `replica`, the `cluster:` section's (and its
//! Redis client) in `cluster`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pingora_core::server::configuration::ServerConf;
use serde_yaml::{Mapping, Value};

mod admin;
mod cluster;
#[cfg(test)]
mod doc_check;
pub mod keys;
mod kv_events;
mod mode;
pub mod netpolicy;
pub mod overload;
pub mod pd;
mod replica;
pub mod responses;
pub mod secrets;
mod section;
pub mod tls;

pub use admin::{read_token, AdminConf, Token, TokenSource};
pub use cluster::ClusterConf;
pub use kv_events::{KvEndpoints, KvEvents};
pub use mode::Mode;
pub use pd::{PdConf, Protocol, Role};
pub use replica::{check_replica, split_address, Discover, ReplicaConf};
use section::{validate, RawSection};

/// Everything inferlb reads from its conf, validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// The client listener: TLS (offering h2 and http/1.1) when `tls` is set, else plain HTTP.
    pub listen: String,
    /// With `tls` set, a second listener for plain HTTP (inside a cluster, for probes).
    pub plain_listen: Option<String>,
    pub tls: Option<crate::conf::tls::TlsConf>,
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
    /// Client keys (`Authorization: Bearer ...` or `x-api-key`), needed on every path but
    /// `public_paths`; empty: no check.
    /// From the conf, `api_keys_env` and `api_keys_file` (read again when it changes).
    pub api_keys: Arc<crate::conf::keys::KeyList>,
    /// How often secret files (keys, tokens, passwords) are read again.
    pub secrets_reload_interval: Duration,
    /// Request headers larger than this in total get 431.
    pub max_header_bytes: usize,
    pub access_log: crate::telemetry::access::Format,
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
    pub overload: Option<crate::conf::overload::OverloadConf>,
    /// The admin listener's tokens and where replicas may be.
    pub admin: AdminConf,
    /// Paths forwarded besides the defaults ([`crate::protocol::edge::forwarded_by_default`]).
    pub forward_paths: Vec<crate::protocol::edge::PathRule>,
    /// Paths open without a client key when `api_keys` is set.
    pub public_paths: Vec<crate::protocol::edge::PathRule>,
    /// Prefill/decode disaggregation, for models whose replicas take those roles.
    pub pd: PdConf,
    /// Where the Responses API's stored exchanges are kept.
    pub responses: crate::conf::responses::ResponsesConf,
    /// Per model, the directory of its tokenizer (`tokenizer.json`, `tokenizer_config.json`):
    /// its prompts' token ids are what the replicas' KV events name.
    pub tokenizers: std::collections::BTreeMap<String, PathBuf>,
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
    pub tls: crate::conf::tls::UpstreamTls,
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
        if self.api_keys.in_conf() {
            out.push(
                "inferlb.api_keys: keys written in the conf; secrets belong in a file \
                 (api_keys_file) or the environment (api_keys_env)"
                    .into(),
            );
        }
        for (i, r) in self.replicas.iter().enumerate() {
            if r.api_key.is_some() {
                out.push(format!(
                    "inferlb.replicas[{i}].api_key: a key written in the conf; secrets belong \
                     in a file (api_key_file) or the environment (api_key_env)"
                ));
            }
        }
        for (i, r) in self.replicas.iter().enumerate() {
            let earlier = self.replicas[..i].iter().find(|o| {
                // Ranks of one data-parallel server each have their own cache.
                let ranks = o.data_parallel_rank.is_some()
                    && r.data_parallel_rank.is_some()
                    && o.data_parallel_rank != r.data_parallel_rank;
                o.socket.is_some() && o.socket == r.socket && !ranks
            });
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

/// A positive number of seconds below about 116 days, for `inferlb.{key}`.
fn seconds(key: &str, v: f64) -> Result<Duration, String> {
    if v.is_finite() && v > 0.0 && v < 1e7 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(format!(
            "inferlb.{key} must be a positive number of seconds, got {v}"
        ))
    }
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
            (
                format!("{GOOD}  admin_listen: 127.0.0.1:7770\n"),
                "inferlb.admin_listen: \"127.0.0.1:7770\" is the port of `listen`",
            ),
            (
                format!("{GOOD}  admin_listen: 0.0.0.0:7770\n"),
                "port of `listen`",
            ),
            (
                format!("{GOOD}  plain_listen: \"127.0.0.1:7771\"\n  tls: {{cert_file: c, key_file: k}}\n"),
                "inferlb.plain_listen: \"127.0.0.1:7771\" is the port of `admin_listen`",
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
            (
                format!("{GOOD}  forward_paths: [/tokenize, \"/v1//x\"]\n"),
                "inferlb.forward_paths[1]: \"/v1//x\" is not in normal form",
            ),
            (
                format!("{GOOD}  public_paths: [\"/a/*/b\"]\n"),
                "inferlb.public_paths[0]",
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
    fn secrets_in_the_conf_are_refused_or_warned_about_and_never_printed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keys = dir.path().join("keys");
        std::fs::write(&keys, "from-a-file-1\n").expect("write");
        let refused = [
            (
                format!("{GOOD}  cluster: {{redis_url: \"redis://:hunter2hunter2@127.0.0.1\"}}\n"),
                "redis_password_file",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"redis://user:hunter2hunter2@127.0.0.1:6379/0\"}}\n"),
                "a password in the URL",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"rediss://127.0.0.1/#insecure\"}}\n"),
                "redis_ca_file",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"redis://127.0.0.1\", redis_ca_file: {keys:?}}}\n"),
                "only with a rediss://",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"rediss://127.0.0.1\", redis_ca_file: {keys:?}}}\n"),
                "no certificate",
            ),
            (
                format!("{GOOD}  cluster: {{redis_url: \"redis://127.0.0.1\", redis_password_env: INFERLB_TEST_UNSET_VAR}}\n"),
                "redis_password_env",
            ),
            (format!("{GOOD}  api_keys: [hunter2]\n"), "api_keys[0]"),
            (format!("{GOOD}  api_keys_file: /nonexistent/keys\n"), "api_keys_file"),
            (format!("{GOOD}  api_keys_env: INFERLB_TEST_UNSET_VAR\n"), "api_keys_env"),
            (
                GOOD.replace("8002}", "8002, api_key_file: /nonexistent/key}"),
                "replicas[1].api_key_file",
            ),
            (
                GOOD.replace("8002}", "8002, api_key: hunter2hunter2, api_key_env: X}"),
                "not several",
            ),
            (format!("{GOOD}  secrets_reload_interval_seconds: 0\n"), "secrets_reload"),
        ];
        for (text, needle) in refused {
            let e = parse(&text, None)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
            assert!(!e.contains("hunter2"), "a secret in {e:?}");
        }
        let text = format!(
            "{}  api_keys: [conf-key-hunter2]\n  api_keys_file: {keys:?}\n  \
             cluster: {{redis_url: \"redis://127.0.0.1\", redis_password_file: {keys:?}}}\n",
            GOOD.replace("8002}", "8002, api_key: replica-hunter2}")
        );
        let c = parse(&text, None).expect("valid").inferlb;
        assert_eq!(
            **c.api_keys.current(),
            ["conf-key-hunter2", "from-a-file-1"]
        );
        let key = c.replicas[1].key.as_ref().expect("a key");
        assert_eq!(*key.current(), "replica-hunter2");
        let pass = c.cluster.as_ref().and_then(|c| c.redis_password.as_ref());
        assert_eq!(
            pass.map(|p| p.current().to_string()).as_deref(),
            Some("from-a-file-1")
        );
        let shown = format!("{c:?}");
        for secret in ["hunter2", "from-a-file-1"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        let w = c.warnings();
        assert!(w.iter().any(|w| w.contains("inferlb.api_keys:")), "{w:?}");
        assert!(
            w.iter().any(|w| w.contains("replicas[1].api_key:")),
            "{w:?}"
        );
        // What a cluster shares of a replica: where its key is read, never the key.
        let mut r = c.replicas[1].clone();
        let shared = serde_json::to_string(&r).expect("json");
        assert!(
            !shared.contains("hunter2") && !shared.contains("api_key"),
            "{shared}"
        );
        r.api_key = None;
        r.api_key_env = Some("GPU1_KEY".into());
        let shared = serde_json::to_string(&r).expect("json");
        assert!(shared.contains(r#""api_key_env":"GPU1_KEY""#), "{shared}");
    }

    #[test]
    fn the_admin_section_is_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("good");
        std::fs::write(&good, "a-token-of-enough-length\n").expect("write");
        let short = dir.path().join("short");
        std::fs::write(&short, "short\n").expect("write");
        let missing = dir.path().join("missing");
        std::env::set_var("INFERLB_CONF_TEST_TOKEN", "another-token-of-enough-length");
        let (good, short, missing) = (good.display(), short.display(), missing.display());
        let public = GOOD.replace("127.0.0.1:8002", "8.8.8.8:80");
        let metadata = GOOD.replace("127.0.0.1:8002", "169.254.169.254:80");
        let refused = [
            (format!("{GOOD}  admin: {{token: a-token-of-enough-length}}\n"), "unknown field `token`"),
            (
                format!("{GOOD}  admin_listen: 0.0.0.0:7771\n"),
                "inferlb.admin_listen: 0.0.0.0:7771 is not a loopback address",
            ),
            (format!("{GOOD}  admin_listen: \"[::]:7771\"\n"), "inferlb.admin.token_file or inferlb.admin.token_env"),
            (format!("{GOOD}  admin_listen: 10.0.0.1:7771\n"), "not a loopback"),
            (format!("{GOOD}  admin: {{token_file: {missing}}}\n"), "inferlb.admin.token_file"),
            (format!("{GOOD}  admin: {{token_file: {short}}}\n"), "at least 16 characters"),
            (
                format!("{GOOD}  admin: {{metrics_token_file: {short}}}\n"),
                "inferlb.admin.metrics_token_file",
            ),
            (
                format!("{GOOD}  admin: {{token_file: {good}, token_env: INFERLB_CONF_TEST_TOKEN}}\n"),
                "not both",
            ),
            (format!("{GOOD}  admin: {{token_env: INFERLB_CONF_TEST_UNSET}}\n"), "inferlb.admin.token_env"),
            (format!("{GOOD}  admin: {{allowed_networks: [10.0.0.0/8, ten]}}\n"), "inferlb.admin.allowed_networks[1]"),
            (format!("{GOOD}  admin: {{reload_interval_seconds: 0}}\n"), "reload_interval_seconds"),
            (public.clone(), "inferlb.replicas[1].address: \"8.8.8.8:80\": 8.8.8.8 is outside admin.allowed_networks"),
            (metadata.clone(), "inferlb.replicas[1].address"),
            (GOOD.replace("127.0.0.1:8002", "\"[fe80::1]:80\""), "inferlb.replicas[1].address"),
            (
                GOOD.replace("127.0.0.1:8002", "\"[::ffff:169.254.169.254]:80\""),
                "that is 169.254.169.254",
            ),
            (
                format!("{metadata}  admin: {{allowed_networks: [0.0.0.0/0]}}\n"),
                "a cloud metadata address",
            ),
            (
                format!("{public}  admin: {{allowed_networks: [10.0.0.0/8]}}\n"),
                "inferlb.replicas[0].address",
            ),
        ];
        for (text, needle) in refused {
            let e = parse(&text, None)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
            assert!(!e.contains("token-of-enough"), "a token in {e:?}");
        }
        let accepted = [
            format!("{GOOD}  admin_listen: 0.0.0.0:7771\n  admin: {{token_file: {good}}}\n"),
            format!("{GOOD}  admin_listen: 0.0.0.0:7771\n  admin: {{token_env: INFERLB_CONF_TEST_TOKEN}}\n"),
            format!("{GOOD}  admin_listen: \"[::1]:7771\"\n"),
            format!("{public}  admin: {{allowed_networks: [127.0.0.0/8, 8.8.8.8]}}\n"),
            format!("{metadata}  admin: {{allowed_networks: [127.0.0.1, 169.254.169.254/32]}}\n"),
        ];
        for text in accepted {
            if let Err(e) = parse(&text, None) {
                panic!("{e}: {text}");
            }
        }
        let l = parse(
            &format!("{GOOD}  admin: {{token_file: {good}, metrics_token_file: {good}}}\n"),
            None,
        )
        .expect("valid");
        let shown = format!("{:?}", l.inferlb);
        let (source, token) = l.inferlb.admin.token.expect("a token");
        assert!(
            token.matches(b"a-token-of-enough-length"),
            "the newline is dropped"
        );
        assert!(!shown.contains("a-token-of"), "Debug shows no token");
        assert!(matches!(source, TokenSource::File { .. }));
    }

    #[test]
    fn forward_and_public_paths_are_read() {
        let text =
            format!("{GOOD}  forward_paths: [/tokenize, /sim/*]\n  public_paths: [/v1/models]\n");
        let l = parse(&text, None).expect("valid");
        use crate::protocol::edge::PathRule;
        assert_eq!(
            l.inferlb.forward_paths,
            [
                PathRule::Exact("/tokenize".into()),
                PathRule::Below("/sim".into())
            ]
        );
        assert_eq!(
            l.inferlb.public_paths,
            [PathRule::Exact("/v1/models".into())]
        );
        assert!(parse(GOOD, None)
            .expect("valid")
            .inferlb
            .forward_paths
            .is_empty());
    }

    #[test]
    fn replicas_are_required() {
        let e = parse("inferlb: {}", None).err().expect("test fixture");
        assert!(e.contains("inferlb.replicas"), "{e}");
    }
}
