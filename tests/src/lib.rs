//! Workspace-level end-to-end tests that start the real binaries (broker, aggregator, agents).
//! The tests live in `tests/`; this library finds the binaries the workspace build produced,
//! starts brokers (the embedded one or Mosquitto), and records what crosses the broker through a
//! loopback proxy ([`Proxy`]), since a `#` subscriber can miss messages on rumqttd.

pub mod capture;
pub mod fed;

pub use capture::{Packet, Proxy};

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Path of a workspace binary built beside the running test (`<target>/<profile>/<name>`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("<target>/<profile>");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is not built: run the workspace tests (`cargo test --release --workspace`)",
        p.display()
    );
    p
}

/// Runs end-to-end tests one at a time: each starts several processes that train, and running
/// them together on a 2-core machine would only make every one of them slower and their
/// deadlines harder to reason about.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A child process that is killed and reaped when dropped, so a failing test leaves no broker,
/// aggregator or agent running.
#[derive(Debug)]
pub struct Guard(pub std::process::Child);

impl Guard {
    /// Waits up to `limit` for the process to exit; kills it and returns `None` on timeout.
    pub fn wait_for(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Ok(Some(s)) = self.0.try_wait() {
                return Some(s);
            }
            if t0.elapsed() > limit {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Asks the process to stop (SIGTERM, as systemd or `kill` do) without waiting for it.
    pub fn terminate(&self) {
        let st = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(st.success(), "kill -TERM failed");
    }

    /// Kills the process (SIGKILL: no clean-up, no MQTT DISCONNECT) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Which MQTT broker a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// `unifed-broker` (rumqttd), the embedded broker.
    Embedded,
    /// The system's Mosquitto (`mosquitto` on the PATH or in /usr/sbin).
    Mosquitto,
}

/// A TLS listener's files (PEM): the CA, the server certificate and its key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// CA certificate.
    pub ca: PathBuf,
    /// Server certificate (for 127.0.0.1 and localhost).
    pub cert: PathBuf,
    /// Server private key.
    pub key: PathBuf,
}

/// Whether Mosquitto tests can run: true if it is installed; false (after printing SKIPPED)
/// if not, unless `UNIFED_REQUIRE_MOSQUITTO` is set (CI), where a missing broker fails.
pub fn mosquitto_available() -> bool {
    if mosquitto().is_some() {
        return true;
    }
    assert!(
        std::env::var_os("UNIFED_REQUIRE_MOSQUITTO").is_none(),
        "UNIFED_REQUIRE_MOSQUITTO is set but mosquitto is not installed"
    );
    eprintln!("SKIPPED: mosquitto is not installed (scripts/install-mosquitto.sh)");
    false
}

/// A running broker on a loopback port, restartable on the same port.
#[derive(Debug)]
pub struct Broker {
    /// Which broker.
    pub kind: BrokerKind,
    /// Its loopback port.
    pub port: u16,
    /// Largest packet it accepts.
    pub max_packet: usize,
    /// Username and password clients must give (Mosquitto runs with a password file).
    pub credentials: Option<(String, String)>,
    /// TLS files of the listener (Mosquitto only), if it speaks TLS.
    pub tls: Option<TlsFiles>,
    dir: tempfile::TempDir,
    process: Option<Guard>,
}

/// The Mosquitto executable, if installed (`scripts/install-mosquitto.sh` installs it).
pub fn mosquitto() -> Option<PathBuf> {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")]);
    candidates
        .map(|d| d.join("mosquitto"))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

impl Broker {
    /// Starts a broker of `kind` on a free loopback port with packet limit `max_packet`.
    pub fn start(kind: BrokerKind, max_packet: usize) -> Broker {
        Self::start_with(kind, max_packet, None)
    }

    /// Like [`Broker::start`], with a TLS listener (Mosquitto only) when `tls` is given.
    pub fn start_with(kind: BrokerKind, max_packet: usize, tls: Option<TlsFiles>) -> Broker {
        assert!(
            tls.is_none() || kind == BrokerKind::Mosquitto,
            "TLS tests run on Mosquitto"
        );
        let dir = tempfile::tempdir().expect("broker dir");
        let credentials = match kind {
            BrokerKind::Embedded => None,
            BrokerKind::Mosquitto => Some(("unifed".to_string(), "e2e-secret".to_string())),
        };
        let mut b = Broker {
            kind,
            port: 0,
            max_packet,
            credentials,
            tls,
            dir,
            process: None,
        };
        b.port = match kind {
            BrokerKind::Embedded => 0,
            BrokerKind::Mosquitto => free_port(),
        };
        b.restart();
        b
    }

    /// Kills the broker (SIGKILL): every connection drops, retained messages in RAM are lost.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// (Re)starts the broker on its port and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        match self.kind {
            BrokerKind::Embedded => {
                let listen = format!("127.0.0.1:{}", self.port);
                let t0 = Instant::now();
                loop {
                    let mut child = Guard(
                        Command::new(binary("unifed-broker"))
                            .args(["--listen", &listen, "--max-packet-bytes"])
                            .arg(self.max_packet.to_string())
                            .stdout(Stdio::piped())
                            .spawn()
                            .expect("starting unifed-broker"),
                    );
                    let mut line = String::new();
                    BufReader::new(child.0.stdout.take().expect("stdout"))
                        .read_line(&mut line)
                        .expect("broker stdout");
                    if let Some(port) = line.trim().rsplit(':').next().and_then(|p| p.parse().ok())
                    {
                        self.port = port;
                        self.process = Some(child);
                        return;
                    }
                    // The old socket may linger for a moment after a kill: try again.
                    assert!(
                        t0.elapsed() < Duration::from_secs(20),
                        "unifed-broker did not start on {listen}"
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            BrokerKind::Mosquitto => {
                let exe = mosquitto().expect("mosquitto is not installed");
                let (user, pass) = self.credentials.clone().expect("credentials");
                let pw = self.dir.path().join("passwd");
                std::fs::write(&pw, format!("{user}:{pass}\n")).expect("password file");
                let st = Command::new(exe.with_file_name("mosquitto_passwd"))
                    .arg("-U")
                    .arg(&pw)
                    .status();
                if !st.as_ref().is_ok_and(|s| s.success()) {
                    // mosquitto_passwd lives in /usr/bin on Debian.
                    let st = Command::new("mosquitto_passwd").arg("-U").arg(&pw).status();
                    assert!(st.is_ok_and(|s| s.success()), "mosquitto_passwd -U failed");
                }
                let conf = self.dir.path().join("mosquitto.conf");
                std::fs::write(
                    &conf,
                    fed::mosquitto_conf(
                        self.port,
                        &pw,
                        self.max_packet,
                        &current_user(),
                        self.tls.as_ref(),
                    ),
                )
                .expect("mosquitto.conf");
                let child = Guard(
                    Command::new(exe)
                        .arg("-c")
                        .arg(&conf)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("starting mosquitto"),
                );
                self.process = Some(child);
                let t0 = Instant::now();
                while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
                    assert!(
                        t0.elapsed() < Duration::from_secs(20),
                        "mosquitto did not start on port {}",
                        self.port
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// The broker's folder (configs, password file).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn current_user() -> String {
    Command::new("id")
        .arg("-un")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "root".into())
}

/// The names of a spec's BN weight and bias tensors, in spec order (what sites share under
/// BN sharing `affine`).
pub fn bn_affine_names(spec: &unifed_protocol::ModelSpec) -> Vec<&str> {
    spec.tensors
        .iter()
        .filter(|t| t.kind.is_bn_affine())
        .map(|t| t.name.as_str())
        .collect()
}

/// A payload as postcard bytes (lets one closure build envelopes of several payload types).
pub trait Erased {
    /// The postcard encoding.
    fn bytes(&self) -> Vec<u8>;
}

impl<T: serde::Serialize> Erased for T {
    fn bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("postcard encodes plain data")
    }
}

/// A test CA made here (never committed) and what it signs, as PEM files in `dir`: `ca.pem`;
/// the broker's certificate for 127.0.0.1/localhost (`server.pem`, `server.key`); a client
/// certificate whose common name is the identity for each of `clients` (`{who}.pem`,
/// `{who}.key`); `stranger.pem`/`.key`, a client certificate named `grey` of another CA; and
/// that other CA (`other-ca.pem`, returned second).
pub fn certificates(dir: &Path, clients: &[&str]) -> (TlsFiles, PathBuf) {
    let ca = |name: &str| {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        let key = rcgen::KeyPair::generate().expect("key");
        (p.self_signed(&key).expect("CA"), key)
    };
    let (ca_cert, ca_key) = ca("UniFed test CA");
    let (other, other_key) = ca("Another CA");
    let issue = |names: Vec<String>, cn: &str, by: (&rcgen::Certificate, &rcgen::KeyPair)| {
        let mut p = rcgen::CertificateParams::new(names).expect("params");
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().expect("key");
        (p.signed_by(&key, by.0, by.1).expect("certificate"), key)
    };
    let write = |name: &str, (cert, key): (rcgen::Certificate, rcgen::KeyPair)| {
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("pem");
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("key");
    };
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).expect("ca");
    std::fs::write(dir.join("other-ca.pem"), other.pem()).expect("ca");
    write(
        "server",
        issue(
            vec!["127.0.0.1".into(), "localhost".into()],
            "unifed test broker",
            (&ca_cert, &ca_key),
        ),
    );
    for c in clients {
        write(c, issue(vec![], c, (&ca_cert, &ca_key)));
    }
    write("stranger", issue(vec![], "grey", (&other, &other_key)));
    (
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
        },
        dir.join("other-ca.pem"),
    )
}
