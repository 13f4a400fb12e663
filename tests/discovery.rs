//! Replicas found by DNS (a real dnsmasq on loopback, as a headless Service would answer) and
//! added or removed through the admin API, while traffic flows.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

fn dnsmasq() -> PathBuf {
    ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("dnsmasq (make deps installs dnsmasq-base)")
}

/// dnsmasq answering for the names in `hosts` only, on 127.0.0.1:`port`.
fn start_dns(dir: &Path, port: u16, hosts: &Path) -> Proc {
    let mut cmd = Command::new(dnsmasq());
    cmd.arg("--keep-in-foreground")
        .arg(format!("--port={port}"))
        .args([
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
        ])
        .args(["--user=root", "--pid-file=", "--local-ttl=0"])
        .arg(format!("--addn-hosts={}", hosts.display()));
    let p = Proc::spawn(
        "dnsmasq",
        cmd,
        Some(&dir.join("dnsmasq.log")),
        Signal::SIGTERM,
    )
    .expect("spawn dnsmasq");
    std::thread::sleep(Duration::from_millis(300));
    p
}

/// A simulated replica on `ip:port` (loopback has every 127.x address).
fn sim_at(dir: &Path, ip: &str, port: u16, id: &str) -> Proc {
    sim_with(dir, ip, port, id, &[])
}

/// The same, with more of the simulator's flags.
fn sim_with(dir: &Path, ip: &str, port: u16, id: &str, flags: &[String]) -> Proc {
    let mut cmd = Command::new(inferlb_harness::bin("inferlb-sim"));
    cmd.args(["--listen", &format!("{ip}:{port}"), "--id", id]);
    cmd.args(flags);
    let p = Proc::spawn(
        id,
        cmd,
        Some(&dir.join(format!("{id}.log"))),
        Signal::SIGTERM,
    )
    .expect("spawn sim");
    let up = wait_until(Duration::from_secs(10), || {
        std::net::TcpStream::connect((ip, port)).is_ok()
    });
    assert!(up, "sim {id} on {ip}:{port}");
    p
}

/// dnsmasq answering `vllm.test` with 127.0.0.2 and 127.0.0.3: its hosts file (rewritten to
/// change the answer), the process and its port.
fn dns_of_two_pods(dir: &Path) -> (PathBuf, Proc, u16) {
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 vllm.test\n127.0.0.3 vllm.test\n").expect("hosts");
    let dns_port = free_port();
    let dns = start_dns(dir, dns_port, &hosts);
    (hosts, dns, dns_port)
}

/// The test conf with `replicas`, discovery asking dnsmasq on `dns_port` every 0.3 s.
fn discovering(dns_port: u16, replicas: Vec<Replica>) -> LbConf {
    LbConf {
        replicas,
        extra: format!(
            "  discovery_interval_seconds: 0.3\n  discovery_nameserver: \"127.0.0.1:{dns_port}\"\n"
        ),
        ..test_conf()
    }
}

