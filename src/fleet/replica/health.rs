//! A replica's fitness to take requests: the health checks' verdict (with Pingora's
//! consecutive-results thresholds), demotion by a failed connection, and drain.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Consecutive check results, as Pingora's checker counts them: `threshold` results against
/// the current state flip it; one result agreeing with it resets the count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    pub healthy: bool,
    pub against: usize,
}

impl Health {
    /// The state after one check; `true` in the second place when it flipped.
    pub fn observe(self, ok: bool, failures: usize, successes: usize) -> (Health, bool) {
        if ok == self.healthy {
            return (Health { against: 0, ..self }, false);
        }
        let threshold = if ok { successes } else { failures };
        let against = self.against + 1;
        if against >= threshold.max(1) {
            (
                Health {
                    healthy: ok,
                    against: 0,
                },
                true,
            )
        } else {
            (Health { against, ..self }, false)
        }
    }
}

pub struct HealthState {
    checks: Mutex<Health>,
    /// `checks.healthy`, readable without the lock on the request path.
    healthy: AtomicBool,
    /// Set when a connection to it failed; cleared by the next health check that *started*
    /// after the failure and passed (see `demotions`).
    demoted: AtomicBool,
    /// Counts demotions, so a check that began before a failure cannot clear it.
    demotions: AtomicU64,
    draining: AtomicBool,
}

impl HealthState {
    pub fn new(healthy: bool) -> HealthState {
        HealthState {
            checks: Mutex::new(Health {
                healthy,
                against: 0,
            }),
            healthy: AtomicBool::new(healthy),
            demoted: AtomicBool::new(false),
            demotions: AtomicU64::new(0),
            draining: AtomicBool::new(false),
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    pub fn is_demoted(&self) -> bool {
        self.demoted.load(Ordering::Relaxed)
    }
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
    /// Healthy by the checks and not demoted: it can serve what it already holds.
    pub fn is_reachable(&self) -> bool {
        self.is_healthy() && !self.is_demoted()
    }
    /// Healthy by the checks, not demoted by a failed connection, not drained.
    pub fn is_live(&self) -> bool {
        self.is_reachable() && !self.is_draining()
    }

    /// A connection to it failed: it gets no new requests until a health check passes.
    pub fn demote(&self) {
        self.demotions.fetch_add(1, Ordering::Relaxed);
        self.demoted.store(true, Ordering::Relaxed);
    }

    /// The demotion count before a health check starts; pass it to [`Self::readmits`].
    pub fn demotions(&self) -> u64 {
        self.demotions.load(Ordering::Relaxed)
    }

    /// A check that started at demotion count `before` ended `ok`: a pass re-admits a replica
    /// demoted before the check began. True when it did.
    pub fn readmits(&self, ok: bool, before: u64) -> bool {
        ok && self.demotions() == before && self.demoted.swap(false, Ordering::Relaxed)
    }

    /// Counts one check result; the new health when it flipped.
    pub fn observe_check(&self, ok: bool, failures: usize, successes: usize) -> Option<bool> {
        let mut h = self.checks.lock().ok()?;
        let (next, flipped) = h.observe(ok, failures, successes);
        *h = next;
        self.healthy.store(next.healthy, Ordering::Relaxed);
        flipped.then_some(next.healthy)
    }

    /// Drains it or puts it back; `Some(draining)` when that changed. An undrained replica is
    /// demoted: it re-enters after a check that started after the undrain passes.
    pub fn set_draining(&self, draining: bool) -> Option<bool> {
        let was = self.draining.swap(draining, Ordering::Relaxed);
        if was && !draining {
            self.demote();
        }
        (was != draining).then_some(draining)
    }
}
