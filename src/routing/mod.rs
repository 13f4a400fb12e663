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
    /// Prefill tokens already queued on it: requests that have not produced a first token.
    pub queued_tokens: u64,
    /// Requests it is running (decoding or prefilling).
    pub running: usize,
}

/// The replica chosen, by id, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    pub replica: &'a str,
    pub route: Route,
}

/// Which replica (by id) served the prompt or the session whose hash is the argument.
pub type ServedBy<'a> = &'a dyn Fn(u64) -> Option<Arc<str>>;

/// What a policy is asked about one request.
pub struct Ask<'a> {
    pub shape: &'a Shape,
    /// The request's session key, which names its home before any prompt prefix does.
    pub session: Option<u64>,
    pub served_by: ServedBy<'a>,
    /// A fresh value of the caller's counter: it breaks ties and drives round-robin.
    pub tick: u64,
}

/// A routing policy: one per file in this folder.
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
    fn choose<'c, 'a>(
        &self,
        ask: &Ask<'_>,
        available: &[&'c Candidate<'a>],
    ) -> (&'c Candidate<'a>, Route);
}

/// The policy the conf names.
#[derive(Debug)]
pub struct Router {
    policy: Box<dyn Policy>,
}

impl Router {
    /// The factory: the policy called `mode` in the conf. `spill_margin` is adaptive's one
    /// tunable: a pinned continuation spills when its replica has at least this many more
    /// requests in flight than the least busy available one (`None`: never).
    pub fn new(mode: Mode, spill_margin: Option<usize>) -> Router {
        let policy: Box<dyn Policy> = match mode {
            Mode::RoundRobin => Box::new(roundrobin::RoundRobin),
            Mode::Affinity => Box::new(hashed::Hashed),
            Mode::Adaptive => Box::new(adaptive::Adaptive { spill_margin }),
            Mode::PrefillCost => Box::new(prefill_cost::PrefillCost),
        };
        debug_assert_eq!(policy.name(), mode.name());
        Router { policy }
    }

    pub fn name(&self) -> &'static str {
        self.policy.name()
    }

    /// See [`Policy::weighs_prefill`].
    pub fn weighs_prefill(&self) -> bool {
        self.policy.weighs_prefill()
    }

    /// Chooses a replica, or `None` when no candidate is available.
    pub fn decide<'a>(
        &self,
        shape: &Shape,
        session: Option<u64>,
        candidates: &[Candidate<'a>],
        served_by: ServedBy<'_>,
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
        let (chosen, route) = self.policy.choose(&ask, &available);
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
