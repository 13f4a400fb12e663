//! TLS, with rustls: the listener's certificate (served from memory, reloaded when its files
//! change) and what inferlb trusts and presents toward replicas behind TLS.
//!
//! Not here: the handshake itself and ALPN (Pingora's listener and connector do both), and
//! which replica is TLS (`address: https://host:port`, read by `config::check_replica`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::tls::sign::CertifiedKey;
use pingora_core::tls::{ClientHello, CryptoProvider, ResolvesServerCert};
use pingora_core::utils::tls::{CertKey, WrappedX509};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

/// `inferlb.tls`: the listener serves TLS with this certificate chain and key (PEM).
#[derive(Debug, Clone)]
pub struct TlsConf {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// How often the two files are read again; a changed, valid pair replaces the served one.
    pub reload_interval: Duration,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTls {
    cert_file: PathBuf,
    key_file: PathBuf,
    #[serde(default = "default_reload_interval")]
    reload_interval_seconds: f64,
}

fn default_reload_interval() -> f64 {
    5.0
}

impl RawTls {
    /// Checks the pair can be served now: a conf that would fail at the first handshake is
    /// refused at start (and by `-t`) instead.
    pub(crate) fn validate(self) -> Result<TlsConf, String> {
        let r = self.reload_interval_seconds;
        if !(r.is_finite() && (0.1..=86_400.0).contains(&r)) {
            return Err(format!(
                "inferlb.tls.reload_interval_seconds: {r} must be between 0.1 and 86400"
            ));
        }
        load_pair(&self.cert_file, &self.key_file).map_err(|e| format!("inferlb.tls: {e}"))?;
        Ok(TlsConf {
            cert_file: self.cert_file,
            key_file: self.key_file,
            reload_interval: Duration::from_secs_f64(r),
        })
    }
}

/// The rustls provider Pingora installs (ring); installed here too, so that a certificate can
/// be loaded before any listener is built.
fn provider() -> Result<Arc<CryptoProvider>, String> {
    pingora_core::tls::install_default_crypto_provider();
    CryptoProvider::get_default()
        .cloned()
        .ok_or_else(|| "no TLS crypto provider installed".to_string())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("cannot read a private key from {}: {e}", path.display()))
}

/// A chain and key already read (PEM bytes), checked to belong together; `files` names them.
fn parse_pair(cert: &[u8], key: &[u8], files: &TlsConf) -> Result<CertifiedKey, String> {
    let (c, k) = (files.cert_file.display(), files.key_file.display());
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{c}: not PEM certificates: {e}"))?;
    if chain.is_empty() {
        return Err(format!("{c}: no certificate in it"));
    }
    let key_der =
        PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("{k}: no private key: {e}"))?;
    CertifiedKey::from_der(chain, key_der, &*provider()?)
        .map_err(|e| format!("{c} and {k} do not make a usable pair: {e}"))
}

/// A certificate chain and its key, checked to belong together.
pub fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain = read_certs(cert)?;
    let key_der = read_key(key)?;
    CertifiedKey::from_der(chain, key_der, &*provider()?).map_err(|e| {
        format!(
            "{} and {} do not make a usable pair: {e}",
            cert.display(),
            key.display()
        )
    })
}

