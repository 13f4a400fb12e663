//! The replicas, and the policy's view of them.
//!
//! It holds replicas and answers questions about the set (which may serve a model, what the
//! policy may choose from); each replica keeps its own state (`replica/`), and what the
//! replicas served lives in the affinity table (`affinity.rs`). The set changes at runtime
//! (DNS discovery, the admin API): readers take a snapshot, which a change replaces whole, so a
//! request holds the replicas it saw for as long as it needs them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;

use crate::conf::{ReplicaConf, UpstreamConf};
use crate::fleet::events::Listener;
use crate::fleet::pool::{Leg, Protocol};
use crate::fleet::replica::{CacheSource, Prompt, Replica};
use crate::routing::Candidate;
use crate::telemetry::metrics;

/// The replicas at one moment.
pub type Snapshot = Arc<Vec<Arc<Replica>>>;

pub struct Registry {
    list: ArcSwap<Vec<Arc<Replica>>>,
    /// How replicas added later reach their servers.
    upstream: UpstreamConf,
    /// Serialises changes (each replaces the whole list).
    changing: Mutex<()>,
    /// Breaks ties and drives round-robin.
    counter: AtomicU64,
    /// Added to the counter: this instance's rank in a cluster, so instances deciding at the
    /// same moment break their first ties differently.
    offset: AtomicU64,
    /// The other instances, when there is a cluster: every replica shares its load with them.
    listener: OnceLock<Arc<dyn Listener>>,
}

impl Registry {
    /// The configured replicas (those found by DNS come later, from discovery).
    pub fn new(confs: &[ReplicaConf], upstream: &UpstreamConf) -> Registry {
        let list: Vec<Arc<Replica>> = confs
            .iter()
            .filter(|c| c.discover.is_none())
            .map(|c| Arc::new(Replica::new(c, upstream)))
            .collect();
        list.iter().for_each(|r| metrics::track(&r.id, r));
        Registry {
            list: ArcSwap::from_pointee(list),
            upstream: upstream.clone(),
            changing: Mutex::new(()),
            counter: AtomicU64::new(0),
            offset: AtomicU64::new(0),
            listener: OnceLock::new(),
        }
    }

