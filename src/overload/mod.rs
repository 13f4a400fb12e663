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
//! Not for routing (which replica: `crate::routing`) nor for answering (the proxy writes the
//! 429 in the caller's API's shape). Everything here is off unless `inferlb.overload` is set.

pub mod budget;
pub mod conf;
pub mod metrics;
pub mod policy;
pub mod queue;
pub mod shared;
mod who;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

pub use conf::OverloadConf;
use metrics::METRICS;
use policy::{Drain, Limits, ReplicaLoad};
use queue::{Full, Pushed, Queue};
pub use who::Who;

use crate::registry::Registry;

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

/// What one request holds from admission to its end: its key's concurrency and its prefill in
/// transit, both given back when it ends (or when it is dropped, whatever happened).
#[derive(Default)]
pub struct Pass {
    owner: Option<Arc<Overload>>,
    key: u64,
    label: Option<Arc<str>>,
    /// The prompt tokens charged at admission (estimated).
    tokens: u64,
    counted: bool,
    ticket: Option<u64>,
    /// For the access log: `-`, `queued`, or why it was refused or left.
    pub note: Option<&'static str>,
    /// How long it waited in the queue.
    pub waited: Option<Duration>,
}

impl Pass {
    /// The request's prefill is now counted on its replica: no longer in transit.
    pub fn routed(&mut self) {
        if let (Some(o), Some(t)) = (&self.owner, self.ticket.take()) {
            o.lock().transit.remove(&t);
        }
    }

    /// Gives back what it holds, under one lock; the queue is looked at again only when it
    /// holds requests that the freed place may let go.
    fn release(&mut self) {
        let Some(o) = &self.owner else {
            return;
        };
        let (ticket, counted) = (self.ticket.take(), std::mem::take(&mut self.counted));
        if ticket.is_none() && !counted {
            return;
        }
        let waiting = {
            let mut s = o.lock();
            if let Some(t) = ticket {
                s.transit.remove(&t);
            }
            if counted {
                s.budgets.end(self.key);
            }
            !s.queue.is_empty()
        };
        if counted && waiting {
            o.pump();
        }
    }

    fn label(&self) -> &str {
        self.label.as_deref().unwrap_or("anonymous")
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.release();
    }
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
                budgets: budget::Budgets::new(conf.window, now),
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