fn live_ids(lb: &Lb) -> Vec<String> {
    let state = lb.admin("GET", "/admin/replicas");
    let mut ids: Vec<String> = state["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter(|r| r["live"] == true)
        .map(|r| r["id"].as_str().unwrap_or("").to_string())
        .collect();
    ids.sort();
    ids
}
#[test]
fn replicas_come_and_go_with_dns_and_the_admin_api() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let port = free_port();
    let _s2 = sim_at(dir, "127.0.0.2", port, "pod-a");
    let _s3 = sim_at(dir, "127.0.0.3", port, "pod-b");
    let (hosts, dns, dns_port) = dns_of_two_pods(dir);

    let conf = discovering(
        dns_port,
        vec![Replica {
            extra: "discover: dns".into(),
            ..Replica::new("vllm", &format!("vllm.test:{port}"))
        }],
    );
    let lb = Lb::start(dir, &[], conf);
    // Ready once a replica is found and passes a health check.
    let ready = || {
        http()
            .get(lb.admin_url("/ready"))
            .send()
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    let (a, b) = (
        format!("vllm-127.0.0.2-{port}"),
        format!("vllm-127.0.0.3-{port}"),
    );
    let both = wait_until(Duration::from_secs(10), || {
        live_ids(&lb) == vec![a.clone(), b.clone()]
    });
    assert!(
        both,
        "{}\n{}",
        lb.admin("GET", "/admin/replicas"),
        lb.proc.log_text()
    );
    assert_eq!(ready(), 200, "ready once a replica is live");

    // A conversation pinned to one pod; that pod leaves the Service: the next turn moves.
    let (home, _, _) = routed_chat(&lb, &[("user", "hello")]);
    let (again, route, _) = routed_chat(
        &lb,
        &[("user", "hello"), ("assistant", "hi"), ("user", "more")],
    );
    assert_eq!((again.as_str(), route.as_str()), (home.as_str(), "pinned"));
    let (kept_ip, gone) = if home == a {
        ("127.0.0.3", &a)
    } else {
        ("127.0.0.2", &b)
    };
    std::fs::write(&hosts, format!("{kept_ip} vllm.test\n")).expect("hosts");
    assert!(
        dns.signal(Signal::SIGHUP),
        "dnsmasq reloads its hosts file on SIGHUP"
    );
    let left = wait_until(Duration::from_secs(10), || !live_ids(&lb).contains(gone));
    assert!(left, "{}", lb.admin("GET", "/admin/replicas"));
    let turn3 = [
        ("user", "hello"),
        ("assistant", "hi"),
        ("user", "more"),
        ("assistant", "ok"),
        ("user", "and"),
    ];
    let (moved, route, _) = routed_chat(&lb, &turn3);
    assert_ne!(&moved, gone);
    assert_eq!(route, "repinned");

    // Added by hand: joins after a passing health check; removed by hand: gone.
    let extra_port = free_port();
    let _s4 = sim_at(dir, "127.0.0.1", extra_port, "by-hand");
    let added = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&serde_json::json!({"id": "by-hand", "address": format!("127.0.0.1:{extra_port}")}))
        .send()
        .expect("add");
    assert_eq!(added.status(), 201);
    assert!(wait_until(Duration::from_secs(10), || live_ids(&lb)
        .contains(&"by-hand".to_string())));
    let dup = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&serde_json::json!({"id": "by-hand", "address": format!("127.0.0.1:{extra_port}")}))
        .send()
        .expect("add again");
    assert_eq!(dup.status(), 400, "an id is unique");
    let bad = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&serde_json::json!({"id": "bad id", "address": "nowhere"}))
        .send()
        .expect("bad add");
    assert_eq!(bad.status(), 400);
    let removed = http()
        .delete(lb.admin_url("/admin/replicas/by-hand"))
        .send()
        .expect("delete");
    assert_eq!(removed.status(), 200);
    assert!(!live_ids(&lb).contains(&"by-hand".to_string()));
    let missing = http()
        .delete(lb.admin_url("/admin/replicas/by-hand"))
        .send()
        .expect("delete");
    assert_eq!(missing.status(), 404);
    // Traffic never stopped.
    for i in 0..4 {
        routed_chat(&lb, &[("user", &format!("still here {i}"))]);
    }
}

/// An address the name resolves to outside `admin.allowed_networks` never becomes a replica
/// (a DNS answer is not trusted to say where inferlb connects); it is logged once.
#[test]
fn dns_answers_outside_the_allowed_networks_are_skipped() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let port = free_port();
    let _s2 = sim_at(dir, "127.0.0.2", port, "pod-a");
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 vllm.test\n127.0.0.3 vllm.test\n").expect("hosts");
    let dns_port = free_port();
    let _dns = start_dns(dir, dns_port, &hosts);
    let conf = LbConf {
        replicas: vec![Replica {
            extra: "discover: dns".into(),
            ..Replica::new("vllm", &format!("vllm.test:{port}"))
        }],
        extra: format!(
            "  discovery_interval_seconds: 0.2\n  discovery_nameserver: \"127.0.0.1:{dns_port}\"\n  \
             admin: {{allowed_networks: [127.0.0.1/32, 127.0.0.2/32]}}\n"
        ),
        ..test_conf()
    };
    let lb = Lb::start(dir, &[], conf);
    let kept = format!("vllm-127.0.0.2-{port}");
    // Both addresses come in one answer: once one is a replica, the other was judged too.
    let found = wait_until(Duration::from_secs(10), || {
        live_ids(&lb) == vec![kept.clone()]
    });
    let state = lb.admin("GET", "/admin/replicas");
    assert!(found, "{state}");
    let all: Vec<&str> = state["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert_eq!(all, [kept.as_str()], "{state}");
    let log = lb.proc.log_text();
    let skipped = format!("resolved to 127.0.0.3:{port}, skipped");
    assert_eq!(log.matches(&skipped).count(), 1, "logged once:\n{log}");
}

