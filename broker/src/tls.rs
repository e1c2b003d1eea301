//! Mutual TLS in front of rumqttd. rumqttd awaits each TLS handshake inline in its accept loop,
//! so one client that opens a connection and says nothing stalls every later accept; here each
//! handshake runs in a task of its own under a short timeout, at most [`MAX_HANDSHAKES`] at once
//! and [`HANDSHAKES_PER_ADDRESS`] from one address, apart from the `max_connections` slots of
//! established clients (which a handshake does not take until it has completed), and only a
//! client whose certificate chains to the federation's CA reaches the broker, which listens in
//! plain TCP on a loopback port of its own. So silent connections from one address cannot keep
//! the others out.

use anyhow::{Context, Result, bail};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

/// A client has this long to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once, from every address.
pub const MAX_HANDSHAKES: usize = 256;
/// Handshakes in progress at once from one IP address.
pub const HANDSHAKES_PER_ADDRESS: usize = 8;

/// Handshakes in progress by address; an entry leaves when its last handshake ends.
type Pending = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// One handshake in progress from `ip`, counted until dropped.
struct PendingSlot {
    pending: Pending,
    ip: std::net::IpAddr,
}

impl PendingSlot {
    /// Counts a handshake from `ip`, unless that address has [`HANDSHAKES_PER_ADDRESS`] already.
    fn take(pending: &Pending, ip: std::net::IpAddr) -> Option<PendingSlot> {
        let mut map = pending.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= HANDSHAKES_PER_ADDRESS {
            return None;
        }
        *n += 1;
        Some(PendingSlot {
            pending: pending.clone(),
            ip,
        })
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// The acceptor for the broker's certificate `cert` and key `key`, requiring a client
/// certificate signed by a CA of `client_ca` (all PEM).
pub fn acceptor(cert: &Path, key: &Path, client_ca: &Path) -> Result<TlsAcceptor> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let certs = rustls_pemfile::certs(&mut &read(cert)?[..])
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: not PEM certificates", cert.display()))?;
    if certs.is_empty() {
        bail!("{}: holds no certificate", cert.display());
    }
    let key_der = rustls_pemfile::private_key(&mut &read(key)?[..])
        .with_context(|| format!("{}: not a PEM key", key.display()))?
        .with_context(|| format!("{}: holds no private key", key.display()))?;
    let mut roots = RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut &read(client_ca)?[..]) {
        let c = c.with_context(|| format!("{}: not PEM certificates", client_ca.display()))?;
        roots
            .add(c)
            .with_context(|| format!("{}: a CA certificate is not valid", client_ca.display()))?;
    }
    if roots.is_empty() {
        bail!("{}: holds no CA certificate", client_ca.display());
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .context("the client-certificate verifier")?;
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key_der)
        .with_context(|| format!("{} and {} do not match", cert.display(), key.display()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Accepts TLS clients on `listener` and joins each, once its handshake (with a valid client
/// certificate) completed within [`HANDSHAKE_TIMEOUT`], to a plain connection to `broker`.
/// A connection is closed at once when [`MAX_HANDSHAKES`] are in progress, or
/// [`HANDSHAKES_PER_ADDRESS`] from its address, or every one of the `max_connections` slots of
/// established clients is taken; a handshake takes a slot only once it has completed.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    broker: SocketAddr,
    max_connections: usize,
) -> Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let pending: Pending = Default::default();
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if slots.available_permits() == 0 {
            tracing::warn!(%peer, "connection refused: {max_connections} connections already");
            continue;
        }
        let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection refused: {MAX_HANDSHAKES} handshakes in progress");
            continue;
        };
        let Some(from_peer) = PendingSlot::take(&pending, peer.ip()) else {
            tracing::warn!(%peer, "connection refused: {HANDSHAKES_PER_ADDRESS} handshakes in progress from its address");
            continue;
        };
        let slots = slots.clone();
        // No Nagle delay on either side of the relay (see the rumqttd patch in third_party).
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let shaken = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            drop((handshake, from_peer));
            let tls = match shaken {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return tracing::warn!(%peer, error = %e, "TLS handshake refused"),
                Err(_) => return tracing::warn!(%peer, "TLS handshake timed out"),
            };
            let Ok(_slot) = slots.try_acquire_owned() else {
                return tracing::warn!(%peer, "connection closed: {max_connections} connections already");
            };
            // The client is who its certificate names; without a common name, it is no one.
            let who = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| crate::acl::common_name(c));
            let Some(who) = who.map(|cn| crate::acl::Identity::from_common_name(&cn)) else {
                return tracing::warn!(%peer, "connection closed: its certificate names no one");
            };
            let plain = match TcpStream::connect(broker).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s
                }
                Err(e) => {
                    return tracing::error!(error = %e, "the broker behind TLS is unreachable");
                }
            };
            let (from_client, mut to_client) = tokio::io::split(tls);
            let (mut from_broker, to_broker) = plain.into_split();
            // Whichever direction ends first ends the connection.
            tokio::select! {
                r = crate::acl::guard(from_client, to_broker, &who) => {
                    if let Err(e) = r {
                        tracing::warn!(%peer, ?who, error = %e, "connection closed by the access policy");
                    }
                }
                _ = tokio::io::copy(&mut from_broker, &mut to_client) => {}
            }
        });
    }
}
