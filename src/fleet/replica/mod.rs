//! One replica and what belongs to it alone, as separate parts it owns:
//!
//! - its [`Endpoint`]: address, `Host`, socket, the peer the proxy connects to, its key; fixed
//!   at creation;
//! - its [`HealthState`]: the health checks' verdict, demotion by the data path, drain by the
//!   admin API;
//! - its load (`load`): requests in flight and prefill queued, here and as reported;
//! - its [`CacheModel`]: how much of a prompt it likely holds;
//! - the models it serves, and its [`Role`] in its pool.
//!
//! Health and demotion are per replica, never per address: two replicas may share an address
//! (two names for one server, or a DNS name that resolves like another), and each is checked,
//! demoted and re-admitted on its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use crate::conf::{ReplicaConf, UpstreamConf};
use crate::fleet::events::Listener;
use crate::fleet::pool::Role;
use crate::telemetry::metrics::ReplicaGauges;

mod cache;
mod endpoint;
mod health;
mod load;
mod pending;
mod progress;
mod ratio;
mod restarts;

pub use cache::{
    CacheModel, CacheSource, Check, Freshness, Prediction, Prompt, DEFAULT_CACHE_TOKENS,
};
pub use endpoint::{Endpoint, RANK_HEADER};
pub use health::{Health, HealthState};
use load::Load;
pub use load::{HeldKv, InFlight, QueuedPrefill, MAX_REPORTED_REQUESTS};
pub use pending::Pending;

pub struct Replica {
    /// The configured id: metrics, logs, headers and the affinity table name it.
    pub id: Arc<str>,
    /// Where it is and how to reach it; never changes (a moved replica is a new one).
    pub endpoint: Endpoint,
    /// Its part in its pool: `plain` for every replica today.
    pub role: Role,
    pub health: HealthState,
    /// How much of a prompt it likely holds.
    pub cache: CacheModel,
    /// The conf fixed `models`: never replaced by what the replica says.
    pub models_configured: bool,
    /// The models it serves: from the conf, or learnt from its /v1/models (empty: unknown,
    /// so it is not excluded from any model's pool).
    models: RwLock<Arc<[String]>>,
    /// Passing health checks since start: models are re-learnt every so often.
    checks_passed: AtomicU64,
    /// The `discover: dns` entry that found it; None for one configured or added by hand.
    pub origin: Option<String>,
    /// Its KV event endpoints, read by `fleet::kv_events`.
    pub kv_events: Option<crate::conf::KvEvents>,
    load: Load,
    /// Its process's restarts, as its `/metrics` tells them.
    restarts: restarts::Restarts,
    /// Told of each change of its load and of what it prefilled (the cluster, if any).
    listener: OnceLock<Arc<dyn Listener>>,
}

impl Replica {
    /// A configured replica, healthy until the checks say otherwise. `conf` was validated:
    /// its address resolved.
    pub fn new(conf: &ReplicaConf, upstream: &UpstreamConf) -> Replica {
        Replica::build(conf, upstream, true, None)
    }

    /// A replica that appeared at runtime: it takes requests after its first passing check.
    pub fn joining(conf: &ReplicaConf, upstream: &UpstreamConf, origin: Option<&str>) -> Replica {
        Replica::build(conf, upstream, false, origin)
    }

    fn build(
        conf: &ReplicaConf,
        upstream: &UpstreamConf,
        healthy: bool,
        origin: Option<&str>,
    ) -> Replica {
        Replica {
            id: Arc::from(conf.id.as_str()),
            endpoint: Endpoint::new(conf, upstream),
            role: conf.role,
            // Healthy until the checks say otherwise, as Pingora's checker starts.
            health: HealthState::new(healthy),
            cache: match conf.kv_events() {
                Some(_) => CacheModel::estimate(conf.cache_tokens).with_events(),
                None => CacheModel::estimate(conf.cache_tokens),
            },
            models_configured: !conf.models.is_empty(),
            models: RwLock::new(Arc::from(conf.models.clone())),
            checks_passed: AtomicU64::new(0),
            origin: origin.map(str::to_owned),
            kv_events: conf.kv_events(),
            load: Load::default(),
            restarts: Default::default(),
            listener: OnceLock::new(),
        }
    }

