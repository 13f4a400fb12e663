//! The routing policies: (request shape, a snapshot of the replicas) → a replica id.
//!
//! Pure: no clock, no network, no Pingora types, no shared state. The caller hands in a
//! snapshot, a way to look up which replica served a prefix, and a tick from its counter; it
//! updates its own state (in-flight counts, the affinity table) after the decision. So every
//! decision here can be replayed in a unit test.
//!
//! Replicas are named by their configured id, never by a position in a list.

use std::fmt;

use crate::shape::Shape;

mod adaptive;
pub mod cost;
mod spread;

/// Which policy the balancer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Shape ignored: a plain counter over live replicas.
    RoundRobin,
    /// Every request pinned by a hash of its prefix (sends a same-prefix burst to one card).
    Affinity,
    /// Continuations go back to the replica that served their prefix; the rest spreads.
    Adaptive,
    /// The replica with the least prefill to do for this request, its queue included.
    #[serde(rename = "prefill_cost")]
    PrefillCost,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "roundrobin" => Ok(Mode::RoundRobin),
            "affinity" => Ok(Mode::Affinity),
            "adaptive" => Ok(Mode::Adaptive),
            "prefill_cost" => Ok(Mode::PrefillCost),
            other => Err(format!(
                "unknown routing mode {other:?}: expected roundrobin, affinity, adaptive or prefill_cost"
            )),
        }
    }
}

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

/// One replica as the policy sees it at decision time. `handle` is the caller's own name for
/// it (the balancer's replica, a test's string); the decision hands it back untouched.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a, H> {
    pub handle: H,
    pub id: &'a str,
    /// Healthy, not demoted, not drained, and not already tried by this request.
    pub available: bool,
    /// Healthy, not demoted and not tried, drained or not: it can still serve what it stores.
    pub reachable: bool,
    pub in_flight: usize,
    /// Tokens of this request's prompt it likely holds in its prefix cache (`prefill_cost`).
    pub cached_tokens: u64,
    /// Prefill tokens already queued on it: requests that have not produced a first token.
    pub queued_tokens: u64,
    /// Requests it is running (decoding or prefilling).
    pub running: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<H> {
    pub replica: H,
    pub route: Route,
}

/// The policy and its one tunable.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub mode: Mode,
    /// A pinned continuation spills when its replica has at least this many more requests in
    /// flight than the least busy available one. `None`: never spill.
    pub spill_margin: Option<usize>,
}

impl Policy {
    /// Chooses a replica, or `None` when no candidate is available.
    ///
    /// `served_by(h)` answers which replica (by id) served the prompt whose hash is `h`, or
    /// the session whose key is `h`; `session` is the request's session key, which names its
    /// home before any prompt prefix does. `tick` is a fresh value of the caller's counter (it
    /// breaks ties and drives roundrobin).
    pub fn decide<H: Copy, S: AsRef<str>>(
        &self,
        shape: &Shape,
        session: Option<u64>,
        candidates: &[Candidate<'_, H>],
        served_by: impl Fn(u64) -> Option<S>,
        tick: u64,
    ) -> Option<Decision<H>> {
        let available: Vec<&Candidate<'_, H>> = candidates.iter().filter(|c| c.available).collect();
        if available.is_empty() {
            return None;
        }
        let (replica, route) = match self.mode {
            Mode::RoundRobin => (spread::round_robin(&available, tick), Route::RoundRobin),
            Mode::Affinity => (
                spread::rendezvous(&available, shape.affinity_key()),
                Route::Hashed,
            ),
            Mode::Adaptive => {
                let homes = session.into_iter().chain(shape.strict_prefixes());
                adaptive::decide(self.spill_margin, homes, &available, served_by, tick)
            }
            Mode::PrefillCost => {
                // The session names its home outright; an exact continuation with the tokens
                // of the prefix its home served.
                let session_home = session.and_then(&served_by).map(|id| (id, 0));
                let home = session_home.or_else(|| {
                    shape
                        .strict_prefix_links()
                        .find_map(|l| served_by(l.hash).map(|id| (id, l.bytes / 4)))
                });
                let home = home.as_ref().map(|(id, tokens)| (id.as_ref(), *tokens));
                cost::decide(shape.prompt_tokens(), home, &available, tick)
            }
        };
        Some(Decision {
            replica: replica.handle,
            route,
        })
    }
}

/// A request about a stored response goes to the replica that stores it, drained or not, and
/// nowhere else: `None` when that replica cannot be reached.
pub fn stored<H: Copy>(owner: &str, candidates: &[Candidate<'_, H>]) -> Option<Decision<H>> {
    let c = candidates.iter().find(|c| c.id == owner && c.reachable)?;
    Some(Decision {
        replica: c.handle,
        route: Route::Stored,
    })
}

#[cfg(test)]
mod tests;
