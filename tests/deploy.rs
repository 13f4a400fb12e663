//! deploy/k8s: every manifest parses and is named, the kustomization lists them all, the
//! ConfigMap's conf passes the real `inferlb -t`, and the Deployment, Services and conf agree
//! on ports, probe paths, names and the grace period. deploy/Dockerfile (no container runtime
//! here, so it is read, not built): its stages, the binary it copies out of the build stage's
//! cargo target, its user, ports and entrypoint agree with Cargo.toml, the Deployment and the
//! conf, and .dockerignore keeps what the build reads.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s")
}

/// One YAML document of one file in deploy/k8s.
struct Doc {
    file: String,
    value: Value,
}

/// Every document of every deploy/k8s/*.yaml, in file order; empty documents are skipped.
fn docs() -> Vec<Doc> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(k8s_dir())
        .expect("deploy/k8s exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no YAML file in deploy/k8s");
    let mut out = vec![];
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("read manifest");
        for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let value = Value::deserialize(de)
                .unwrap_or_else(|e| panic!("{file}: document {i} does not parse: {e}"));
            if !value.is_null() {
                out.push(Doc {
                    file: file.clone(),
                    value,
                });
            }
        }
    }
    out
}

/// The value at a dotted path (`spec.template.spec.containers.0`); numbers index sequences.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, key| match key.parse::<usize>() {
            Ok(i) if v.is_sequence() => v.get(i),
            _ => v.get(key),
        })
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{path}: missing or not a string"))
}

fn u64_at(v: &Value, path: &str) -> u64 {
    at(v, path)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{path}: missing or not a number"))
}

/// The only object of this kind and name.
fn object<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Doc> = docs
        .iter()
        .filter(|d| {
            at(&d.value, "kind").and_then(Value::as_str) == Some(kind)
                && at(&d.value, "metadata.name").and_then(Value::as_str) == Some(name)
        })
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}/{name} in deploy/k8s");
    &found[0].value
}

/// The port number of `host:port`.
fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{addr:?} is not host:port"))
}

/// The ConfigMap's `inferlb.yaml`, as text.
fn conf_text(docs: &[Doc]) -> String {
    let cm = object(docs, "ConfigMap", "inferlb");
    at(cm, "data")
        .and_then(|d| d.get("inferlb.yaml"))
        .and_then(Value::as_str)
        .expect("ConfigMap inferlb has data.\"inferlb.yaml\"")
        .to_owned()
}

fn conf(docs: &[Doc]) -> Value {
    serde_yaml::from_str(&conf_text(docs)).expect("inferlb.yaml parses")
}

/// The inferlb container of the inferlb Deployment.
fn container(deployment: &Value) -> &Value {
    let containers = at(deployment, "spec.template.spec.containers")
        .and_then(Value::as_sequence)
        .expect("containers");
    containers
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some("inferlb"))
        .expect("a container named inferlb")
}

/// A port as a container names it (`http`) or as a number, resolved to its number.
fn resolve_port(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("a port is a number or a name");
    at(container, "ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
        .map(|p| u64_at(p, "containerPort"))
        .unwrap_or_else(|| panic!("no container port named {name:?}"))
}

/// Where the Deployment mounts the Secret `inferlb-secrets`.
const SECRETS_DIR: &str = "/etc/inferlb-secrets/";

/// Runs the real binary with `-t -c` on `text`, its /tmp paths moved into a temporary dir and
/// the Secret's files (as an operator creates them) into another.
fn check_conf(text: &str) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let secrets = dir.path().join("secrets");
    std::fs::create_dir(&secrets).expect("secrets dir");
    for (file, value) in [
        ("client-keys", "a-client-key-0001\n"),
        ("vllm-api-key", "a-vllm-key-0001\n"),
        ("admin-token", "a-stand-in-admin-token-for-the-test\n"),
    ] {
        std::fs::write(secrets.join(file), value).expect("write secret");
    }
    let text = text
        .replace("/tmp/", &format!("{}/", dir.path().display()))
        .replace(SECRETS_DIR, &format!("{}/", secrets.display()));
    let file = dir.path().join("inferlb.yaml");
    std::fs::write(&file, text).expect("write conf");
    Command::new(env!("CARGO_BIN_EXE_inferlb"))
        .arg("-t")
        .arg("-c")
        .arg(&file)
        .env_remove("ROUTING")
        .output()
        .expect("run inferlb -t")
}

