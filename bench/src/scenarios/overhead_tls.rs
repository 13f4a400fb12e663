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
use std::sync::Arc;
use std::time::Duration;

use inferlb_harness::{Lb, LbConf, Nginx, NginxTls};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::crypto::ring as provider;
use serde::Serialize;

use crate::procfs::with_children;
use crate::scenarios::overhead::{
    cpu_per_request, instant_replicas, lb_conf, overhead_target, rounds_note, rows_table, warm_up,
    Row, Spread,
};
use crate::Sizes;

/// The one TLS 1.3 cipher suite both servers are measured with (IANA and OpenSSL name).
pub const SUITE: &str = "TLS_AES_128_GCM_SHA256";
/// The one key-exchange group (OpenSSL's name).
const GROUP: &str = "X25519";

/// Everything the HTTPS pass measured.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TlsOverheadResult {
    pub rows: Vec<Row>,
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
    let (sims, lb, nginx) = tokio::task::block_in_place(|| {
        let sims = instant_replicas(&sims_dir);
        // inferlb as the plain overhead pass runs it, with TLS on `listen` and the plain
        // listener beside it: one process serves both rows.
        let plain_port = inferlb_harness::free_port();
        let conf = LbConf {
            extra: format!(
                "  tls: {{cert_file: '{}', key_file: '{}'}}\n  plain_listen: 127.0.0.1:{plain_port}\n",
                pki.cert_file.display(),
                pki.key_file.display()
            ),
            ..lb_conf(&sims)
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
    let mut targets: Vec<(Row, String, &reqwest::Client, Vec<u32>)> = vec![];
    if !smoke {
        let sim_pids = sims[0].proc().map(|p| p.pid()).into_iter().collect();
        targets.push((
            Row::new("direct", "http"),
            sims[0].url(""),
            client,
            sim_pids,
        ));
        targets.push((
            Row::new("inferlb", "http"),
            format!("http://127.0.0.1:{plain_port}"),
            client,
            lb_pids.clone(),
        ));
    }
    targets.push((
        Row::new("inferlb", "https"),
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
                targets.push((Row::new("nginx", "http"), n.url(), client, pids.clone()));
            }
            let url = n.tls_url("127.0.0.1").expect("nginx's TLS port");
            targets.push((Row::new("nginx", "https"), url, &https, pids));
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
                row.variant
            );
            warm_up(c, base).await;
            let name = format!("{} {}", row.target, row.variant);
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
        rounds_note(r.rounds)
    );
    md.push_str(&rows_table(&r.rows, "scheme"));
    let find = |t: &str, s: &str| r.rows.iter().find(|x| x.target == t && x.variant == s);
    for target in ["inferlb", "nginx"] {
        if let (Some(h), Some(t)) = (find(target, "http"), find(target, "https")) {
            let cpu = Spread::zip(&h.cpu_us_rounds, &t.cpu_us_rounds, |a, b| b - a);
            md.push_str(&format!(
                "\nTLS adds to {target}: {} ms at p50 and {} ms at p99 at 200 rps, {} µs of CPU a request; saturation throughput https/http = {}.\n",
                Spread::paired(t, h, |b, a| b.fixed_p50_ms - a.fixed_p50_ms).cell(2),
                Spread::paired(t, h, |b, a| b.fixed_p99_ms - a.fixed_p99_ms).cell(2),
                cpu.cell(1),
                Spread::paired(t, h, |b, a| b.saturation_rps / a.saturation_rps).cell(2),
            ));
        }
    }
    if let (Some(i), Some(n)) = (find("inferlb", "https"), find("nginx", "https")) {
        let paired = Spread::paired(i, n, |a, b| a.saturation_rps / b.saturation_rps);
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
        .filter(|row| row.broken())
        .map(|row| format!("overhead, {} over {}", row.target, row.variant))
        .collect();
    for (target, said) in &r.negotiated {
        if !said.contains("TLS13_AES_128_GCM_SHA256") {
            out.push(format!("overhead over https, {target} negotiated {said}"));
        }
    }
    out
}
