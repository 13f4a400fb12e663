//! The system under test for one scenario: two fresh simulated replicas (cold caches) and,
//! unless the target is a direct connection, inferlb in front of them. Every process comes from
//! `inferlb-harness` and is stopped when the cluster drops.

use std::path::PathBuf;

use inferlb_harness::{Lb, LbConf, Sim};
use serde_json::Value;

/// What to start.
pub struct ClusterSpec<'a> {
    /// inferlb's routing mode; None: no balancer, clients talk to the first replica.
    pub routing: Option<&'a str>,
    /// The simulator's speed factor.
    pub speed: f64,
    /// Prefix-cache capacity of each replica, in tokens.
    pub cache_tokens: usize,
    /// Further flags for both replicas.
    pub sim_flags: &'a [&'a str],
    /// inferlb's log (RUST_LOG=warn); None: discarded.
    pub log: Option<PathBuf>,
    /// inferlb's `spill_margin`; None: its default.
    pub spill_margin: Option<usize>,
}

pub struct Cluster {
    /// gpu0, gpu1.
    pub sims: Vec<Sim>,
    pub lb: Option<Lb>,
    /// Conf, pid file and replica logs; removed after the processes stopped (fields drop in
    /// order).
    _dir: tempfile::TempDir,
}

/// Prompt tokens the replicas processed, and how many of them came from their prefix caches.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokenCounts {
    pub prompt: u64,
    pub cached: u64,
}

impl Cluster {
    /// Starts the replicas, waits until they are healthy, then starts inferlb and waits until it
    /// serves. Blocks (briefly) the runtime thread it is called on.
    pub fn start(spec: &ClusterSpec) -> Cluster {
        tokio::task::block_in_place(|| Cluster::start_blocking(spec))
    }

    fn start_blocking(spec: &ClusterSpec) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let (speed, cache) = (spec.speed.to_string(), spec.cache_tokens.to_string());
        let mut flags = vec!["--speed", &speed, "--cache-tokens", &cache];
        flags.extend_from_slice(spec.sim_flags);
        let sims: Vec<Sim> = (0..2)
            .map(|i| Sim::spawn(dir.path(), &format!("gpu{i}"), &flags))
            .collect();
        for s in &sims {
            s.assert_healthy();
        }
        let lb = spec.routing.map(|routing| {
            let conf = LbConf {
                threads: Some(2),
                max_retries: Some(4),
                routing: Some(routing.to_string()),
                health_interval_seconds: Some(0.5),
                spill_margin: spec.spill_margin,
                ..LbConf::default()
            };
            let refs: Vec<&Sim> = sims.iter().collect();
            Lb::start_logged(dir.path(), &refs, conf, spec.log.as_deref(), "warn")
        });
        Cluster {
            sims,
            lb,
            _dir: dir,
        }
    }

    /// Where clients send their requests.
    pub fn target(&self) -> String {
        match &self.lb {
            Some(lb) => lb.url(""),
            None => self.sims[0].url(""),
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
