//! MQTT plumbing shared by the agent and the aggregator (neither depends on the other).
//!
//! One task owns the rumqttc event loop ([`spawn_event_loop`]): it reconnects with exponential
//! backoff (rumqttc itself retries at full speed), re-subscribes on every ConnAck (a clean
//! session loses subscriptions), and forwards incoming publishes over a channel, so that the
//! application task can `publish().await` without starving the loop. [`report`] is the typed
//! contract between the services and a supervising process.

pub mod config_check;
pub mod disk;
pub mod memory;
pub mod report;
pub mod service;
pub mod throttle;

pub use memory::release_free_memory;

/// Makes the process that `cmd` starts die (SIGKILL) when the thread that started it ends, so
/// that a supervisor killed by a signal or a timeout leaves no orphans holding ports, files or a
/// GPU. Linux only; elsewhere it leaves `cmd` as it is.
#[allow(unsafe_code)]
pub fn end_with_parent(cmd: &mut std::process::Command) -> &mut std::process::Command {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl and getppid are async-signal-safe and touch no memory of the parent.
        unsafe {
            let parent = libc::getpid();
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before the prctl: then nothing will signal us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    cmd
}

use rumqttc::{AsyncClient, Event, EventLoop, LastWill, MqttOptions, Packet, QoS};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::sync::mpsc;

/// Where and how to reach the broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Username, if the broker requires one.
    #[serde(default)]
    pub username: Option<String>,
    /// Password for `username`.
    #[serde(default)]
    pub password: Option<String>,
    /// Largest MQTT packet either way, in bytes (must exceed the chunk size plus headers).
    #[serde(default = "default_max_packet")]
    pub max_packet_bytes: usize,
    /// Keep-alive interval.
    #[serde(default = "default_keep_alive")]
    pub keep_alive_secs: u64,
    /// TLS: the CA certificate(s), PEM, that the broker's certificate must chain to. Without
    /// it the connection is plain TCP (loopback or a trusted network only).
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Mutual TLS: this client's certificate (PEM, its chain), shown to a broker that requires
    /// client certificates (Mosquitto's `require_certificate`, `unifed-broker --tls-client-ca`).
    /// Needs `ca_file` and `key_file`.
    #[serde(default)]
    pub cert_file: Option<std::path::PathBuf>,
    /// Mutual TLS: the private key of `cert_file` (PEM), readable by this service only.
    #[serde(default)]
    pub key_file: Option<std::path::PathBuf>,
}

fn default_max_packet() -> usize {
    1 << 20
}

fn default_keep_alive() -> u64 {
    30
}

impl BrokerConfig {
    /// The TLS files the config names, each under its key in `[broker]`.
    pub fn tls_files(&self) -> [(&'static str, Option<&std::path::Path>); 3] {
        [
            ("ca_file", self.ca_file.as_deref()),
            ("cert_file", self.cert_file.as_deref()),
            ("key_file", self.key_file.as_deref()),
        ]
    }

    /// Makes the TLS file paths relative to the folder of the config file `config` (see
    /// [`service::resolve_path`]).
    pub fn resolve_paths(&mut self, config: &std::path::Path) {
        for p in [&mut self.ca_file, &mut self.cert_file, &mut self.key_file] {
            service::resolve_opt(config, p);
        }
    }

    /// A broker on `host:port` with default limits.
    pub fn new(host: &str, port: u16) -> Self {
        BrokerConfig {
            host: host.into(),
            port,
            username: None,
            password: None,
            max_packet_bytes: default_max_packet(),
            keep_alive_secs: default_keep_alive(),
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }

    /// rumqttc options for `client_id`, with every limit set explicitly, an optional Last Will,
    /// TLS when `ca_file` is set and a client certificate when `cert_file` and `key_file` are.
    /// Fails when a file cannot be read or holds no PEM item of its kind, or when the TLS
    /// settings are incomplete.
    pub fn options(
        &self,
        client_id: &str,
        will: Option<LastWill>,
    ) -> Result<MqttOptions, OptionsError> {
        let mut o = MqttOptions::new(client_id, self.host.clone(), self.port);
        let pem = |path: &std::path::Path, what: &'static str, marker: &'static str| {
            let b = std::fs::read(path).map_err(|error| OptionsError::Read {
                what,
                path: path.into(),
                error,
            })?;
            if String::from_utf8_lossy(&b).contains(marker) {
                Ok(b)
            } else {
                Err(OptionsError::NoPem {
                    what,
                    path: path.into(),
                    marker,
                })
            }
        };
        let client_auth = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(c), Some(k)) => Some((
                pem(c, "client certificate", "CERTIFICATE-----")?,
                pem(k, "client key", "PRIVATE KEY-----")?,
            )),
            _ => return Err(OptionsError::HalfMutualTls),
        };
        if let Some(ca) = &self.ca_file {
            let ca = pem(ca, "CA file", "CERTIFICATE-----")?;
            // rustls needs one process-wide crypto provider; ring is the one compiled in.
            let _ = rustls::crypto::ring::default_provider().install_default();
            o.set_transport(rumqttc::Transport::tls_with_config(
                rumqttc::TlsConfiguration::Simple {
                    ca,
                    alpn: None,
                    client_auth,
                },
            ));
        } else if client_auth.is_some() {
            return Err(OptionsError::ClientCertWithoutTls);
        }
        o.set_max_packet_size(self.max_packet_bytes + 4096, self.max_packet_bytes + 4096);
        o.set_keep_alive(Duration::from_secs(self.keep_alive_secs.max(5)));
        o.set_clean_session(true);
        o.set_request_channel_capacity(4096);
        o.set_inflight(100);
        if let (Some(u), Some(p)) = (&self.username, &self.password) {
            o.set_credentials(u.clone(), p.clone());
        }
        if let Some(w) = will {
            o.set_last_will(w);
        }
        Ok(o)
    }
}

