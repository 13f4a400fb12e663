//! A stream's state: logged and counted once per change, and the replica's freshness (what
//! the cost policy reads) kept with it.

use std::sync::Weak;

use super::StreamState;
use crate::fleet::replica::{Freshness, Replica};
use crate::telemetry::metrics::METRICS;

/// Logs and counts a change of a stream's state, once; nothing once the replica left the
/// registry (its series went with it).
pub(super) fn transition(
    replica: &Weak<Replica>,
    id: &str,
    state: &mut Option<StreamState>,
    to: StreamState,
) {
    let fresh = freshness(to);
    if *state == Some(to) || replica.strong_count() == 0 {
        return;
    }
    let from = state.map_or("none", StreamState::as_str);
    match to {
        StreamState::Live => log::info!("replica {id}: KV event stream live (was {from})"),
        _ => log::warn!(
            "replica {id}: KV event stream {} (was {from}): its prefixes come from the estimate",
            to.as_str()
        ),
    }
    METRICS
        .kv_events_state
        .with_label_values(&[id])
        .set(to as i64);
    if let Some(r) = replica.upgrade() {
        r.cache.set_freshness(fresh);
    }
    *state = Some(to);
}

fn freshness(state: StreamState) -> Freshness {
    match state {
        StreamState::Live => Freshness::Live,
        StreamState::Partial => Freshness::Partial,
        StreamState::Gone => Freshness::Gone,
    }
}

/// The replica's freshness as the stream's `state` says, where the two parted while the state
/// held: the poll marks a restarted replica's emptied index partial behind the stream's back,
/// and a stream that found the restart itself first reads on whole. Only once the stream
/// followed every restart the poll read (`restarts`), lest the index the poll just emptied
/// read live before the stream begins anew.
pub(super) fn resync(r: &Replica, state: Option<StreamState>, restarts: u64) {
    if let Some(state) = state {
        let fresh = freshness(state);
        if r.cache.freshness() != fresh && r.restarts() == restarts {
            r.cache.set_freshness(fresh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The poll found a restart the stream had found first, and marked the index partial
    /// behind it: the stream, reading on whole, makes it live again without a state change.
    #[test]
    fn a_stream_that_stays_live_keeps_its_replica_live() {
        let conf = "inferlb:\n  replicas:\n    - {id: gpu0, address: \"127.0.0.1:1\", \
                    kv_events: \"tcp://127.0.0.1:2\"}\n";
        let l = crate::conf::parse(conf, None).expect("conf");
        let reg = crate::fleet::registry::Registry::new(&l.inferlb.replicas, &l.inferlb.upstream);
        let r = reg.all().first().cloned().expect("gpu0");
        let weak = Arc::downgrade(&r);
        let mut state = None;
        transition(&weak, "gpu0", &mut state, StreamState::Live);
        assert_eq!(r.cache.freshness(), Freshness::Live);
        r.cache.restarted();
        assert_eq!(r.cache.freshness(), Freshness::Partial);
        transition(&weak, "gpu0", &mut state, StreamState::Live);
        resync(&r, state, r.restarts());
        assert_eq!(r.cache.freshness(), Freshness::Live);
        // A restart the stream has not followed yet: the emptied index stays partial.
        r.cache.restarted();
        resync(&r, state, r.restarts().wrapping_sub(1));
        assert_eq!(r.cache.freshness(), Freshness::Partial);
    }
}
