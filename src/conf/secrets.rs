//! Secrets kept out of the conf: a value read from a file or an environment variable
//! ([`Secret`]), and what reads every file-backed secret again (the client keys of
//! [`super::keys`] among them). None ever prints its value (Debug says where it comes from),
//! so a secret cannot reach a log through a `{:?}`.
//!
//! A file is read again when it changes ([`SecretsReloader`] polls every file-backed secret
//! alive, like the TLS certificate reloader): a rotated Kubernetes Secret takes effect without a
//! restart. A file that cannot be read, or reads as nothing usable, keeps the value in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

/// A string never printed: a key written in the conf, as deserialised.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Redacted(pub String);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// What a secret written in the conf serialises as (`serialize_with` on a raw conf field): the
/// marker its `Debug` shows, never a byte of it.
pub(crate) fn redact<T: ?Sized, S: serde::Serializer>(_: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("<redacted>")
}

/// As [`redact`], for a list of secrets: one marker per entry, so an empty list stays `[]`.
pub(crate) fn redact_each<S: serde::Serializer>(v: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|_| "<redacted>"))
}

#[derive(Clone, PartialEq, Eq)]
enum Source {
    File(PathBuf),
    Env(String),
    Conf,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(n) => write!(f, "environment variable {n}"),
            Source::Conf => f.write_str("the conf"),
        }
    }
}

/// One secret value (a token, a password): from a file (surrounding whitespace trimmed, so a
/// trailing newline is not part of it), an environment variable, or, for compatibility, the
/// conf itself. Never empty.
pub struct Secret {
    source: Source,
    value: ArcSwap<String>,
    /// The file's bytes last read, to notice a change whatever the mtime says (Kubernetes swaps
    /// a Secret's files by renaming a symlinked directory).
    loaded: Mutex<Vec<u8>>,
}

impl Secret {
    /// Reads `path` now; it is read again when it changes (see [`SecretsReloader`]).
    pub fn from_file(path: impl Into<PathBuf>) -> Result<Arc<Secret>, String> {
        let path = path.into();
        let bytes = read(&path)?;
        let value = one_value(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let s = Arc::new(Secret {
            source: Source::File(path),
            value: ArcSwap::from_pointee(value),
            loaded: Mutex::new(bytes),
        });
        watch(Arc::downgrade(&s) as Weak<dyn Watched>);
        Ok(s)
    }

    /// Reads the variable `name` of this process's environment, once.
    pub fn from_env(name: &str) -> Result<Arc<Secret>, String> {
        let value = std::env::var(name)
            .map_err(|e| format!("environment variable {name}: {e}"))
            .and_then(|v| {
                one_value(v.as_bytes()).map_err(|e| format!("environment variable {name}: {e}"))
            })?;
        Ok(Arc::new(Secret {
            source: Source::Env(name.to_string()),
            value: ArcSwap::from_pointee(value),
            loaded: Mutex::new(vec![]),
        }))
    }

    /// A value written in the conf (kept for compatibility; `Config::warnings` says so).
    pub fn literal(value: &str) -> Arc<Secret> {
        Arc::new(Secret {
            source: Source::Conf,
            value: ArcSwap::from_pointee(value.to_string()),
            loaded: Mutex::new(vec![]),
        })
    }

    /// The value in use now.
    pub fn current(&self) -> Arc<String> {
        self.value.load_full()
    }

    /// Where it comes from, for messages: `file /run/x`, `environment variable X`, `the conf`.
    pub fn source(&self) -> String {
        self.source.to_string()
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.source == other.source
            && (self.source != Source::Conf || self.current() == other.current())
    }
}
impl Eq for Secret {}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({})", self.source)
    }
}

impl Watched for Secret {
    fn reload(&self) -> Result<bool, String> {
        let Source::File(path) = &self.source else {
            return Ok(false);
        };
        let bytes = read(path)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if *loaded == bytes {
            return Ok(false);
        }
        let value = one_value(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        self.value.store(Arc::new(value));
        *loaded = bytes;
        Ok(true)
    }

    fn name(&self) -> String {
        self.source()
    }
}

pub(super) fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// A single secret's text: trimmed, non-empty, one line of visible characters. The messages
/// never quote the value.
fn one_value(bytes: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())?;
    let v = text.trim();
    if v.is_empty() {
        return Err("empty".into());
    }
    if v.chars().any(|c| c.is_control()) {
        return Err("more than one line, or control characters".into());
    }
    Ok(v.to_string())
}

/// Something read from a file that may change.
pub(super) trait Watched: Send + Sync {
    /// Reads it again: whether it changed; an error keeps what is in use.
    fn reload(&self) -> Result<bool, String>;
    /// What it is, for the log (never its value).
    fn name(&self) -> String;
}

/// Every file-backed secret alive: each registers itself when made, and is forgotten once
/// dropped (a replica removed takes its key with it).
static WATCHED: LazyLock<Mutex<Vec<Weak<dyn Watched>>>> = LazyLock::new(Default::default);

pub(super) fn watch(w: Weak<dyn Watched>) {
    WATCHED.lock().unwrap_or_else(|e| e.into_inner()).push(w);
}

/// Reads every file-backed secret again: what changed, and what could not be read (by name).
pub fn reload_all() -> (Vec<String>, Vec<(String, String)>) {
    let alive: Vec<Arc<dyn Watched>> = {
        let mut all = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    };
    let (mut changed, mut failed) = (vec![], vec![]);
    for w in alive {
        match w.reload() {
            Ok(true) => changed.push(w.name()),
            Ok(false) => {}
            Err(e) => failed.push((w.name(), e)),
        }
    }
    (changed, failed)
}

/// Polls the secret files every `interval` and swaps in what changed.
pub struct SecretsReloader {
    pub interval: Duration,
}

#[async_trait]
impl BackgroundService for SecretsReloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // Logged once per state, not on every tick of a lasting problem.
        let mut failing: Vec<String> = vec![];
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            let Ok((changed, failed)) = tokio::task::spawn_blocking(reload_all).await else {
                continue;
            };
            let m = &crate::telemetry::metrics::METRICS.secret_reloads;
            for name in changed {
                m.with_label_values(&["changed"]).inc();
                log::warn!("secret reloaded from {name}");
            }
            let now: Vec<String> = failed.iter().map(|(n, _)| n.clone()).collect();
            for (name, e) in &failed {
                m.with_label_values(&["failed"]).inc();
                if !failing.contains(name) {
                    log::error!("secret not reloaded, the one in use is kept: {e}");
                }
            }
            failing = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_is_trimmed_and_never_empty() {
        assert_eq!(one_value(b"  s3cret-value\n").unwrap(), "s3cret-value");
        for bad in [&b""[..], b" \n", b"two\nlines", b"\xff"] {
            assert!(one_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_bad_one_keeps_the_old_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first-secret\n").unwrap();
        let s = Secret::from_file(&path).unwrap();
        assert_eq!(*s.current(), "first-secret");
        assert_eq!(s.reload(), Ok(false));
        std::fs::write(&path, "second-secret").unwrap();
        assert_eq!(s.reload(), Ok(true));
        assert_eq!(*s.current(), "second-secret");
        std::fs::write(&path, "\n").unwrap();
        assert!(s.reload().is_err());
        assert_eq!(*s.current(), "second-secret");
        std::fs::remove_file(&path).unwrap();
        assert!(s.reload().is_err());
        assert_eq!(*s.current(), "second-secret");
        assert!(!format!("{s:?}").contains("second-secret"));
    }
}
