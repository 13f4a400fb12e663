//! The balancer (`inferlb`) and the one writer of its conf.

use std::fmt::Write as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{bin, free_port, http_status, wait_until, yaml_str, Proc, Signal, Sim};

/// SIGINT is Pingora's quick stop; SIGTERM would wait out the grace period for streams.
const LB_STOP: Signal = Signal::SIGINT;

/// One entry of `inferlb.replicas`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Replica {
    pub id: String,
    /// host:port
    pub address: String,
    pub api_key: Option<String>,
    pub models: Vec<String>,
    /// Its prefix cache's capacity in tokens (`cache_tokens`); None: inferlb learns it from the
    /// replica's `/metrics`.
    pub cache_tokens: Option<u64>,
    /// Further keys of this entry, YAML flow style (`"weight: 2"`), for rare keys.
    pub extra: String,
}

impl Replica {
    pub fn new(id: &str, address: &str) -> Replica {
        Replica {
            id: id.into(),
            address: address.into(),
            ..Replica::default()
        }
    }

    /// The entry for a simulated replica: its id and address.
    pub fn of(sim: &Sim) -> Replica {
        Replica::new(&sim.id, &sim.addr())
    }
}

/// inferlb's conf file. Each field is one key; `None` (or empty) leaves the key out, so
/// inferlb's own default applies. A key any test or the bench sets gets a field here, and
/// [`LbConf::render`] is the only place the file's text is made.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LbConf {
    // Pingora's server keys, at the top level.
    pub threads: Option<usize>,
    /// Default (set by [`Lb::start`]): `<dir>/inferlb.pid`.
    pub pid_file: Option<PathBuf>,
    /// Default (set by [`Lb::start`]): `<dir>/upgrade.sock`.
    pub upgrade_sock: Option<PathBuf>,
    pub grace_period_seconds: Option<u64>,
    pub graceful_shutdown_timeout_seconds: Option<u64>,
    pub max_retries: Option<usize>,
    /// Further top-level lines, for rare Pingora keys (`"key: value\n"`).
    pub server_extra: String,

    // The `inferlb:` section.
    /// Port of `listen` on 127.0.0.1; 0: a free one, picked by [`Lb::start`].
    pub listen_port: u16,
    /// Port of `admin_listen` on 127.0.0.1; 0: a free one, picked by [`Lb::start`].
    pub admin_port: u16,
    /// adaptive | affinity | roundrobin | prefill_cost
    pub routing: Option<String>,
    pub health_path: Option<String>,
    pub health_interval_seconds: Option<f64>,
    pub health_timeout_seconds: Option<f64>,
    pub health_failures: Option<usize>,
    pub health_successes: Option<usize>,
    pub upstream_connect_timeout_seconds: Option<f64>,
    pub upstream_read_timeout_seconds: Option<f64>,
    pub upstream_write_timeout_seconds: Option<f64>,
    pub upstream_idle_timeout_seconds: Option<f64>,
    pub max_body_bytes: Option<usize>,
    pub body_read_timeout_seconds: Option<f64>,
    pub max_header_bytes: Option<usize>,
    pub affinity_capacity: Option<usize>,
    pub spill_margin: Option<usize>,
    pub state_file: Option<PathBuf>,
    /// Client keys; empty: the key is left out (no check).
    pub api_keys: Vec<String>,
    /// kv | json | off
    pub access_log: Option<String>,
    /// A request header naming a session (e.g. `x-session-id`).
    pub session_header: Option<String>,
    pub stored_responses_capacity: Option<usize>,
    pub stored_lookup_timeout_seconds: Option<f64>,
    /// How often each replica's `/metrics` is read for its load.
    pub load_poll_interval_seconds: Option<f64>,
    /// The `overload:` section's body as YAML (`"max_running: 2\nqueue_length: 10\n"`),
    /// indented under the key by the writer.
    pub overload: Option<String>,
    /// After the replicas [`Lb::start`] adds for the sims it is given.
    pub replicas: Vec<Replica>,
    /// Further lines at the end of the `inferlb:` section, indented by two spaces, for rare keys.
    pub extra: String,
    /// Not written to the file: variables set in inferlb's environment (secrets the conf
    /// names by `*_env`).
    pub env: Vec<(String, String)>,
}

