//! Health checks: Pingora's `HttpHealthCheck` (GET /health) run by Pingora's background
//! service, wrapped so that a passing check also re-admits a replica the data path demoted,
//! and so that each up/down transition is logged once.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use async_trait::async_trait;
use pingora_core::Result;
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::Backend;

use crate::config::HealthConf;
use crate::replicas::Replicas;

pub struct ReplicaHealthCheck {
    http: HttpHealthCheck,
    timeout: Duration,
    /// Set once the replica set exists (it needs the load balancer this check belongs to).
    replicas: Arc<OnceLock<Arc<Replicas>>>,
}

impl ReplicaHealthCheck {
    pub fn new(conf: &HealthConf, replicas: Arc<OnceLock<Arc<Replicas>>>) -> Self {
        let mut http = HttpHealthCheck::new("localhost", false);
        if let Ok(mut req) = RequestHeader::build("GET", conf.path.as_bytes(), None) {
            let _ = req.append_header("Host", "localhost");
            http.req = req;
        }
        http.consecutive_failure = conf.failures;
        http.consecutive_success = conf.successes;
        http.peer_template.options.connection_timeout = Some(conf.timeout);
        http.peer_template.options.read_timeout = Some(conf.timeout);
        ReplicaHealthCheck {
            http,
            timeout: conf.timeout,
            replicas,
        }
    }
}

#[async_trait]
impl HealthCheck for ReplicaHealthCheck {
    async fn check(&self, target: &Backend) -> Result<()> {
        let found = self
            .replicas
            .get()
            .and_then(|rs| rs.by_backend(target).map(|r| (rs, r, rs.demotions(r))));
        self.http.check(target).await?;
        if let Some((rs, r, before)) = found {
            rs.check_passed(r, before);
            let passed = r.checks_passed.fetch_add(1, Ordering::Relaxed);
            // Learn what it serves when it comes up, then now and then (a redeploy may change it).
            if !r.models_configured && (r.models().is_empty() || passed % 60 == 0) {
                if let Some(models) =
                    fetch_models(&r.address, r.api_key.as_deref(), self.timeout).await
                {
                    r.set_models(models);
                }
            }
        }
        Ok(())
    }

    async fn health_status_change(&self, target: &Backend, healthy: bool) {
        let Some(rs) = self.replicas.get() else {
            return;
        };
        let Some(r) = rs.by_backend(target) else {
            return;
        };
        if healthy {
            log::warn!(
                "replica {} ({}) is up: health check passed",
                r.id,
                r.address
            );
        } else {
            log::warn!(
                "replica {} ({}) is down: health check failed",
                r.id,
                r.address
            );
        }
        crate::metrics::METRICS
            .up
            .with_label_values(&[&r.id])
            .set((healthy && !r.is_demoted()) as i64);
    }

    fn health_threshold(&self, success: bool) -> usize {
        self.http.health_threshold(success)
    }
}

/// `GET /v1/models` of a replica: the ids it lists, or None when it does not answer sensibly.
async fn fetch_models(address: &str, key: Option<&str>, timeout: Duration) -> Option<Vec<String>> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(address).await.ok()?;
        let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
        let req = format!("GET /v1/models HTTP/1.0\r\nhost: {address}\r\n{auth}\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.take(1 << 20).read_to_end(&mut out).await.ok()?;
        Some(out)
    };
    let out = tokio::time::timeout(timeout, exchange).await.ok()??;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    if !out.starts_with(b"HTTP/1.1 200") && !out.starts_with(b"HTTP/1.0 200") {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out[split + 4..]).ok()?;
    let ids: Vec<String> = v["data"]
        .as_array()?
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    (!ids.is_empty()).then_some(ids)
}
