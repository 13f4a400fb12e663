//! Loopback ports for the processes a test starts, each handed out once per process.
//!
//! A port asked of the kernel (`bind` to port 0) comes from the ephemeral range, the same range
//! every outgoing connection takes its source port from: between the moment a port is chosen
//! and the moment the program under test binds it, a client connection elsewhere in the test
//! run may take it, and two calls may even return the same port. Either way one listener ends
//! up answering for another (seen: a balancer whose admin port was its proxy port, and a
//! readiness check answered by another test's process). So ports come from outside the
//! ephemeral range, from a cursor that starts at a place that differs from process to process
//! and never hands out the same port twice in one process, and each is checked free by binding
//! it first.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The fewest ports a range outside the ephemeral one must hold to be used.
const MIN_RANGE: u32 = 2_000;

/// The lowest port handed out: below it are well-known and registered services.
const LOWEST: u32 = 10_000;

/// A loopback port nothing listens on right now, not handed out before by this process, and
/// outside the range the kernel takes outgoing connections' source ports from.
pub fn free_port() -> u16 {
    let (low, len) = *range();
    if len == 0 {
        return kernel_port();
    }
    static NEXT: AtomicU32 = AtomicU32::new(0);
    next_free(low, len, start_offset(len), &NEXT)
        .unwrap_or_else(|| panic!("no free loopback port in {low}..{}", low + len))
}

/// The first of `n` consecutive free loopback ports, each handed out as [`free_port`] hands
/// out one (never again in this process): for a server that binds a port per rank, the
/// configured one plus its rank, as vLLM's data-parallel engines bind their event sockets.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..1_000 {
        let first = free_port();
        // The cursor walks up one port a try: the next ports are the next free ones, unless
        // one was taken or the range wrapped; then this run is abandoned and another tried.
        let consecutive = (1..n).all(|k| u32::from(free_port()) == u32::from(first) + u32::from(k));
        if consecutive {
            return first;
        }
    }
    panic!("no run of {n} free loopback ports");
}

/// The first port of `low..low + len` that can be bound, walking from `start` plus the
/// cursor `next` (which moves past every port it tries, so none is tried twice).
fn next_free(low: u32, len: u32, start: u32, next: &AtomicU32) -> Option<u16> {
    (0..len).find_map(|_| {
        let port = low + (start + next.fetch_add(1, Ordering::Relaxed)) % len;
        let port = u16::try_from(port).expect("ranges lie within u16");
        TcpListener::bind(("127.0.0.1", port))
            .is_ok()
            .then_some(port)
    })
}

/// The port range to hand out from, as (first port, count); count 0 when neither side of the
/// ephemeral range has room.
fn range() -> &'static (u32, u32) {
    static RANGE: OnceLock<(u32, u32)> = OnceLock::new();
    RANGE.get_or_init(|| {
        let text =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
        outside(ephemeral(&text))
    })
}

/// The ephemeral range `(first, last)` from `ip_local_port_range`'s text; Linux's default
/// when it cannot be read.
fn ephemeral(text: &str) -> (u32, u32) {
    let mut it = text.split_whitespace().map(str::parse::<u32>);
    match (it.next(), it.next()) {
        (Some(Ok(first)), Some(Ok(last))) if first <= last => (first, last),
        _ => (32_768, 60_999),
    }
}

/// The larger side of `LOWEST..=65535` outside the ephemeral range `(first, last)`, as
/// (first port, count), or count 0 when neither side holds `MIN_RANGE` ports.
fn outside((first, last): (u32, u32)) -> (u32, u32) {
    let below = (LOWEST, first.saturating_sub(LOWEST));
    let above = (last + 1, 65_536u32.saturating_sub(last + 1));
    let best = if below.1 >= above.1 { below } else { above };
    if best.1 >= MIN_RANGE {
        best
    } else {
        (0, 0)
    }
}

/// Where this process starts in a range of `len` ports: from its pid and the time, so that
/// two test processes running at once start far apart.
fn start_offset(len: u32) -> u32 {
    static START: OnceLock<u32> = OnceLock::new();
    *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        std::process::id()
            .wrapping_mul(7_919)
            .wrapping_add(nanos / 1_000)
            % len
    })
}

/// A port the kernel picks, remembered so that it is never handed out twice.
fn kernel_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..1_000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
    panic!("the kernel kept handing out loopback ports already given");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_outside_the_ephemeral_range() {
        for (text, want) in [
            ("32768\t60999\n", (10_000, 22_768)),
            ("1024 60999", (61_000, 4_536)),
            ("1024 65000", (0, 0)),
            ("40000 65535", (10_000, 30_000)),
            ("", (10_000, 22_768)),
            ("garbage", (10_000, 22_768)),
        ] {
            assert_eq!(outside(ephemeral(text)), want, "{text:?}");
        }
    }

    #[test]
    fn no_port_is_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len());
        let (low, len) = *range();
        for p in ports {
            assert!(len == 0 || (low..low + len).contains(&u32::from(p)), "{p}");
        }
    }

    /// A port something listens on is passed over. (Whether a port handed out is still free
    /// later is not asserted: anything on the machine may take it meanwhile.)
    #[test]
    fn a_port_in_use_is_passed_over() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = u32::from(held.local_addr().unwrap().port());
        let next = AtomicU32::new(0);
        let got = next_free(busy, 2, 0, &next);
        assert_ne!(got, u16::try_from(busy).ok());
        assert!(
            got.is_none() || got == u16::try_from(busy + 1).ok(),
            "{got:?}"
        );
        assert!(
            next.load(Ordering::Relaxed) >= 2,
            "the busy port was tried, then the next"
        );
    }
}