/// Why [`BrokerConfig::options`] cannot make the client's options: a TLS file that cannot be
/// read or holds no PEM item of its kind, or incomplete TLS settings.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    /// A TLS file cannot be read.
    #[error("reading the {what} {}: {error}", path.display())]
    Read {
        /// Which file: `CA file`, `client certificate` or `client key`.
        what: &'static str,
        /// Its path.
        path: std::path::PathBuf,
        /// Why it cannot be read.
        error: std::io::Error,
    },
    /// A TLS file holds no PEM item of the kind it should.
    #[error("the {what} {} holds no PEM {marker}", path.display())]
    NoPem {
        /// Which file: `CA file`, `client certificate` or `client key`.
        what: &'static str,
        /// Its path.
        path: std::path::PathBuf,
        /// The end of the PEM header looked for, e.g. `CERTIFICATE-----`.
        marker: &'static str,
    },
    /// Only one of `cert_file` and `key_file` is set.
    #[error("mutual TLS needs both cert_file and key_file")]
    HalfMutualTls,
    /// A client certificate is set without `ca_file`, that is without TLS.
    #[error("a client certificate needs TLS: set ca_file too")]
    ClientCertWithoutTls,
}

impl From<OptionsError> for String {
    fn from(e: OptionsError) -> String {
        e.to_string()
    }
}

/// What the event-loop task forwards.
#[derive(Debug, Clone)]
pub enum NetEvent {
    /// (Re)connected and re-subscribed.
    Connected,
    /// The connection dropped; the loop is backing off before reconnecting.
    Disconnected(String),
    /// The broker answered a subscription (one per topic filter subscribed after each
    /// connection).
    Subscribed,
    /// A message arrived.
    Message {
        /// Its topic.
        topic: String,
        /// Its payload: a slice of the client's read buffer, not a copy of it.
        payload: bytes::Bytes,
    },
}

/// Connects with `options` and spawns the task that owns the event loop. `subscriptions` are
/// (re)made on every ConnAck. Returns the client handle and the receiver of events; the task ends
/// when the receiver is dropped.
pub fn spawn_event_loop(
    options: MqttOptions,
    subscriptions: Vec<String>,
) -> (AsyncClient, mpsc::UnboundedReceiver<NetEvent>) {
    let (client, rx, _) = spawn_event_loop_with_side(options, subscriptions, |_, _| false);
    (client, rx)
}

