//! Pools and roles. A model's replicas form its pool; in a disaggregated pool some replicas
//! prefill and hand the KV to others that decode. Today every replica is `plain` and a model
//! has one pool: the replicas that serve it.

/// A replica's part in its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// No KV connector: it prefills and decodes its own requests (every replica today).
    Plain,
    /// Computes prompts' KV for decode replicas to pull.
    Prefill,
    /// Pulls the KV a prefill replica computed, then generates.
    Decode,
    /// Its connector serves either side (vLLM's `kv_both`).
    Both,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Plain => "plain",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// Whether it can serve a request whole, prompt and answer, with no handover.
    pub fn serves_whole(self) -> bool {
        matches!(self, Role::Plain | Role::Both)
    }
}
