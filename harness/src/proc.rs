//! A child process that is stopped when its handle drops.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, signal, SigHandler, Signal};
use nix::unistd::Pid;

/// How long a process gets to exit after its stop signal before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(10);

/// A running child process. Dropping it (or [`Proc::stop`]) sends the signal the program
/// stops cleanly on, waits for it to exit (at most the stop limit, 10 s unless changed), and
/// only if it is still running then kills it and its own children with SIGKILL.
///
/// Once the process has been waited for, its pid is never signalled again (it may belong to
/// another process by then).
pub struct Proc {
    child: Child,
    name: String,
    log: Option<PathBuf>,
    stop_signal: Signal,
    stop_limit: Duration,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Spawns `cmd` with stdin and stdout closed and stderr appended to `log` (discarded when
    /// None). `stop_signal` is what [`Proc::stop`] and drop send first.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        log: Option<&Path>,
        stop_signal: Signal,
    ) -> io::Result<Proc> {
        let stderr = match log {
            Some(p) => Stdio::from(OpenOptions::new().create(true).append(true).open(p)?),
            None => Stdio::null(),
        };
        // A shell starting a job in the background (`make test &` in a script) has it ignore
        // SIGINT and SIGQUIT, and ignored signals are inherited: a child that stops on one of
        // them would not. Each child starts with the stop signals at their defaults.
        // SAFETY: the closure runs in the forked child before exec and only calls sigaction,
        // which is async-signal-safe; it allocates nothing and takes no lock.
        unsafe {
            cmd.pre_exec(|| {
                for sig in [Signal::SIGINT, Signal::SIGQUIT, Signal::SIGTERM] {
                    signal(sig, SigHandler::SigDfl).map_err(io::Error::from)?;
                }
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        Ok(Proc {
            child,
            name: name.to_string(),
            log: log.map(Path::to_path_buf),
            stop_signal,
            stop_limit: STOP_LIMIT,
            exited: None,
        })
    }

    /// Changes how long [`Proc::stop`] waits after the stop signal before it kills.
    pub fn set_stop_limit(&mut self, limit: Duration) {
        self.stop_limit = limit;
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    /// What the process wrote to stderr so far ("" without a log file).
    pub fn log_text(&self) -> String {
        self.log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Sends `sig`; false when the process has already been waited for or the signal failed.
    pub fn signal(&self, sig: Signal) -> bool {
        self.exited.is_none() && kill(self.nix_pid(), sig).is_ok()
    }

    /// The exit status, if the process has exited (without waiting).
    pub fn try_exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    pub fn has_exited(&mut self) -> bool {
        self.try_exited().is_some()
    }

    /// Waits at most `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.try_exited() {
                return Some(s);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the process: its stop signal, a bounded wait, then SIGKILL for it and its children
    /// if it is still there. Does nothing once it has exited.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if let Some(s) = self.try_exited() {
            return Some(s);
        }
        if self.signal(self.stop_signal) {
            if let Some(s) = self.wait_exit(self.stop_limit) {
                return Some(s);
            }
        }
        if let Some(s) = self.try_exited() {
            return Some(s);
        }
        eprintln!(
            "harness: {} (pid {}) still running {:?} after {}: killing it",
            self.name,
            self.pid(),
            self.stop_limit,
            self.stop_signal
        );
        // Its children first, while they can still be found by their parent pid.
        for child in children_of(self.pid()) {
            let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
        self.exited
    }

    fn nix_pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pids fit an i32"))
    }
}

impl Drop for Proc {
    /// Stops the process. When a test is failing (the thread is panicking), the end of the
    /// process's log goes to stderr first, where the test's output shows it: the log itself
    /// is usually in a temporary directory that is gone once the test ends.
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            let text = self.log_text();
            if !text.is_empty() {
                let tail = last_lines(&text, LOG_TAIL_LINES);
                eprintln!("harness: the end of {}'s log:\n{tail}", self.name);
            }
        }
    }
}

/// How many lines of a process's log a failing test shows.
const LOG_TAIL_LINES: usize = 60;

/// The last `n` lines of `text`.
fn last_lines(text: &str, n: usize) -> &str {
    let start = text
        .trim_end()
        .rmatch_indices('\n')
        .nth(n.saturating_sub(1))
        .map_or(0, |(i, _)| i + 1);
    &text[start..]
}

/// The pids whose parent is `pid`, from /proc.
fn children_of(pid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: i32) -> bool {
        // A zombie is dead for this purpose; /proc/<pid>/stat's state is Z.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let rest = s[s.rfind(')')? + 1..].to_string();
                rest.split_whitespace().next().map(|st| st != "Z")
            })
            .unwrap_or(false)
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn drop_stops_with_the_stop_signal_and_logs_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("p.log");
        let mut p = Proc::spawn(
            "sleeper",
            sh("echo started >&2; trap 'echo got INT >&2; exit 0' INT; while :; do sleep 0.05; done"),
            Some(&log),
            Signal::SIGINT,
        )
        .unwrap();
        assert!(crate::wait_until(Duration::from_secs(5), || p
            .log_text()
            .contains("started")));
        let pid = p.pid() as i32;
        let started = Instant::now();
        let status = p.stop().expect("exited");
        assert!(status.success(), "it ran its own INT handler: {status:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(p.log_text().contains("got INT"), "{}", p.log_text());
        assert!(!p.signal(Signal::SIGTERM), "never signalled once reaped");
        drop(p);
        assert!(!alive(pid));
    }

    #[test]
    fn a_process_ignoring_its_stop_signal_is_killed_with_its_children() {
        let mut p = Proc::spawn(
            "stubborn",
            sh("trap '' TERM; sleep 300 & sleep 300 & wait"),
            None,
            Signal::SIGTERM,
        )
        .unwrap();
        p.set_stop_limit(Duration::from_millis(300));
        let pid = p.pid();
        let mut kids = vec![];
        assert!(crate::wait_until(Duration::from_secs(5), || {
            kids = children_of(pid);
            kids.len() == 2
        }));
        let started = Instant::now();
        drop(p);
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(!alive(pid as i32));
        // The orphans' new parent (init) reaps them; until then they are zombies at most.
        assert!(crate::wait_until(Duration::from_secs(5), || kids
            .iter()
            .all(|k| !alive(*k))));
    }

    #[test]
    fn an_exited_process_is_reported_and_not_signalled() {
        let mut p = Proc::spawn("quick", sh("exit 3"), None, Signal::SIGINT).unwrap();
        let s = p.wait_exit(Duration::from_secs(5)).expect("exited");
        assert_eq!(s.code(), Some(3));
        assert!(p.has_exited());
        assert_eq!(p.stop().and_then(|s| s.code()), Some(3));
    }

    #[test]
    fn a_failing_test_shows_the_last_lines_of_a_log() {
        for (text, n, tail) in [
            ("", 3, ""),
            ("a\nb\nc\n", 3, "a\nb\nc\n"),
            ("a\nb\nc\nd\n", 2, "c\nd\n"),
            ("a\nb\nc", 2, "b\nc"),
            ("a\nb\n", 9, "a\nb\n"),
        ] {
            assert_eq!(last_lines(text, n), tail, "{text:?}, {n}");
        }
    }
}
