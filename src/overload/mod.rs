//! Overload and fairness: which requests go to the fleet now, which wait inside inferlb, and
//! which are told to come back later (429 with `Retry-After`).
//!
//! A request first meets its key's budget (requests at once, tokens per minute:
//! [`budget`], shared with a cluster's other instances when there are any: [`shared`]); then,
//! when every live replica that may serve its model is over a limit in queued prefill tokens
//! or running requests ([`policy`]), it waits in a bounded queue ordered by class and shared
//! fairly between keys ([`queue`]), until one of them has room, its client leaves, or the wait
//! bound passes. Responses already streaming are never touched: only admission is decided here.
//!
//! Here: the state behind one lock, the pump that lets queued requests go while their replicas
//! have room, and the 429's shape. Admitting one request (its budget, at once or the wait in the
//! queue, a refusal's `Retry-After`) is in `admit`; what an admitted request holds until it
//! ends, and its end, in `pass`.
//!
//! Not for routing (which replica: `crate::routing`) nor for answering (the proxy writes the
//! 429 in the caller's API's shape). Everything here is off unless `inferlb.overload` is set.

mod admit;
pub mod budget;
pub mod metrics;
mod pass;
pub mod policy;
pub mod queue;
pub mod shared;
mod who;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

pub use crate::conf::overload::OverloadConf;
use metrics::METRICS;
pub use pass::Pass;
use policy::{Drain, Limits, ReplicaLoad};
use queue::Queue;
pub use who::Who;

use crate::fleet::registry::Registry;

/// How often the queue is looked at while it holds requests (a replica's prefill ends at a
/// first byte, which nothing here is told of).
const PUMP_EVERY: Duration = Duration::from_millis(20);

/// What a waiting request is told.
#[derive(Debug)]
enum Verdict {
    /// Go to a replica; its prefill is counted in transit under this ticket.
    Go(u64),
    /// A higher class or a key under its share took its slot.
    PushedOut,
}

/// A waiting request: how it is told, and the model whose replicas it needs (`None`: any).
struct Waiter {
    tx: oneshot::Sender<Verdict>,
    model: Option<Arc<str>>,
}

struct State {
    queue: Queue<Waiter>,
    budgets: budget::Budgets,
    drain: Drain,
    /// Requests let go whose prefill no replica counts yet: ticket → (tokens, model).
    transit: HashMap<u64, (u64, Option<Arc<str>>)>,
    next_ticket: u64,
}

pub struct Overload {
    conf: OverloadConf,
    limits: Limits,
    registry: Arc<Registry>,
    state: Mutex<State>,
    /// A task is looking at the queue every [`PUMP_EVERY`].
    pumping: AtomicBool,
    /// Budgets shared with a cluster's other instances, when it has any.
    sharing: Option<shared::Sharing>,
    sharing_started: AtomicBool,
}

/// Every reason a request is answered 429.
pub const REASONS: [&str; 6] = [
    "concurrency",
    "tokens_per_minute",
    "queue_full",
    "key_share",
    "pushed_out",
    "queue_timeout",
];

/// A 429: why, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooMany {
    /// The `reason` label: `concurrency`, `tokens_per_minute`, `queue_full`, `key_share`,
    /// `pushed_out`, `queue_timeout`.
    pub reason: &'static str,
    pub retry_after: u64,
    pub message: String,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    Go,
    Refused(TooMany),
    /// The client hung up while it waited.
    Gone,
}

impl Overload {
    /// Overload protection as configured (`None`: off). Its series exist either way, at zero,
    /// so dashboards and alerts find them.
    pub fn from_conf(
        conf: Option<OverloadConf>,
        sharing: Option<shared::Sharing>,
        registry: Arc<Registry>,
    ) -> Option<Arc<Overload>> {
        let default = ["default".to_string()];
        let classes = conf.as_ref().map_or(&default[..], |c| &c.classes[..]);
        for c in classes {
            METRICS.queue_length.with_label_values(&[c]).set(0);
            METRICS.queue_wait.with_label_values(&[c]);
            METRICS.abandoned.with_label_values(&[c]);
        }
        for reason in REASONS {
            METRICS.rejected.with_label_values(&["anonymous", reason]);
        }
        for kind in ["prompt", "completion"] {
            METRICS.tokens.with_label_values(&["anonymous", kind]);
        }
        METRICS.saturated.set(0);
        METRICS.shared.set(0);
        conf.map(|c| {
            let mut o = Overload::new(c, registry);
            o.sharing = sharing;
            Arc::new(o)
        })
    }