impl LbConf {
    /// The conf file's text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        macro_rules! line {
            ($($arg:tt)*) => { let _ = writeln!(out, $($arg)*); };
        }
        if let Some(v) = self.threads {
            line!("threads: {v}");
        }
        if let Some(p) = &self.pid_file {
            line!("pid_file: {}", yaml_str(&p.to_string_lossy()));
        }
        if let Some(p) = &self.upgrade_sock {
            line!("upgrade_sock: {}", yaml_str(&p.to_string_lossy()));
        }
        if let Some(v) = self.grace_period_seconds {
            line!("grace_period_seconds: {v}");
        }
        if let Some(v) = self.graceful_shutdown_timeout_seconds {
            line!("graceful_shutdown_timeout_seconds: {v}");
        }
        if let Some(v) = self.max_retries {
            line!("max_retries: {v}");
        }
        out.push_str(&self.server_extra);

        line!("inferlb:");
        line!("  listen: 127.0.0.1:{}", self.listen_port);
        line!("  admin_listen: 127.0.0.1:{}", self.admin_port);
        if let Some(v) = &self.routing {
            line!("  routing: {v}");
        }
        let health = flow(&[
            ("path", self.health_path.as_deref().map(yaml_str)),
            ("interval_seconds", num(self.health_interval_seconds)),
            ("timeout_seconds", num(self.health_timeout_seconds)),
            ("failures", num(self.health_failures)),
            ("successes", num(self.health_successes)),
        ]);
        if let Some(h) = health {
            line!("  health: {h}");
        }
        let upstream = flow(&[
            (
                "connect_timeout_seconds",
                num(self.upstream_connect_timeout_seconds),
            ),
            (
                "read_timeout_seconds",
                num(self.upstream_read_timeout_seconds),
            ),
            (
                "write_timeout_seconds",
                num(self.upstream_write_timeout_seconds),
            ),
            (
                "idle_timeout_seconds",
                num(self.upstream_idle_timeout_seconds),
            ),
        ]);
        if let Some(u) = upstream {
            line!("  upstream: {u}");
        }
        if let Some(v) = self.max_body_bytes {
            line!("  max_body_bytes: {v}");
        }
        if let Some(v) = self.body_read_timeout_seconds {
            line!("  body_read_timeout_seconds: {v}");
        }
        if let Some(v) = self.max_header_bytes {
            line!("  max_header_bytes: {v}");
        }
        if let Some(v) = self.affinity_capacity {
            line!("  affinity_capacity: {v}");
        }
        if let Some(v) = self.spill_margin {
            line!("  spill_margin: {v}");
        }
        if let Some(p) = &self.state_file {
            line!("  state_file: {}", yaml_str(&p.to_string_lossy()));
        }
        if !self.api_keys.is_empty() {
            line!("  api_keys: {}", list(&self.api_keys));
        }
        if let Some(v) = &self.access_log {
            line!("  access_log: {v}");
        }
        if let Some(v) = &self.session_header {
            line!("  session_header: {}", yaml_str(v));
        }
        if let Some(v) = self.stored_responses_capacity {
            line!("  stored_responses_capacity: {v}");
        }
        if let Some(v) = self.stored_lookup_timeout_seconds {
            line!("  stored_lookup_timeout_seconds: {v}");
        }
        if let Some(v) = self.load_poll_interval_seconds {
            line!("  load_poll_interval_seconds: {v}");
        }
        if let Some(section) = &self.overload {
            line!("  overload:");
            for l in section.lines().filter(|l| !l.trim().is_empty()) {
                line!("    {l}");
            }
        }
        line!("  replicas:");
        for r in &self.replicas {
            let mut keys = vec![
                ("id", Some(yaml_str(&r.id))),
                ("address", Some(yaml_str(&r.address))),
                ("api_key", r.api_key.as_deref().map(yaml_str)),
            ];
            if !r.models.is_empty() {
                keys.push(("models", Some(list(&r.models))));
            }
            keys.push(("cache_tokens", num(r.cache_tokens)));
            let mut entry = flow(&keys).unwrap_or_default();
            if !r.extra.is_empty() {
                entry.pop();
                entry.push_str(&format!(", {}}}", r.extra));
            }
            line!("    - {entry}");
        }
        out.push_str(&self.extra);
        out
    }

    /// Writes the rendered conf to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.render())
    }
}