#[test]
fn every_manifest_parses_and_is_listed() {
    let docs = docs();
    for d in &docs {
        for key in ["apiVersion", "kind", "metadata.name"] {
            let v = at(&d.value, key).and_then(Value::as_str);
            assert!(
                v.is_some_and(|s| !s.is_empty()),
                "{}: a document has no {key}",
                d.file
            );
        }
    }
    let kustomization = object(&docs, "Kustomization", "inferlb");
    let listed: Vec<&str> = at(kustomization, "resources")
        .and_then(Value::as_sequence)
        .expect("kustomization resources")
        .iter()
        .map(|r| r.as_str().expect("a resource is a file name"))
        .collect();
    let mut files: Vec<&str> = docs
        .iter()
        .map(|d| d.file.as_str())
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    files.dedup();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(
        sorted, files,
        "kustomization.yaml lists every other manifest, once"
    );
    for kind in [
        "Namespace",
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
    ] {
        assert!(
            docs.iter().any(|d| str_at(&d.value, "kind") == kind),
            "a {kind} in deploy/k8s"
        );
    }
}

#[test]
fn configmap_conf_passes_inferlb_t() {
    let docs = docs();
    let text = conf_text(&docs);
    let out = check_conf(&text);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "inferlb -t refused the ConfigMap's conf: {stdout}{stderr}"
    );
    assert!(
        stdout.contains("configuration") && stdout.contains("is valid"),
        "{stdout}"
    );
    assert!(!stderr.contains("warning"), "warnings: {stderr}");

    // The check is not vacuous: the same conf with a broken key is refused.
    let broken = text.replace("admin_listen: 0.0.0.0:7771", "admin_listen: nowhere");
    assert_ne!(broken, text);
    let out = check_conf(&broken);
    assert!(!out.status.success(), "a broken admin_listen passed -t");
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin_listen"));

    // Its admin listener is not loopback: without the token it would not start.
    let open = text.replace("token_file: /etc/inferlb-secrets/admin-token", "");
    assert_ne!(open, text);
    let out = check_conf(&open);
    assert!(
        !out.status.success(),
        "an open admin API on 0.0.0.0 passed -t"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("inferlb.admin.token_file"));
}

