//! `inferlb.admin`: who may use the admin listener (a bearer token read from a file or the
//! environment, never written in the conf: there is no `token` key) and where replicas may be
//! (`allowed_networks`, judged by [`crate::conf::netpolicy`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::conf::netpolicy::Networks;

/// The section as written; see the README for each key.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawAdmin {
    token_file: Option<PathBuf>,
    token_env: Option<String>,
    metrics_token_file: Option<PathBuf>,
    allowed_networks: Option<Vec<String>>,
    reload_interval_seconds: f64,
}

impl Default for RawAdmin {
    fn default() -> Self {
        RawAdmin {
            token_file: None,
            token_env: None,
            metrics_token_file: None,
            allowed_networks: None,
            reload_interval_seconds: 5.0,
        }
    }
}

/// Where a token comes from; a file is read again when it changes, the environment once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    File { key: &'static str, path: PathBuf },
    Env { key: &'static str, var: String },
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::File { key, path } => write!(f, "inferlb.admin.{key} {}", path.display()),
            TokenSource::Env { key, var } => write!(f, "inferlb.admin.{key} ${var}"),
        }
    }
}

/// A bearer token. Its `Debug` shows no byte of it, so a `Config` can be logged whole.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        self.0.as_bytes().ct_eq(presented).into()
    }
}

/// A token's shortest length: a guessable token is no lock.
pub const MIN_TOKEN_LEN: usize = 16;

/// Reads the token `source` names: surrounding whitespace (a file's final newline) is dropped;
/// what is left must be at least [`MIN_TOKEN_LEN`] visible ASCII characters.
pub fn read_token(source: &TokenSource) -> Result<Token, String> {
    let text = match source {
        TokenSource::File { path, .. } => {
            std::fs::read_to_string(path).map_err(|e| format!("{source}: cannot read it: {e}"))?
        }
        TokenSource::Env { var, .. } => std::env::var(var).map_err(|e| format!("{source}: {e}"))?,
    };
    let token = text.trim();
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!(
            "{source}: the token must be at least {MIN_TOKEN_LEN} characters, it has {}",
            token.len()
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{source}: the token must be visible ASCII, without spaces"
        ));
    }
    Ok(Token(token.into()))
}

/// `inferlb.admin`, validated: each token as read at start, with where to read it again.
#[derive(Debug, Clone)]
pub struct AdminConf {
    /// For `/admin/*`; `None`: open, which only a loopback `admin_listen` allows.
    pub token: Option<(TokenSource, Token)>,
    /// For `/metrics` and `/ready` (the admin token opens them too); `None`: open.
    pub metrics_token: Option<(TokenSource, Token)>,
    /// Where replicas may be.
    pub allowed_networks: Networks,
    /// How often token files are read again.
    pub reload_interval: Duration,
}

impl Default for AdminConf {
    fn default() -> Self {
        AdminConf {
            token: None,
            metrics_token: None,
            allowed_networks: Networks::default(),
            reload_interval: Duration::from_secs(5),
        }
    }
}

fn with_token(source: Option<TokenSource>) -> Result<Option<(TokenSource, Token)>, String> {
    source.map(|s| read_token(&s).map(|t| (s, t))).transpose()
}

/// Validates the section; `admin_listen` is where the admin listener will be.
pub(super) fn validate(raw: RawAdmin, admin_listen: SocketAddr) -> Result<AdminConf, String> {
    let token = match (raw.token_file, raw.token_env) {
        (Some(_), Some(_)) => {
            return Err(
                "inferlb.admin: token_file or token_env, not both (which one would count?)".into(),
            )
        }
        (Some(path), None) => Some(TokenSource::File {
            key: "token_file",
            path,
        }),
        (None, Some(var)) if var.is_empty() || var.contains(['=', '\0']) => {
            return Err(format!(
                "inferlb.admin.token_env: {var:?} is not an environment variable's name"
            ))
        }
        (None, Some(var)) => Some(TokenSource::Env {
            key: "token_env",
            var,
        }),
        (None, None) => None,
    };
    let token = with_token(token)?;
    if token.is_none() && !crate::conf::netpolicy::judged_as(admin_listen.ip()).is_loopback() {
        return Err(format!(
            "inferlb.admin_listen: {admin_listen} is not a loopback address, and the admin API \
             there could add, remove and drain replicas for anyone who reaches it: set \
             inferlb.admin.token_file or inferlb.admin.token_env (a bearer token, read from a \
             file or an environment variable)"
        ));
    }
    let metrics_token = with_token(raw.metrics_token_file.map(|path| TokenSource::File {
        key: "metrics_token_file",
        path,
    }))?;
    let allowed_networks = match raw.allowed_networks {
        None => Networks::default(),
        Some(list) => {
            Networks::parse(&list).map_err(|e| format!("inferlb.admin.allowed_networks{e}"))?
        }
    };
    let r = raw.reload_interval_seconds;
    if !(r.is_finite() && (0.1..=86_400.0).contains(&r)) {
        return Err(format!(
            "inferlb.admin.reload_interval_seconds: {r} must be between 0.1 and 86400"
        ));
    }
    Ok(AdminConf {
        token,
        metrics_token,
        allowed_networks,
        reload_interval: Duration::from_secs_f64(r),
    })
}
