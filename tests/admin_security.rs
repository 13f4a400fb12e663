//! The admin plane, attacked from outside (issue 21, item 2): the bearer token on `/admin/*`
//! (read from a file, followed when the file changes), the optional token on `/metrics` and
//! `/ready`, the refusal to start an open admin API on a non-loopback address, and
//! `admin.allowed_networks` for replicas added at runtime, in the conf, and at connect time.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use inferlb_harness::{bin, http_status, Redis};

const TOKEN: &str = "admin-token-0123456789abcdef";

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// An admin call: (status, `www-authenticate`, JSON body or Null).
fn call(
    lb: &Lb,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, Option<String>, serde_json::Value) {
    let c = http();
    let url = lb.admin_url(path);
    let mut req = match method {
        "POST" => c.post(url),
        "DELETE" => c.delete(url),
        _ => c.get(url),
    };
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().expect("admin call");
    let status = r.status().as_u16();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or("").to_string());
    let text = r.text().unwrap_or_default();
    (
        status,
        challenge,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

fn listed(lb: &Lb, auth: Option<&str>, id: &str) -> bool {
    let (_, _, state) = call(lb, "GET", "/admin/replicas", auth, None);
    state["replicas"]
        .as_array()
        .is_some_and(|a| a.iter().any(|r| r["id"] == id))
}

/// Replicas an attacker would point inferlb at: each refused with 400, never listed. The first
/// is one no packet leaves this host for (link-local without a scope cannot be connected to),
/// so a build without the check fails here before anything reaches 169.254.169.254.
fn refused_adds(lb: &Lb, auth: Option<&str>) {
    for (id, address, needle) in [
        ("linklocal6", "[fe80::1]:80", "fe80::1"),
        ("evil", "169.254.169.254:80", "169.254.169.254"),
        (
            "evil6",
            "[::ffff:169.254.169.254]:80",
            "that is 169.254.169.254",
        ),
        ("linklocal", "169.254.10.1:80", "169.254.10.1"),
        ("public", "8.8.8.8:80", "outside admin.allowed_networks"),
        ("aws6", "[fd00:ec2::254]:80", "metadata"),
    ] {
        let body = serde_json::json!({"id": id, "address": address});
        let (status, _, answer) = call(lb, "POST", "/admin/replicas", auth, Some(body));
        assert_eq!(status, 400, "{address}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(needle), "{address}: {error}");
        assert!(!listed(lb, auth, id), "{address} was listed");
    }
}

#[test]
fn without_a_token_the_admin_api_works_on_loopback_and_refuses_metadata_addresses() {
    let root = tempfile::tempdir().expect("tempdir");
    let (a, b) = two_sims(root.path(), &[]);
    let lb = Lb::start(root.path(), &[&a], test_conf());
    refused_adds(&lb, None);

    let body = serde_json::json!({"id": "gpu1", "address": b.addr()});
    let (status, _, answer) = call(&lb, "POST", "/admin/replicas", None, Some(body));
    assert_eq!(status, 201, "{answer}");
    let (status, _, _) = call(&lb, "POST", "/admin/replicas/gpu1/drain", None, None);
    assert_eq!(status, 200);
    let (status, _, _) = call(&lb, "DELETE", "/admin/replicas/gpu1", None, None);
    assert_eq!(status, 200);

    // Each change is logged with the caller's address; the replica's key never is.
    let log = lb.proc.log_text();
    for change in [
        format!("added replica gpu1 at {}", b.addr()),
        format!("drained replica gpu1 at {}", b.addr()),
        format!("removed replica gpu1 at {}", b.addr()),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains(&change))
            .unwrap_or_else(|| panic!("no {change:?} in\n{log}"));
        assert!(
            line.contains("INFO") && line.contains("admin: 127.0.0.1:"),
            "{line}"
        );
    }
}

#[test]
fn the_admin_token_guards_every_admin_path_and_follows_its_file() {
    let root = tempfile::tempdir().expect("tempdir");
    let a = Sim::start(root.path(), "gpu0", &[]);
    let token_file = root.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token");
    let conf = LbConf {
        extra: format!(
            "  admin: {{token_file: \"{}\", reload_interval_seconds: 0.1}}\n",
            token_file.display()
        ),
        ..test_conf()
    };
    let lb = Lb::start(root.path(), &[&a], conf);
    let right = bearer(TOKEN);
    let wrong = bearer("admin-token-0123456789abcdeX");

    for (method, path) in [
        ("GET", "/admin/replicas"),
        ("POST", "/admin/replicas/gpu0/drain"),
        ("POST", "/admin/replicas"),
        ("DELETE", "/admin/replicas/gpu0"),
        ("GET", "/nowhere"),
    ] {
        for auth in [None, Some(wrong.as_str()), Some("Basic YWRtaW46YWRtaW4=")] {
            let body = (path == "/admin/replicas" && method == "POST")
                .then(|| serde_json::json!({"id": "x", "address": a.addr()}));
            let (status, challenge, answer) = call(&lb, method, path, auth, body);
            assert_eq!(status, 401, "{method} {path} {auth:?}: {answer}");
            assert_eq!(challenge.as_deref(), Some("Bearer"), "{method} {path}");
            assert!(answer["error"].is_string(), "{answer}");
        }
    }
    assert_eq!(lb.replica_state_with(&right, "gpu0")["draining"], false);
    assert!(listed(&lb, Some(&right), "gpu0"), "nothing was removed");
    refused_adds(&lb, Some(&right));
    let (status, _, _) = call(
        &lb,
        "POST",
        "/admin/replicas/gpu0/drain",
        Some(&right),
        None,
    );
    assert_eq!(status, 200);
    let (status, _, _) = call(
        &lb,
        "POST",
        "/admin/replicas/gpu0/undrain",
        Some(&right),
        None,
    );
    assert_eq!(status, 200);
    // Scrapers and probes need nothing by default.
    assert_eq!(
        http_status(lb.admin_port, "/metrics", Duration::from_secs(2)),
        Some(200)
    );
    assert!(lb.metrics().contains("inferlb_"));

    // A rewritten file: the new token opens, the old one no longer does.
    let next = "admin-token-the-second-one-0123";
    std::fs::write(&token_file, format!("{next}\n")).expect("rewrite");
    let moved = wait_until(Duration::from_secs(5), || {
        call(&lb, "GET", "/admin/replicas", Some(&bearer(next)), None).0 == 200
    });
    assert!(moved, "{}", lb.proc.log_text());
    assert_eq!(
        call(&lb, "GET", "/admin/replicas", Some(&right), None).0,
        401
    );
    // An emptied file keeps the token in use, and says so.
    std::fs::write(&token_file, "").expect("empty");
    let said = wait_until(Duration::from_secs(5), || {
        lb.proc.log_text().contains("token not reloaded")
    });
    assert!(said, "{}", lb.proc.log_text());
    assert_eq!(
        call(&lb, "GET", "/admin/replicas", Some(&bearer(next)), None).0,
        200
    );

    let log = lb.proc.log_text();
    let refusal = log
        .lines()
        .find(|l| l.contains("refused: wrong bearer token"))
        .unwrap_or_else(|| panic!("no refusal logged:\n{log}"));
    assert!(
        refusal.contains("WARN") && refusal.contains("from 127.0.0.1:"),
        "{refusal}"
    );
    assert!(log.contains("drained replica gpu0"), "{log}");
    for secret in [TOKEN, next] {
        assert!(!log.contains(secret), "a token in the log:\n{log}");
    }
}

trait WithToken {
    fn replica_state_with(&self, auth: &str, id: &str) -> serde_json::Value;
}

impl WithToken for Lb {
    fn replica_state_with(&self, auth: &str, id: &str) -> serde_json::Value {
        let (_, _, state) = call(self, "GET", "/admin/replicas", Some(auth), None);
        state["replicas"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["id"] == id).cloned())
            .unwrap_or_else(|| panic!("{id} in {state}"))
    }
}