#[test]
fn deployment_agrees_with_the_conf() {
    let docs = docs();
    let conf = conf(&docs);
    let listen = str_at(&conf, "inferlb.listen");
    let admin = str_at(&conf, "inferlb.admin_listen");
    assert!(
        admin.starts_with("0.0.0.0:"),
        "admin_listen must be reachable from the kubelet's probes: {admin}"
    );
    let deployment = object(&docs, "Deployment", "inferlb");
    assert!(
        u64_at(deployment, "spec.replicas") >= 2,
        "several instances"
    );
    let c = container(deployment);

    let ports: Vec<u64> = at(c, "ports")
        .and_then(Value::as_sequence)
        .expect("container ports")
        .iter()
        .map(|p| u64_at(p, "containerPort"))
        .collect();
    assert!(
        ports.contains(&port_of(listen)),
        "container port for {listen}"
    );
    assert!(
        ports.contains(&port_of(admin)),
        "container port for {admin}"
    );

    for (probe, path) in [("readinessProbe", "/ready"), ("livenessProbe", "/metrics")] {
        let get = at(c, &format!("{probe}.httpGet")).unwrap_or_else(|| panic!("{probe}.httpGet"));
        assert_eq!(str_at(get, "path"), path, "{probe} path");
        let port = resolve_port(c, get.get("port").expect("probe port"));
        assert_eq!(port, port_of(admin), "{probe} on the admin port");
    }

    // The conf is read where the command says, from the ConfigMap.
    let command: Vec<&str> = at(c, "command")
        .and_then(Value::as_sequence)
        .expect("command")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let conf_path = command
        .windows(2)
        .find(|w| w[0] == "-c")
        .map(|w| w[1])
        .expect("command has -c FILE");
    assert!(!command.contains(&"-d"), "runs in the foreground");
    let pod = at(deployment, "spec.template.spec").expect("pod spec");
    let mounts = at(c, "volumeMounts")
        .and_then(Value::as_sequence)
        .expect("volumeMounts");
    let volumes = at(pod, "volumes")
        .and_then(Value::as_sequence)
        .expect("volumes");
    let volume_of = |dir: &str| -> &Value {
        let mount = mounts
            .iter()
            .find(|m| str_at(m, "mountPath") == dir)
            .unwrap_or_else(|| panic!("nothing mounted at {dir}"));
        let name = str_at(mount, "name");
        volumes
            .iter()
            .find(|v| str_at(v, "name") == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    let (conf_dir, conf_file) = conf_path.rsplit_once('/').expect("an absolute path");
    assert_eq!(conf_file, "inferlb.yaml");
    assert_eq!(str_at(volume_of(conf_dir), "configMap.name"), "inferlb");
    // The admin token is a file of a Secret, not a line of the ConfigMap.
    let token = str_at(&conf, "inferlb.admin.token_file");
    let (token_dir, token_key) = token.rsplit_once('/').expect("an absolute path");
    let secret = volume_of(token_dir);
    assert!(
        at(secret, "secret.secretName").is_some(),
        "{token} is not from a Secret"
    );
    if let Some(items) = at(secret, "secret.items").and_then(Value::as_sequence) {
        assert!(items.iter().any(|i| str_at(i, "path") == token_key));
    }

    // Client keys from the Secret, mounted where the conf reads them; none in the conf.
    let keys = str_at(&conf, "inferlb.api_keys_file");
    let (keys_dir, _) = keys.rsplit_once('/').expect("an absolute path");
    assert_eq!(format!("{keys_dir}/"), SECRETS_DIR);
    assert_eq!(
        str_at(volume_of(keys_dir), "secret.secretName"),
        "inferlb-secrets"
    );
    let keys_mount = mounts
        .iter()
        .find(|m| str_at(m, "mountPath") == keys_dir)
        .expect("the Secret's mount");
    assert!(
        at(keys_mount, "subPath").is_none(),
        "a subPath mount is never updated: a rotated key would not be seen"
    );
    assert!(
        at(&conf, "inferlb.api_keys").is_none(),
        "keys in the ConfigMap"
    );

    // A read-only root: every file inferlb writes is under a writable emptyDir.
    assert_eq!(
        at(c, "securityContext.readOnlyRootFilesystem").and_then(Value::as_bool),
        Some(true)
    );
    let non_root = at(pod, "securityContext.runAsNonRoot")
        .or_else(|| at(c, "securityContext.runAsNonRoot"))
        .and_then(Value::as_bool);
    assert_eq!(non_root, Some(true), "runAsNonRoot");
    for key in ["pid_file", "upgrade_sock"] {
        let path = str_at(&conf, key);
        let dir = Path::new(path).parent().unwrap().to_str().unwrap();
        assert!(
            at(volume_of(dir), "emptyDir").is_some(),
            "{key} {path} is on an emptyDir"
        );
    }
    if let Some(state) = at(&conf, "inferlb.state_file").and_then(Value::as_str) {
        let dir = Path::new(state).parent().unwrap().to_str().unwrap();
        assert!(
            at(volume_of(dir), "emptyDir").is_some(),
            "state_file {state}"
        );
    }

    // SIGTERM: streams get grace_period_seconds, the runtime graceful_shutdown_timeout_seconds
    // more, after the preStop hook; the kubelet must not SIGKILL before.
    let grace = u64_at(&conf, "grace_period_seconds");
    let shutdown = u64_at(&conf, "graceful_shutdown_timeout_seconds");
    let pre_stop = at(c, "lifecycle.preStop.sleep.seconds")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let pod_grace = u64_at(pod, "terminationGracePeriodSeconds");
    assert!(
        pod_grace >= grace,
        "{pod_grace} s < grace_period_seconds {grace}"
    );
    assert!(
        pod_grace >= pre_stop + grace + shutdown,
        "terminationGracePeriodSeconds {pod_grace} < preStop {pre_stop} + grace {grace} + shutdown {shutdown}"
    );
}

#[test]
fn services_reach_what_the_conf_names() {
    let docs = docs();
    let conf = conf(&docs);
    let deployment = object(&docs, "Deployment", "inferlb");
    let c = container(deployment);
    let pod_labels = at(deployment, "spec.template.metadata.labels").expect("pod labels");
    let selects_pods = |selector: &Value| {
        let m = selector.as_mapping().expect("selector is a mapping");
        !m.is_empty() && m.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
    };

    // The clients' Service and the admin one reach the conf's two listeners.
    for (name, key) in [
        ("inferlb", "inferlb.listen"),
        ("inferlb-admin", "inferlb.admin_listen"),
    ] {
        let svc = object(&docs, "Service", name);
        assert!(
            selects_pods(at(svc, "spec.selector").expect("selector")),
            "Service {name} selects the inferlb pods"
        );
        let target = at(svc, "spec.ports.0.targetPort").expect("targetPort");
        assert_eq!(
            resolve_port(c, target),
            port_of(str_at(&conf, key)),
            "Service {name} targets {key}"
        );
    }
    let admin = object(&docs, "Service", "inferlb-admin");
    let spec_type = at(admin, "spec.type").and_then(Value::as_str);
    assert!(
        matches!(spec_type, None | Some("ClusterIP")),
        "the admin Service stays cluster-internal"
    );
    let annotations = at(admin, "metadata.annotations").expect("annotations");
    assert_eq!(
        annotations
            .get("prometheus.io/scrape")
            .and_then(Value::as_str),
        Some("true")
    );
    assert_eq!(
        annotations
            .get("prometheus.io/port")
            .and_then(Value::as_str),
        Some(
            port_of(str_at(&conf, "inferlb.admin_listen"))
                .to_string()
                .as_str()
        )
    );

    let pdb = object(&docs, "PodDisruptionBudget", "inferlb");
    assert!(selects_pods(
        at(pdb, "spec.selector.matchLabels").expect("pdb selector")
    ));
    assert_eq!(u64_at(pdb, "spec.minAvailable"), 1);

    // cluster.redis_url names the Valkey Service and its port.
    let url = str_at(&conf, "inferlb.cluster.redis_url");
    let host_port = url.strip_prefix("redis://").expect("a redis:// URL");
    let (host, port) = host_port.rsplit_once(':').expect("host:port");
    let valkey = object(&docs, "Service", host);
    assert_eq!(
        u64_at(valkey, "spec.ports.0.port"),
        port.parse::<u64>().unwrap()
    );
    object(&docs, "Deployment", host);

    // The DNS-discovered replica is the headless Service, in the kustomization's namespace.
    let replicas = at(&conf, "inferlb.replicas")
        .and_then(Value::as_sequence)
        .expect("replicas");
    assert_eq!(replicas.len(), 1);
    assert_eq!(str_at(&replicas[0], "discover"), "dns");
    let address = str_at(&replicas[0], "address");
    let host = address.rsplit_once(':').unwrap().0;
    let mut labels = host.split('.');
    let (service, namespace) = (labels.next().unwrap(), labels.next().expect("a namespace"));
    assert_eq!(
        labels.collect::<Vec<_>>(),
        ["svc", "cluster", "local"],
        "{address}"
    );
    let kustomization = object(&docs, "Kustomization", "inferlb");
    assert_eq!(str_at(kustomization, "namespace"), namespace);
    let headless = object(&docs, "Service", service);
    assert_eq!(str_at(headless, "spec.clusterIP"), "None");
    assert_eq!(u64_at(headless, "spec.ports.0.port"), port_of(address));
}

/// One stage of a Dockerfile: `FROM base AS name` and its instructions (keyword upper-cased,
/// the rest as written, continuation lines joined).
#[derive(Debug)]
struct Stage {
    base: String,
    name: Option<String>,
    instructions: Vec<(String, String)>,
}

impl Stage {
    /// The arguments of every instruction `keyword` in this stage.
    fn all(&self, keyword: &str) -> Vec<&str> {
        self.instructions
            .iter()
            .filter(|(k, _)| k == keyword)
            .map(|(_, a)| a.as_str())
            .collect()
    }

    /// The arguments of the last instruction `keyword` (the one that takes effect).
    fn last(&self, keyword: &str) -> &str {
        self.all(keyword)
            .last()
            .copied()
            .unwrap_or_else(|| panic!("no {keyword} in the stage FROM {}", self.base))
    }
}

/// deploy/Dockerfile's stages, in order.
fn dockerfile() -> Vec<Stage> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/Dockerfile");
    let text = std::fs::read_to_string(&path).expect("deploy/Dockerfile exists");
    let mut lines: Vec<String> = vec![];
    let mut open = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && open.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                open.push_str(head);
                open.push(' ');
            }
            None => {
                open.push_str(t);
                lines.push(std::mem::take(&mut open));
            }
        }
    }
    let mut stages: Vec<Stage> = vec![];
    for line in lines {
        let (keyword, args) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let (keyword, args) = (keyword.to_ascii_uppercase(), args.trim().to_string());
        if keyword == "FROM" {
            let words: Vec<&str> = args.split_whitespace().collect();
            let name = match words.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name.to_string()),
                [_] => None,
                _ => panic!("FROM {args}: expected `FROM image [AS name]`"),
            };
            stages.push(Stage {
                base: words[0].to_string(),
                name,
                instructions: vec![],
            });
        } else {
            let stage = stages
                .last_mut()
                .unwrap_or_else(|| panic!("{keyword} before the first FROM"));
            stage.instructions.push((keyword, args));
        }
    }
    stages
}

