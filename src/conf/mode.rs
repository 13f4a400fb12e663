//! `inferlb.routing`: the name of the policy the balancer runs. The policies themselves live
//! in `crate::routing`, which builds one from this name.

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

impl Mode {
    /// The name the conf and the `ROUTING` variable use.
    pub fn name(self) -> &'static str {
        match self {
            Mode::RoundRobin => "roundrobin",
            Mode::Affinity => "affinity",
            Mode::Adaptive => "adaptive",
            Mode::PrefillCost => "prefill_cost",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            Mode::RoundRobin,
            Mode::Affinity,
            Mode::Adaptive,
            Mode::PrefillCost,
        ]
        .into_iter()
        .find(|m| m.name() == s)
        .ok_or_else(|| {
            format!(
                "unknown routing mode {s:?}: expected roundrobin, affinity, adaptive or prefill_cost"
            )
        })
    }
}
