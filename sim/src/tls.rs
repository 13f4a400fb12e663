//! Serving the simulator over TLS (`--tls-cert`/`--tls-key`), optionally asking clients for a
//! certificate signed by `--tls-client-ca` (a service mesh's mTLS): a replica behind TLS for
//! the balancer's upstream tests.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// A TLS acceptor for the certificate chain and key, requiring client certificates signed by
/// `client_ca` when one is given.
pub fn acceptor(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<TlsAcceptor, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let builder = ServerConfig::builder();
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in
                CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))?
            {
                let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
                roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| e.to_string())?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| e.to_string())?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `app` over TLS on `listener` until `stop` fires; connections already open finish.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        let (tcp, _) = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let Ok(Ok(tls)) =
                tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
            else {
                return;
            };
            let service = TowerToHyperService::new(app);
            let _ = Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), service)
                .await;
        });
    }
}
