//! Keeps the affinity table and the stored-responses table across a binary upgrade (or a
//! restart).
//!
//! Each process writes its table to `state_file` every couple of seconds when it changed, and
//! once more when it shuts down; each process reads the file at start and merges what another
//! process wrote while it runs. During a graceful upgrade the new process therefore learns the
//! old one's pins, including those the old one made in its last seconds, and conversations stay
//! on their warm replicas. A merge never overrides a pin the reading process made itself.
//!
//! A process skips the file it wrote itself (its table holds all of it already; merging it
//! back would only bring back pins it since let go). The writer is named by a nonce drawn
//! once per process, not by its pid: in a container inferlb is PID 1 at every start, and a
//! restarted pod must load what the pod before it left.
//!
//! Not a database: losing the file costs each conversation one cold prefill, nothing more.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::{Deserialize, Serialize};

use crate::fleet::affinity::AffinityTable;
use crate::fleet::poll::plausible_start;
use crate::fleet::registry::Registry;
use crate::protocol::api::prompt::HASH_VERSION;

#[derive(Serialize, Deserialize)]
struct Snapshot {
    /// The prompt hash version of `entries`; files from before versions were written are 1.
    #[serde(default = "first_version")]
    version: u32,
    /// The writer's pid: kept for the older binaries that read it (a downgrade).
    #[serde(default)]
    pid: u32,
    /// The writer's [`process_nonce`], so a process does not merge its own snapshot; absent
    /// in files of older binaries, which are always another process's.
    #[serde(default)]
    writer: Option<u64>,
    /// (hash of a served prompt, replica id), least recently used first.
    entries: Vec<(u64, String)>,
    /// (hash of a stored response id, replica id): ids do not depend on the prompt hash.
    #[serde(default)]
    stored: Vec<(u64, String)>,
    /// (replica id, its latest process start the writer read, Unix ms): a replica that
    /// restarted since lost what the writer's pins to it name. Absent in older files.
    #[serde(default)]
    starts: Vec<(String, u64)>,
}

fn first_version() -> u32 {
    1
}

/// This process's nonce: random (from the kernel), drawn once. Differs between two processes
/// even when they get the same pid, as a container's PID 1 does at every start.
pub fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut bytes = [0u8; 8];
        let random = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
        match random {
            Ok(()) => u64::from_le_bytes(bytes),
            // No /dev/urandom (not Linux): the clock in nanoseconds, the pid and an address
            // of this process's (randomised) stack, hashed.
            Err(_) => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
                h.update(&now.map_or(0, |d| d.as_nanos()).to_le_bytes());
                h.update(&std::process::id().to_le_bytes());
                h.update(&(&bytes as *const _ as usize).to_le_bytes());
                h.digest()
            }
        }
    })
}

pub struct StateKeeper {
    pub affinity: Arc<AffinityTable>,
    pub stored: Arc<AffinityTable>,
    pub registry: Arc<Registry>,
    pub path: PathBuf,
    pub interval: Duration,
    /// Set when the process starts handing over: save at once, the new process is waiting.
    pub leaving: Arc<AtomicBool>,
    /// A file of another hash version was seen (and logged) already.
    pub other_version_seen: AtomicBool,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl StateKeeper {
    fn generation(&self) -> u64 {
        self.affinity.generation() + self.stored.generation()
    }

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
        if snapshot.writer == Some(process_nonce()) {
            return 0;
        }
        let resolve = |id: &str| self.registry.get(id).map(|r| r.id.clone());
        let stored = snapshot.stored.iter().map(|(h, id)| (*h, id.as_str()));
        let mut learnt = self.stored.merge(stored, resolve);
        let restarted = self.restarted_since(&snapshot.starts);
        if snapshot.version == HASH_VERSION {
            let entries = snapshot
                .entries
                .iter()
                .filter(|(_, id)| !restarted.contains(id.as_str()))
                .map(|(h, id)| (*h, id.as_str()));
            learnt += self.affinity.merge(entries, resolve);
        } else if !self.other_version_seen.swap(true, Ordering::Relaxed) {
            log::warn!(
                "{} holds prompt hashes of version {}, this process uses {HASH_VERSION}: \
                 its affinity pins are not used (each conversation pays one cold prefill)",
                self.path.display(),
                snapshot.version
            );
        }
        learnt
    }

