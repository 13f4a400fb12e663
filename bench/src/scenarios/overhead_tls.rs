//! The proxy's own cost over HTTPS: inferlb and nginx each terminating TLS in front of the same
//! plain replicas (which answer at once), beside the same two processes' plain listeners and a
//! direct connection, in rounds whose order rotates.
//!
//! Both TLS servers present one certificate (ECDSA P-256, for 127.0.0.1 and localhost) from a CA
//! made here at start with rcgen, and the client trusts only that CA. The client (reqwest on
//! rustls with ring) offers TLS 1.3 only, one cipher suite (TLS_AES_128_GCM_SHA256), one key
//! exchange group (X25519) and ALPN http/1.1 only, so both servers negotiate exactly that;
//! nginx is pinned to the same on its side too. The http rows of inferlb and nginx are the
//! plain listeners of the same two processes. What each server negotiated is read from a
//! handshake at start and printed under the table. Connections are kept alive and reused, as
//! for the plain rows, and warmed up before each measurement: the rows are steady state, not
//! handshakes.
//!
//! Latency and throughput on a 2-core machine shared with other work move with that work; the
//! CPU time the server process spends per request (read from /proc around a fixed number of
//! requests from 32 clients) moves much less, so it is measured too.

use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inferlb_harness::{Lb, LbConf, Nginx, NginxTls, Replica, Sim};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::crypto::ring as provider;
use serde::Serialize;

use crate::client::{pct, small_request};
use crate::cluster::sim_caps;
use crate::scenarios::overhead::{overhead_target, Latency};
use crate::Sizes;

/// The one TLS 1.3 cipher suite both servers are measured with (IANA and OpenSSL name).
pub const SUITE: &str = "TLS_AES_128_GCM_SHA256";
/// The one key-exchange group (OpenSSL's name).
const GROUP: &str = "X25519";

/// One metric over the rounds.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// NaN everywhere when no round measured it.
    fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        Spread {
            median: pct(&v, 0.5),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// `median (min–max)`, or the value alone when there was one round.
    fn cell(&self, decimals: usize) -> String {
        if self.min == self.max || self.median.is_nan() {
            format!("{:.decimals$}", self.median)
        } else {
            format!(
                "{:.decimals$} ({:.decimals$}–{:.decimals$})",
                self.median, self.min, self.max
            )
        }
    }
}

/// One target over every round.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TlsRow {
    /// direct | inferlb | nginx
    pub target: String,
    /// http | https
    pub scheme: String,
    /// Each round's measurement.
    pub rounds: Vec<Latency>,
    pub fixed_p50_ms: Spread,
    pub fixed_p99_ms: Spread,
    pub saturation_rps: Spread,
    pub saturation_p50_ms: Spread,
    pub saturation_p99_ms: Spread,
    pub sse_gap_p50_ms: Spread,
    pub sse_gap_p99_ms: Spread,
    /// CPU time of the server's process(es) per request at saturation, µs, each round.
    pub cpu_us_rounds: Vec<f64>,
    pub cpu_us_per_request: Spread,
    /// Over every round.
    pub errors: u64,
}

impl TlsRow {
    fn new(target: &str, scheme: &str) -> TlsRow {
        TlsRow {
            target: target.into(),
            scheme: scheme.into(),
            ..TlsRow::default()
        }
    }

    fn summarize(&mut self) {
        let r = &self.rounds;
        self.fixed_p50_ms = Spread::of(r.iter().map(|l| l.fixed_p50_ms));
        self.fixed_p99_ms = Spread::of(r.iter().map(|l| l.fixed_p99_ms));
        self.saturation_rps = Spread::of(r.iter().map(|l| l.saturation_rps));
        self.saturation_p50_ms = Spread::of(r.iter().map(|l| l.saturation_p50_ms));
        self.saturation_p99_ms = Spread::of(r.iter().map(|l| l.saturation_p99_ms));
        self.sse_gap_p50_ms = Spread::of(r.iter().map(|l| l.sse_gap_p50_ms));
        self.sse_gap_p99_ms = Spread::of(r.iter().map(|l| l.sse_gap_p99_ms));
        self.cpu_us_per_request = Spread::of(self.cpu_us_rounds.iter().copied());
        self.errors = r.iter().map(|l| l.errors).sum();
    }
}

