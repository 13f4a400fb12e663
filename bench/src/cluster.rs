//! The system under test for one scenario: fresh simulated replicas (cold caches) and in front
//! of them inferlb, a peer router, or nothing (a direct connection to the first replica). Every
//! process comes from `inferlb-harness` and is stopped when the cluster drops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use inferlb_harness::{bin, Lb, LbConf, Peer, PeerConf, PeerKind, Replica, Sim};
use serde_json::Value;

/// What receives the clients' requests.
#[derive(Debug, Clone, Copy)]
pub enum Front<'a> {
    /// No balancer: clients talk to the first replica.
    Direct,
    /// inferlb in this routing mode.
    Inferlb(&'a str),
    /// A peer router (`--policy cache_aware`) from this virtual environment.
    Peer(PeerKind, &'a Path),
}

/// What to start.
pub struct ClusterSpec<'a> {
    pub front: Front<'a>,
    /// How many replicas (gpu0, gpu1, ...).
    pub replicas: usize,
    /// The simulator's speed factor.
    pub speed: f64,
    /// Prefix-cache capacity of each replica, in tokens.
    pub cache_tokens: usize,
    /// Further flags for every replica.
    pub sim_flags: &'a [&'a str],
    /// The front's log (inferlb with RUST_LOG=warn); None: discarded.
    pub log: Option<PathBuf>,
    /// inferlb's `spill_margin`; None: its default.
    pub spill_margin: Option<usize>,
    /// Further lines of inferlb's `inferlb:` section (see `LbConf::extra`).
    pub lb_extra: &'a str,
}

impl ClusterSpec<'_> {
    /// Two replicas behind `front`, no further flags, no log, default spill margin.
    pub fn pair(front: Front<'_>, speed: f64, cache_tokens: usize) -> ClusterSpec<'_> {
        ClusterSpec {
            front,
            replicas: 2,
            speed,
            cache_tokens,
            sim_flags: &[],
            log: None,
            spill_margin: None,
            lb_extra: "",
        }
    }
}

pub struct Cluster {
    /// Stopped first (fields drop in order): no front outlives its replicas' ports.
    pub lb: Option<Lb>,
    pub peer: Option<Peer>,
    /// gpu0, gpu1, ...
    pub sims: Vec<Sim>,
    /// Conf, pid file and replica logs; removed after the processes stopped.
    _dir: tempfile::TempDir,
}

/// Prompt tokens the replicas processed, and how many of them came from their prefix caches.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokenCounts {
    pub prompt: u64,
    pub cached: u64,
}

impl TokenCounts {
    /// What was counted between `before` and `self`, as a hit rate.
    pub fn hit_rate_since(&self, before: &TokenCounts) -> f64 {
        let prompt = self.prompt.saturating_sub(before.prompt);
        let cached = self.cached.saturating_sub(before.cached);
        cached as f64 / prompt.max(1) as f64
    }
}

/// What this build of the simulator can do, found out once.
#[derive(Debug, Clone, Default)]
pub struct SimCaps {
    /// Values `--scheduler` takes; empty when the simulator has no such flag.
    pub schedulers: Vec<String>,
    /// Its `/metrics` has `vllm:cache_config_info` (inferlb learns each cache's size there).
    pub cache_config_info: bool,
}

static CAPS: OnceLock<SimCaps> = OnceLock::new();

/// Flags every peer router gets after the bench's own (`--peer-flags`), set once by main.
static PEER_FLAGS: OnceLock<Vec<String>> = OnceLock::new();

/// Sets the further flags for the peer routers (the last of a repeated flag wins in both).
pub fn set_peer_flags(flags: Vec<String>) {
    let _ = PEER_FLAGS.set(flags);
}

/// The simulator's capabilities: its `--help` and one short-lived replica's `/metrics`.
pub fn sim_caps() -> &'static SimCaps {
    CAPS.get_or_init(|| {
        let help = Command::new(bin("inferlb-sim"))
            .arg("--help")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let schedulers = if help.contains("--scheduler") {
            ["fcfs", "chunked", "prefill-first"]
                .into_iter()
                .filter(|s| help.contains(s))
                .map(str::to_owned)
                .collect()
        } else {
            vec![]
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let sim = Sim::start(dir.path(), "probe", &[]);
        let cache_config_info = metrics_text(sim.port).contains("vllm:cache_config_info");
        drop(sim);
        SimCaps {
            schedulers,
            cache_config_info,
        }
    })
}

