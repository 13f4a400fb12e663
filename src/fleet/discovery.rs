//! Replicas found by DNS: a `discover: dns` entry's `address` names several replicas (a
//! Kubernetes headless Service); it is re-resolved on an interval, and each address becomes a
//! replica whose id is derived from it (`{id}-{ip}-{port}`), so it is the same across restarts
//! and instances. Replicas that appear join after a passing health check; replicas that vanish
//! leave (their conversations move on their next turn, `repinned`). A failed lookup changes
//! nothing: only an answer that the name has no addresses (or fewer) removes replicas. An
//! address outside `admin.allowed_networks` is skipped, and logged the first time it is seen.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::Resolver;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::conf::netpolicy::Networks;
use crate::conf::{DiscoveryConf, ReplicaConf};
use crate::fleet::registry::Registry;

/// The id of the replica at `addr` found by the entry `id`: stable, and a valid id.
pub fn replica_id(id: &str, addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => v6.to_string().replace(':', "-"),
    };
    format!("{id}-{ip}-{}", addr.port())
}

/// What to add (each replica's conf) and what to remove (ids) so that `entry`'s replicas
/// are exactly those at `found`: one per address, or with `data_parallel_size`, one per rank
/// of each.
pub fn plan(
    entry: &ReplicaConf,
    found: &BTreeSet<SocketAddr>,
    present: &BTreeSet<String>,
) -> (Vec<ReplicaConf>, Vec<String>) {
    let wanted: Vec<ReplicaConf> = found
        .iter()
        .flat_map(|a| entry.found_at(replica_id(&entry.id, *a), *a).ranks())
        .collect();
    let remove = present
        .iter()
        .filter(|p| !wanted.iter().any(|r| r.id == **p))
        .cloned()
        .collect();
    let add = wanted
        .into_iter()
        .filter(|r| !present.contains(&r.id))
        .collect();
    (add, remove)
}

/// The addresses of `found` a replica may have, and those it may not, each with why.
pub fn admitted(
    found: BTreeSet<SocketAddr>,
    networks: &Networks,
) -> (BTreeSet<SocketAddr>, Vec<(SocketAddr, String)>) {
    let mut refused = vec![];
    let kept = found
        .into_iter()
        .filter(|a| match networks.check(a.ip()) {
            Ok(()) => true,
            Err(why) => {
                refused.push((*a, why));
                false
            }
        })
        .collect();
    (kept, refused)
}

pub struct Discovery {
    pub entries: Vec<ReplicaConf>,
    pub conf: DiscoveryConf,
    pub registry: Arc<Registry>,
    /// Where a found replica may be.
    pub networks: Networks,
    /// Refused addresses already logged: a lasting answer is logged once, not every interval.
    pub refused: Mutex<BTreeSet<SocketAddr>>,
}

fn resolver(conf: &DiscoveryConf) -> Result<Resolver<TokioRuntimeProvider>, String> {
    let builder = match conf.nameserver {
        Some(ns) => {
            let mut udp = ConnectionConfig::udp();
            udp.port = ns.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = ns.port();
            let server = NameServerConfig::new(ns.ip(), true, vec![udp, tcp]);
            let config = ResolverConfig::from_parts(None, vec![], vec![server]);
            Resolver::builder_with_config(config, TokioRuntimeProvider::default())
        }
        None => Resolver::builder_tokio().map_err(|e| e.to_string())?,
    };
    builder.build().map_err(|e| e.to_string())
}

impl Discovery {
    /// Re-resolves one entry and brings the registry in line; errors leave it as it is.
    async fn refresh(&self, resolver: &Resolver<TokioRuntimeProvider>, entry: &ReplicaConf) {
        let Ok((_, host_port)) = crate::conf::split_address(&entry.address) else {
            return;
        };
        let Some((host, port)) = host_port.rsplit_once(':') else {
            return;
        };
        let Ok(port) = port.parse::<u16>() else {
            return;
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let found: BTreeSet<SocketAddr> = match resolver.lookup_ip(host).await {
            Ok(ips) => ips.iter().map(|ip| SocketAddr::new(ip, port)).collect(),
            Err(e) if e.is_no_records_found() || e.is_nx_domain() => BTreeSet::new(),
            Err(e) => {
                log::warn!(
                    "discovery: cannot resolve {} ({e}); replicas unchanged",
                    entry.address
                );
                return;
            }
        };
        let (found, refused) = admitted(found, &self.networks);
        if let Ok(mut seen) = self.refused.lock() {
            for (addr, why) in refused {
                if seen.insert(addr) {
                    log::warn!(
                        "discovery: {} resolved to {addr}, skipped: {why}",
                        entry.address
                    );
                }
            }
        }
        let present: BTreeSet<String> = self
            .registry
            .all()
            .iter()
            .filter(|r| r.origin.as_deref() == Some(&entry.id))
            .map(|r| r.id.to_string())
            .collect();
        let (add, remove) = plan(entry, &found, &present);
        for conf in add {
            if let Err(e) = self.registry.add(&conf, Some(&entry.id)) {
                log::warn!("discovery: {e}");
            }
        }
        for id in remove {
            self.registry.remove(&id);
        }
    }
}

#[async_trait]
impl BackgroundService for Discovery {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let resolver = match resolver(&self.conf) {
            Ok(r) => r,
            Err(e) => {
                log::error!("discovery: no DNS resolver ({e}); replicas by DNS are not found");
                return;
            }
        };
        let mut tick = tokio::time::interval(self.conf.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            for entry in &self.entries {
                self.refresh(&resolver, entry).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_valid() {
        let v4: SocketAddr = "10.0.0.5:8000".parse().expect("addr");
        assert_eq!(replica_id("vllm", v4), "vllm-10.0.0.5-8000");
        let v6: SocketAddr = "[fd00::1]:8000".parse().expect("addr");
        assert_eq!(replica_id("vllm", v6), "vllm-fd00--1-8000");
        assert!(replica_id("vllm", v6)
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)));
    }

