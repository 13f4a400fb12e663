//! Pools and roles. A model's replicas form its pool; in a disaggregated pool some replicas
//! prefill and hand the KV to others that decode (the roles are the conf's,
//! [`crate::conf::Role`]).

pub use crate::conf::{Protocol, Role};

/// A part of a request: served whole, or one leg of a handover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// Served whole, by a pool whose handovers speak this protocol.
    Whole(Protocol),
    Prefill,
    Decode,
}

impl Leg {
    /// Whether a replica of `role` takes this part.
    pub fn takes(self, role: Role) -> bool {
        match self {
            Leg::Whole(protocol) => role.serves_whole_by(protocol),
            Leg::Prefill => role.prefills(),
            Leg::Decode => role.decodes(),
        }
    }
}