/// Everything the HTTPS pass measured.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TlsOverheadResult {
    pub rows: Vec<TlsRow>,
    /// Per HTTPS target: what a handshake with the bench's client negotiated
    /// (`TLSv1_3 TLS13_AES_128_GCM_SHA256 X25519 http/1.1`), or why it failed.
    pub negotiated: Vec<(String, String)>,
    pub rounds: usize,
    /// Seconds of each phase (fixed rate, saturation).
    pub seconds: f64,
    /// Requests of each CPU measurement.
    pub cpu_requests: usize,
    /// Targets that could not be measured, and why.
    pub skipped: Vec<String>,
}

/// The test PKI: the CA's certificate (DER, for the client's roots) and the server's files.
struct Pki {
    ca_der: rustls::pki_types::CertificateDer<'static>,
    cert_file: std::path::PathBuf,
    key_file: std::path::PathBuf,
}

/// A CA and one server certificate from it, for 127.0.0.1 and localhost, written into `dir`.
fn make_pki(dir: &Path) -> Pki {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "inferlb bench CA");
    let ca = ca_params.self_signed(&ca_key).expect("self-signed CA");
    let key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .expect("server params");
    params
        .distinguished_name
        .push(DnType::CommonName, "inferlb bench server");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca, &ca_key).expect("sign");
    let (cert_file, key_file) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert_file, cert.pem()).expect("write the certificate");
    std::fs::write(&key_file, key.serialize_pem()).expect("write the key");
    std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write the CA");
    Pki {
        ca_der: ca.der().clone(),
        cert_file,
        key_file,
    }
}

/// The client's TLS: TLS 1.3, [`SUITE`], X25519 and ALPN http/1.1 only, trusting only `ca`.
fn pinned_tls(ca: &rustls::pki_types::CertificateDer<'static>) -> rustls::ClientConfig {
    let crypto = rustls::crypto::CryptoProvider {
        cipher_suites: vec![provider::cipher_suite::TLS13_AES_128_GCM_SHA256],
        kx_groups: vec![provider::kx_group::X25519],
        ..provider::default_provider()
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("the test CA as a root");
    let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(crypto))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3 with the pinned suite")
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    c
}

/// One handshake with `tls` against a loopback port: what was negotiated.
fn negotiated(port: u16, tls: &rustls::ClientConfig) -> Result<String, String> {
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    let mut conn =
        rustls::ClientConnection::new(Arc::new(tls.clone()), name).map_err(|e| e.to_string())?;
    let mut sock = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    let limit = Some(Duration::from_secs(5));
    sock.set_read_timeout(limit).map_err(|e| e.to_string())?;
    sock.set_write_timeout(limit).map_err(|e| e.to_string())?;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).map_err(|e| e.to_string())?;
    }
    let said = format!(
        "{} {} {} {}",
        conn.protocol_version()
            .map_or("?".into(), |v| format!("{v:?}")),
        conn.negotiated_cipher_suite()
            .map_or("?".into(), |s| format!("{:?}", s.suite())),
        conn.negotiated_key_exchange_group()
            .map_or("?".into(), |g| format!("{:?}", g.name())),
        conn.alpn_protocol()
            .map_or("no ALPN".into(), |p| String::from_utf8_lossy(p)
                .into_owned()),
    );
    conn.send_close_notify();
    let _ = conn.complete_io(&mut sock);
    Ok(said)
}

/// 64 requests, 32 at a time: the pool holds warm connections (TLS handshakes done) before a
/// measurement starts.
async fn warm_up(client: &reqwest::Client, base: &str) {
    for _ in 0..2 {
        let batch = (0..32).map(|_| small_request(client, base));
        futures::future::join_all(batch).await;
    }
}

/// Clock ticks a second of /proc's CPU times (`getconf CLK_TCK`; Linux's USER_HZ is 100).
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// A process's user and system CPU time so far (every thread's), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // After the command's ")": state ppid ... utime (the 12th) stime (the 13th).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse::<u64>().ok())
        .sum()
}

