//! Where a replica is and how inferlb reaches it: fixed when the replica is created. A replica
//! that moves is removed and added again, under the same id or another.

use std::net::SocketAddr;
use std::sync::Arc;

use pingora_core::upstreams::peer::HttpPeer;
use pingora_load_balancing::Backend;

use crate::conf::secrets::Secret;
use crate::conf::{ReplicaConf, UpstreamConf};

pub struct Endpoint {
    /// As configured (`host:port`, or `https://host:port`).
    pub address: String,
    /// `host:port` of `address`: sent as `Host`.
    pub host: String,
    /// `address`, resolved once at start.
    pub socket: SocketAddr,
    /// What the proxy connects to, with the upstream timeouts set.
    pub peer: HttpPeer,
    /// What the health check probes.
    pub backend: Backend,
    /// Sent to it in place of the client's key (read from its secret at each use, so a
    /// rotated file takes effect).
    pub api_key: Option<Arc<Secret>>,
    /// SGLang's protocol: where its bootstrap server listens (a prefill replica's).
    pub bootstrap: Option<SocketAddr>,
    /// The data-parallel rank it is of the server at `address`: every request to it names the
    /// rank in [`RANK_HEADER`], which vLLM and SGLang honour.
    pub data_parallel_rank: Option<u16>,
}

/// The header naming the data-parallel rank that is to serve a request (vLLM's
/// `X-data-parallel-rank`, read in any case; SGLang's too). Only inferlb sets it: a client's
/// is dropped, since it would choose the rank in place of the routing.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

impl Endpoint {
    /// `conf` was validated: its address resolved.
    pub fn new(conf: &ReplicaConf, upstream: &UpstreamConf) -> Endpoint {
        let socket = conf
            .socket
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9)));
        let sni = conf.sni.clone().unwrap_or_default();
        let mut peer = HttpPeer::new(socket, conf.tls, sni);
        if conf.tls {
            // Verification stays on (Pingora's default): a replica whose certificate does not
            // check out fails to connect, and is demoted like any other connect failure.
            peer.options.ca = upstream.tls.ca.clone();
            peer.client_cert_key = upstream.tls.client.clone();
        }
        let o = &mut peer.options;
        o.connection_timeout = Some(upstream.connect_timeout);
        o.total_connection_timeout = Some(upstream.connect_timeout);
        o.read_timeout = Some(upstream.read_timeout);
        o.write_timeout = Some(upstream.write_timeout);
        o.idle_timeout = Some(upstream.idle_timeout);
        let backend = Backend {
            addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(socket),
            weight: 1,
            ext: Default::default(),
        };
        Endpoint {
            address: conf.address.clone(),
            host: crate::conf::split_address(&conf.address)
                .map_or_else(|_| conf.address.clone(), |(_, h)| h.to_string()),
            socket,
            peer,
            backend,
            api_key: conf.key.clone(),
            bootstrap: conf.bootstrap_port.map(|p| SocketAddr::new(socket.ip(), p)),
            data_parallel_rank: conf.data_parallel_rank,
        }
    }
}