    /// A snapshot of the replicas.
    pub fn all(&self) -> Snapshot {
        self.list.load_full()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Replica>> {
        self.list.load().iter().find(|r| &*r.id == id).cloned()
    }

    /// Adds a replica, unhealthy until a health check passes; an error when the id is taken.
    pub fn add(&self, conf: &ReplicaConf, origin: Option<&str>) -> Result<Arc<Replica>, String> {
        let _one = self
            .changing
            .lock()
            .map_err(|_| "registry lock poisoned".to_string())?;
        let now = self.list.load_full();
        if now.iter().any(|r| *r.id == *conf.id) {
            return Err(format!("a replica with id {:?} exists", conf.id));
        }
        let r = Arc::new(Replica::joining(conf, &self.upstream, origin));
        if let Some(l) = self.listener.get() {
            r.listen(l);
        }
        let mut next = (*now).clone();
        next.push(r.clone());
        self.list.store(Arc::new(next));
        metrics::track(&r.id, &r);
        log::warn!(
            "replica {} ({}) added: joins after a passing health check",
            r.id,
            r.endpoint.address
        );
        Ok(r)
    }

    /// Removes a replica: no new requests; those in flight finish. Its conversations move on
    /// their next turn (`repinned`).
    pub fn remove(&self, id: &str) -> Option<Arc<Replica>> {
        let _one = self.changing.lock().ok()?;
        let now = self.list.load_full();
        let gone = now.iter().find(|r| &*r.id == id)?.clone();
        let next: Vec<Arc<Replica>> = now.iter().filter(|r| &*r.id != id).cloned().collect();
        self.list.store(Arc::new(next));
        // Its series go with it: a removed replica is not `up`, and DNS churn does not grow
        // the scrape without bound.
        metrics::forget(&gone.id, &gone);
        log::warn!("replica {} ({}) removed", gone.id, gone.endpoint.address);
        Some(gone)
    }

    /// The policy's view of the pool serving `model`; `tried` replicas are not available to
    /// this request again. Each candidate is named by its replica's id. With the prompt's
    /// links, each says how much of it the replica likely holds (its cache model); without,
    /// nothing is looked up.
    pub fn candidates<'a>(
        fleet: &'a [Arc<Replica>],
        tried: &[Arc<Replica>],
        model: Option<&str>,
        prompt: Prompt<'_>,
        protocol: Protocol,
    ) -> Vec<Candidate<'a>> {
        Registry::candidates_for(Leg::Whole(protocol), fleet, tried, model, prompt)
    }

    /// Like [`Registry::candidates`], of the replicas that take `leg`.
    pub fn candidates_for<'a>(
        leg: Leg,
        fleet: &'a [Arc<Replica>],
        tried: &[Arc<Replica>],
        model: Option<&str>,
        prompt: Prompt<'_>,
    ) -> Vec<Candidate<'a>> {
        fleet
            .iter()
            // The model's pool, of replicas that take this leg.
            .filter(|r| leg.takes(r.role) && model.is_none_or(|m| r.serves(m)))
            .map(|r| {
                let fresh = !tried.iter().any(|t| Arc::ptr_eq(t, r));
                let (cached, pending) = if prompt.links.is_empty() {
                    ((0, CacheSource::Estimate), 0)
                } else {
                    let pending = r.cache.pending.shared_tokens(prompt.links);
                    (r.cache.likely_cached(prompt), pending)
                };
                Candidate {
                    id: &r.id,
                    available: fresh && r.is_live(),
                    reachable: fresh && r.is_reachable(),
                    in_flight: r.in_flight_everywhere(),
                    cached_tokens: cached.0,
                    cached_exact: cached.1 == CacheSource::Events,
                    pending_tokens: pending,
                    queued_tokens: r.queued_tokens(),
                    running: r.running(),
                    kv_tokens: r.kv_tokens(),
                }
            })
            .collect()
    }

    /// Whether `model` is served disaggregated: among the replicas that may serve it, some
    /// prefill and some decode (by their configured roles, live or not).
    pub fn disaggregated(fleet: &[Arc<Replica>], model: Option<&str>) -> bool {
        let pool = || fleet.iter().filter(|r| model.is_none_or(|m| r.serves(m)));
        let prefill = pool().find(|r| r.role.prefills());
        // One `both` replica alone is no pair: a handover to itself is a request served whole.
        prefill.is_some_and(|p| pool().any(|d| d.role.decodes() && !Arc::ptr_eq(p, d)))
            || (pool().filter(|r| r.role.prefills()).count() > 1
                && pool().any(|r| r.role.decodes()))
    }

    /// The replicas that can serve what they hold (drained or not).
    pub fn reachable(&self) -> Vec<Arc<Replica>> {
        let list = self.list.load();
        list.iter().filter(|r| r.is_reachable()).cloned().collect()
    }

    /// Whether any replica may serve `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.list.load().iter().any(|r| r.serves(model))
    }

    /// Every model some replica serves, sorted, each once.
    pub fn all_models(&self) -> Vec<String> {
        let list = self.list.load();
        let mut all: Vec<String> = list.iter().flat_map(|r| r.models().to_vec()).collect();
        all.sort();
        all.dedup();
        all
    }

    pub fn tick(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed) + self.offset.load(Ordering::Relaxed)
    }

    /// This instance's rank among a cluster's instances (0 alone, or the lowest id).
    pub fn rank(&self) -> u64 {
        self.offset.load(Ordering::Relaxed)
    }

    /// This instance's rank among a cluster's instances (0 alone).
    pub fn set_rank(&self, rank: u64) {
        self.offset.store(rank, Ordering::Relaxed);
    }

    /// Every replica, now and added later, tells `listener` its changes.
    pub fn listen(&self, listener: Arc<dyn Listener>) {
        let _one = self.changing.lock();
        if self.listener.set(listener.clone()).is_ok() {
            self.list.load().iter().for_each(|r| r.listen(&listener));
        }
    }
}

/// A registry of replicas `ids`, each on a loopback port of its own (nothing listens), built
/// from a conf text as the balancer builds its own.
#[cfg(test)]
pub(crate) fn test_registry(ids: &[&str]) -> Registry {
    let (replicas, upstream) = test_confs(ids);
    Registry::new(&replicas, &upstream)
}

