//! `pingora-floor PORT UPSTREAM_PORT...`: Pingora 0.9.1 as a bare reverse proxy, with none of
//! inferlb's work (no body read, no routing, no metrics, no access log): requests go round robin
//! to the upstreams on loopback, on pooled keep-alive connections, from two worker threads like
//! the bench's inferlb, with the same allocator (mimalloc) and the same plain listener (no L4
//! read buffer).
//!
//! The overhead pass measures it beside inferlb and nginx: what Pingora itself costs a request on
//! this machine, the floor under anything built on it.

use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use pingora_core::listeners::{L4BufferSettings, ListenerConfig};
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_proxy::{ProxyHttp, Session};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Floor {
    upstreams: Vec<HttpPeer>,
    next: AtomicUsize,
}

#[async_trait]
impl ProxyHttp for Floor {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora_core::Result<Box<HttpPeer>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        Ok(Box::new(self.upstreams[i].clone()))
    }
}

fn main() {
    let ports: Vec<u16> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a port number"))
        .collect();
    let Some((&listen, upstreams)) = ports.split_first().filter(|(_, u)| !u.is_empty()) else {
        eprintln!("usage: pingora-floor PORT UPSTREAM_PORT...");
        std::process::exit(2);
    };
    let conf = ServerConf {
        threads: 2,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let floor = Floor {
        upstreams: upstreams
            .iter()
            .map(|p| HttpPeer::new(("127.0.0.1", *p), false, String::new()))
            .collect(),
        next: AtomicUsize::new(0),
    };
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, floor);
    proxy.add_listener(
        ListenerConfig::tcp(format!("127.0.0.1:{listen}")).l4_buffer(L4BufferSettings {
            read: Some(0),
            write: None,
        }),
    );
    server.add_service(proxy);
    server.run_forever();
}