/// An exec-form (JSON array) instruction's words.
fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("{args}: not the exec (JSON) form: {e}"))
}

#[test]
fn dockerfile_builds_the_release_binary_and_runs_it_as_the_deployment_expects() {
    let stages = dockerfile();
    assert!(
        stages.len() >= 2,
        "multi-stage: a build stage and a run stage"
    );
    let run = stages.last().unwrap();
    let build_name = run
        .last("COPY")
        .split_whitespace()
        .find_map(|w| w.strip_prefix("--from="))
        .expect("the run stage copies from a build stage")
        .to_string();
    let build = stages
        .iter()
        .find(|s| s.name.as_deref() == Some(build_name.as_str()))
        .unwrap_or_else(|| panic!("no stage named {build_name}"));
    assert!(
        build.base.starts_with("rust:"),
        "the build stage is a Rust image: {}",
        build.base
    );
    // Small: distroless (no shell) or a slim Debian, and never the build image again.
    assert!(
        run.base.starts_with("gcr.io/distroless/cc") || run.base.contains("-slim"),
        "the run stage is a small image: {}",
        run.base
    );
    assert_ne!(run.base, build.base);

    // The build stage's cargo builds inferlb's binary, in release, from Cargo.lock.
    let cargo = build
        .all("RUN")
        .into_iter()
        .find(|r| r.contains("cargo build"))
        .expect("the build stage runs cargo build");
    let words: Vec<&str> = cargo.split_whitespace().collect();
    let flag = |f: &str| words.windows(2).find(|w| w[0] == f).map(|w| w[1]);
    assert!(words.contains(&"--release") && words.contains(&"--locked"));
    // Cargo.toml's `[package] name = "..."` (no TOML parser among the dependencies).
    let cargo_toml =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("Cargo.toml");
    let package = cargo_toml
        .split("[package]")
        .nth(1)
        .and_then(|p| p.lines().find_map(|l| l.trim().strip_prefix("name = ")))
        .map(|n| n.trim_matches('"'))
        .expect("the root package's name");
    assert_eq!(flag("--package").or(flag("-p")), Some(package));
    let bin = flag("--bin").expect("cargo build --bin NAME");
    // The root package's binary is src/main.rs, named after the package.
    assert_eq!(bin, package);
    assert!(Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/main.rs")
        .exists());
    assert_eq!(
        Path::new(env!("CARGO_BIN_EXE_inferlb"))
            .file_name()
            .unwrap(),
        bin
    );

    // What the run stage copies is where that build put it: <WORKDIR>/target/release/<bin>.
    let workdir = build.last("WORKDIR").trim_end_matches('/');
    let copy: Vec<&str> = run
        .last("COPY")
        .split_whitespace()
        .filter(|w| !w.starts_with("--"))
        .collect();
    let [from, to] = copy.as_slice() else {
        panic!("COPY --from={build_name} SOURCE DEST");
    };
    assert_eq!(*from, format!("{workdir}/target/release/{bin}"));
    assert!(
        build
            .all("COPY")
            .iter()
            .any(|c| c.split_whitespace().collect::<Vec<_>>() == [".", "."]),
        "the build stage copies the build context (the repository root) into its WORKDIR"
    );

    // The pod runs the image's user: not root, and the uid/gid the Deployment sets.
    let deployment_docs = docs();
    let deployment = object(&deployment_docs, "Deployment", "inferlb");
    let pod = at(deployment, "spec.template.spec").expect("pod spec");
    let user = run.last("USER");
    let (uid, gid) = user.split_once(':').unwrap_or((user, user));
    assert!(
        !matches!(uid, "root" | "0") && uid.parse::<u64>().is_ok(),
        "USER {user}: a numeric uid other than 0 (runAsNonRoot checks a numeric uid)"
    );
    assert_eq!(
        uid.parse::<u64>().ok(),
        at(pod, "securityContext.runAsUser").and_then(Value::as_u64)
    );
    assert_eq!(
        gid.parse::<u64>().ok(),
        at(pod, "securityContext.runAsGroup").and_then(Value::as_u64)
    );

    // EXPOSE: the conf's two listeners, which are the Deployment's container ports.
    let conf = conf(&deployment_docs);
    let c = container(deployment);
    let mut exposed: Vec<u64> = run
        .all("EXPOSE")
        .iter()
        .flat_map(|e| e.split_whitespace())
        .map(|p| p.trim_end_matches("/tcp").parse().expect("EXPOSE port"))
        .collect();
    exposed.sort();
    let mut listeners = vec![
        port_of(str_at(&conf, "inferlb.listen")),
        port_of(str_at(&conf, "inferlb.admin_listen")),
    ];
    listeners.sort();
    let mut container_ports: Vec<u64> = at(c, "ports")
        .and_then(Value::as_sequence)
        .expect("container ports")
        .iter()
        .map(|p| u64_at(p, "containerPort"))
        .collect();
    container_ports.sort();
    assert_eq!(exposed, listeners, "EXPOSE and the conf's listeners");
    assert_eq!(
        exposed, container_ports,
        "EXPOSE and the Deployment's ports"
    );

    // ENTRYPOINT: the copied binary (on distroless's PATH) reading the conf where the
    // Deployment mounts the ConfigMap, as the Deployment's own command does.
    let entry = exec_form(run.last("ENTRYPOINT"));
    assert_eq!(
        Path::new(to).parent(),
        Some(Path::new("/usr/local/bin")),
        "the binary goes on the PATH"
    );
    assert_eq!(
        entry[0],
        Path::new(to).file_name().unwrap().to_str().unwrap()
    );
    let command: Vec<String> = at(c, "command")
        .and_then(Value::as_sequence)
        .expect("command")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    assert_eq!(entry, command, "ENTRYPOINT and the Deployment's command");
    let conf_path = entry
        .windows(2)
        .find(|w| w[0] == "-c")
        .map(|w| w[1].clone())
        .expect("ENTRYPOINT has -c FILE");
    let (dir, file) = conf_path.rsplit_once('/').expect("an absolute path");
    let mount = at(c, "volumeMounts")
        .and_then(Value::as_sequence)
        .expect("volumeMounts")
        .iter()
        .find(|m| str_at(m, "mountPath") == dir)
        .unwrap_or_else(|| panic!("the Deployment mounts nothing at {dir}"));
    let volume = at(pod, "volumes")
        .and_then(Value::as_sequence)
        .expect("volumes")
        .iter()
        .find(|v| str_at(v, "name") == str_at(mount, "name"))
        .expect("the mount's volume");
    let config_map = object(
        &deployment_docs,
        "ConfigMap",
        str_at(volume, "configMap.name"),
    );
    assert!(
        at(config_map, "data").and_then(|d| d.get(file)).is_some(),
        "the ConfigMap has the key {file}"
    );
}