/// `GET /metrics` on a loopback port, blocking (the harness is synchronous).
fn metrics_text(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let head = b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n";
    if s.write_all(head).is_err() {
        return String::new();
    }
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

impl Cluster {
    /// Starts the replicas, waits until they are healthy, then starts the front and waits
    /// until it serves; panics if inferlb or a replica does not start. Blocks (briefly) the
    /// runtime thread it is called on.
    pub fn start(spec: &ClusterSpec) -> Cluster {
        Cluster::try_start(spec).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Cluster::start`], with a peer router that does not start as an error (the replicas
    /// are stopped again then).
    pub fn try_start(spec: &ClusterSpec) -> Result<Cluster, String> {
        tokio::task::block_in_place(|| Cluster::start_blocking(spec))
    }

    fn start_blocking(spec: &ClusterSpec) -> Result<Cluster, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (speed, cache) = (spec.speed.to_string(), spec.cache_tokens.to_string());
        let mut flags = vec!["--speed", &speed, "--cache-tokens", &cache];
        flags.extend_from_slice(spec.sim_flags);
        let sims: Vec<Sim> = (0..spec.replicas.max(1))
            .map(|i| Sim::spawn(dir.path(), &format!("gpu{i}"), &flags))
            .collect();
        for s in &sims {
            s.assert_healthy();
        }
        let (mut lb, mut peer) = (None, None);
        match spec.front {
            Front::Direct => {}
            Front::Inferlb(routing) => {
                // Each cache's size comes from the replica's /metrics when it says it;
                // otherwise it is configured.
                let learnt = sim_caps().cache_config_info;
                let conf = LbConf {
                    threads: Some(2),
                    max_retries: Some(4),
                    routing: Some(routing.to_string()),
                    health_interval_seconds: Some(0.5),
                    spill_margin: spec.spill_margin,
                    extra: spec.lb_extra.to_string(),
                    // Every duration of the replicas is divided by the speed: the load read
                    // keeps its 250 ms of the modelled engine's time.
                    load_poll_interval_seconds: Some((0.25 / spec.speed.max(1.0)).max(0.01)),
                    replicas: sims
                        .iter()
                        .map(|s| Replica {
                            cache_tokens: (!learnt).then_some(spec.cache_tokens as u64),
                            ..Replica::of(s)
                        })
                        .collect(),
                    ..LbConf::default()
                };
                lb = Some(Lb::start_logged(
                    dir.path(),
                    &[],
                    conf,
                    spec.log.as_deref(),
                    "warn",
                ));
            }
            Front::Peer(kind, venv) => {
                let workers: Vec<String> = sims.iter().map(|s| s.url("")).collect();
                peer = Some(Peer::start(
                    kind,
                    venv,
                    &workers,
                    &peer_conf(kind, spec.speed),
                    spec.log.as_deref(),
                )?);
            }
        }
        Ok(Cluster {
            lb,
            peer,
            sims,
            _dir: dir,
        })
    }

    /// Where clients send their requests.
    pub fn target(&self) -> String {
        match (&self.lb, &self.peer) {
            (Some(lb), _) => lb.url(""),
            (None, Some(p)) => p.url(""),
            (None, None) => self.sims[0].url(""),
        }
    }

    /// inferlb's admin port, when there is a balancer.
    pub fn admin_port(&self) -> Option<u16> {
        self.lb.as_ref().map(|l| l.admin_port)
    }

    /// Stops replica `i` (gpu<i>).
    pub fn stop_sim(&mut self, i: usize) {
        self.sims[i].stop();
    }

    /// Prompt and cached tokens, summed over the running replicas.
    pub async fn token_counts(&self, client: &reqwest::Client) -> TokenCounts {
        let mut total = TokenCounts::default();
        for s in self.sims.iter().filter(|s| s.is_running()) {
            if let Ok(r) = client.get(s.url("/sim/stats")).send().await {
                if let Ok(v) = r.json::<Value>().await {
                    total.prompt += v["prompt_tokens"].as_u64().unwrap_or(0);
                    total.cached += v["cached_tokens"].as_u64().unwrap_or(0);
                }
            }
        }
        total
    }
}

/// A peer router as its project documents it (`--policy cache_aware`, every other setting its
/// default), except that its cache-tree eviction interval is divided by the speed like every
/// duration of the replicas (SGLang: 60 s, vLLM: 120 s by default).
fn peer_conf(kind: PeerKind, speed: f64) -> PeerConf {
    let default_eviction = match kind {
        PeerKind::Sglang => 60.0,
        PeerKind::Vllm => 120.0,
    };
    let eviction = (default_eviction / speed.max(1.0)).round().max(1.0) as u64;
    let mut extra = vec!["--eviction-interval-secs".into(), eviction.to_string()];
    extra.extend(PEER_FLAGS.get().cloned().unwrap_or_default());
    PeerConf {
        extra,
        ..PeerConf::default()
    }
}