fn num<T: std::fmt::Display>(v: Option<T>) -> Option<String> {
    v.map(|v| v.to_string())
}

/// `{a: 1, b: 2}` of the keys that are set; None when none is.
fn flow(keys: &[(&str, Option<String>)]) -> Option<String> {
    let set: Vec<String> = keys
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}: {v}")))
        .collect();
    (!set.is_empty()).then(|| format!("{{{}}}", set.join(", ")))
}

fn list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| yaml_str(s)).collect();
    format!("[{}]", quoted.join(", "))
}

/// A running balancer.
pub struct Lb {
    pub port: u16,
    pub admin_port: u16,
    pub proc: Proc,
    /// The conf file it was started with.
    pub conf: PathBuf,
}

impl Lb {
    /// Starts inferlb in front of `sims` (then `conf.replicas`), with its conf in
    /// `<dir>/inferlb.yaml` and its log in `<dir>/inferlb.log` (RUST_LOG=info), and waits until
    /// both its ports answer; panics, with its log, if they do not within 10 s.
    pub fn start(dir: &Path, sims: &[&Sim], conf: LbConf) -> Lb {
        Lb::start_logged(dir, sims, conf, Some(&dir.join("inferlb.log")), "info")
    }

    /// [`Lb::start`] with the log file (truncated first; None: discarded) and RUST_LOG chosen.
    pub fn start_logged(
        dir: &Path,
        sims: &[&Sim],
        mut conf: LbConf,
        log: Option<&Path>,
        rust_log: &str,
    ) -> Lb {
        if conf.listen_port == 0 {
            conf.listen_port = free_port();
        }
        if conf.admin_port == 0 {
            conf.admin_port = free_port();
        }
        conf.pid_file.get_or_insert_with(|| dir.join("inferlb.pid"));
        conf.upgrade_sock
            .get_or_insert_with(|| dir.join("upgrade.sock"));
        let mut replicas: Vec<Replica> = sims.iter().map(|s| Replica::of(s)).collect();
        replicas.append(&mut conf.replicas);
        conf.replicas = replicas;
        let path = dir.join("inferlb.yaml");
        conf.write(&path)
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        if let Some(log) = log {
            std::fs::write(log, "").unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        }
        let mut cmd = Command::new(bin("inferlb"));
        cmd.arg("-c")
            .arg(&path)
            .env("RUST_LOG", rust_log)
            .env_remove("ROUTING")
            .envs(conf.env.iter().map(|(k, v)| (k, v)));
        let proc = Proc::spawn("inferlb", cmd, log, LB_STOP)
            .unwrap_or_else(|e| panic!("spawn inferlb: {e}"));
        let mut lb = Lb {
            port: conf.listen_port,
            admin_port: conf.admin_port,
            proc,
            conf: path,
        };
        let up = wait_until(Duration::from_secs(10), || {
            lb.is_ready() || lb.proc.has_exited()
        });
        assert!(
            up && !lb.proc.has_exited(),
            "inferlb did not start (exit: {:?}):\n{}",
            lb.proc.try_exited(),
            lb.proc.log_text()
        );
        lb
    }

    /// Its proxy port accepts connections and its admin port serves /metrics.
    pub fn is_ready(&self) -> bool {
        TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            && http_status(self.admin_port, "/metrics", Duration::from_secs(1)) == Some(200)
    }