/// `GET path` on the admin port with an optional bearer token: the status.
fn status_of(port: u16, path: &str, token: Option<&str>) -> u16 {
    let mut req = http().get(format!("http://127.0.0.1:{port}{path}"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().map(|r| r.status().as_u16()).unwrap_or(0)
}

#[test]
fn a_metrics_token_closes_metrics_and_ready() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let a = Sim::start(dir, "gpu0", &[]);
    let metrics_token = "metrics-token-0123456789abc";
    std::fs::write(dir.join("metrics-token"), metrics_token).expect("token");
    std::fs::write(dir.join("admin-token"), TOKEN).expect("token");
    let conf = LbConf {
        listen_port: free_port(),
        admin_port: free_port(),
        pid_file: Some(dir.join("inferlb.pid")),
        upgrade_sock: Some(dir.join("upgrade.sock")),
        replicas: vec![Replica::of(&a)],
        extra: format!(
            "  admin: {{token_file: \"{}\", metrics_token_file: \"{}\"}}\n",
            dir.join("admin-token").display(),
            dir.join("metrics-token").display()
        ),
        ..test_conf()
    };
    let path = dir.join("inferlb.yaml");
    conf.write(&path).expect("conf");
    // Not `Lb::start`: it waits for an open /metrics.
    let mut cmd = Command::new(bin("inferlb"));
    cmd.arg("-c").arg(&path).env("RUST_LOG", "info");
    let _lb = Lb::spawn("inferlb", cmd, Some(&dir.join("inferlb.log"))).expect("spawn");
    let port = conf.admin_port;
    let up = wait_until(Duration::from_secs(10), || {
        http_status(port, "/metrics", Duration::from_secs(1)) == Some(401)
    });
    assert!(
        up,
        "{}",
        std::fs::read_to_string(dir.join("inferlb.log")).unwrap_or_default()
    );
    let live = wait_until(Duration::from_secs(10), || {
        status_of(port, "/ready", Some(metrics_token)) == 200
    });
    assert!(live, "ready with the metrics token");
    let cases = [
        ("/metrics", None, 401),
        ("/metrics", Some("metrics-token-0123456789abX"), 401),
        ("/metrics", Some(metrics_token), 200),
        ("/metrics", Some(TOKEN), 200),
        ("/ready", None, 401),
        ("/ready", Some(TOKEN), 200),
        ("/admin/replicas", Some(metrics_token), 401),
        ("/admin/replicas", Some(TOKEN), 200),
    ];
    for (path, token, want) in cases {
        assert_eq!(status_of(port, path, token), want, "{path} {token:?}");
    }
}

/// Starts inferlb on `conf` (a file in `dir`) and waits for it to exit: (exit code, its log).
fn start_fails(dir: &Path, name: &str, conf: &str) -> (Option<i32>, String) {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, conf).expect("conf");
    let log = dir.join(format!("{name}.log"));
    let mut cmd = Command::new(bin("inferlb"));
    cmd.arg("-c").arg(&path);
    let mut p = Lb::spawn(name, cmd, Some(&log)).expect("spawn");
    let status = p.wait_exit(Duration::from_secs(10));
    (status.and_then(|s| s.code()), p.log_text())
}

