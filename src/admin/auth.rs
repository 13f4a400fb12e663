//! Who may use the admin listener: the bearer tokens of `inferlb.admin`, kept in memory and read
//! again when their files change (a Kubernetes Secret mounted as a file is replaced in place),
//! like the TLS certificate. A bad or empty read keeps the token in use and logs an error.
//!
//! Not here: which paths exist (`admin`), what a token may look like (`config::read_token`).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::conf::{read_token, AdminConf, Token, TokenSource};

/// One token: the one in use, and where it comes from.
pub struct Gate {
    /// `None`: no token is configured, and this gate is open.
    token: Option<(TokenSource, ArcSwap<Token>)>,
}

impl Gate {
    fn new(conf: &Option<(TokenSource, Token)>) -> Gate {
        Gate {
            token: conf
                .as_ref()
                .map(|(s, t)| (s.clone(), ArcSwap::from_pointee(t.clone()))),
        }
    }

    fn is_open(&self) -> bool {
        self.token.is_none()
    }

    fn matches(&self, presented: &[u8]) -> bool {
        self.token
            .as_ref()
            .is_some_and(|(_, t)| t.load().matches(presented))
    }

    /// Reads a token file again: `Ok(true)` when it changed (and is now in use).
    fn reload(&self) -> Result<bool, String> {
        let Some((source @ TokenSource::File { .. }, current)) = &self.token else {
            return Ok(false);
        };
        let fresh = read_token(source)?;
        if **current.load() == fresh {
            return Ok(false);
        }
        current.store(Arc::new(fresh));
        Ok(true)
    }
}