    /// Healthy by the checks and not demoted: it can serve what it already holds.
    pub fn is_reachable(&self) -> bool {
        self.health.is_reachable()
    }
    /// Healthy by the checks, not demoted by a failed connection, not drained.
    pub fn is_live(&self) -> bool {
        self.health.is_live()
    }

    pub fn models(&self) -> Arc<[String]> {
        self.models
            .read()
            .map(|m| m.clone())
            .unwrap_or_else(|_| Arc::from(vec![]))
    }
    pub fn set_models(&self, models: Vec<String>) {
        if let Ok(mut m) = self.models.write() {
            if **m != *models {
                log::info!("replica {} serves {:?}", self.id, models);
                *m = Arc::from(models);
            }
        }
    }
    /// Whether it may serve `model` (a replica whose models are unknown may).
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models();
        models.is_empty() || models.iter().any(|m| m == model)
    }

    /// A connection to it failed: it gets no new requests until a health check passes.
    pub fn demote(&self) {
        self.health.demote();
    }

    /// Records one health check that started at demotion count `before` (see
    /// [`HealthState::observe_check`]). Returns the new health when it flipped, and the number
    /// of checks passed before this one.
    pub fn observe_check(
        &self,
        ok: bool,
        before: u64,
        failures: usize,
        successes: usize,
    ) -> (Option<bool>, u64) {
        if self.health.readmits(ok, before) {
            log::info!("replica {} re-admitted: health check passed", self.id);
        }
        let flipped = self.health.observe_check(ok, failures, successes);
        let passed = if ok {
            self.checks_passed.fetch_add(1, Ordering::Relaxed)
        } else {
            self.checks_passed.load(Ordering::Relaxed)
        };
        (flipped, passed)
    }

    /// Takes it out of rotation (or puts it back). In-flight requests finish; pinned
    /// conversations move on their next turn. An undrained replica re-enters only after a
    /// health check that started after the undrain passes: it was probably restarted.
    pub fn set_draining(&self, draining: bool) {
        match self.health.set_draining(draining) {
            Some(false) => log::warn!(
                "replica {} undrained: back after its next passing health check",
                self.id
            ),
            Some(true) => log::warn!("replica {} draining", self.id),
            None => {}
        }
    }
}

