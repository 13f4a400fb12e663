//! Health checks: every replica probed with Pingora's `HttpHealthCheck` (GET /health) on an
//! interval, all in parallel. The result is recorded on the replica itself (`replica/`): a
//! passing check re-admits a replica the data path demoted, and each up/down transition is
//! logged once. Probes go by replica, never by address, so two replicas that share an address
//! are each checked and re-admitted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use futures::future::join_all;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};

use crate::conf::HealthConf;
use crate::fleet::registry::Registry;
use crate::fleet::replica::Replica;

/// A TLS replica's check, and the replica it was made for.
type TlsCheck = (Weak<Replica>, Arc<HttpHealthCheck>);

pub struct HealthChecker {
    /// The check of every plain-HTTP replica.
    http: HttpHealthCheck,
    /// A replica behind TLS is checked with its own peer (SNI, trusted roots, client
    /// certificate), by id; dropped when the replica leaves, rebuilt when another replica
    /// takes its id (the `Weak` names the one it was made for, and keeps its address from
    /// being reused).
    tls: Mutex<HashMap<Arc<str>, TlsCheck>>,
    conf: HealthConf,
    registry: Arc<Registry>,
}

impl HealthChecker {
    pub fn new(conf: &HealthConf, registry: Arc<Registry>) -> Self {
        HealthChecker {
            http: http_check(conf, "localhost", None),
            tls: Mutex::new(HashMap::new()),
            conf: conf.clone(),
            registry,
        }
    }

    fn tls_check(&self, r: &Arc<Replica>) -> Arc<HttpHealthCheck> {
        let mut checks = self.tls.lock().unwrap_or_else(|e| e.into_inner());
        match checks.get(&r.id) {
            Some((made_for, check)) if made_for.ptr_eq(&Arc::downgrade(r)) => check.clone(),
            _ => {
                let check = Arc::new(http_check(
                    &self.conf,
                    &r.endpoint.host,
                    Some(&r.endpoint.peer),
                ));
                checks.insert(r.id.clone(), (Arc::downgrade(r), check.clone()));
                check
            }
        }
    }

    async fn check(&self, r: &Arc<Replica>) {
        let before = r.health.demotions();
        let ok = if r.endpoint.peer.is_tls() {
            self.tls_check(r).check(&r.endpoint.backend).await
        } else {
            self.http.check(&r.endpoint.backend).await
        };
        if let Err(e) = &ok {
            log::debug!("health check of {} failed: {e}", r.id);
        }
        let ok = ok.is_ok();
        let (flipped, passed) =
            r.observe_check(ok, before, self.conf.failures, self.conf.successes);
        match flipped {
            Some(true) => log::warn!(
                "replica {} ({}) is up: health check passed",
                r.id,
                r.endpoint.address
            ),
            Some(false) => log::warn!(
                "replica {} ({}) is down: health check failed",
                r.id,
                r.endpoint.address
            ),
            None => {}
        }
        // Learn what it serves when it comes up, then now and then (a redeploy may change it).
        if ok && !r.models_configured && (r.models().is_empty() || passed % 60 == 0) {
            if let Some(models) = crate::fleet::probe::models(r, self.conf.timeout).await {
                r.set_models(models);
            }
        }
    }
}

/// `GET {conf.path}` with `Host: host`; over `peer`'s TLS settings when given.
fn http_check(conf: &HealthConf, host: &str, peer: Option<&HttpPeer>) -> HttpHealthCheck {
    let mut http = HttpHealthCheck::new(host, false);
    if let Some(peer) = peer {
        http.peer_template = peer.clone();
    }
    if let Ok(mut req) = RequestHeader::build("GET", conf.path.as_bytes(), None) {
        let _ = req.append_header("Host", host);
        http.req = req;
    }
    let o = &mut http.peer_template.options;
    o.connection_timeout = Some(conf.timeout);
    o.total_connection_timeout = Some(conf.timeout);
    o.read_timeout = Some(conf.timeout);
    http
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.conf.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            let replicas = self.registry.all();
            self.tls
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|id, _| replicas.iter().any(|r| r.id == *id));
            join_all(replicas.iter().map(|r| self.check(r))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::conf::{ReplicaConf, UpstreamConf};

    fn tls_replica(id: &str, sni: &str) -> Arc<Replica> {
        let conf = ReplicaConf {
            id: id.into(),
            address: "https://127.0.0.1:1".into(),
            api_key: None,
            models: vec![],
            socket: "127.0.0.1:1".parse().ok(),
            cache_tokens: None,
            discover: None,
            sni: Some(sni.into()),
            tls: true,
            ..ReplicaConf::default()
        };
        Arc::new(Replica::new(&conf, &upstream()))
    }

    fn upstream() -> UpstreamConf {
        let second = Duration::from_secs(1);
        UpstreamConf {
            connect_timeout: second,
            read_timeout: second,
            write_timeout: second,
            idle_timeout: second,
            tls: Default::default(),
        }
    }

    #[test]
    fn a_replica_that_takes_a_gone_replicas_id_gets_a_check_of_its_own() {
        let conf = HealthConf {
            path: "/health".into(),
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failures: 1,
            successes: 1,
        };
        let checker = HealthChecker::new(&conf, Arc::new(Registry::new(&[], &upstream())));
        let old = tls_replica("gpu0", "old.example");
        let first = checker.tls_check(&old);
        assert!(Arc::ptr_eq(&first, &checker.tls_check(&old)), "kept");
        assert_eq!(first.peer_template.sni, "old.example");
        // Removed and added again under the same id, between two rounds of checks.
        let new = tls_replica("gpu0", "new.example");
        let second = checker.tls_check(&new);
        assert_eq!(second.peer_template.sni, "new.example");
        assert!(Arc::ptr_eq(&second, &checker.tls_check(&new)), "kept");
    }
}