/// Replicas found by DNS take their entry's role: a decode pool behind a headless Service,
/// beside a prefill replica of the conf, makes the model disaggregated.
#[test]
fn discovered_replicas_take_their_entrys_role() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let port = free_port();
    let _s2 = sim_at(dir, "127.0.0.2", port, "pod-a");
    let _s3 = sim_at(dir, "127.0.0.3", port, "pod-b");
    let prefill = Sim::start(dir, "p1", &[]);
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 decode.test\n127.0.0.3 decode.test\n").expect("hosts");
    let dns_port = free_port();
    let _dns = start_dns(dir, dns_port, &hosts);
    let mut conf = discovering(
        dns_port,
        vec![
            Replica {
                extra: "role: prefill".into(),
                ..Replica::of(&prefill)
            },
            Replica {
                extra: "discover: dns, role: decode".into(),
                ..Replica::new("decode", &format!("decode.test:{port}"))
            },
        ],
    );
    // Through the prefill pool whatever the decode pods run.
    conf.extra
        .push_str("  pd: {local_prefill_tokens: 0, local_prefill_idle_tokens: 0}\n");
    let lb = Lb::start(dir, &[], conf);
    let pods = [
        format!("decode-127.0.0.2-{port}"),
        format!("decode-127.0.0.3-{port}"),
    ];
    let found = wait_until(Duration::from_secs(10), || {
        pods.iter().all(|p| live_ids(&lb).contains(p))
    });
    assert!(found, "{}", lb.admin("GET", "/admin/replicas"));
    for p in &pods {
        assert_eq!(lb.replica_state(p)["role"], "decode");
    }
    assert_eq!(lb.replica_state("p1")["role"], "prefill");
    // The prefill replica here has no KV connector: the request is served whole on a decode
    // pod, never on the prefill replica.
    let (replica, route, _) = routed_chat(&lb, &[("user", &text_of("dns", 2000))]);
    assert!(pods.contains(&replica), "{replica}");
    assert_eq!(route, "pd-local");
    assert_eq!(
        lb.metric("inferlb_pd_whole_total{reason=\"no_handover\"}"),
        1.0
    );
}

/// A discover entry's event ports: each replica found is subscribed to on its own address
/// (its stream goes live), and a replica that leaves the Service takes its stream with it.
#[test]
fn each_replica_dns_finds_is_subscribed_to_on_its_own_address() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let (port, events, replay) = (free_port(), free_port(), free_port());
    let publishing = |ip: &str| {
        vec![
            "--kv-events".to_string(),
            format!("tcp://{ip}:{events}"),
            "--kv-events-replay".to_string(),
            format!("tcp://{ip}:{replay}"),
        ]
    };
    let _s2 = sim_with(dir, "127.0.0.2", port, "pod-a", &publishing("127.0.0.2"));
    let _s3 = sim_with(dir, "127.0.0.3", port, "pod-b", &publishing("127.0.0.3"));
    let (hosts, dns, dns_port) = dns_of_two_pods(dir);
    let conf = discovering(
        dns_port,
        vec![Replica {
            extra: format!(
                "discover: dns, kv_events_port: {events}, kv_events_replay_port: {replay}"
            ),
            ..Replica::new("vllm", &format!("vllm.test:{port}"))
        }],
    );
    let lb = Lb::start(dir, &[], conf);
    let state = |ip: &str| {
        let series = format!("inferlb_kv_events_state{{replica=\"vllm-{ip}-{port}\"}}");
        sample_value(&lb.metrics(), &series)
    };
    let live = wait_until(Duration::from_secs(15), || {
        state("127.0.0.2") == Some(2.0) && state("127.0.0.3") == Some(2.0)
    });
    assert!(
        live,
        "both streams live: {:?} {:?}\n{}",
        state("127.0.0.2"),
        state("127.0.0.3"),
        lb.proc.log_text()
    );
    // A stream can be live before its replica's health check passes: both are routable first.
    let pods = [
        format!("vllm-127.0.0.2-{port}"),
        format!("vllm-127.0.0.3-{port}"),
    ];
    assert!(
        wait_until(Duration::from_secs(10), || {
            let ids = live_ids(&lb);
            pods.iter().all(|p| ids.contains(p))
        }),
        "{}",
        lb.admin("GET", "/admin/replicas")
    );
    // What a found replica stores reaches inferlb from its own publisher.
    let prompt = text_of("found by dns", 2000);
    let (home, _, _) = routed_chat(&lb, &[("user", prompt.as_str())]);
    let stored = format!("inferlb_kv_events_total{{kind=\"stored\",replica=\"{home}\"}}");
    assert!(
        wait_until(Duration::from_secs(10), || sample_value(
            &lb.metrics(),
            &stored
        )
        .is_some_and(|v| v > 0.0)),
        "{home} published its blocks: {}",
        lb.metrics()
    );
    std::fs::write(&hosts, "127.0.0.3 vllm.test\n").expect("hosts");
    assert!(dns.signal(Signal::SIGHUP), "dnsmasq reloads its hosts file");
    assert!(
        wait_until(Duration::from_secs(10), || state("127.0.0.2").is_none()),
        "the stream of a replica that left goes with it: {:?}",
        state("127.0.0.2")
    );
    assert_eq!(state("127.0.0.3"), Some(2.0));
}