#[test]
fn unsafe_confs_do_not_start() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let base = LbConf {
        listen_port: free_port(),
        admin_port: free_port(),
        pid_file: Some(dir.join("inferlb.pid")),
        upgrade_sock: Some(dir.join("upgrade.sock")),
        replicas: vec![Replica::new("a", &format!("127.0.0.1:{}", free_port()))],
        ..test_conf()
    };
    let text = base.render();
    let open_admin = text.replace("admin_listen: 127.0.0.1:", "admin_listen: 0.0.0.0:");
    assert_ne!(open_admin, text);
    let metadata = text.replace(&base.replicas[0].address, "169.254.169.254:80");
    assert_ne!(metadata, text);
    let literal = format!("{text}  admin: {{token: {TOKEN}}}\n");
    for (name, conf, needle) in [
        (
            "open-admin",
            open_admin.as_str(),
            "inferlb.admin_listen: 0.0.0.0:",
        ),
        ("metadata", metadata.as_str(), "inferlb.replicas[0].address"),
        ("literal", literal.as_str(), "unknown field `token`"),
    ] {
        let (code, log) = start_fails(dir, name, conf);
        assert_eq!(code, Some(2), "{name}: {log}");
        assert!(
            log.contains("invalid configuration") && log.contains(needle),
            "{name}: {log}"
        );
    }
    let (_, log) = start_fails(dir, "open-admin-again", &open_admin);
    assert!(
        log.contains("inferlb.admin.token_file or inferlb.admin.token_env"),
        "{log}"
    );
    assert!(!log.contains(TOKEN));
}