    #[test]
    fn the_plan_adds_what_appeared_and_removes_what_vanished() {
        let a: SocketAddr = "10.0.0.1:80".parse().expect("addr");
        let b: SocketAddr = "10.0.0.2:80".parse().expect("addr");
        let entry = ReplicaConf {
            id: "v".into(),
            address: "v.test:80".into(),
            ..Default::default()
        };
        let ids =
            |add: &[ReplicaConf]| -> Vec<String> { add.iter().map(|r| r.id.clone()).collect() };
        let present: BTreeSet<String> =
            ["v-10.0.0.1-80".to_string(), "v-10.0.0.9-80".to_string()].into();
        let (add, remove) = plan(&entry, &[a, b].into(), &present);
        assert_eq!(ids(&add), ["v-10.0.0.2-80"]);
        assert_eq!(add[0].socket, Some(b));
        assert_eq!(remove, vec!["v-10.0.0.9-80".to_string()]);
        let (add, remove) = plan(&entry, &BTreeSet::new(), &present);
        assert!(add.is_empty());
        assert_eq!(remove.len(), 2, "a name with no addresses removes them all");
        // Data-parallel pods: a replica per rank of each, and a pod that goes takes all its
        // ranks; a rank present stays.
        let dp = ReplicaConf {
            data_parallel_size: Some(2),
            kv_events_port: Some(5557),
            ..entry
        };
        let present: BTreeSet<String> = [
            "v-10.0.0.1-80-dp0".to_string(),
            "v-10.0.0.9-80-dp0".to_string(),
            "v-10.0.0.9-80-dp1".to_string(),
        ]
        .into();
        let (add, remove) = plan(&dp, &[a, b].into(), &present);
        assert_eq!(
            ids(&add),
            [
                "v-10.0.0.1-80-dp1",
                "v-10.0.0.2-80-dp0",
                "v-10.0.0.2-80-dp1"
            ]
        );
        let found: Vec<_> = add
            .iter()
            .map(|r| (r.data_parallel_rank, r.kv_events.as_deref().unwrap_or("")))
            .collect();
        assert_eq!(
            found,
            [
                (Some(1), "tcp://10.0.0.1:5558"),
                (Some(0), "tcp://10.0.0.2:5557"),
                (Some(1), "tcp://10.0.0.2:5558")
            ]
        );
        assert_eq!(remove, ["v-10.0.0.9-80-dp0", "v-10.0.0.9-80-dp1"]);
    }

    #[test]
    fn refused_addresses_are_skipped() {
        let addrs = |list: &[&str]| -> BTreeSet<SocketAddr> {
            list.iter().map(|a| a.parse().expect("addr")).collect()
        };
        let cases: &[(&[&str], &[&str], &[&str])] = &[
            (
                &["10.0.0.1:80", "10.0.0.2:80"],
                &["10.0.0.1:80", "10.0.0.2:80"],
                &[],
            ),
            (
                &[
                    "10.0.0.1:80",
                    "169.254.169.254:80",
                    "[fe80::1]:80",
                    "8.8.8.8:80",
                ],
                &["10.0.0.1:80"],
                &["8.8.8.8:80", "169.254.169.254:80", "[fe80::1]:80"],
            ),
            (
                &["[::ffff:169.254.169.254]:80"],
                &[],
                &["[::ffff:169.254.169.254]:80"],
            ),
            (&[], &[], &[]),
        ];
        for (found, kept, refused) in cases {
            let (k, r) = admitted(addrs(found), &Networks::default());
            assert_eq!(k, addrs(kept), "{found:?}");
            let r: BTreeSet<SocketAddr> = r.into_iter().map(|(a, _)| a).collect();
            assert_eq!(r, addrs(refused), "{found:?}");
        }
    }
}
