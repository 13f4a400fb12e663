//! What /proc says of the processes under test: CPU time, resident memory, open descriptors.
//! Linux only; a process that cannot be read counts as 0.

/// Clock ticks a second of /proc's CPU times (`getconf CLK_TCK`; Linux's USER_HZ is 100).
pub fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The fields of `/proc/<pid>/stat` after the command's ")": state ppid ... (every thread's
/// times are in it).
fn stat_fields(pid: u32) -> Vec<String> {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return vec![];
    };
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace().map(str::to_owned).collect()
}

/// A process's user and system CPU time so far (every thread's), in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    // utime is the 12th field after the command, stime the 13th.
    stat_fields(pid)
        .iter()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse::<u64>().ok())
        .sum()
}

/// Seconds of CPU `pids` spent so far, together.
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>() as f64 / clock_ticks()
}

/// `pid` and its children (nginx's master and its workers).
pub fn with_children(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let parent = stat_fields(p).get(1).and_then(|x| x.parse::<u32>().ok());
        if parent == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// Resident memory, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Open file descriptors.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_readable() {
        let me = std::process::id();
        assert!(rss_kib(me) > 0);
        assert!(fds(me) > 0);
        assert!(with_children(me).contains(&me));
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(0);
        }
        assert!(cpu_seconds(&[me]) > 0.0);
    }
}
