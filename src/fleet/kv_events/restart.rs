//! How a replica's stream follows its publisher's restart, found by the stream itself (its
//! sequence began again) or by the replica's `/metrics` (a later process start): the cache
//! emptied once, the sequence begun anew.

use super::Sequence;
use crate::fleet::replica::Replica;

/// Whether the replica restarted by its `/metrics` since this stream last looked (`restarts`,
/// the count it followed): its cache was cleared then and its publisher began again, so the
/// stream begins anew from the new publisher's first batch. Nothing is cleared again (what was
/// sent to it since counts), and a restart found while the subscriber was away (reconnecting)
/// is followed as one found while it read.
pub(super) fn renewed(r: &Replica, restarts: &mut u64, seq: &mut Sequence) -> bool {
    let now = r.restarts();
    if now == *restarts {
        return false;
    }
    *restarts = now;
    *seq = Sequence::default();
    log::info!(
        "replica {}: restarted (its /metrics); its KV event stream begins anew",
        r.id
    );
    true
}

/// The publisher began again (`how` it was found): its cache is empty, and its sequence
/// starts anew.
pub(super) fn restarted(r: &Replica, seq: &mut Sequence, how: &str) {
    r.cache.clear();
    log::info!(
        "replica {}: its KV event publisher restarted; its estimate is cleared ({how})",
        r.id
    );
    *seq = Sequence::default();
}