/// Its gauges, read at each scrape from the state itself.
impl ReplicaGauges for Replica {
    fn up(&self) -> bool {
        self.is_reachable()
    }
    fn in_flight(&self) -> usize {
        Replica::in_flight(self)
    }
    fn draining(&self) -> bool {
        self.health.is_draining()
    }
    fn role(&self) -> &'static str {
        self.role.name()
    }
    fn kv_tokens(&self) -> u64 {
        Replica::kv_tokens(self)
    }
    fn bytes_per_token(&self) -> Vec<(&'static str, f64)> {
        use crate::protocol::api::Family;
        [
            (Family::Chat, "chat"),
            (Family::Completions, "completions"),
            (Family::Responses, "responses"),
            (Family::Messages, "messages"),
        ]
        .into_iter()
        .filter_map(|(f, api)| {
            let milli = self.cache.bytes_per_token_milli(f)?;
            Some((api, milli as f64 / 1000.0))
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (start, results, failures, successes) → (healthy, flipped) after each result.
    type Row = (
        Health,
        &'static [bool],
        usize,
        usize,
        &'static [(bool, bool)],
    );

    #[test]
    fn health_flips_after_the_threshold_of_consecutive_results() {
        let up = Health {
            healthy: true,
            against: 0,
        };
        let rows: &[Row] = &[
            // one failure of two: still up; a pass resets the count
            (
                up,
                &[false, true, false],
                2,
                1,
                &[(true, false), (true, false), (true, false)],
            ),
            // two in a row: down, flipped once
            (
                up,
                &[false, false, false],
                2,
                1,
                &[(true, false), (false, true), (false, false)],
            ),
            // one pass brings it back with successes = 1
            (
                Health {
                    healthy: false,
                    against: 0,
                },
                &[true],
                2,
                1,
                &[(true, true)],
            ),
            // a threshold of 0 acts as 1
            (up, &[false], 0, 0, &[(false, true)]),
        ];
        for (start, results, failures, successes, expect) in rows {
            let mut h = *start;
            for (i, (ok, want)) in results.iter().zip(expect.iter()).enumerate() {
                let (next, flipped) = h.observe(*ok, *failures, *successes);
                assert_eq!(
                    (next.healthy, flipped),
                    *want,
                    "{start:?} {results:?} step {i}"
                );
                h = next;
            }
        }
    }

    pub(super) fn replica(id: &str, address: &str) -> Replica {
        let conf = ReplicaConf {
            id: id.into(),
            address: address.into(),
            api_key: None,
            models: vec![],
            socket: address.parse().ok(),
            cache_tokens: None,
            discover: None,
            sni: None,
            tls: false,
            ..ReplicaConf::default()
        };
        let upstream = crate::conf::UpstreamConf {
            connect_timeout: std::time::Duration::from_secs(1),
            read_timeout: std::time::Duration::from_secs(1),
            write_timeout: std::time::Duration::from_secs(1),
            idle_timeout: std::time::Duration::from_secs(1),
            tls: Default::default(),
        };
        Replica::new(&conf, &upstream)
    }

    #[test]
    fn a_check_that_began_before_a_demotion_does_not_readmit() {
        let r = replica("a", "127.0.0.1:1");
        let before = r.health.demotions();
        r.demote();
        r.observe_check(true, before, 2, 1);
        assert!(
            r.health.is_demoted(),
            "the check started before the failure"
        );
        let before = r.health.demotions();
        r.observe_check(true, before, 2, 1);
        assert!(!r.health.is_demoted() && r.is_live());
    }

    #[test]
    fn replicas_sharing_an_address_keep_their_own_state() {
        let (a, b) = (replica("a", "127.0.0.1:1"), replica("b", "127.0.0.1:1"));
        a.demote();
        b.demote();
        let (ba, bb) = (a.health.demotions(), b.health.demotions());
        a.observe_check(true, ba, 2, 1);
        b.observe_check(true, bb, 2, 1);
        assert!(a.is_live() && b.is_live());
        b.set_draining(true);
        assert!(a.is_live() && !b.is_live());
    }

    #[test]
    fn queued_prefill_is_local_until_the_replica_reports_more() {
        let r = Arc::new(replica("a", "127.0.0.1:1"));
        let a = r.queue_prefill(1000);
        let _flight = r.start();
        let _flight2 = r.start();
        assert_eq!((r.queued_tokens(), r.running()), (1000, 1));
        // The replica reports 3 waiting (one is ours) and 5 running: two others at the mean.
        r.set_reported_load(Some((3, 5)));
        assert_eq!((r.queued_tokens(), r.running()), (3000, 5));
        drop(a);
        assert_eq!(r.queued_tokens(), 3 * 1000, "now three others, at the mean");
        r.set_reported_load(None);
        assert_eq!(
            (r.queued_tokens(), r.running()),
            (0, 2),
            "stale: local counts only"
        );
    }

    /// Sums and products of reported and shared counts saturate: the largest counts read as
    /// the busiest replica, never wrap around to an idle one. Unchecked, a peer's `u64::MAX`
    /// queued tokens plus this process's 1,000 wrapped to 999.
    #[test]
    fn absurd_counts_saturate_instead_of_wrapping() {
        let r = Arc::new(replica("a", "127.0.0.1:1"));
        let _queued = r.queue_prefill(1000);
        let _flight = r.start();
        r.set_peer_load(u64::MAX, 0, u64::MAX);
        assert_eq!(r.queued_tokens(), u64::MAX);
        assert_eq!(r.in_flight_everywhere(), usize::MAX);
        assert_eq!(r.running(), usize::MAX);
        r.set_peer_load(0, 0, 0);
        // A report past the bound counts as the bound, times the mean request.
        r.set_reported_load(Some((u64::MAX, u64::MAX)));
        assert_eq!(
            (r.queued_tokens(), r.running()),
            (
                1000 + (MAX_REPORTED_REQUESTS - 1) * 1000,
                MAX_REPORTED_REQUESTS as usize
            )
        );
    }
}
