//! One try of a request on one replica. Each try is a new [`Attempt`] that replaces the last
//! one whole, so the previous try's counts are released by the replacement itself; what the
//! try still holds on its replica follows from its [`Phase`], not from which fields are set.

use std::sync::Arc;

use crate::fleet::index::Recency;
use crate::fleet::replica::{InFlight, QueuedPrefill, Replica};
use crate::routing::Route;

/// What the policy chose for the next try: the replica, why, and its prefill already queued
/// there (under a policy that weighs prefill, or overload protection), so the next request's
/// decision sees it.
pub struct Choice {
    pub replica: Arc<Replica>,
    pub route: Route,
    pub prefill: Option<QueuedPrefill>,
    /// The KV the request's context will hold there, in tokens: its decode load.
    pub kv_tokens: u64,
    /// Tokens of the prompt the cache model said the replica holds (checked against the
    /// answer's usage); `None` when the answer's cached count says nothing of its cache (a
    /// handed-over turn's decode pulled what it lacked).
    pub predicted: Option<u64>,
    /// `predicted` came from the replica's KV events, not the estimate.
    pub predicted_exact: bool,
}

/// Where a try stands, and what it holds on its replica.
pub enum Phase {
    /// Sent, no first byte yet: counted in flight, its prefill queued.
    Waiting {
        in_flight: InFlight,
        prefill: Option<QueuedPrefill>,
    },
    /// The first byte arrived: the prefill is over, the request still in flight.
    Answering { in_flight: InFlight },
    /// Over, or given up with no replica left: it holds nothing.
    Ended,
}

pub struct Attempt {
    /// This try's number, from 1.
    pub n: u32,
    pub route: Route,
    pub phase: Phase,
    /// See [`Choice::predicted`].
    pub predicted: Option<u64>,
    pub predicted_exact: bool,
    /// When the links its replica held of the prompt were last recorded there, before its
    /// prefill recorded them again: for the check of the prediction.
    pub recency: Recency,
}

impl Attempt {
    /// Try number `n` of `choice`: counted in flight on its replica from now on.
    pub fn start(n: u32, choice: Choice) -> Attempt {
        let in_flight = choice.replica.start_holding(choice.kv_tokens);
        Attempt {
            n,
            route: choice.route,
            predicted: choice.predicted,
            predicted_exact: choice.predicted_exact,
            recency: Recency::default(),
            phase: Phase::Waiting {
                in_flight,
                prefill: choice.prefill,
            },
        }
    }

    /// Its replica, while the try holds a place there.
    pub fn current(&self) -> Option<&Arc<Replica>> {
        match &self.phase {
            Phase::Waiting { in_flight, .. } | Phase::Answering { in_flight } => {
                Some(in_flight.replica())
            }
            Phase::Ended => None,
        }
    }

    /// The first byte arrived: the queued prefill is handed back (to record the prompt in the
    /// replica's cache model), once.
    pub fn answering(&mut self) -> Option<QueuedPrefill> {
        match std::mem::replace(&mut self.phase, Phase::Ended) {
            Phase::Waiting { in_flight, prefill } => {
                self.phase = Phase::Answering { in_flight };
                prefill
            }
            other => {
                self.phase = other;
                None
            }
        }
    }

    /// An error answer: the prefill ends without the replica holding the prompt.
    pub fn refused(&mut self) {
        if let Phase::Waiting { prefill, .. } = &mut self.phase {
            *prefill = None;
        }
    }

    /// The try is over: its counts are released now.
    pub fn end(&mut self) {
        self.phase = Phase::Ended;
    }
}
