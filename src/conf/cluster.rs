//! `cluster:`, the instances that share state through Redis: the section as written
//! ([`RawCluster`]), checked once into the [`ClusterConf`] the link and the shared budgets
//! trust, and the Redis client made from it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::conf::secrets::Secret;

#[derive(Debug, Clone)]
pub struct ClusterConf {
    /// Without a password: that comes from `redis_password`.
    pub redis_url: String,
    pub redis_password: Option<Arc<Secret>>,
    /// PEM: the CA a `rediss://` server's certificate is checked against (else the system's).
    pub redis_ca: Option<Arc<Vec<u8>>>,
    pub instance_id: String,
    /// How long a shared pin lives in Redis without being renewed.
    pub pin_ttl: Duration,
}

impl ClusterConf {
    /// The Redis client, for every user of the cluster's Redis (shared state, shared budgets):
    /// the URL, the password as it is now, and TLS trusting `redis_ca` for `rediss://`.
    pub fn client(&self) -> redis::RedisResult<redis::Client> {
        use redis::IntoConnectionInfo;
        let mut info = self.redis_url.as_str().into_connection_info()?;
        if let Some(p) = &self.redis_password {
            let settings = info
                .redis_settings()
                .clone()
                .set_password(p.current().as_str());
            info = info.set_redis_settings(settings);
        }
        if !matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
            return redis::Client::open(info);
        }
        // rustls needs its process-wide provider (ring, as Pingora's) before a handshake.
        pingora_core::tls::install_default_crypto_provider();
        redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: self.redis_ca.as_ref().map(|c| c.to_vec()),
            },
        )
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    redis_url: String,
    #[serde(default)]
    instance_id: Option<String>,
    #[serde(default = "default_pin_ttl")]
    pin_ttl_seconds: f64,
    #[serde(default)]
    redis_password_file: Option<PathBuf>,
    #[serde(default)]
    redis_password_env: Option<String>,
    #[serde(default)]
    redis_ca_file: Option<PathBuf>,
}

fn default_pin_ttl() -> f64 {
    86_400.0
}

/// The `cluster:` section checked once: its Redis secrets, its instance id, its pin TTL.
pub(super) fn validate(c: &RawCluster) -> Result<ClusterConf, String> {
    let (redis_password, redis_ca) = redis_secrets(c)?;
    let instance_id = match c.instance_id.as_deref().map(str::trim) {
        None | Some("") => default_instance_id(),
        Some(id) if id.contains(['|', '#']) || id.contains(char::is_whitespace) => {
            return Err(format!(
                "inferlb.cluster.instance_id: {id:?} may not contain '|', '#' or spaces"
            ))
        }
        Some(id) => id.to_string(),
    };
    Ok(ClusterConf {
        redis_url: c.redis_url.clone(),
        redis_password,
        redis_ca,
        instance_id,
        pin_ttl: super::seconds("cluster.pin_ttl_seconds", c.pin_ttl_seconds)?,
    })
}

/// A Redis password, and the PEM of the CA a `rediss://` server is checked against.
type RedisSecrets = (Option<Arc<Secret>>, Option<Arc<Vec<u8>>>);

/// The Redis URL checked (no password in it: the conf is not where a secret goes), its
/// password from a file or the environment, and the CA a `rediss://` server is checked
/// against. A message never quotes a URL that may hold a password.
fn redis_secrets(c: &RawCluster) -> Result<RedisSecrets, String> {
    use redis::IntoConnectionInfo;
    let key = "inferlb.cluster";
    let shown = if c.redis_url.contains('@') {
        "(not shown: it has an '@')".to_string()
    } else {
        format!("{:?}", c.redis_url)
    };
    let info = c
        .redis_url
        .as_str()
        .into_connection_info()
        .map_err(|e| format!("{key}.redis_url: {shown}: {e}"))?;
    if info.redis_settings().password().is_some() {
        return Err(format!(
            "{key}.redis_url: a password in the URL; put it in {key}.redis_password_file or \
             {key}.redis_password_env instead"
        ));
    }
    let tls = match info.addr() {
        redis::ConnectionAddr::TcpTls { insecure: true, .. } => {
            return Err(format!(
                "{key}.redis_url: #insecure skips the server's certificate check; trust its CA \
                 with {key}.redis_ca_file instead"
            ))
        }
        a => matches!(a, redis::ConnectionAddr::TcpTls { .. }),
    };
    let password = match (&c.redis_password_file, &c.redis_password_env) {
        (None, None) => None,
        (Some(p), None) => {
            Some(Secret::from_file(p).map_err(|e| format!("{key}.redis_password_file: {e}"))?)
        }
        (None, Some(n)) => {
            Some(Secret::from_env(n).map_err(|e| format!("{key}.redis_password_env: {e}"))?)
        }
        (Some(_), Some(_)) => {
            return Err(format!(
                "{key}: redis_password_file or redis_password_env, not both"
            ))
        }
    };
    let ca = match &c.redis_ca_file {
        None => None,
        Some(_) if !tls => {
            return Err(format!(
                "{key}.redis_ca_file: only with a rediss:// (TLS) URL"
            ))
        }
        Some(p) => {
            use rustls_pki_types::pem::PemObject;
            let pem = std::fs::read(p)
                .map_err(|e| format!("{key}.redis_ca_file: cannot read {}: {e}", p.display()))?;
            let certs = rustls_pki_types::CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    format!(
                        "{key}.redis_ca_file: {}: not PEM certificates: {e}",
                        p.display()
                    )
                })?;
            if certs.is_empty() {
                return Err(format!(
                    "{key}.redis_ca_file: {}: no certificate in it",
                    p.display()
                ));
            }
            Some(Arc::new(pem))
        }
    };
    Ok((password, ca))
}

/// An instance id for a cluster whose conf names none: the host name and the pid.
fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("{host}-{}", std::process::id())
}
