//! An operator's changes (drains, replicas added or removed through the admin API) held until
//! they are written to Redis: never dropped, oldest first. A later change of the same subject
//! replaces one not yet written, and each admin call waiting on a change hears when it is
//! written (a replaced change's call hears it never will be).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::{oneshot, Notify};

use super::Change;

/// What a held change is about: a later change with the same subject replaces it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Subject {
    Drain(String),
    Replica(String),
}

impl Change {
    /// The subject of a change that is held until written (drains, replicas); None for pins
    /// and prefilled prompts, which may be dropped.
    pub(crate) fn subject(&self) -> Option<Subject> {
        match self {
            Change::Drain { replica, .. } => Some(Subject::Drain(replica.to_string())),
            Change::Replica { id, .. } => Some(Subject::Replica(id.clone())),
            Change::Pin { .. } | Change::Prefilled { .. } => None,
        }
    }
}

/// A held change, with the admin calls waiting for it.
struct Entry {
    seq: u64,
    change: Change,
    acks: Vec<oneshot::Sender<()>>,
}

#[derive(Default)]
pub(crate) struct Held {
    entries: Mutex<Vec<Entry>>,
    seq: AtomicU64,
    /// Signalled when a change is held: the sync task writes it at once.
    pub(crate) wake: Notify,
}

impl Held {
    /// Holds `change` (replacing a held one of the same subject) and wakes the writer; the
    /// receiver hears when it is written.
    pub(super) fn hold(&self, change: Change) -> oneshot::Receiver<()> {
        let (ack, written) = oneshot::channel();
        let subject = change.subject();
        if let Ok(mut held) = self.entries.lock() {
            held.retain(|h| h.change.subject() != subject);
            held.push(Entry {
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                change,
                acks: vec![ack],
            });
        }
        self.wake.notify_one();
        written
    }

    /// The changes held, oldest first, each with its sequence number.
    pub(crate) fn all(&self) -> Vec<(u64, Change)> {
        self.entries.lock().map_or_else(
            |_| Vec::new(),
            |h| h.iter().map(|h| (h.seq, h.change.clone())).collect(),
        )
    }

    /// These held changes were written: they are let go, and their admin calls told.
    pub(crate) fn written(&self, seqs: &[u64]) {
        let mut acks = Vec::new();
        if let Ok(mut held) = self.entries.lock() {
            held.retain_mut(|h| {
                let done = seqs.contains(&h.seq);
                if done {
                    acks.append(&mut h.acks);
                }
                !done
            });
        }
        for a in acks {
            let _ = a.send(());
        }
    }

    /// Whether a change of `subject` made here is held, not yet written.
    pub(crate) fn holds(&self, subject: &Subject) -> bool {
        self.entries.lock().is_ok_and(|h| {
            h.iter()
                .any(|h| h.change.subject().as_ref() == Some(subject))
        })
    }
}