    /// The replicas of `starts` (as a file's writer read them) that this process read a
    /// later start of: restarted since, so the writer's pins to them name a lost cache. A
    /// replica this process has not read yet takes the writer's start as its first, so that
    /// its first read here finds a restart that happened while no process followed it (an
    /// upgrade, or inferlb and the replica restarted together), and drops the pins then.
    /// Stored Responses ids are not concerned: the balancer's store resends their history.
    fn restarted_since<'s>(&self, starts: &'s [(String, u64)]) -> HashSet<&'s str> {
        starts
            .iter()
            .filter(|(id, start)| {
                plausible_start(*start)
                    && self
                        .registry
                        .get(id)
                        .is_some_and(|r| !r.seed_start(*start) && r.started_ms() > *start)
            })
            .map(|(id, _)| id.as_str())
            .collect()
    }

    /// Writes the table atomically (a reader never sees half a file).
    pub fn save(&self) -> std::io::Result<()> {
        let owned = |entries: Vec<(u64, Arc<str>)>| {
            entries
                .into_iter()
                .map(|(h, id)| (h, id.to_string()))
                .collect()
        };
        // The starts before the pins: a restart read in between is saved with the pins made
        // since (the next process drops them, one cold turn each), not old pins beside the new
        // start (the next process would keep them).
        let starts = self
            .registry
            .all()
            .iter()
            .map(|r| (r.id.to_string(), r.started_ms()))
            .filter(|(_, start)| *start > 0)
            .collect();
        let snapshot = Snapshot {
            version: HASH_VERSION,
            pid: std::process::id(),
            writer: Some(process_nonce()),
            entries: owned(self.affinity.snapshot()),
            stored: owned(self.stored.snapshot()),
            starts,
        };
        let tmp = self
            .path
            .with_extension(format!("tmp.{:016x}", process_nonce()));
        std::fs::write(&tmp, serde_json::to_vec(&snapshot)?)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[async_trait]
impl BackgroundService for StateKeeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut seen = modified(&self.path);
        let mut saved_generation = self.generation();
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
            let generation = self.generation();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conf::{ReplicaConf, UpstreamConf};

    fn keeper(path: PathBuf) -> StateKeeper {
        let conf = ReplicaConf {
            id: "gpu0".into(),
            address: "127.0.0.1:1".into(),
            api_key: None,
            models: vec![],
            socket: "127.0.0.1:1".parse().ok(),
            cache_tokens: None,
            discover: None,
            sni: None,
            tls: false,
            ..ReplicaConf::default()
        };
        let t = Duration::from_secs(1);
        let upstream = UpstreamConf {
            connect_timeout: t,
            read_timeout: t,
            write_timeout: t,
            idle_timeout: t,
            tls: Default::default(),
        };
        StateKeeper {
            affinity: Arc::new(AffinityTable::new(100, None)),
            stored: Arc::new(AffinityTable::new(100, None)),
            registry: Arc::new(Registry::new(&[conf], &upstream)),
            path,
            interval: t,
            leaving: Arc::new(AtomicBool::new(false)),
            other_version_seen: AtomicBool::new(false),
        }
    }

    fn write(path: &Path, version: Option<u32>) {
        let mut v = serde_json::json!({
            "pid": 1,
            "entries": [[7, "gpu0"], [8, "gone"]],
            "stored": [[9, "gpu0"]],
        });
        if let Some(version) = version {
            v["version"] = version.into();
        }
        std::fs::write(path, v.to_string()).expect("write");
    }

    #[test]
    fn pins_of_this_hash_version_are_merged_and_unknown_replicas_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        write(&path, Some(HASH_VERSION));
        let k = keeper(path);
        assert_eq!(k.load(), 2, "one pin and one stored id");
        assert_eq!(k.affinity.served_by(7).as_deref(), Some("gpu0"));
        assert_eq!(k.affinity.served_by(8), None);
        assert_eq!(k.stored.served_by(9).as_deref(), Some("gpu0"));
    }

    #[test]
    fn another_versions_pins_are_not_used_but_stored_ids_are() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        // A file from before versions were written: version 1.
        write(&path, None);
        let k = keeper(path.clone());
        assert_eq!(k.load(), 1);
        assert!(k.affinity.is_empty());
        assert_eq!(k.stored.served_by(9).as_deref(), Some("gpu0"));
        assert!(k.other_version_seen.load(Ordering::Relaxed), "logged");
        // What this process saves carries its version, and reads back.
        k.affinity.record(5, &Arc::from("gpu0"));
        k.save().expect("save");
        let text = std::fs::read_to_string(&path).expect("read");
        let saved: Snapshot = serde_json::from_str(&text).expect("json");
        assert_eq!(saved.version, HASH_VERSION);
        assert_eq!(saved.entries, vec![(5, "gpu0".to_string())]);
    }

    /// A restarted container: the process before had the same pid (PID 1) and left its pins.
    #[test]
    fn a_file_of_another_process_with_this_pid_is_loaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        let entries = serde_json::json!([[7, "gpu0"]]);
        let files = [
            // This binary, in the container before.
            serde_json::json!({"version": HASH_VERSION, "pid": std::process::id(),
                "writer": process_nonce().wrapping_add(1), "entries": entries}),
            // An older binary (no nonce written), in the container before.
            serde_json::json!({"version": HASH_VERSION, "pid": std::process::id(),
                "entries": entries}),
        ];
        for file in files {
            std::fs::write(&path, file.to_string()).expect("write");
            let k = keeper(path.clone());
            assert_eq!(k.load(), 1, "{file}");
            assert_eq!(k.affinity.served_by(7).as_deref(), Some("gpu0"));
        }
    }

    /// A replica that restarted since the file's writer read its start: the writer's pins to
    /// it are not merged. One not read here yet takes the writer's start as its first, so its
    /// first read here finds the restart (and the poll drops the pins then); the start saved
    /// is the latest read.
    #[test]
    fn pins_to_a_replica_that_restarted_since_the_file_are_not_merged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        let file = |start: u64| {
            let v = serde_json::json!({"version": HASH_VERSION, "entries": [[7, "gpu0"]],
                "stored": [[9, "gpu0"]], "starts": [["gpu0", start], ["gone", 1]]});
            std::fs::write(&path, v.to_string()).expect("write");
        };
        // Not read here yet: merged, and the writer's start taken.
        file(1_000);
        let k = keeper(path.clone());
        assert_eq!(k.load(), 2);
        let gpu0 = k.registry.get("gpu0").expect("gpu0");
        assert_eq!(gpu0.started_ms(), 1_000);
        assert!(gpu0.started(2_000), "the first read here is a restart");
        // Read here later than the writer did: its pins are not merged, its stored ids are.
        let k = keeper(path.clone());
        let gpu0 = k.registry.get("gpu0").expect("gpu0");
        gpu0.started(2_000);
        assert_eq!(k.load(), 1);
        assert_eq!(k.affinity.served_by(7), None);
        assert_eq!(k.stored.served_by(9).as_deref(), Some("gpu0"));
        // The same start, or the writer's later: merged.
        for start in [2_000, 3_000] {
            file(start);
            let k = keeper(path.clone());
            k.registry.get("gpu0").expect("gpu0").started(2_000);
            assert_eq!(k.load(), 2, "{start}");
        }
        k.save().expect("save");
        let saved: Snapshot =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(saved.starts, vec![("gpu0".to_string(), 2_000)]);
    }

    /// During an upgrade both processes write the file and read each other's: each skips its
    /// own, which holds nothing its table does not (and pins it let go since).
    #[test]
    fn a_file_this_process_wrote_is_not_merged_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        let k = keeper(path.clone());
        k.affinity.record(5, &Arc::from("gpu0"));
        k.save().expect("save");
        let saved: Snapshot =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(saved.writer, Some(process_nonce()));
        assert_eq!(
            saved.pid,
            std::process::id(),
            "older binaries still read it"
        );
        // Another keeper of this process (its table empty) takes the file for its own.
        let again = keeper(path.clone());
        assert_eq!(again.load(), 0);
        assert!(again.affinity.is_empty());
        // Nothing left behind but the file.
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(left.len(), 1);
    }
}