    pub fn new(conf: OverloadConf, registry: Arc<Registry>) -> Overload {
        let now = Instant::now();
        let classes = conf.classes.len();
        Overload {
            limits: Limits {
                max_queued_prefill_tokens: conf.max_queued_prefill_tokens,
                max_running: conf.max_running,
            },
            state: Mutex::new(State {
                queue: Queue::new(conf.queue_length, classes),
                budgets: budget::Budgets::new(conf.window, now, conf.max_keys),
                drain: Drain::new(now),
                transit: HashMap::new(),
                next_ticket: 1,
            }),
            conf,
            registry,
            pumping: AtomicBool::new(false),
            sharing: None,
            sharing_started: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere never leaves the counts half-written (each change is one step).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key, its label, class and budget, from the request's headers.
    pub fn identify(&self, headers: &http::HeaderMap) -> Who {
        who::identify(&self.conf, headers)
    }

    /// The conf name of the listed key the request carries (`Authorization: Bearer` or
    /// `x-api-key`), if it is listed.
    pub fn key_name(&self, headers: &http::HeaderMap) -> Option<Arc<str>> {
        who::listed_name(&self.conf, headers)
    }

    /// The load now of each replica that may serve `model`, with what was let go for it but
    /// is not counted on a replica yet.
    fn replica_loads(
        &self,
        model: Option<&str>,
        transit: &HashMap<u64, (u64, Option<Arc<str>>)>,
    ) -> Vec<ReplicaLoad> {
        let mut fleet: Vec<ReplicaLoad> = self
            .registry
            .all()
            .iter()
            .filter(|r| model.is_none_or(|m| r.serves(m)))
            .map(|r| ReplicaLoad {
                live: r.is_live(),
                queued_tokens: r.queued_tokens(),
                running: r.running(),
                role: r.role,
            })
            .collect();
        for (tokens, m) in transit.values() {
            if model.is_none() || m.is_none() || m.as_deref() == model {
                self.limits.place(&mut fleet, *tokens);
            }
        }
        fleet
    }

    fn let_go(s: &mut State, tokens: u64, model: Option<Arc<str>>, now: Instant) -> u64 {
        let t = s.next_ticket;
        s.next_ticket += 1;
        s.transit.insert(t, (tokens, model));
        s.drain.record(now);
        t
    }

    fn show(&self, s: &State) {
        for (name, n) in self.conf.classes.iter().zip(s.queue.len_by_class()) {
            METRICS
                .queue_length
                .with_label_values(&[name])
                .set(n as i64);
        }
    }

    /// Lets queued requests go, in the queue's order, while their replicas have room.
    pub fn pump(&self) {
        let now = Instant::now();
        let mut guard = self.lock();
        let s: &mut State = &mut guard;
        if s.queue.is_empty() {
            METRICS.saturated.set(0);
            return;
        }
        // The common case under load, at the cost of one look at the replicas: nothing fits.
        // A disaggregated fleet's pools are judged per model below: one model's full prefill
        // pool says nothing of another model's replicas.
        let all = self.replica_loads(None, &s.transit);
        if !policy::disaggregated(&all) && self.limits.saturated(&all) {
            return;
        }
        // Each model's replicas, looked at once a pump; a placement adds to them, and a model
        // whose replicas are full stays full for the rest of the pump.
        let mut fleets: HashMap<Option<Arc<str>>, Vec<ReplicaLoad>> = HashMap::new();
        let mut full: std::collections::HashSet<Option<Arc<str>>> = Default::default();
        while let Some(e) = s.queue.pop_where(|e| {
            let model = &e.item.model;
            if full.contains(model) {
                return false;
            }
            let fleet = fleets
                .entry(model.clone())
                .or_insert_with(|| self.replica_loads(model.as_deref(), &s.transit));
            let placed = self.limits.place(fleet, e.tokens);
            if !placed {
                full.insert(model.clone());
            }
            placed
        }) {
            let ticket = Self::let_go(s, e.tokens, e.item.model.clone(), now);
            if e.item.tx.send(Verdict::Go(ticket)).is_err() {
                // Its waiter is gone already.
                s.transit.remove(&ticket);
            }
        }
        METRICS.saturated.set(i64::from(!s.queue.is_empty()));
        self.show(s);
    }

    /// Starts sharing budgets with the cluster, once, from the first request's runtime.
    fn keep_sharing(self: &Arc<Self>) {
        if let Some(sharing) = &self.sharing {
            if !self.sharing_started.swap(true, Ordering::AcqRel) {
                tokio::spawn(shared::run(self.clone(), sharing.clone()));
            }
        }
    }

    /// Makes sure a task looks at the queue every [`PUMP_EVERY`] while it holds requests.
    fn keep_pumping(self: &Arc<Self>) {
        if self.pumping.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PUMP_EVERY).await;
                me.pump();
                if me.lock().queue.is_empty() {
                    me.pumping.store(false, Ordering::Release);
                    // A request queued between the look and the store starts its own pump.
                    if me.lock().queue.is_empty() || me.pumping.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
            }
        });
        self.pump();
    }

    /// The queue's own memory now (its tables), and its length.
    pub fn queue_bytes(&self) -> (usize, usize) {
        let s = self.lock();
        (s.queue.approx_bytes(), s.queue.len())
    }
}
