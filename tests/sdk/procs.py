"""What both SDK test files need to start processes: free loopback ports and a bounded wait.

Ports come from outside the kernel's ephemeral range, from a cursor that never hands out a
port twice in one run, each checked free by binding it: a port asked of the kernel (bind to
port 0) is in the range outgoing connections take their source ports from, and two asks can
return the same port, so two listeners could end up sharing one (see harness/src/ports.rs,
which does the same for the Rust tests).
"""

import itertools
import os
import signal
import socket
import subprocess
import time
import urllib.request

LOWEST = 10_000
MIN_RANGE = 2_000


def _range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        first, last = 32_768, 60_999
    below = (LOWEST, max(first - LOWEST, 0))
    above = (last + 1, max(65_536 - (last + 1), 0))
    best = below if below[1] >= above[1] else above
    return best if best[1] >= MIN_RANGE else (0, 0)


_LOW, _LEN = _range()
_CURSOR = itertools.count((os.getpid() * 7_919 + time.time_ns() // 1_000) % max(_LEN, 1))
_GIVEN = set()


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port():
    """A loopback port nothing listens on, not handed out before in this run."""
    for _ in range(max(_LEN, 1_000)):
        if _LEN:
            port = _LOW + next(_CURSOR) % _LEN
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        if port not in _GIVEN and _bindable(port):
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free loopback port")


def wait_http(url, limit=10.0):
    """True once `url` answers 200, polling for at most `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.05)
    return False


def stop(p, is_lb):
    """Stops a process the way it stops cleanly (inferlb: SIGINT, Pingora's quick stop;
    inferlb-sim: SIGTERM), as the Rust harness does; SIGKILL only if it is still there after
    10 s."""
    p.send_signal(signal.SIGINT if is_lb else signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
