//! The routing policies: (request shape, a snapshot of the replicas) → a replica id.
//!
//! Pure: no clock, no network, no Pingora types, no shared state, and nothing from the fleet:
//! the caller hands in [`Candidate`]s (numbers and an id per replica), a way to look up which
//! replica served a prefix, and a tick from its counter; it updates its own state (in-flight
//! counts, the affinity table) after the decision. So every decision here can be replayed in
//! a unit test.
//!
//! One [`Policy`] per file, built by [`Router::new`] from the conf's name for it. Replicas are
//! named by their configured id, never by a position in a list.

use std::fmt;
use std::sync::Arc;

use crate::conf::Mode;
use crate::protocol::api::shape::Shape;

mod adaptive;
mod hashed;
pub mod pd;
pub mod prefill_cost;
mod roundrobin;
mod spread;

/// Why a replica was chosen; it names the response header and the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// A continuation sent back to the replica that served its prefix.
    Pinned,
    /// A continuation whose replica is down, drained or already tried: moved, the table follows.
    Repinned,
    /// A continuation moved off a replica far busier than the others (one cold prefill).
    Spilled,
    /// A fresh request spread to the least busy replica.
    Spread,
    /// `affinity` mode: chosen by the hash of the prefix.
    Hashed,
    /// A request about a stored response (Responses API), sent to the replica that stores it.
    Stored,
    /// `prefill_cost`: to the replica likely holding the longest prefix of the prompt.
    Prefix,
    /// `roundrobin` mode.
    RoundRobin,
    /// Disaggregated: prefilled on a prefill replica, its KV pulled by the decode replica.
    Pd,
    /// Disaggregated pool, served whole on the decode replica that lacks little of the prompt.
    PdLocal,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Pinned => "pinned",
            Route::Repinned => "repinned",
            Route::Spilled => "spilled",
            Route::Spread => "spread",
            Route::Hashed => "hashed",
            Route::Stored => "stored",
            Route::Prefix => "prefix",
            Route::RoundRobin => "roundrobin",
            Route::Pd => "pd",
            Route::PdLocal => "pd-local",
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One replica as a policy sees it at decision time, named by its id.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub id: &'a str,
    /// Healthy, not demoted, not drained, and not already tried by this request.
    pub available: bool,
    /// Healthy, not demoted and not tried, drained or not: it can still serve what it stores.
    pub reachable: bool,
    pub in_flight: usize,
    /// Tokens of this request's prompt it likely holds in its prefix cache (filled in only
    /// for a policy that [`Policy::weighs_prefill`]).
    pub cached_tokens: u64,
    /// `cached_tokens` came from the replica's own KV events, not the estimate.
    pub cached_exact: bool,
    /// Tokens of this request's prompt that a request this instance queued on it, whose
    /// prefill is not over, shares: it will hold them once that prefill ends (filled in like
    /// `cached_tokens`; requests handed over between prefill and decode pools are not counted).
    pub pending_tokens: u64,
    /// Prefill tokens already queued on it: requests that have not produced a first token.
    pub queued_tokens: u64,
    /// Requests it is running (decoding or prefilling).
    pub running: usize,
    /// KV its running requests hold, in tokens (a decode replica's load).
    pub kv_tokens: u64,
}

/// The replica chosen, by id, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    pub replica: &'a str,
    pub route: Route,
}

/// What a policy is asked about one request. `served_by(h)` answers which replica (by id)
/// served the prompt or the session whose hash is `h`.
pub struct Ask<'a, F: Fn(u64) -> Option<Arc<str>>> {
    pub shape: &'a Shape,
    /// The request's session key, which names its home before any prompt prefix does.
    pub session: Option<u64>,
    pub served_by: &'a F,
    /// A fresh value of the caller's counter: it breaks ties and drives round-robin.
    pub tick: u64,
}

/// A routing policy: one per file in this folder. Dispatched statically by [`Router`] (the
/// lookups a decision makes, one per prefix of a long prompt, inline into it).
pub trait Policy: Send + Sync + fmt::Debug {
    /// Its name in the conf (`inferlb.routing`).
    fn name(&self) -> &'static str;