#[cfg(test)]
pub(crate) fn test_confs(ids: &[&str]) -> (Vec<ReplicaConf>, UpstreamConf) {
    let entries: String = ids
        .iter()
        .enumerate()
        .map(|(i, id)| format!("    - {{id: {id}, address: \"127.0.0.1:{}\"}}\n", 1 + i))
        .collect();
    let l =
        crate::conf::parse(&format!("inferlb:\n  replicas:\n{entries}"), None).expect("test conf");
    (l.inferlb.replicas, l.inferlb.upstream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::METRICS;

    /// The scrape's lines that name replica `id`.
    fn series_of(id: &str) -> Vec<String> {
        let text = String::from_utf8(crate::telemetry::metrics::render()).expect("utf-8");
        let label = format!("replica=\"{id}\"");
        text.lines()
            .filter(|l| l.contains(&label))
            .map(str::to_owned)
            .collect()
    }

    fn sample(name_and_labels: &str) -> Option<f64> {
        let text = String::from_utf8(crate::telemetry::metrics::render()).expect("utf-8");
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name_and_labels)?.strip_prefix(' ')?;
            rest.trim().parse().ok()
        })
    }

    /// Every family that carries a replica label loses the replica's series when it is
    /// removed, and a request that ends after the removal does not bring them back. Before,
    /// a removed replica kept `inferlb_replica_up 1` for good.
    #[test]
    fn a_removed_replicas_series_go_with_it_and_stay_gone() {
        let reg = test_registry(&["gone-a", "kept-b"]);
        let m = &*METRICS;
        let count = |id: &str| {
            m.requests.with_label_values(&[id, "spread", "2xx"]).inc();
            m.failovers
                .with_label_values(&[id, "connect_refused"])
                .inc();
            m.upstream_errors
                .with_label_values(&[id, "read_timeout"])
                .inc();
            m.prompt_tokens.with_label_values(&[id]).inc_by(5);
            m.cached_tokens.with_label_values(&[id]).inc_by(3);
            m.pd_legs.with_label_values(&[id, "decode", "ok"]).inc();
            m.pd_pull_tokens.with_label_values(&[id]).inc_by(7);
        };
        count("gone-a");
        count("kept-b");
        let families = [
            "inferlb_requests_total{",
            "inferlb_failovers_total{",
            "inferlb_upstream_errors_total{",
            "inferlb_prompt_tokens_total{",
            "inferlb_cached_prompt_tokens_total{",
            "inferlb_replica_up{",
            "inferlb_replica_in_flight{",
            "inferlb_replica_draining{",
            "inferlb_replica_role{",
            "inferlb_replica_kv_tokens{",
            "inferlb_pd_legs_total{",
            "inferlb_pd_pull_tokens_total{",
        ];
        for id in ["gone-a", "kept-b"] {
            let series = series_of(id);
            for f in families {
                assert!(
                    series.iter().any(|l| l.starts_with(f)),
                    "{id} has a {f} series: {series:?}"
                );
            }
        }
        assert_eq!(sample(r#"inferlb_replica_up{replica="gone-a"}"#), Some(1.0));

        let gone = reg.get("gone-a").expect("configured");
        let flight = gone.start();
        assert!(reg.remove("gone-a").is_some());
        assert_eq!(series_of("gone-a"), Vec::<String>::new());
        // A request that was in flight on it ends now: its counts go nowhere.
        count("gone-a");
        drop(flight);
        assert_eq!(series_of("gone-a"), Vec::<String>::new());
        assert_eq!(
            series_of("kept-b").len(),
            families.len(),
            "the other keeps its own"
        );

        // Added back under the same id, it has series again, as a new replica (not up yet).
        let (confs, _) = test_confs(&["gone-a"]);
        reg.add(&confs[0], None).expect("added");
        assert_eq!(sample(r#"inferlb_replica_up{replica="gone-a"}"#), Some(0.0));
        assert_eq!(
            sample(r#"inferlb_requests_total{code="2xx",replica="gone-a",route="spread"}"#),
            None,
            "its old counts are not back"
        );
    }

    /// The gauge is the count itself: however starts and drops interleave, it reads 0 once
    /// every request ended. When each thread set the gauge to the value its own fetch_add or
    /// fetch_sub returned, a stale value could be the last one written.
    #[test]
    fn the_in_flight_gauge_is_zero_once_every_request_ended() {
        let reg = test_registry(&["race-a"]);
        let r = reg.get("race-a").expect("configured");
        for round in 0..200 {
            let go = std::sync::Barrier::new(4);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        go.wait();
                        for _ in 0..100 {
                            drop(r.start());
                        }
                    });
                }
            });
            assert_eq!(
                sample(r#"inferlb_replica_in_flight{replica="race-a"}"#),
                Some(0.0),
                "round {round}"
            );
        }
        let _held = r.start();
        assert_eq!(
            sample(r#"inferlb_replica_in_flight{replica="race-a"}"#),
            Some(1.0)
        );
    }
}