/// A simulated replica on `ip:port` (loopback has every 127.x address).
fn sim_at(dir: &Path, ip: &str, id: &str) -> (Proc, u16) {
    let port = free_port();
    let mut cmd = Command::new(bin("inferlb-sim"));
    cmd.args(["--listen", &format!("{ip}:{port}"), "--id", id]);
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
    (p, port)
}

/// A replica another instance shares (through Redis) at an address this instance's
/// allowed_networks refuses is never added here: not listed, never health-checked, polled or
/// connected to; a replica it allows, shared after it, is. The instance that allows it uses it.
#[test]
fn a_shared_replica_outside_the_allowed_networks_is_never_added() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let redis = Redis::start(dir);
    let a = Sim::start(dir, "gpu0", &[]);
    let near = Sim::start(dir, "near", &[]);
    let (_far, far_port) = sim_at(dir, "127.0.0.2", "far");
    let instance = |name: &str, admin: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).expect("dir");
        let conf = LbConf {
            routing: Some("roundrobin".into()),
            extra: format!("{}{admin}", redis.cluster_conf(name)),
            ..test_conf()
        };
        Lb::start(&d, &[&a], conf)
    };
    let one = instance("one", "");
    let two = instance("two", "  admin: {allowed_networks: [127.0.0.1/32]}\n");
    let far = format!("127.0.0.2:{far_port}");

    // Two refuses it itself; one (the default networks) takes it and shares it, then shares
    // a replica two allows.
    let body = serde_json::json!({"id": "far", "address": far});
    let (status, _, answer) = call(&two, "POST", "/admin/replicas", None, Some(body.clone()));
    assert_eq!(status, 400, "{answer}");
    let (status, _, answer) = call(&one, "POST", "/admin/replicas", None, Some(body));
    assert_eq!(status, 201, "{answer}");
    let body = serde_json::json!({"id": "near", "address": near.addr()});
    let (status, _, answer) = call(&one, "POST", "/admin/replicas", None, Some(body));
    assert_eq!(status, 201, "{answer}");
    let listed = |lb: &Lb, id: &str| {
        let (_, _, state) = call(lb, "GET", "/admin/replicas", None, None);
        state["replicas"]
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["id"] == id && r["live"] == true))
    };
    assert!(wait_until(Duration::from_secs(10), || listed(&one, "far")
        && listed(&one, "near")
        && listed(&two, "near")));
    // Changes arrive in order: with `near` here, `far` was seen and refused.
    assert!(!listed(&two, "far"), "two lists far");
    assert!(
        two.proc
            .log_text()
            .contains("replica far from another instance not added: 127.0.0.2 is outside"),
        "{}",
        two.proc.log_text()
    );
    let seen: Vec<String> = (0..6)
        .map(|i| routed_chat(&two, &[("user", &format!("question {i}"))]).0)
        .collect();
    assert!(seen.iter().all(|r| r == "gpu0" || r == "near"), "{seen:?}");
    let seen: Vec<String> = (0..6)
        .map(|i| routed_chat(&one, &[("user", &format!("one {i}"))]).0)
        .collect();
    assert!(seen.iter().any(|r| r == "far"), "one uses it: {seen:?}");
}