    /// The load now of each replica that may serve `model`, with what was let go for it but
    /// is not counted on a replica yet.
    fn fleet(
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

    fn refuse(&self, pass: &mut Pass, s: &mut State, reason: &'static str, wait: u64) -> TooMany {
        if pass.counted {
            // It never ran: its key gets its place and its tokens back.
            pass.counted = false;
            s.budgets.end(pass.key);
            s.budgets
                .charge(pass.key, -(pass.tokens as i64), Instant::now());
        }
        pass.note = Some(reason);
        METRICS
            .rejected
            .with_label_values(&[pass.label(), reason])
            .inc();
        let message = match reason {
            "concurrency" => "too many requests of this key at once".to_string(),
            "tokens_per_minute" => "this key's tokens per minute are used up".to_string(),
            "key_share" => "this key holds its share of the queue".to_string(),
            "queue_timeout" => "the replicas are saturated and the request waited too long".into(),
            _ => "the replicas are saturated and the queue is full".to_string(),
        };
        TooMany {
            reason,
            retry_after: wait,
            message: format!("{message}; retry after {wait} s"),
        }
    }

    fn retry_after(&self, s: &mut State, now: Instant) -> u64 {
        let ahead = s.queue.len();
        let rate = s.drain.per_second(now);
        policy::retry_after(ahead, rate, self.conf.queue_timeout)
    }

    fn show(&self, s: &State) {
        for (name, n) in self.conf.classes.iter().zip(s.queue.len_by_class()) {
            METRICS
                .queue_length
                .with_label_values(&[name])
                .set(n as i64);
        }
    }

    /// Admits a request of about `tokens` prompt tokens for `model`'s replicas: at once, after
    /// waiting in the queue, or not (429). `gone` completes when the client hangs up.
    pub async fn admit(
        self: &Arc<Self>,
        pass: &mut Pass,
        who: Who,
        tokens: u64,
        model: Option<&str>,
        gone: impl Future<Output = ()>,
    ) -> Admission {
        let Who {
            key,
            label,
            class,
            budget,
        } = who;
        *pass = Pass {
            owner: Some(self.clone()),
            key,
            label,
            tokens,
            ..Pass::default()
        };
        let class_name = self.conf.classes[class].as_str();
        self.keep_sharing();
        let now = Instant::now();
        let (id, rx) = {
            let mut s = self.lock();
            if let Err((over, wait)) = s.budgets.check(key, budget, tokens, now) {
                let reason = match over {
                    budget::Over::Concurrency => "concurrency",
                    budget::Over::TokensPerMinute => "tokens_per_minute",
                };
                let wait = wait.as_secs_f64().ceil().max(1.0) as u64;
                return Admission::Refused(self.refuse(pass, &mut s, reason, wait));
            }
            s.budgets.start(key, tokens, now);
            pass.counted = true;
            METRICS
                .tokens
                .with_label_values(&[pass.label(), "prompt"])
                .inc_by(tokens);
            let go_now = !self.conf.limits_load() || {
                let mut fleet = self.fleet(model, &s.transit);
                s.queue.is_empty() && self.limits.place(&mut fleet, tokens)
            };
            if go_now {
                let model = model.map(Arc::from);
                pass.ticket = Some(Self::let_go(&mut s, tokens, model, now));
                pass.note = Some("-");
                METRICS
                    .queue_wait
                    .with_label_values(&[class_name])
                    .observe(0.0);
                return Admission::Go;
            }
            let (tx, rx) = oneshot::channel();
            let waiter = Waiter {
                tx,
                model: model.map(Arc::from),
            };
            let id = match s.queue.push(key, class, tokens, waiter) {
                Pushed::Queued(id) => id,
                Pushed::Evicted(id, out) => {
                    let _ = out.item.tx.send(Verdict::PushedOut);
                    id
                }
                Pushed::Refused(why, _) => {
                    let reason = match why {
                        Full::Queue => "queue_full",
                        Full::KeyShare => "key_share",
                    };
                    let wait = self.retry_after(&mut s, now);
                    return Admission::Refused(self.refuse(pass, &mut s, reason, wait));
                }
            };
            METRICS.saturated.set(1);
            self.show(&s);
            (id, rx)
        };
        self.keep_pumping();
        // Its replicas may have room while other models' requests wait.
        self.pump();
        let mut rx = rx;
        let (waited, answered) = tokio::select! {
            v = &mut rx => (None, v.ok()),
            _ = tokio::time::sleep(self.conf.queue_timeout) => (Some("queue_timeout"), None),
            _ = gone => (Some("client_gone"), None),
        };
        let waited_for = now.elapsed();
        pass.waited = Some(waited_for);
        let mut s = self.lock();
        // Under the lock an entry is either still queued or was answered (the pump and a
        // push-out send while they hold it): a verdict is never lost.
        let left = waited.filter(|_| s.queue.remove(id).is_some());
        let verdict = answered.or_else(|| rx.try_recv().ok());
        self.show(&s);
        if waited == Some("client_gone") {
            if left.is_some() {
                METRICS.abandoned.with_label_values(&[class_name]).inc();
            }
            if let Some(Verdict::Go(ticket)) = verdict {
                pass.ticket = Some(ticket);
            }
            // It never ran: its tokens go back (its place, when the pass ends).
            s.budgets
                .charge(pass.key, -(pass.tokens as i64), Instant::now());
            pass.note = Some("client_gone");
            return Admission::Gone;
        }
        let reason = match verdict {
            Some(Verdict::Go(ticket)) => {
                pass.ticket = Some(ticket);
                pass.note = Some("queued");
                let q = METRICS.queue_wait.with_label_values(&[class_name]);
                q.observe(waited_for.as_secs_f64());
                return Admission::Go;
            }
            Some(Verdict::PushedOut) => "pushed_out",
            None => "queue_timeout",
        };
        let wait = self.retry_after(&mut s, Instant::now());
        Admission::Refused(self.refuse(pass, &mut s, reason, wait))
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
        if self.limits.saturated(&self.fleet(None, &s.transit)) {
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
                .or_insert_with(|| self.fleet(model.as_deref(), &s.transit));
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

    /// The request ended: its key is charged what the replica reported (the completion, and
    /// the prompt's difference from the estimate); its place is given back.
    pub fn finish(&self, pass: &mut Pass, prompt: Option<u64>, completion: Option<u64>) {
        if pass.owner.is_none() {
            return;
        }
        let correction = prompt.map_or(0, |p| p as i64 - pass.tokens as i64);
        let completion = completion.unwrap_or(0);
        if pass.counted && (correction != 0 || completion > 0) {
            let extra = correction.saturating_add(completion as i64);
            self.lock().budgets.charge(pass.key, extra, Instant::now());
            METRICS
                .tokens
                .with_label_values(&[pass.label(), "completion"])
                .inc_by(completion);
        }
        pass.release();
    }

    /// The queue's own memory now (its tables), and its length.
    pub fn queue_bytes(&self) -> (usize, usize) {
        let s = self.lock();
        (s.queue.approx_bytes(), s.queue.len())
    }
}
