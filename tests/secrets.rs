//! Secrets out of the conf, against the real binary: client keys from a file (reloaded when it
//! changes, an empty or bad file keeping the keys in use) and the environment; replica keys
//! from a file or the environment, never written to Redis, each instance reading its own; the
//! admin API refusing a literal key; a Redis behind TLS with a password.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use inferlb_harness::{Redis, RedisTls};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use serde_json::{json, Value};

/// Replaces a file's content as an operator's tooling (or Kubernetes) does: written beside,
/// renamed over, so a reader never sees it half-written.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

fn chat_status(lb: &Lb, key: Option<&str>) -> u16 {
    let mut req =
        http()
            .post(lb.url("/v1/chat/completions"))
            .json(&chat_body(&[("user", "x")], false, 1));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().expect("request").status().as_u16()
}

fn reloads(lb: &Lb, result: &str) -> f64 {
    let want = format!("{{result=\"{result}\"}}");
    lb.samples("inferlb_secret_reloads_total")
        .iter()
        .find(|(labels, _)| *labels == want)
        .map_or(0.0, |(_, v)| *v)
}

#[test]
fn client_keys_come_from_a_file_and_the_environment_and_a_changed_file_is_reloaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = Sim::start(dir.path(), "gpu0", &[]);
    let keys = dir.path().join("client-keys");
    replace(&keys, "# the clients' keys\nfile-key-0001\n\n");
    let lb = Lb::start(
        dir.path(),
        &[&a],
        LbConf {
            extra: format!(
                "  api_keys_file: {keys:?}\n  api_keys_env: CLIENT_KEYS\n  \
                 secrets_reload_interval_seconds: 0.1\n"
            ),
            env: vec![("CLIENT_KEYS".into(), "env-key-0001, env-key-0002".into())],
            ..test_conf()
        },
    );
    assert_eq!(chat_status(&lb, None), 401);
    assert_eq!(chat_status(&lb, Some("wrong-key-0001")), 401);
    for key in ["file-key-0001", "env-key-0001", "env-key-0002"] {
        assert_eq!(chat_status(&lb, Some(key)), 200, "{key}");
    }

    // A rotated file: the new key is accepted, the old one no longer, without a restart.
    replace(&keys, "file-key-0002\n");
    let rotated = wait_until(Duration::from_secs(10), || {
        chat_status(&lb, Some("file-key-0002")) == 200
    });
    assert!(rotated, "{}", lb.proc.log_text());
    assert_eq!(chat_status(&lb, Some("file-key-0001")), 401);
    assert_eq!(chat_status(&lb, Some("env-key-0001")), 200);
    assert!(reloads(&lb, "changed") >= 1.0);

    // A file emptied, commented out or holding a bad key keeps the keys in use: the reloader
    // read it (counted as failed), and the API stays closed.
    for bad in ["", "# nothing\n", "file-key-0003\nshort\n"] {
        let before = reloads(&lb, "failed");
        replace(&keys, bad);
        let read = wait_until(Duration::from_secs(10), || reloads(&lb, "failed") > before);
        assert!(
            read,
            "the reloader never read {bad:?}: {}",
            lb.proc.log_text()
        );
        assert_eq!(chat_status(&lb, None), 401, "{bad:?}");
        assert_eq!(chat_status(&lb, Some("file-key-0002")), 200, "{bad:?}");
        assert_eq!(chat_status(&lb, Some("file-key-0003")), 401, "{bad:?}");
    }
    let log = lb.proc.log_text();
    assert!(log.contains("secret not reloaded"), "{log}");
    for key in ["file-key-000", "env-key-000", "short"] {
        assert!(!log.contains(key), "{key} in the log:\n{log}");
    }
}

