//! `pd:`, prefill/decode disaggregation: which handover protocol the pools speak, and when a
//! turn is served whole on its decode replica instead of going through the prefill pool.
//! Replicas take their part with `replicas[].role`; a model whose replicas include both
//! prefill and decode roles is served disaggregated.

use serde::{Deserialize, Serialize};

/// A replica's part in its pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// No KV connector: it prefills and decodes its own requests; never sent handover fields
    /// (vLLM ignores `kv_transfer_params` without a connector).
    #[default]
    Plain,
    /// Computes prompts' KV for decode replicas to pull.
    Prefill,
    /// Pulls the KV a prefill replica computed, then generates; serves a request whole too.
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

    pub fn is_plain(&self) -> bool {
        *self == Role::Plain
    }

    /// Whether it may serve a request whole, prompt and answer, with no handover. A prefill
    /// replica may not: the prefill pool is kept for prompts.
    pub fn serves_whole(self) -> bool {
        !matches!(self, Role::Prefill)
    }

    /// Whether it may serve a request whole under `protocol`: under SGLang's, only a replica
    /// with no connector or a `both` one; an SGLang server in a disaggregation mode refuses a
    /// request without a bootstrap room ("Disaggregated request received without bootstrap
    /// room id").
    pub fn serves_whole_by(self, protocol: Protocol) -> bool {
        match protocol {
            Protocol::Vllm => self.serves_whole(),
            Protocol::Sglang => matches!(self, Role::Plain | Role::Both),
        }
    }

    /// Whether it takes a handover's first leg.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether it takes a handover's second leg.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// How a prefill replica hands its KV to a decode replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// vLLM's NixlConnector: the prefill answers with `kv_transfer_params`, which go into the
    /// decode request; the decode replica pulls the blocks.
    #[default]
    Vllm,
    /// SGLang's bootstrap: both legs at once, meeting in a `bootstrap_room` on the prefill
    /// server's bootstrap port.
    Sglang,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

/// `pd:` as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPd {
    protocol: Protocol,
    local_prefill_tokens: u64,
    /// Unset: [`DEFAULT_LOCAL_PREFILL_IDLE_TOKENS`], or 0 where `local_prefill_tokens` is 0
    /// (which said "always through the prefill pool" before this key existed).
    local_prefill_idle_tokens: Option<u64>,
    warm_prefill: bool,
    prefill_timeout_seconds: f64,
}

/// Tokens below which a turn's uncached part is prefilled on its decode replica (`pd-local`)
/// rather than sent through the prefill pool (see docs/routing.md for the measurement).
pub const DEFAULT_LOCAL_PREFILL_TOKENS: u64 = 1024;

/// Tokens below which a turn's uncached part is prefilled on a decode replica that runs
/// nothing: one engine step at vLLM's default budget on a large GPU (`max_num_batched_tokens`
/// 8192), so a handover arriving meanwhile waits at most a step (docs/pd.md).
pub const DEFAULT_LOCAL_PREFILL_IDLE_TOKENS: u64 = 8192;

impl Default for RawPd {
    fn default() -> Self {
        RawPd {
            protocol: Protocol::Vllm,
            local_prefill_tokens: DEFAULT_LOCAL_PREFILL_TOKENS,
            local_prefill_idle_tokens: None,
            warm_prefill: false,
            prefill_timeout_seconds: 600.0,
        }
    }
}

/// The disaggregation settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct PdConf {
    pub protocol: Protocol,
    /// A turn whose prompt its decode replica lacks fewer tokens of than this is served whole
    /// there: no prefill hop, no KV moved.
    pub local_prefill_tokens: u64,
    /// The same where the decode replica runs nothing (no stream there to stall); a value
    /// below `local_prefill_tokens` has no effect (`routing::pd::path` takes the larger).
    pub local_prefill_idle_tokens: u64,
    /// A turn served whole on its decode replica is prefilled again on an idle prefill
    /// replica, off the client's path (`routing::pd::warm_prefill`), under vLLM's protocol.
    /// Off by default: measured, it lowers the agent loop's TTFT p90 but not to the peers',
    /// and runs with it lost more requests to ITL than runs without (docs/pd.md).
    pub warm_prefill: bool,
    /// The prefill leg's whole exchange must end within this.
    pub prefill_timeout: std::time::Duration,
}

