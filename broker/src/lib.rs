//! The embedded MQTT broker (rumqttd 0.20) with every setting given explicitly. It runs as a
//! process of its own (the `unifed-broker` binary, or a role of `unifed-demo`) so tests and the
//! demo can start, kill and restart it: rumqttd has no shutdown API and cannot report an
//! ephemeral port.
//!
//! It prints `unifed-broker listening on <addr>` on stdout once the port accepts connections.
//! Settings and why (see `shared/notes/mqtt-stack.md`):
//! - `max_payload_size` is rumqttd's limit on a whole packet (remaining length), so it is set to
//!   the largest application packet plus room for topic and header;
//! - `dynamic_filters = true`: in 0.20.0 it has no effect (`DataLog::matches` in
//!   `router/logs.rs` always answers `Some`, so a publish nobody subscribed to is dropped, and
//!   no log is made for it), but a rumqttd whose router took its `None` branch would otherwise
//!   disconnect the publisher;
//! - router limits are non-zero (rumqttd's zero defaults panic or refuse every connection), and
//!   each filter's in-memory log is bounded ([`log_limits`]): 32 MiB for the filters every site
//!   shares, 8 MiB for a site's own model and package replies, in segments of 1 MiB, so the
//!   broker's memory grows by 9 MiB per site rather than 32; and `--model-log-mib` (64) for the
//!   model chunks sent once for every site, a whole model so a site that falls behind the
//!   others loses none. rumqttd has no ACL: any client that may connect can publish on any
//!   topic, so a forged chunk reaches every site (which drops it unsigned) and a flood of them
//!   can push real chunks out of that log (sites then ask for them again). A federation whose
//!   network is not trusted runs Mosquitto with the ACL `unifed-aggregator mosquitto-config`
//!   writes, where only the aggregator may publish there. The logs keep packets as slices
//!   of the buffers they were read into, so chunks are cut to fit 256 KiB packets
//!   (`unifed_protocol::chunking::CHUNK_BYTES`).

pub mod acl;
pub mod tls;

use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The broker's settings (also its command line).
#[derive(clap::Args, Debug, Clone)]
pub struct BrokerArgs {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub listen: SocketAddr,
    /// Largest MQTT packet accepted, in bytes (application chunks plus topic and header).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_packet_bytes: usize,
    /// MiB of model chunks sent once for every site (`unifed/+/+/chunks/model`) the broker
    /// keeps for sites that read them late: at least the largest model payload, or a site
    /// that falls further behind than this loses chunks and asks for them again (seconds
    /// later).
    #[arg(long, default_value_t = 64)]
    pub model_log_mib: usize,
    /// Maximum client connections.
    #[arg(long, default_value_t = 1000)]
    pub max_connections: usize,
    /// Username:password pairs allowed to connect (none: anonymous access).
    #[arg(long = "user")]
    pub users: Vec<String>,
    /// Mutual TLS: the broker's certificate (PEM). With `--tls-key` and `--tls-client-ca` the
    /// listener speaks TLS only and refuses every client without a certificate signed by that
    /// CA.
    #[arg(long, requires_all = ["tls_key", "tls_client_ca"])]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Mutual TLS: the private key of `--tls-cert` (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_client_ca"])]
    pub tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: the CA (PEM) every client certificate must be signed by.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_client_ca: Option<std::path::PathBuf>,
}

/// Log filter for a broker process: rumqttd logs every client disconnect, clean ones included,
/// at ERROR from `rumqttd::server::broker`; that target is off unless RUST_LOG asks for it.
pub const LOG_FILTER: &str = "warn,rumqttd::server::broker=off";

/// Bytes a filter shared by every site (the aggregator's `update/+`) keeps at least: the upload
/// windows of every sampled site at once (the aggregator's `broker_update_log_bytes` must not
/// exceed it; it announces `log / (sampled sites + 1)` per site in each round manifest).
pub const SHARED_LOG_BYTES: usize = 32 << 20;
/// Bytes one site's bulk reply filter keeps at least: twice a site's fetch window
/// (`unifed_protocol::chunking::FETCH_WINDOW_BYTES`).
pub const PER_SITE_LOG_BYTES: usize = 8 << 20;
/// The filters that carry bulk data to one site: model chunks and onboarding packages. Each
/// site has its own, so their logs are kept small (see [`PER_SITE_LOG_BYTES`]).
pub const PER_SITE_BULK_FILTERS: [&str; 2] =
    ["unifed/+/+/chunks/reply/+", "unifed/+/+/onboard/reply/+"];

/// The filter of the model chunks sent once for every site (see
/// [`BrokerArgs::model_log_mib`]).
pub const MODEL_CHUNKS_FILTER: &str = "unifed/+/+/chunks/model";

/// The in-memory log limits of a filter that keeps at least `keep` bytes, for packets of at
/// most `packet` bytes. rumqttd keeps a filter's log in segments of 1 MiB and drops the oldest
/// when a new one starts; a segment is closed by the packet that takes it to 1 MiB or past it
/// (one packet larger than that fills one alone). So a log of `n` segments of `s` bytes keeps
/// at least `(n - 1) * s` bytes and holds at most `n` times `s` plus one packet. A segment of
/// exactly 1 MiB closes after four 256 KiB chunks; one of 1 MiB plus a packet's slack held five.
pub fn log_limits(keep: usize, packet: usize) -> rumqttd::SegmentConfig {
    let segment = 1 << 20;
    rumqttd::SegmentConfig {
        max_segment_size: segment,
        max_segment_count: keep.max(2 * packet).div_ceil(segment) + 1,
    }
}