/// What `/sim/echo` on the replica `lb` picked saw: (replica, authorization header).
fn echoed(lb: &Lb) -> (String, String) {
    let r = http()
        .get(lb.url("/sim/echo"))
        .header("authorization", "Bearer client-key-0001")
        .send()
        .expect("echo");
    assert_eq!(r.status(), 200);
    let replica = r
        .headers()
        .get("x-inferlb-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let v: Value = r.json().expect("echo json");
    let auth = v["headers"]["authorization"].as_str().unwrap_or_default();
    (replica, auth.to_string())
}

/// The authorization each of `ids` got, over requests spread by round-robin.
fn keys_sent(lb: &Lb, ids: &[&str]) -> Vec<String> {
    let mut seen: Vec<Option<String>> = vec![None; ids.len()];
    for _ in 0..(8 * ids.len()) {
        let (replica, auth) = echoed(lb);
        if let Some(i) = ids.iter().position(|id| *id == replica) {
            seen[i] = Some(auth);
        }
        if seen.iter().all(Option::is_some) {
            break;
        }
    }
    seen.into_iter()
        .map(|s| s.expect("every replica was reached"))
        .collect()
}

#[test]
fn replica_keys_come_from_a_file_or_the_environment_and_a_changed_file_is_reloaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = two_sims(dir.path(), &[]);
    let key_file = dir.path().join("gpu0-key");
    replace(&key_file, "gpu0-secret-1\n");
    let lb = Lb::start(
        dir.path(),
        &[],
        LbConf {
            routing: Some("roundrobin".into()),
            replicas: vec![
                Replica {
                    extra: format!("api_key_file: {key_file:?}"),
                    ..Replica::of(&a)
                },
                Replica {
                    extra: "api_key_env: GPU1_KEY".into(),
                    ..Replica::of(&b)
                },
            ],
            extra: "  secrets_reload_interval_seconds: 0.1\n  forward_paths: [/sim/echo]\n".into(),
            env: vec![("GPU1_KEY".into(), "gpu1-secret-1".into())],
            ..test_conf()
        },
    );
    assert_eq!(
        keys_sent(&lb, &["gpu0", "gpu1"]),
        ["Bearer gpu0-secret-1", "Bearer gpu1-secret-1"]
    );
    replace(&key_file, "gpu0-secret-2\n");
    let rotated = wait_until(Duration::from_secs(10), || {
        keys_sent(&lb, &["gpu0"]) == ["Bearer gpu0-secret-2"]
    });
    assert!(rotated, "{}", lb.proc.log_text());
    let log = lb.proc.log_text();
    assert!(!log.contains("secret-"), "{log}");
}

fn instance(root: &Path, name: &str, sims: &[&Sim], cluster: &str, env: &[(&str, &str)]) -> Lb {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("dir");
    let conf = LbConf {
        routing: Some("roundrobin".into()),
        // `/sim/echo` shows what the replica received.
        extra: format!("{cluster}  forward_paths: [/sim/echo]\n"),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..test_conf()
    };
    Lb::start(&dir, sims, conf)
}

fn connected(lb: &Lb) -> bool {
    lb.metric("inferlb_cluster_connected") == 1.0
}

/// One replica's entry in `/admin/replicas`, if it is listed.
fn listed(lb: &Lb, id: &str) -> Option<Value> {
    let all = lb.admin("GET", "/admin/replicas");
    all["replicas"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["id"] == id).cloned())
}