/// `pid` and its children (nginx's master and its workers).
fn with_children(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let parent = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| {
                let rest = s.rsplit_once(')')?.1.to_string();
                rest.split_whitespace().nth(1)?.parse::<u32>().ok()
            });
        if parent == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// `requests` small requests from 32 closed-loop clients: the CPU time `pids` spent, µs a
/// request (NaN when a request failed or nothing was counted).
async fn cpu_per_request(
    client: &reqwest::Client,
    base: &str,
    pids: &[u32],
    requests: usize,
) -> f64 {
    let ticks = || pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>();
    let before = ticks();
    let left = Arc::new(AtomicUsize::new(requests));
    let clients = (0..32).map(|_| {
        let left = left.clone();
        async move {
            let mut failed = 0;
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                if small_request(client, base).await.is_none() {
                    failed += 1;
                }
            }
            failed
        }
    });
    let failed: usize = futures::future::join_all(clients).await.into_iter().sum();
    let spent = ticks().saturating_sub(before);
    if failed > 0 || spent == 0 {
        return f64::NAN;
    }
    spent as f64 / clock_ticks() * 1e6 / requests as f64
}

/// The pass: `rounds` rounds (1 when `smoke`, over the HTTPS targets only) of every target.
pub async fn overhead_tls(
    client: &reqwest::Client,
    s: &Sizes,
    rounds: usize,
    smoke: bool,
) -> TlsOverheadResult {
    let rounds = if smoke { 1 } else { rounds.max(1) };
    let mut out = TlsOverheadResult {
        rounds,
        seconds: s.overhead_seconds,
        ..TlsOverheadResult::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = make_pki(dir.path());
    let tls = pinned_tls(&pki.ca_der);
    let https = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(256)
        .timeout(Duration::from_secs(600))
        .http1_only()
        .use_preconfigured_tls(tls.clone())
        .build()
        .expect("the HTTPS client");

    // The same replicas as the plain overhead pass: they answer at once.
    let (sims_dir, lb_dir, nginx_dir) = (
        dir.path().join("sims"),
        dir.path().join("lb"),
        dir.path().join("nginx"),
    );
    for d in [&sims_dir, &lb_dir, &nginx_dir] {
        std::fs::create_dir_all(d).expect("a scenario directory");
    }
    let flags = [
        "--speed",
        "1",
        "--cache-tokens",
        "100000",
        "--prefill-tokens-per-s",
        "1e9",
        "--decode-interval-ms",
        "5",
    ];
    let learnt = sim_caps().cache_config_info;
    let (sims, lb, nginx) = tokio::task::block_in_place(|| {
        let sims: Vec<Sim> = (0..2)
            .map(|i| Sim::spawn(&sims_dir, &format!("gpu{i}"), &flags))
            .collect();
        for sim in &sims {
            sim.assert_healthy();
        }
        // inferlb as the plain overhead pass runs it, with TLS on `listen` and the plain
        // listener beside it: one process serves both rows.
        let plain_port = inferlb_harness::free_port();
        let conf = LbConf {
            threads: Some(2),
            max_retries: Some(4),
            routing: Some("adaptive".into()),
            health_interval_seconds: Some(0.5),
            load_poll_interval_seconds: Some(0.25),
            replicas: sims
                .iter()
                .map(|sim| Replica {
                    cache_tokens: (!learnt).then_some(100_000),
                    ..Replica::of(sim)
                })
                .collect(),
            extra: format!(
                "  tls: {{cert_file: '{}', key_file: '{}'}}\n  plain_listen: 127.0.0.1:{plain_port}\n",
                pki.cert_file.display(),
                pki.key_file.display()
            ),
            ..LbConf::default()
        };
        let lb = Lb::start_logged(&lb_dir, &[], conf, None, "warn");
        let nginx = Nginx::find().map(|bin| {
            let nginx_tls = NginxTls {
                cert_file: pki.cert_file.clone(),
                key_file: pki.key_file.clone(),
                protocols: Some("TLSv1.3".into()),
                ciphersuites: Some(SUITE.into()),
                curves: Some(GROUP.into()),
            };
            let upstreams: Vec<u16> = sims.iter().map(|sim| sim.port).collect();
            Nginx::start_tls(&bin, &nginx_dir, &upstreams, &nginx_tls)
        });
        (sims, (lb, plain_port), nginx)
    });
    let (lb, plain_port) = lb;

    // (row, base URL, client, the server's processes)
    let lb_pids = vec![lb.proc.pid()];
    let mut targets: Vec<(TlsRow, String, &reqwest::Client, Vec<u32>)> = vec![];
    if !smoke {
        let sim_pids = sims[0].proc().map(|p| p.pid()).into_iter().collect();
        targets.push((
            TlsRow::new("direct", "http"),
            sims[0].url(""),
            client,
            sim_pids,
        ));
        targets.push((
            TlsRow::new("inferlb", "http"),
            format!("http://127.0.0.1:{plain_port}"),
            client,
            lb_pids.clone(),
        ));
    }
    targets.push((
        TlsRow::new("inferlb", "https"),
        format!("https://127.0.0.1:{}", lb.port),
        &https,
        lb_pids,
    ));
    let mut tls_ports = vec![("inferlb".to_string(), lb.port)];
    match &nginx {
        None => out
            .skipped
            .push("nginx: not installed (make deps installs it)".into()),
        Some(Err(e)) => out.skipped.push(format!("nginx: {e}")),
        Some(Ok(n)) => {
            let pids = tokio::task::block_in_place(|| with_children(n.pid()));
            if !smoke {
                targets.push((TlsRow::new("nginx", "http"), n.url(), client, pids.clone()));
            }
            let url = n.tls_url("127.0.0.1").expect("nginx's TLS port");
            targets.push((TlsRow::new("nginx", "https"), url, &https, pids));
            tls_ports.push(("nginx".into(), n.tls_port.unwrap_or_default()));
        }
    }
    for s in &out.skipped {
        eprintln!("[overhead https] {s}: skipped");
    }
    for (name, port) in tls_ports {
        let said = tokio::task::block_in_place(|| negotiated(port, &tls))
            .unwrap_or_else(|e| format!("handshake failed: {e}"));
        eprintln!("[overhead https] {name} negotiated {said}");
        out.negotiated.push((name, said));
    }

    // Each round starts one target later, so no target is always first or last.
    let n = targets.len();
    let cpu_requests = if smoke { 2_000 } else { 20_000 };
    out.cpu_requests = cpu_requests;
    for round in 0..rounds {
        for k in 0..n {
            let (row, base, c, pids) = &mut targets[(round + k) % n];
            eprintln!(
                "[overhead https] round {}/{rounds}: {} over {}",
                round + 1,
                row.target,
                row.scheme
            );
            warm_up(c, base).await;
            let name = format!("{} {}", row.target, row.scheme);
            row.rounds.push(overhead_target(c, &name, base, s).await);
            let cpu = cpu_per_request(c, base, pids, cpu_requests).await;
            row.cpu_us_rounds.push(cpu);
        }
    }
    out.rows = targets
        .into_iter()
        .map(|(mut row, _, _, _)| {
            row.summarize();
            row
        })
        .collect();
    // Stopped before their directory goes: nginx (master and workers), inferlb, the replicas.
    drop(nginx);
    drop(lb);
    drop(sims);
    out
}

/// The markdown table, with what TLS adds (each round's https minus the same round's http, the
/// median over the rounds) under it.
pub fn table(r: &TlsOverheadResult) -> String {
    if r.rows.is_empty() {
        return String::new();
    }
    let mut md = format!(
        "\nProxy overhead over HTTPS (as above; TLS 1.3, {SUITE}, {GROUP}, one ECDSA P-256 certificate from a CA made at bench start, HTTP/1.1 by ALPN; the client offers only that suite and group, nginx is pinned to them too; connections kept alive and reused (nginx's keepalive_requests raised from 1,000 for both its rows), warmed up before each measurement: steady state, no handshakes; replicas plain HTTP; server CPU: user+system time of the process that answers the client (the replica for direct, inferlb, nginx's master and workers; the replicas' not counted) over {} requests from 32 clients, per request; {}):\n\n",
        r.cpu_requests,
        if r.rounds == 1 {
            "1 round".to_string()
        } else {
            format!(
                "{} rounds in rotating order, each cell the median (min–max) of the rounds",
                r.rounds
            )
        }
    );
    md.push_str("| target | scheme | p50 at 200 rps (ms) | p99 at 200 rps (ms) | saturation (req/s) | p50 at saturation (ms) | p99 at saturation (ms) | SSE gap p50 (ms) | SSE gap p99 (ms) | server CPU per request (µs) | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for row in &r.rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.target,
            row.scheme,
            row.fixed_p50_ms.cell(2),
            row.fixed_p99_ms.cell(2),
            row.saturation_rps.cell(0),
            row.saturation_p50_ms.cell(2),
            row.saturation_p99_ms.cell(2),
            row.sse_gap_p50_ms.cell(2),
            row.sse_gap_p99_ms.cell(2),
            row.cpu_us_per_request.cell(1),
            row.errors
        ));
    }
    let find = |t: &str, s: &str| r.rows.iter().find(|x| x.target == t && x.scheme == s);
    for target in ["inferlb", "nginx"] {
        if let (Some(h), Some(t)) = (find(target, "http"), find(target, "https")) {
            let paired = |f: fn(&Latency) -> f64, ratio: bool| {
                Spread::of(h.rounds.iter().zip(&t.rounds).map(|(a, b)| {
                    if ratio {
                        f(b) / f(a)
                    } else {
                        f(b) - f(a)
                    }
                }))
            };
            let cpu = Spread::of(
                h.cpu_us_rounds
                    .iter()
                    .zip(&t.cpu_us_rounds)
                    .map(|(a, b)| b - a),
            );
            md.push_str(&format!(
                "\nTLS adds to {target}: {} ms at p50 and {} ms at p99 at 200 rps, {} µs of CPU a request; saturation throughput https/http = {}.\n",
                paired(|l| l.fixed_p50_ms, false).cell(2),
                paired(|l| l.fixed_p99_ms, false).cell(2),
                cpu.cell(1),
                paired(|l| l.saturation_rps, true).cell(2),
            ));
        }
    }
    if let (Some(i), Some(n)) = (find("inferlb", "https"), find("nginx", "https")) {
        let paired = Spread::of(
            i.rounds
                .iter()
                .zip(&n.rounds)
                .map(|(a, b)| a.saturation_rps / b.saturation_rps),
        );
        md.push_str(&format!(
            "\nOver HTTPS, saturation throughput inferlb/nginx = {}.\n",
            paired.cell(2)
        ));
    }
    let said: Vec<String> = r
        .negotiated
        .iter()
        .map(|(t, s)| format!("{t}: {s}"))
        .collect();
    if !said.is_empty() {
        md.push_str(&format!(
            "\nNegotiated with the bench's client: {}.\n",
            said.join("; ")
        ));
    }
    for s in &r.skipped {
        md.push_str(&format!("\nSkipped: {s}.\n"));
    }
    md
}

/// Why the smoke run has no good measurement from this pass (empty: it has).
pub fn broken(r: &TlsOverheadResult) -> Vec<String> {
    let mut out: Vec<String> = r
        .rows
        .iter()
        .filter(|row| {
            row.fixed_p50_ms.median.is_nan()
                || row.cpu_us_per_request.median.is_nan()
                || row.errors > 0
        })
        .map(|row| format!("overhead, {} over {}", row.target, row.scheme))
        .collect();
    for (target, said) in &r.negotiated {
        if !said.contains("TLS13_AES_128_GCM_SHA256") {
            out.push(format!("overhead over https, {target} negotiated {said}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_is_the_median_and_the_range_of_the_rounds() {
        let s = Spread::of([3.0, 1.0, f64::NAN, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(s.cell(1), "2.0 (1.0–3.0)");
        assert_eq!(Spread::of([4.0]).cell(0), "4");
        assert!(Spread::of([]).median.is_nan());
    }
}