/// Runs the broker in this process until it fails (rumqttd has no shutdown: end the process).
/// Prints `unifed-broker listening on <addr>` once the port accepts connections. The process
/// allocates as a relay (`unifed_net::memory::Allocation::Relay`): packets reuse malloc's heap,
/// and what the heap keeps free is handed back every 2 s.
pub fn run(args: &BrokerArgs) -> Result<()> {
    unifed_net::memory::set_allocation(unifed_net::memory::Allocation::Relay);
    if args.max_packet_bytes < 1024 {
        bail!(
            "--max-packet-bytes must be at least 1024, got {}",
            args.max_packet_bytes
        );
    }
    let listen = if args.listen.port() == 0 {
        // rumqttd binds inside its own thread and never reports the port: pick a free one.
        let l =
            TcpListener::bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
        l.local_addr()?
    } else {
        args.listen
    };
    let connections = connection_settings(args)?;
    // Under mutual TLS the public port is ours (tls.rs) and rumqttd listens on loopback.
    let tls = match (&args.tls_cert, &args.tls_key, &args.tls_client_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(tls::acceptor(cert, key, ca)?),
        (None, None, None) => None,
        _ => bail!("mutual TLS needs --tls-cert, --tls-key and --tls-client-ca together"),
    };
    let (public, listen) = match &tls {
        Some(_) => {
            let public = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
            let inner = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
            (Some(public), inner)
        }
        None => (None, listen),
    };
    let server = rumqttd::ServerSettings {
        name: "v4".into(),
        listen,
        tls: None,
        next_connection_delay_ms: 1,
        connections,
    };
    let packet = args.max_packet_bytes + 4096;
    let shared = log_limits(SHARED_LOG_BYTES, packet);
    let per_site = log_limits(PER_SITE_LOG_BYTES, packet);
    let model = log_limits(args.model_log_mib.saturating_mul(1 << 20), packet);
    let config = rumqttd::Config {
        id: 0,
        router: rumqttd::RouterConfig {
            max_connections: args.max_connections,
            max_outgoing_packet_count: 200,
            max_segment_size: shared.max_segment_size,
            max_segment_count: shared.max_segment_count,
            custom_segment: Some(
                PER_SITE_BULK_FILTERS
                    .iter()
                    .map(|f| (f.to_string(), per_site.clone()))
                    .chain([(MODEL_CHUNKS_FILTER.to_string(), model)])
                    .collect(),
            ),
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v4: Some([("v4".to_string(), server)].into()),
        ..Default::default()
    };
    let mut broker = rumqttd::Broker::new(config);
    let handle = std::thread::spawn(move || broker.start().map_err(|e| e.to_string()));
    let t0 = Instant::now();
    while !listening(listen) {
        if handle.is_finished() || t0.elapsed() > Duration::from_secs(10) {
            bail!("the broker did not start listening on {listen}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let shown = match (public, tls) {
        (Some(public), Some(acceptor)) => {
            spawn_tls_front(public, acceptor, listen, args.max_connections)?
        }
        _ => listen,
    };
    println!("unifed-broker listening on {shown}");
    use std::io::Write;
    std::io::stdout().flush()?;
    // rumqttd drops a filter's oldest segment as a new one starts; hand those pages back to the
    // system every few seconds rather than keep the broker at its high-water mark.
    std::thread::spawn(|| {
        loop {
            std::thread::sleep(Duration::from_secs(2));
            unifed_net::release_free_memory();
        }
    });
    match handle.join() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => bail!("broker stopped: {e}"),
        Err(_) => bail!("broker thread panicked"),
    }
}

/// rumqttd's connection settings from `args`: packet size, and the `--user` logins.
fn connection_settings(args: &BrokerArgs) -> Result<rumqttd::ConnectionSettings> {
    let auth = if args.users.is_empty() {
        None
    } else {
        let mut m = HashMap::new();
        for u in &args.users {
            let (user, pass) = u
                .split_once(':')
                .with_context(|| format!("--user `{u}` must be user:password"))?;
            m.insert(user.to_string(), pass.to_string());
        }
        Some(m)
    };
    Ok(rumqttd::ConnectionSettings {
        connection_timeout_ms: 60_000,
        max_payload_size: args.max_packet_bytes + 4096,
        max_inflight_count: 100,
        auth,
        external_auth: None,
        dynamic_filters: true,
    })
}

/// Serves mutual TLS on `public` in a thread of its own, relaying verified clients to rumqttd
/// on `broker` (see [`tls::serve`]); returns the public address.
fn spawn_tls_front(
    public: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    broker: SocketAddr,
    max_connections: usize,
) -> Result<SocketAddr> {
    let addr = public.local_addr()?;
    public.set_nonblocking(true)?;
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the TLS listener");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(public).expect("the TLS listener");
            if let Err(e) = tls::serve(l, acceptor, broker, max_connections).await {
                tracing::error!(error = %e, "the TLS listener stopped");
            }
        });
    });
    Ok(addr)
}

/// Whether something listens on `addr`. On Linux this reads `/proc/net/tcp{,6}` for a LISTEN
/// socket on the port, which neither disturbs the broker (a probe connection makes rumqttd log
/// an aborted connect) nor races with its bind (a probe bind could); elsewhere it connects.
fn listening(addr: SocketAddr) -> bool {
    let port = format!(":{:04X}", addr.port());
    let tables: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect();
    if tables.is_empty() {
        return TcpStream::connect(addr).is_ok();
    }
    tables.iter().flat_map(|t| t.lines().skip(1)).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() > 3 && f[1].ends_with(&port) && f[3] == "0A"
    })
}