#[test]
fn dockerignore_keeps_what_the_build_reads_and_leaves_the_build_tree_out() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(".dockerignore")).expect(".dockerignore exists");
    let patterns: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    // Plain paths, `**/name` and `*.ext` (a root-level name): what this check can read right.
    let simple = |p: &&str| {
        let rest = p.strip_prefix("**/").or(p.strip_prefix("*.")).unwrap_or(p);
        !p.starts_with('!') && !rest.contains(['*', '?', '['])
    };
    assert!(patterns.iter().all(simple), "{patterns:?}");
    // Whether `path` (relative to the root) is left out of the build context.
    let ignored = |path: &str| {
        patterns.iter().any(|p| {
            let under = |prefix: &str| path == prefix || path.starts_with(&format!("{prefix}/"));
            if let Some(name) = p.strip_prefix("**/") {
                path.split('/').any(|part| part == name)
            } else if let Some(ext) = p.strip_prefix("*.") {
                !path.contains('/') && path.ends_with(&format!(".{ext}"))
            } else {
                under(p.trim_matches('/'))
            }
        })
    };
    for out in [".git", "target", "target/release/inferlb", "bench/results"] {
        assert!(ignored(out), "{out} stays out of the build context");
    }
    // Every workspace member's manifest and sources, the lockfile and the declared bench.
    let mut needed = vec![
        "Cargo.toml".to_string(),
        "Cargo.lock".into(),
        "src/main.rs".into(),
        "benches/hot_path.rs".into(),
    ];
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let members = workspace
        .split("members = [")
        .nth(1)
        .and_then(|m| m.split(']').next())
        .expect("workspace members");
    for m in members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| *m != "." && !m.is_empty())
    {
        needed.push(format!("{m}/Cargo.toml"));
        needed.push(format!("{m}/src"));
    }
    for path in &needed {
        assert!(root.join(path).exists(), "{path} exists");
        assert!(!ignored(path), "{path} is in the build context");
    }
}