fn add_replica(lb: &Lb, body: Value) -> (u16, Value) {
    let r = http()
        .post(lb.admin_url("/admin/replicas"))
        .json(&body)
        .send()
        .expect("admin");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn a_replica_added_at_runtime_names_its_key_and_redis_never_holds_it() {
    let root = tempfile::tempdir().expect("tempdir");
    let redis = Redis::start(root.path());
    let (a, b) = two_sims(root.path(), &[]);
    // Everything any instance sends to Redis from here on.
    let seen = root.path().join("monitor.txt");
    let mut monitor = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "MONITOR"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&seen).expect("monitor file"))
        .spawn()
        .expect("redis-cli MONITOR");
    let started = wait_until(Duration::from_secs(5), || {
        redis.cli(&["PING"]).is_some()
            && std::fs::read_to_string(&seen).is_ok_and(|t| t.contains("PING"))
    });
    assert!(started, "MONITOR did not start");
    // Each instance holds gpu1's key in its own environment, under the same name.
    let one = instance(
        root.path(),
        "one",
        &[&a],
        &redis.cluster_conf("one"),
        &[("GPU1_KEY", "key-of-one-0001")],
    );
    let two = instance(
        root.path(),
        "two",
        &[&a],
        &redis.cluster_conf("two"),
        &[("GPU1_KEY", "key-of-two-0002")],
    );
    assert!(wait_until(Duration::from_secs(10), || connected(&one)
        && connected(&two)));

    // A key itself is refused, with what to send instead.
    let (status, v) = add_replica(
        &one,
        json!({"id": "gpu1", "address": b.addr(), "api_key": "literal-secret-1"}),
    );
    assert_eq!(status, 400, "{v}");
    let message = v["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("api_key_env") && message.contains("api_key_file"),
        "{v}"
    );
    assert!(!message.contains("literal-secret"), "{v}");
    assert!(listed(&one, "gpu1").is_none());

    let (status, v) = add_replica(
        &one,
        json!({"id": "gpu1", "address": b.addr(), "api_key_env": "GPU1_KEY"}),
    );
    assert_eq!(status, 201, "{v}");
    let shared = wait_until(Duration::from_secs(10), || {
        [&one, &two]
            .iter()
            .all(|lb| listed(lb, "gpu1").is_some_and(|r| r["live"] == true))
    });
    assert!(shared, "{}", two.admin("GET", "/admin/replicas"));
    // Each instance sends gpu1 the key of its own environment.
    assert_eq!(keys_sent(&one, &["gpu1"]), ["Bearer key-of-one-0001"]);
    assert_eq!(keys_sent(&two, &["gpu1"]), ["Bearer key-of-two-0002"]);

    // Redis holds where the key is read, never the key; nothing sent to it carried one.
    let stored = redis
        .cli(&["GET", "inferlb:replica:gpu1"])
        .unwrap_or_default();
    assert!(
        stored.contains("\"api_key_env\":\"GPU1_KEY\""),
        "{stored:?}"
    );
    let _ = monitor.kill();
    let _ = monitor.wait();
    let commands = std::fs::read_to_string(&seen).unwrap_or_default();
    assert!(commands.contains("inferlb:replica:gpu1"), "{commands}");
    for secret in ["key-of-one", "key-of-two", "literal-secret"] {
        assert!(
            !commands.contains(secret),
            "{secret} sent to Redis:\n{commands}"
        );
    }
}

/// A CA and a certificate for 127.0.0.1 it issued, as PEM files in `dir`: (CA, cert, key).
fn redis_certificates(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "inferlb test redis CA");
    let ca = params.self_signed(&ca_key).expect("CA");
    let key = KeyPair::generate().expect("key");
    let params = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    let cert = params.signed_by(&key, &ca, &ca_key).expect("sign");
    let files = (
        dir.join("redis-ca.pem"),
        dir.join("redis.crt"),
        dir.join("redis.key"),
    );
    std::fs::write(&files.0, ca.pem()).expect("write");
    std::fs::write(&files.1, cert.pem()).expect("write");
    std::fs::write(&files.2, key.serialize_pem()).expect("write");
    files
}

#[test]
fn two_instances_share_a_drain_through_redis_over_tls_with_a_password() {
    let root = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = redis_certificates(root.path());
    let password = "redis-pass-7f3a9c";
    let redis = Redis::start_tls(
        root.path(),
        RedisTls {
            cert_file: cert,
            key_file: key,
            ca_file: ca.clone(),
            password: password.into(),
        },
    );
    assert!(redis.url().starts_with("rediss://"));
    let password_file = root.path().join("redis-password");
    replace(&password_file, &format!("{password}\n"));
    let (a, b) = two_sims(root.path(), &[]);
    let cluster = |name: &str, secret: &str| {
        format!(
            "  cluster: {{redis_url: \"{}\", instance_id: \"{name}\", redis_ca_file: {ca:?}, {secret}}}\n",
            redis.url()
        )
    };
    // One reads the password from a file, the other from its environment.
    let one = instance(
        root.path(),
        "one",
        &[&a, &b],
        &cluster("one", &format!("redis_password_file: {password_file:?}")),
        &[],
    );
    let two = instance(
        root.path(),
        "two",
        &[&a, &b],
        &cluster("two", "redis_password_env: REDIS_PASSWORD"),
        &[("REDIS_PASSWORD", password)],
    );
    let up = wait_until(Duration::from_secs(10), || {
        connected(&one) && connected(&two)
    });
    assert!(up, "{}\n{}", one.proc.log_text(), two.proc.log_text());

    one.admin("POST", "/admin/replicas/gpu0/drain");
    let drained = wait_until(Duration::from_secs(5), || {
        two.replica_state("gpu0")["draining"] == true
    });
    assert!(drained, "{}", two.admin("GET", "/admin/replicas"));
    assert!(redis.exists("inferlb:drain:gpu0"));
    for lb in [&one, &two] {
        let log = lb.proc.log_text();
        assert!(!log.contains(password), "{log}");
    }
}
