//! What one admitted request holds ([`Pass`]) and the end of a request: its key charged what
//! the replica reported, its place and its prefill in transit given back ([`Overload::finish`]),
//! and the queue looked at again when that place may let a waiting request go.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::metrics::METRICS;
use super::Overload;

/// What one request holds from admission to its end: its key's concurrency and its prefill in
/// transit, both given back when it ends (or when it is dropped, whatever happened).
#[derive(Default)]
pub struct Pass {
    pub(super) owner: Option<Arc<Overload>>,
    pub(super) key: u64,
    pub(super) label: Option<Arc<str>>,
    /// The prompt tokens charged at admission (estimated).
    pub(super) tokens: u64,
    pub(super) counted: bool,
    pub(super) ticket: Option<u64>,
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

    pub(super) fn label(&self) -> &str {
        self.label.as_deref().unwrap_or("anonymous")
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.release();
    }
}

impl Overload {
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
}