    /// A URL on the proxy port.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// A URL on the admin port (metrics, admin endpoints).
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.admin_port, path)
    }

    /// The command that starts another inferlb on the same conf (for an upgrade, add `-u`).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(bin("inferlb"));
        cmd.arg("-c").arg(&self.conf).env_remove("ROUTING");
        cmd
    }

    /// Spawns such a command as a [`Proc`] that stops the way inferlb stops (SIGINT).
    pub fn spawn(name: &str, cmd: Command, log: Option<&Path>) -> std::io::Result<Proc> {
        Proc::spawn(name, cmd, log, LB_STOP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_conf_has_only_the_listeners_and_the_replica_list() {
        let c = LbConf {
            listen_port: 7,
            admin_port: 8,
            ..LbConf::default()
        };
        assert_eq!(
            c.render(),
            "inferlb:\n  listen: 127.0.0.1:7\n  admin_listen: 127.0.0.1:8\n  replicas:\n"
        );
    }

    #[test]
    fn every_field_is_rendered_under_its_key() {
        let c = LbConf {
            threads: Some(2),
            pid_file: Some("/d/inferlb.pid".into()),
            upgrade_sock: Some("/d/upgrade.sock".into()),
            grace_period_seconds: Some(5),
            graceful_shutdown_timeout_seconds: Some(2),
            max_retries: Some(4),
            server_extra: "daemon: false\n".into(),
            listen_port: 1,
            admin_port: 2,
            routing: Some("adaptive".into()),
            health_path: Some("/health".into()),
            health_interval_seconds: Some(1.0),
            health_timeout_seconds: Some(0.5),
            health_failures: Some(2),
            health_successes: Some(1),
            upstream_connect_timeout_seconds: Some(2.0),
            upstream_read_timeout_seconds: Some(1.5),
            upstream_write_timeout_seconds: None,
            upstream_idle_timeout_seconds: Some(4.0),
            max_body_bytes: Some(100_000),
            body_read_timeout_seconds: Some(1.0),
            max_header_bytes: Some(16384),
            affinity_capacity: Some(10),
            spill_margin: Some(0),
            state_file: Some("/d/state.json".into()),
            api_keys: vec!["k1".into(), "k2".into()],
            access_log: Some("json".into()),
            session_header: Some("x-session-id".into()),
            stored_responses_capacity: Some(5),
            stored_lookup_timeout_seconds: Some(0.5),
            load_poll_interval_seconds: Some(0.25),
            overload: Some("max_running: 2\nkeys:\n  - {name: a, key: k1}\n".into()),
            replicas: vec![
                Replica::new("gpu0", "127.0.0.1:3"),
                Replica {
                    api_key: Some("secret".into()),
                    models: vec!["a".into(), "b".into()],
                    cache_tokens: Some(200_000),
                    extra: "weight: 2".into(),
                    ..Replica::new("gpu1", "127.0.0.1:4")
                },
            ],
            extra: "  future_key: 1\n".into(),
            // Not in the file.
            env: vec![("KEY".into(), "value".into())],
        };
        let want = "threads: 2\n\
            pid_file: \"/d/inferlb.pid\"\n\
            upgrade_sock: \"/d/upgrade.sock\"\n\
            grace_period_seconds: 5\n\
            graceful_shutdown_timeout_seconds: 2\n\
            max_retries: 4\n\
            daemon: false\n\
            inferlb:\n\
            \x20 listen: 127.0.0.1:1\n\
            \x20 admin_listen: 127.0.0.1:2\n\
            \x20 routing: adaptive\n\
            \x20 health: {path: \"/health\", interval_seconds: 1, timeout_seconds: 0.5, failures: 2, successes: 1}\n\
            \x20 upstream: {connect_timeout_seconds: 2, read_timeout_seconds: 1.5, idle_timeout_seconds: 4}\n\
            \x20 max_body_bytes: 100000\n\
            \x20 body_read_timeout_seconds: 1\n\
            \x20 max_header_bytes: 16384\n\
            \x20 affinity_capacity: 10\n\
            \x20 spill_margin: 0\n\
            \x20 state_file: \"/d/state.json\"\n\
            \x20 api_keys: [\"k1\", \"k2\"]\n\
            \x20 access_log: json\n\
            \x20 session_header: \"x-session-id\"\n\
            \x20 stored_responses_capacity: 5\n\
            \x20 stored_lookup_timeout_seconds: 0.5\n\
            \x20 load_poll_interval_seconds: 0.25\n\
            \x20 overload:\n\
            \x20   max_running: 2\n\
            \x20   keys:\n\
            \x20     - {name: a, key: k1}\n\
            \x20 replicas:\n\
            \x20   - {id: \"gpu0\", address: \"127.0.0.1:3\"}\n\
            \x20   - {id: \"gpu1\", address: \"127.0.0.1:4\", api_key: \"secret\", models: [\"a\", \"b\"], cache_tokens: 200000, weight: 2}\n\
            \x20 future_key: 1\n";
        assert_eq!(c.render(), want);
    }
}
