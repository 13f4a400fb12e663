//! The live replica set: health (from Pingora's checker), demotion (from the data path),
//! drain (from the admin endpoint), in-flight counts, and the affinity table.
//!
//! This is the state the routing policy reads a snapshot of; it holds no policy itself.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use lru::LruCache;
use pingora_load_balancing::{selection::RoundRobin, Backend, LoadBalancer};

use crate::config::ReplicaConf;
use crate::metrics::METRICS;
use crate::routing::Candidate;

pub struct Replica {
    /// The configured id; shared with the affinity table's entries.
    pub id: Arc<str>,
    pub address: String,
    pub backend: Backend,
    /// Set when a connection to it failed; cleared by the next health check that *started*
    /// after the failure and passed (see `demotions`).
    demoted: AtomicBool,
    /// Counts demotions, so a check that began before a failure cannot clear it.
    demotions: AtomicU64,
    draining: AtomicBool,
    in_flight: AtomicUsize,
    /// The models it serves: from the conf, or learnt from its /v1/models (empty: unknown,
    /// so it is not excluded from any model's pool).
    models: RwLock<Arc<[String]>>,
    /// The conf fixed `models`: never replaced by what the replica says.
    pub models_configured: bool,
    /// Sent to it in place of the client's key.
    pub api_key: Option<String>,
    /// Passing health checks since start: models are re-learnt every so often.
    pub checks_passed: AtomicU64,
}

impl Replica {
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
    pub fn is_demoted(&self) -> bool {
        self.demoted.load(Ordering::Relaxed)
    }
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
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
}

/// Counts one request in flight on a replica for as long as it lives.
pub struct InFlight(Arc<Replica>);

impl InFlight {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let n = self.0.in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
        METRICS
            .in_flight
            .with_label_values(&[&self.0.id])
            .set(n as i64);
    }
}

pub struct Replicas {
    list: Vec<Arc<Replica>>,
    /// Pingora's load balancer, used for its health state only; the policy chooses.
    lb: Arc<LoadBalancer<RoundRobin>>,
    /// Hash of a served message list → id of the replica that served it.
    table: Mutex<LruCache<u64, Arc<str>>>,
    /// Bumped on every change of the table, so it is saved only when it changed.
    table_generation: AtomicU64,
    counter: AtomicU64,
}

impl Replicas {
    pub fn new(
        confs: &[ReplicaConf],
        lb: Arc<LoadBalancer<RoundRobin>>,
        capacity: usize,
    ) -> Replicas {
        let list = confs
            .iter()
            .map(|c| {
                METRICS.up.with_label_values(&[&c.id]).set(1);
                METRICS.in_flight.with_label_values(&[&c.id]).set(0);
                METRICS.draining.with_label_values(&[&c.id]).set(0);
                Arc::new(Replica {
                    id: Arc::from(c.id.as_str()),
                    address: c.address.clone(),
                    backend: backend_for(c),
                    demoted: AtomicBool::new(false),
                    demotions: AtomicU64::new(0),
                    draining: AtomicBool::new(false),
                    in_flight: AtomicUsize::new(0),
                    models: RwLock::new(Arc::from(c.models.clone())),
                    models_configured: !c.models.is_empty(),
                    api_key: c.api_key.clone(),
                    checks_passed: AtomicU64::new(0),
                })
            })
            .collect();
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Replicas {
            list,
            lb,
            table: Mutex::new(LruCache::new(capacity)),
            table_generation: AtomicU64::new(0),
            counter: AtomicU64::new(0),
        }
    }