/// The token of `Authorization: Bearer <token>` (the scheme in any case).
pub fn bearer(authorization: &[u8]) -> Option<&[u8]> {
    let text = authorization.trim_ascii();
    let (scheme, rest) = text.split_at(text.iter().position(|b| *b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then_some(rest.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// The admin listener's two gates.
pub struct Auth {
    admin: Gate,
    metrics: Gate,
}

/// The paths scrapers and probes read: behind `metrics_token_file`, not the admin token alone.
pub fn is_probe_path(path: &str) -> bool {
    matches!(path, "/metrics" | "/ready")
}

impl Auth {
    pub fn new(conf: &AdminConf) -> Auth {
        Auth {
            admin: Gate::new(&conf.token),
            metrics: Gate::new(&conf.metrics_token),
        }
    }

    /// Whether a request for `path` with this `Authorization` header value may go on. The admin
    /// token opens every path; the metrics token only `/metrics` and `/ready`.
    pub fn admits(&self, path: &str, authorization: Option<&[u8]>) -> bool {
        let gate = if is_probe_path(path) {
            &self.metrics
        } else {
            &self.admin
        };
        if gate.is_open() {
            return true;
        }
        let Some(token) = authorization.and_then(bearer) else {
            return false;
        };
        // Both compared, whichever matches: the time taken says nothing about which.
        let admin = self.admin.matches(token);
        let metrics = is_probe_path(path) && self.metrics.matches(token);
        admin | metrics
    }

    fn reload(&self) -> Vec<(String, Result<bool, String>)> {
        [&self.admin, &self.metrics]
            .into_iter()
            .filter_map(|g| g.token.as_ref().map(|(s, _)| (s.to_string(), g.reload())))
            .collect()
    }

    /// Whether any token comes from a file (and so needs [`TokenReloader`]).
    pub fn has_files(&self) -> bool {
        [&self.admin, &self.metrics]
            .iter()
            .any(|g| matches!(g.token, Some((TokenSource::File { .. }, _))))
    }
}

/// Reads the token files again on an interval; a changed, valid token replaces the one in use.
pub struct TokenReloader {
    pub auth: Arc<Auth>,
    pub interval: Duration,
}

#[async_trait]
impl BackgroundService for TokenReloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // Logged once per problem, not on every tick while it lasts.
        let mut failing: Vec<String> = vec![];
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            let auth = self.auth.clone();
            let outcomes = match tokio::task::spawn_blocking(move || auth.reload()).await {
                Ok(o) => o,
                Err(e) => {
                    log::error!("admin token reload task failed: {e}");
                    continue;
                }
            };
            for (source, outcome) in outcomes {
                match outcome {
                    Ok(changed) => {
                        failing.retain(|f| *f != source);
                        if changed {
                            log::warn!("admin: token reloaded from {source}");
                        }
                    }
                    Err(e) => {
                        if !failing.contains(&source) {
                            log::error!("admin: token not reloaded, the one in use stays: {e}");
                            failing.push(source);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_token_is_read_from_the_header() {
        let cases: &[(&str, Option<&str>)] = &[
            ("Bearer abc", Some("abc")),
            ("bearer abc", Some("abc")),
            ("BEARER   abc  ", Some("abc")),
            ("Bearer", None),
            ("Bearer ", None),
            ("Basic abc", None),
            ("abc", None),
            ("", None),
            ("Bearerabc", None),
        ];
        for (header, want) in cases {
            let got = bearer(header.as_bytes()).map(|t| String::from_utf8_lossy(t).into_owned());
            assert_eq!(got.as_deref(), *want, "{header:?}");
        }
    }

    fn token_file(dir: &std::path::Path, name: &str, text: &str) -> TokenSource {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write token");
        TokenSource::File {
            key: "token_file",
            path,
        }
    }

    #[test]
    fn each_path_needs_its_token() {
        let dir = tempfile::tempdir().expect("tempdir");
        let admin = token_file(dir.path(), "admin", "admin-token-0123456789\n");
        let metrics = token_file(dir.path(), "metrics", "metrics-token-0123456789");
        let conf = |a: bool, m: bool| AdminConf {
            token: a.then(|| (admin.clone(), read_token(&admin).expect("token"))),
            metrics_token: m.then(|| (metrics.clone(), read_token(&metrics).expect("token"))),
            ..AdminConf::default()
        };
        let a = Some(&b"Bearer admin-token-0123456789"[..]);
        let m = Some(&b"Bearer metrics-token-0123456789"[..]);
        let wrong = Some(&b"Bearer admin-token-012345678"[..]);
        // (admin token set, metrics token set, path, header, admitted)
        let cases = [
            (false, false, "/admin/replicas", None, true),
            (false, false, "/metrics", None, true),
            (true, false, "/admin/replicas", None, false),
            (true, false, "/admin/replicas", wrong, false),
            (true, false, "/admin/replicas", a, true),
            (true, false, "/nowhere", None, false),
            (true, false, "/metrics", None, true),
            (true, false, "/ready", None, true),
            (true, true, "/metrics", None, false),
            (true, true, "/metrics", m, true),
            (true, true, "/ready", a, true),
            (true, true, "/ready", wrong, false),
            (true, true, "/admin/replicas", m, false),
            (false, true, "/admin/replicas", None, true),
            (false, true, "/metrics", None, false),
        ];
        for (has_admin, has_metrics, path, header, want) in cases {
            let auth = Auth::new(&conf(has_admin, has_metrics));
            assert_eq!(
                auth.admits(path, header),
                want,
                "admin {has_admin}, metrics {has_metrics}, {path} {header:?}"
            );
        }
    }

    #[test]
    fn a_rewritten_file_replaces_the_token_and_a_bad_one_keeps_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = token_file(dir.path(), "admin", "first-token-0123456789");
        let auth = Auth::new(&AdminConf {
            token: Some((source.clone(), read_token(&source).expect("token"))),
            ..AdminConf::default()
        });
        let first = Some(&b"Bearer first-token-0123456789"[..]);
        let second = Some(&b"Bearer second-token-0123456789"[..]);
        assert_eq!(auth.reload()[0].1, Ok(false), "unchanged");
        token_file(dir.path(), "admin", "second-token-0123456789\n");
        assert_eq!(auth.reload()[0].1, Ok(true));
        assert!(auth.admits("/admin/replicas", second));
        assert!(!auth.admits("/admin/replicas", first));
        for bad in ["", "  \n", "short"] {
            token_file(dir.path(), "admin", bad);
            assert!(auth.reload()[0].1.is_err(), "{bad:?}");
            assert!(auth.admits("/admin/replicas", second), "kept after {bad:?}");
        }
        std::fs::remove_file(dir.path().join("admin")).expect("rm");
        assert!(auth.reload()[0].1.is_err());
        assert!(auth.admits("/admin/replicas", second), "kept while missing");
    }
}