    /// Whether it weighs prefill: the caller then fills in each candidate's `cached_tokens`
    /// (a prefix-index lookup per replica), counts the chosen replica's queued prefill at
    /// once, and records the prompt in its index when the prefill is over. Others skip all
    /// three.
    fn weighs_prefill(&self) -> bool {
        false
    }

    /// Chooses among `available`, which is never empty.
    fn choose<'c, 'a, F: Fn(u64) -> Option<Arc<str>>>(
        &self,
        ask: &Ask<'_, F>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route);
}

/// What a policy says about itself, without a request: its name and whether it weighs
/// prefill.
trait PolicyInfo {
    fn name(&self) -> &'static str;
    fn weighs_prefill(&self) -> bool;
}

impl<P: Policy> PolicyInfo for P {
    fn name(&self) -> &'static str {
        Policy::name(self)
    }
    fn weighs_prefill(&self) -> bool {
        Policy::weighs_prefill(self)
    }
}

/// The policies there are: a new one is a file, a variant here, and its arms in
/// [`Router::new`] and [`Router::decide`].
#[derive(Debug)]
enum Chosen {
    RoundRobin(roundrobin::RoundRobin),
    Hashed(hashed::Hashed),
    Adaptive(adaptive::Adaptive),
    PrefillCost(prefill_cost::PrefillCost),
}

/// The policy the conf names.
#[derive(Debug)]
pub struct Router {
    policy: Chosen,
}

impl Router {
    /// The factory: the policy called `mode` in the conf. `spill_margin` is adaptive's one
    /// tunable: a pinned continuation spills when its replica has at least this many more
    /// requests in flight than the least busy available one (`None`: never).
    pub fn new(mode: Mode, spill_margin: Option<usize>) -> Router {
        let policy = match mode {
            Mode::RoundRobin => Chosen::RoundRobin(roundrobin::RoundRobin),
            Mode::Affinity => Chosen::Hashed(hashed::Hashed),
            Mode::Adaptive => Chosen::Adaptive(adaptive::Adaptive { spill_margin }),
            Mode::PrefillCost => Chosen::PrefillCost(prefill_cost::PrefillCost),
        };
        let router = Router { policy };
        debug_assert_eq!(router.name(), mode.name());
        router
    }

    fn policy(&self) -> &dyn PolicyInfo {
        match &self.policy {
            Chosen::RoundRobin(p) => p,
            Chosen::Hashed(p) => p,
            Chosen::Adaptive(p) => p,
            Chosen::PrefillCost(p) => p,
        }
    }

    pub fn name(&self) -> &'static str {
        self.policy().name()
    }

    /// See [`Policy::weighs_prefill`].
    pub fn weighs_prefill(&self) -> bool {
        self.policy().weighs_prefill()
    }

    /// Chooses a replica, or `None` when no candidate is available.
    pub fn decide<'a>(
        &self,
        shape: &Shape,
        session: Option<u64>,
        candidates: &[Candidate<'a>],
        served_by: &impl Fn(u64) -> Option<Arc<str>>,
        tick: u64,
    ) -> Option<Decision<'a>> {
        let available: Vec<&Candidate<'a>> = candidates.iter().filter(|c| c.available).collect();
        if available.is_empty() {
            return None;
        }
        let ask = Ask {
            shape,
            session,
            served_by,
            tick,
        };
        let (chosen, route) = match &self.policy {
            Chosen::RoundRobin(p) => p.choose(&ask, &available),
            Chosen::Hashed(p) => p.choose(&ask, &available),
            Chosen::Adaptive(p) => p.choose(&ask, &available),
            Chosen::PrefillCost(p) => p.choose(&ask, &available),
        };
        Some(Decision {
            replica: chosen.id,
            route,
        })
    }
}

/// A request about a stored response goes to the replica that stores it, drained or not, and
/// nowhere else: `None` when that replica cannot be reached.
pub fn stored<'a>(owner: &str, candidates: &[Candidate<'a>]) -> Option<Decision<'a>> {
    let c = candidates.iter().find(|c| c.id == owner && c.reachable)?;
    Some(Decision {
        replica: c.id,
        route: Route::Stored,
    })
}

#[cfg(test)]
mod tests;