impl Default for PdConf {
    fn default() -> Self {
        validate(RawPd::default()).expect("the defaults are valid")
    }
}

pub fn validate(raw: RawPd) -> Result<PdConf, String> {
    let idle_tokens = raw
        .local_prefill_idle_tokens
        .unwrap_or(if raw.local_prefill_tokens == 0 {
            0
        } else {
            DEFAULT_LOCAL_PREFILL_IDLE_TOKENS
        });
    for (key, tokens) in [
        ("local_prefill_tokens", raw.local_prefill_tokens),
        ("local_prefill_idle_tokens", idle_tokens),
    ] {
        if tokens > 10_000_000 {
            return Err(format!(
                "inferlb.pd.{key}: {tokens} is more than a prompt (at most 10,000,000)"
            ));
        }
    }
    let t = raw.prefill_timeout_seconds;
    if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
        return Err(format!(
            "inferlb.pd.prefill_timeout_seconds: {t} must be more than 0 and at most a day"
        ));
    }
    Ok(PdConf {
        protocol: raw.protocol,
        local_prefill_tokens: raw.local_prefill_tokens,
        local_prefill_idle_tokens: idle_tokens,
        warm_prefill: raw.warm_prefill,
        prefill_timeout: std::time::Duration::from_secs_f64(t),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_say_which_legs_they_take() {
        // (role, whole, prefills, decodes)
        let rows = [
            (Role::Plain, true, false, false),
            (Role::Prefill, false, true, false),
            (Role::Decode, true, false, true),
            (Role::Both, true, true, true),
        ];
        for (role, whole, prefills, decodes) in rows {
            assert_eq!(
                (role.serves_whole(), role.prefills(), role.decodes()),
                (whole, prefills, decodes),
                "{role:?}"
            );
        }
    }

    #[test]
    fn bounds_are_checked() {
        let raw = |tokens, secs| RawPd {
            protocol: Protocol::Vllm,
            local_prefill_tokens: tokens,
            local_prefill_idle_tokens: Some(tokens),
            prefill_timeout_seconds: secs,
            ..RawPd::default()
        };
        assert!(validate(raw(0, 1.0)).is_ok());
        assert!(validate(raw(20_000_000, 1.0))
            .unwrap_err()
            .contains("local_prefill_tokens"));
        let idle = RawPd {
            local_prefill_idle_tokens: Some(20_000_000),
            ..RawPd::default()
        };
        assert!(validate(idle)
            .unwrap_err()
            .contains("local_prefill_idle_tokens"));
        for bad in [0.0, -1.0, f64::NAN, 1e9] {
            assert!(validate(raw(1, bad))
                .unwrap_err()
                .contains("prefill_timeout_seconds"));
        }
    }

    /// Unset, the idle bound is 8192, or 0 where `local_prefill_tokens: 0` turned the local
    /// path off (as it did before the idle bound); set, it is what it says.
    #[test]
    fn the_idle_bound_defaults_to_off_where_local_prefill_is() {
        let with = |tokens, idle| {
            validate(RawPd {
                local_prefill_tokens: tokens,
                local_prefill_idle_tokens: idle,
                ..RawPd::default()
            })
            .unwrap()
            .local_prefill_idle_tokens
        };
        assert_eq!(with(1024, None), 8192);
        assert_eq!(with(0, None), 0);
        assert_eq!(with(0, Some(4096)), 4096);
        assert_eq!(with(512, Some(0)), 0);
    }
}
