//! Keeps the affinity table across a binary upgrade (or a restart).
//!
//! Each process writes its table to `state_file` every couple of seconds when it changed, and
//! once more when it shuts down; each process reads the file at start and merges what another
//! process wrote while it runs. During a graceful upgrade the new process therefore learns the
//! old one's pins, including those the old one made in its last seconds, and conversations stay
//! on their warm replicas. A merge never overrides a pin the reading process made itself.
//!
//! Not a database: losing the file costs each conversation one cold prefill, nothing more.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::{Deserialize, Serialize};

use crate::affinity::AffinityTable;
use crate::registry::Registry;

#[derive(Serialize, Deserialize)]
struct Snapshot {
    /// The writer, so a process does not merge its own snapshot.
    pid: u32,
    /// (hash of a served message list, replica id), least recently used first.
    entries: Vec<(u64, String)>,
}

pub struct StateKeeper {
    pub affinity: Arc<AffinityTable>,
    pub registry: Arc<Registry>,
    pub path: PathBuf,
    pub interval: Duration,
    /// Set when the process starts handing over: save at once, the new process is waiting.
    pub leaving: Arc<AtomicBool>,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl StateKeeper {
    /// Merges the file if another process wrote it; returns how many pins were learnt.
    pub fn load(&self) -> usize {
        let Ok(bytes) = std::fs::read(&self.path) else {
            return 0;
        };
        let snapshot: Snapshot = match serde_json::from_slice(&bytes) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("ignoring state file {}: {e}", self.path.display());
                return 0;
            }
        };
        if snapshot.pid == std::process::id() {
            return 0;
        }
        let entries = snapshot.entries.iter().map(|(h, id)| (*h, id.as_str()));
        self.affinity
            .merge(entries, |id| self.registry.get(id).map(|r| r.id.clone()))
    }

    /// Writes the table atomically (a reader never sees half a file).
    pub fn save(&self) -> std::io::Result<()> {
        let snapshot = Snapshot {
            pid: std::process::id(),
            entries: self
                .affinity
                .snapshot()
                .into_iter()
                .map(|(h, id)| (h, id.to_string()))
                .collect(),
        };
        let tmp = self
            .path
            .with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(&snapshot)?)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[async_trait]
impl BackgroundService for StateKeeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut seen = modified(&self.path);
        let mut saved_generation = self.affinity.generation();
        let mut tick = tokio::time::interval(self.interval.min(Duration::from_millis(500)));
        let mut last_save = tokio::time::Instant::now();
        let mut handed_over = false;
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tick.tick() => {}
            }
            let now_modified = modified(&self.path);
            if now_modified.is_some() && now_modified != seen {
                seen = now_modified;
                let learnt = self.load();
                if learnt > 0 {
                    log::info!("learnt {learnt} affinity pins from {}", self.path.display());
                }
            }
            let generation = self.affinity.generation();
            let handing_over = self.leaving.load(Ordering::Relaxed) && !handed_over;
            handed_over |= handing_over;
            if generation != saved_generation
                && (last_save.elapsed() >= self.interval || handing_over)
            {
                match self.save() {
                    Ok(()) => {
                        saved_generation = generation;
                        seen = modified(&self.path);
                    }
                    Err(e) => log::warn!("cannot write {}: {e}", self.path.display()),
                }
                last_save = tokio::time::Instant::now();
            }
        }
        // Shutting down (an upgrade hands over to a new process, or a stop): leave the pins.
        match self.save() {
            Ok(()) => log::info!("affinity table saved to {}", self.path.display()),
            Err(e) => log::warn!("cannot write {}: {e}", self.path.display()),
        }
    }
}