/// The certificate the listener serves: swapped in place when its files change, so a
/// handshake never waits on a reload and no connection is dropped for one.
#[derive(Debug)]
pub struct ServedCertificate {
    current: ArcSwap<CertifiedKey>,
    conf: TlsConf,
    /// The files' bytes last loaded, to notice a change whatever the mtime says (Kubernetes
    /// swaps a Secret's files by renaming a symlinked directory).
    loaded: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl ServedCertificate {
    pub fn new(conf: &TlsConf) -> Result<Arc<ServedCertificate>, String> {
        let files = read_files(conf).map_err(|e| format!("inferlb.tls: {e}"))?;
        let pair = parse_pair(&files.0, &files.1, conf)?;
        Ok(Arc::new(ServedCertificate {
            current: ArcSwap::from_pointee(pair),
            conf: conf.clone(),
            loaded: Mutex::new(files),
        }))
    }

    /// Pingora's listener settings serving this certificate, offering h2 and http/1.1.
    pub fn listener_settings(self: &Arc<Self>) -> Result<TlsSettings, String> {
        let (cert, key) = (
            self.conf.cert_file.to_string_lossy(),
            self.conf.key_file.to_string_lossy(),
        );
        let mut settings = TlsSettings::intermediate(&cert, &key)
            .map_err(|e| format!("inferlb.tls: cannot build the listener: {e}"))?;
        settings.set_cert_resolver(self.clone());
        settings.enable_h2();
        Ok(settings)
    }

    /// Reads the files again; a changed, valid pair is served from the next handshake on.
    /// Returns whether it changed. A bad pair keeps the old one and says why.
    pub fn reload(&self) -> Result<bool, String> {
        let files = read_files(&self.conf)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if *loaded == files {
            return Ok(false);
        }
        // Parsed from the bytes just compared: a file rewritten in between cannot mix in.
        let pair = parse_pair(&files.0, &files.1, &self.conf)?;
        self.current.store(Arc::new(pair));
        *loaded = files;
        Ok(true)
    }

    /// The leaf certificate served now (DER), for tests and logs.
    pub fn leaf(&self) -> Vec<u8> {
        self.current
            .load()
            .cert
            .first()
            .map(|c| c.to_vec())
            .unwrap_or_default()
    }
}

fn read_files(conf: &TlsConf) -> Result<(Vec<u8>, Vec<u8>), String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    Ok((read(&conf.cert_file)?, read(&conf.key_file)?))
}

impl ResolvesServerCert for ServedCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Watches the certificate files and reloads them when they change.
pub struct CertificateReloader {
    pub served: Arc<ServedCertificate>,
}

#[async_trait]
impl BackgroundService for CertificateReloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.served.conf.reload_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // Logged once per state, not on every tick of a lasting problem.
        let mut failing = false;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            let served = self.served.clone();
            let outcome = tokio::task::spawn_blocking(move || served.reload())
                .await
                .unwrap_or_else(|e| Err(format!("reload task failed: {e}")));
            match outcome {
                Ok(true) => {
                    failing = false;
                    metrics_reloaded();
                    log::warn!(
                        "TLS certificate reloaded from {}",
                        self.served.conf.cert_file.display()
                    );
                }
                Ok(false) => failing = false,
                Err(e) => {
                    if !failing {
                        log::error!("TLS certificate not reloaded, still serving the old one: {e}");
                    }
                    failing = true;
                }
            }
        }
    }
}

fn metrics_reloaded() {
    crate::telemetry::metrics::METRICS.tls_reloads.inc();
}

/// What inferlb trusts and presents toward replicas behind TLS (`inferlb.upstream`).
#[derive(Clone, Default)]
pub struct UpstreamTls {
    /// Trusted roots instead of the system's; None: the system's.
    pub ca: Option<Arc<[WrappedX509]>>,
    /// A client certificate for meshes that ask for one (mTLS).
    pub client: Option<Arc<CertKey>>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("client", &self.client.is_some())
            .finish()
    }
}

impl UpstreamTls {
    /// Loads `ca_file` and the client pair; `key` names the conf section in errors.
    pub fn load(
        ca_file: Option<&Path>,
        client: Option<(&Path, &Path)>,
        key: &str,
    ) -> Result<UpstreamTls, String> {
        let ca = match ca_file {
            None => None,
            Some(path) => {
                let certs = read_certs(path).map_err(|e| format!("{key}.ca_file: {e}"))?;
                let wrapped: Vec<WrappedX509> = certs
                    .iter()
                    .map(|c| parse_der(c.as_ref()).map_err(|e| format!("{key}.ca_file: {e}")))
                    .collect::<Result<_, _>>()?;
                Some(Arc::from(wrapped))
            }
        };
        let client = match client {
            None => None,
            Some((cert, key_file)) => {
                load_pair(cert, key_file).map_err(|e| format!("{key}.client_cert_file: {e}"))?;
                let chain = read_certs(cert)?.into_iter().map(|c| c.to_vec()).collect();
                let key_der = read_key(key_file)?.secret_der().to_vec();
                Some(Arc::new(CertKey::new(chain, key_der)))
            }
        };
        Ok(UpstreamTls { ca, client })
    }
}

/// Pingora parses a certificate with a panic on bad DER; check it here first.
fn parse_der(der: &[u8]) -> Result<WrappedX509, String> {
    use x509_parser::prelude::FromDer;
    x509_parser::certificate::X509Certificate::from_der(der)
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    Ok(WrappedX509::new(
        der.to_vec(),
        pingora_core::utils::tls::parse_x509,
    ))
}