    pub fn all(&self) -> &[Arc<Replica>] {
        &self.list
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Replica>> {
        self.list.iter().find(|r| &*r.id == id)
    }

    pub fn is_healthy(&self, r: &Replica) -> bool {
        self.lb.backends().ready(&r.backend)
    }

    /// Healthy by Pingora's checker, not demoted by a failed connection, not drained.
    pub fn is_live(&self, r: &Replica) -> bool {
        self.is_healthy(r) && !r.is_demoted() && !r.is_draining()
    }

    /// The policy's view of the pool serving `model`; `tried` replicas are not available to
    /// this request again.
    pub fn candidates<'a>(
        &'a self,
        tried: &[Arc<Replica>],
        model: Option<&str>,
    ) -> Vec<Candidate<'a>> {
        self.list
            .iter()
            .filter(|r| model.is_none_or(|m| r.serves(m)))
            .map(|r| Candidate {
                id: &r.id,
                available: self.is_live(r) && !tried.iter().any(|t| Arc::ptr_eq(t, r)),
                in_flight: r.in_flight(),
            })
            .collect()
    }

    /// Whether any replica may serve `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.list.iter().any(|r| r.serves(model))
    }

    /// Every model some replica serves, sorted, each once.
    pub fn all_models(&self) -> Vec<String> {
        let mut all: Vec<String> = self.list.iter().flat_map(|r| r.models().to_vec()).collect();
        all.sort();
        all.dedup();
        all
    }

    pub fn tick(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    /// Which replica served the message list hashed `h` (does not refresh its LRU position).
    pub fn served_by(&self, h: u64) -> Option<Arc<str>> {
        self.table.lock().ok()?.peek(&h).cloned()
    }

    /// Records that `replica` served the message list hashed `h`.
    pub fn record_served(&self, h: u64, replica: &Replica) {
        if let Ok(mut t) = self.table.lock() {
            t.put(h, replica.id.clone());
            METRICS.affinity_entries.set(t.len() as i64);
        }
        self.table_generation.fetch_add(1, Ordering::Relaxed);
    }

    pub fn served_generation(&self) -> u64 {
        self.table_generation.load(Ordering::Relaxed)
    }

    /// The affinity table, least recently used first. Copies pointers only, so the request
    /// path waits on the lock as briefly as possible.
    pub fn served_entries(&self) -> Vec<(u64, Arc<str>)> {
        let Ok(t) = self.table.lock() else {
            return vec![];
        };
        t.iter().rev().map(|(h, id)| (*h, id.clone())).collect()
    }

    /// Adds pins another process made, least recently used first. A pin this process already
    /// holds wins (it is at least as recent); ids no longer configured are dropped.
    pub fn merge_served(&self, entries: &[(u64, String)]) -> usize {
        let Ok(mut t) = self.table.lock() else {
            return 0;
        };
        let mut learnt = 0;
        for (h, id) in entries {
            if t.contains(h) {
                continue;
            }
            if let Some(r) = self.get(id) {
                t.put(*h, r.id.clone());
                learnt += 1;
            }
        }
        METRICS.affinity_entries.set(t.len() as i64);
        learnt
    }

    pub fn start(&self, r: &Arc<Replica>) -> InFlight {
        let n = r.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        METRICS.in_flight.with_label_values(&[&r.id]).set(n as i64);
        InFlight(r.clone())
    }

    /// A connection to `r` failed: it gets no new requests until a health check passes.
    pub fn demote(&self, r: &Replica) {
        r.demotions.fetch_add(1, Ordering::Relaxed);
        r.demoted.store(true, Ordering::Relaxed);
        METRICS.up.with_label_values(&[&r.id]).set(0);
    }

    /// The demotion count before a health check starts; pass it to [`Self::check_passed`].
    pub fn demotions(&self, r: &Replica) -> u64 {
        r.demotions.load(Ordering::Relaxed)
    }

    /// A health check that started at demotion count `before` passed.
    pub fn check_passed(&self, r: &Replica, before: u64) {
        if r.demotions.load(Ordering::Relaxed) == before && r.demoted.swap(false, Ordering::Relaxed)
        {
            log::info!("replica {} re-admitted: health check passed", r.id);
        }
        self.publish_up(r);
    }

    pub fn publish_up(&self, r: &Replica) {
        let up = self.is_healthy(r) && !r.is_demoted();
        METRICS.up.with_label_values(&[&r.id]).set(up as i64);
    }

    /// Takes a replica out of rotation (or puts it back). In-flight requests finish; pinned
    /// conversations move on their next turn. An undrained replica re-enters only after a
    /// health check that started after the undrain passes: it was probably restarted.
    pub fn set_draining(&self, r: &Replica, draining: bool) {
        let was = r.draining.swap(draining, Ordering::Relaxed);
        if was && !draining {
            self.demote(r);
            log::warn!(
                "replica {} undrained: back after its next passing health check",
                r.id
            );
        } else if !was && draining {
            log::warn!("replica {} draining", r.id);
        }
        METRICS
            .draining
            .with_label_values(&[&r.id])
            .set(draining as i64);
    }

    pub fn by_backend(&self, b: &Backend) -> Option<&Arc<Replica>> {
        self.list.iter().find(|r| r.backend.addr == b.addr)
    }
}

pub fn backend_for(c: &ReplicaConf) -> Backend {
    use std::net::ToSocketAddrs;
    // Validated by config: the address resolves.
    let addr = c
        .address
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 9)));
    Backend::new(&addr.to_string()).unwrap_or_else(|_| Backend {
        addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(addr),
        weight: 1,
        ext: Default::default(),
    })
}
