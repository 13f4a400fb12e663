//! The configured replicas, and the policy's view of them.
//!
//! It holds replicas and answers questions about the set (which may serve a model, what the
//! policy may choose from); each replica keeps its own state (`replica.rs`), and what the
//! replicas served lives in the affinity table (`affinity.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::api::prompt::Link;
use crate::config::{ReplicaConf, UpstreamConf};
use crate::replica::Replica;
use crate::routing::Candidate;

pub struct Registry {
    list: Vec<Arc<Replica>>,
    /// Breaks ties and drives round-robin.
    counter: AtomicU64,
}

impl Registry {
    pub fn new(confs: &[ReplicaConf], upstream: &UpstreamConf) -> Registry {
        Registry {
            list: confs
                .iter()
                .map(|c| Arc::new(Replica::new(c, upstream)))
                .collect(),
            counter: AtomicU64::new(0),
        }
    }

    pub fn all(&self) -> &[Arc<Replica>] {
        &self.list
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Replica>> {
        self.list.iter().find(|r| &*r.id == id)
    }

    /// The policy's view of the pool serving `model`; `tried` replicas are not available to
    /// this request again. Each candidate carries its replica as the handle the decision
    /// hands back. With the prompt's `links`, each says how much of it the replica likely
    /// holds (its prefix index); without, nothing is looked up.
    pub fn candidates<'a>(
        &'a self,
        tried: &[Arc<Replica>],
        model: Option<&str>,
        links: &[Link],
    ) -> Vec<Candidate<'a, &'a Arc<Replica>>> {
        self.list
            .iter()
            .filter(|r| model.is_none_or(|m| r.serves(m)))
            .map(|r| {
                let fresh = !tried.iter().any(|t| Arc::ptr_eq(t, r));
                Candidate {
                    handle: r,
                    id: &r.id,
                    available: fresh && r.is_live(),
                    reachable: fresh && r.is_reachable(),
                    in_flight: r.in_flight(),
                    cached_tokens: if links.is_empty() {
                        0
                    } else {
                        r.index.cached_tokens(links)
                    },
                    queued_tokens: r.queued_tokens(),
                    running: r.running(),
                }
            })
            .collect()
    }

    /// The replicas that can serve what they hold (drained or not).
    pub fn reachable(&self) -> Vec<Arc<Replica>> {
        self.list
            .iter()
            .filter(|r| r.is_reachable())
            .cloned()
            .collect()
    }

    /// Whether any replica may serve `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.list.iter().any(|r| r.serves(model))
    }

    /// Every model some replica serves, sorted, each once.
    pub fn all_models(&self) -> Vec<String> {
        let mut all: Vec<String> = self.list.iter().flat_map(|r| r.models().to_vec()).collect();
        all.sort();
        all.dedup();
        all
    }

    pub fn tick(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }
}