/// [`spawn_event_loop`] with a second receiver: the messages `aside(topic, payload)` picks go
/// to it rather than to the first, so a task that drains them (the aggregator taking update
/// chunks) never waits behind the other's work. Connection events go to the first receiver
/// only; a picked message is dropped, with a warning, once the second receiver is gone.
pub fn spawn_event_loop_with_side(
    options: MqttOptions,
    subscriptions: Vec<String>,
    aside: impl Fn(&str, &[u8]) -> bool + Send + 'static,
) -> (
    AsyncClient,
    mpsc::UnboundedReceiver<NetEvent>,
    mpsc::UnboundedReceiver<NetEvent>,
) {
    let (client, mut ev): (AsyncClient, EventLoop) = AsyncClient::new(options, 4096);
    // No Nagle delay: a request or an acknowledgement written behind a packet the broker has
    // not acknowledged yet waited for its delayed ACK (up to 40 ms) on every turn of a chunk
    // window.
    let mut network = ev.network_options();
    network.set_tcp_nodelay(true);
    ev.set_network_options(network);
    let (tx, rx) = mpsc::unbounded_channel();
    let (side_tx, side_rx) = mpsc::unbounded_channel();
    let c = client.clone();
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            if tx.is_closed() {
                break;
            }
            match ev.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    backoff = Duration::from_millis(100);
                    for s in &subscriptions {
                        // try_: never wait on the request channel from the task that drains it.
                        if let Err(e) = c.try_subscribe(s.clone(), QoS::AtLeastOnce) {
                            tracing::warn!(topic = %s, error = %e, "subscribe failed");
                        }
                    }
                    report::Report::Connection {
                        up: true,
                        error: None,
                    }
                    .emit();
                    if tx.send(NetEvent::Connected).is_err() {
                        break;
                    }
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if tx.send(NetEvent::Subscribed).is_err() {
                        break;
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let to_side = aside(&p.topic, &p.payload);
                    let message = NetEvent::Message {
                        topic: p.topic,
                        payload: p.payload,
                    };
                    if to_side {
                        if side_tx.send(message).is_err() {
                            tracing::warn!("a message for the side receiver dropped: it is gone");
                        }
                    } else if tx.send(message).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    if backoff == Duration::from_millis(100) {
                        // First failure after a good connection (or at start): say why once.
                        tracing::warn!(error = %e, "MQTT connection failed or lost; retrying with backoff");
                        report::Report::Connection {
                            up: false,
                            error: Some(e.to_string()),
                        }
                        .emit();
                    } else {
                        tracing::debug!(error = %e, backoff_ms = backoff.as_millis() as u64, "MQTT connection failed; backing off");
                    }
                    let _ = tx.send(NetEvent::Disconnected(e.to_string()));
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    });
    (client, rx, side_rx)
}

pub use rumqttc::{AsyncClient as Client, LastWill as Will, QoS as Qos};

/// Runs `fut` on the services' runtime: two worker threads (one for the MQTT event loop, one
/// for the service), timers and I/O enabled.
pub fn block_on<F: std::future::Future>(fut: F) -> std::io::Result<F::Output> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(fut))
}

/// Installs the binaries' log subscriber: `RUST_LOG` if set, else `default_filter`, and at
/// most [`throttle::BURST`] lines per place in the code per [`throttle::WINDOW`] (a flood of
/// junk from the network is counted, not written line by line); logs go to stderr so stdout
/// stays for results.
pub fn init_logging(default_filter: &str) {
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    let env = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let filter = tracing_subscriber::filter::FilterExt::and(env, throttle::Throttle::default());
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        )
        .init();
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_child_started_with_end_with_parent_dies_with_the_thread_that_started_it() {
        // The starting thread ends at once; the kernel then kills its child.
        let mut child = std::thread::spawn(|| {
            super::end_with_parent(&mut std::process::Command::new("sleep"))
                .arg("30")
                .spawn()
                .expect("starting sleep")
        })
        .join()
        .expect("the starting thread");
        let status = child.wait().expect("waiting for sleep");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
}

#[cfg(test)]
mod options_tests {
    use super::{BrokerConfig, OptionsError};
    use std::path::PathBuf;

    fn broker() -> BrokerConfig {
        BrokerConfig::new("127.0.0.1", 1883)
    }

    #[test]
    fn plain_tcp_options_need_no_files() {
        assert!(broker().options("site-a", None).is_ok());
    }

    #[test]
    fn incomplete_or_unreadable_tls_settings_are_refused_with_what_is_wrong() {
        let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let mut b = broker();
        b.cert_file = Some(manifest.clone());
        assert!(matches!(
            b.options("site-a", None),
            Err(OptionsError::HalfMutualTls)
        ));

        let mut b = broker();
        b.ca_file = Some(manifest.with_file_name("no-such-ca.pem"));
        let err = b.options("site-a", None).unwrap_err();
        assert!(
            matches!(
                &err,
                OptionsError::Read {
                    what: "CA file",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().starts_with("reading the CA file "), "{err}");

        let mut b = broker();
        b.ca_file = Some(manifest.clone());
        let err = b.options("site-a", None).unwrap_err();
        assert!(
            matches!(
                &err,
                OptionsError::NoPem {
                    marker: "CERTIFICATE-----",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            String::from(err),
            format!(
                "the CA file {} holds no PEM CERTIFICATE-----",
                manifest.display()
            )
        );
    }

    #[test]
    fn a_client_certificate_without_tls_is_refused() {
        let pem =
            std::env::temp_dir().join(format!("unifed-net-options-{}.pem", std::process::id()));
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\n",
        )
        .unwrap();
        let mut b = broker();
        b.cert_file = Some(pem.clone());
        b.key_file = Some(pem.clone());
        let result = b.options("site-a", None);
        std::fs::remove_file(&pem).unwrap();
        assert!(matches!(result, Err(OptionsError::ClientCertWithoutTls)));
    }
}
