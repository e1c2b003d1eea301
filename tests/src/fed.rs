//! A small federation for the end-to-end tests: the initial model, the aggregator's and the
//! agents' config files, and their processes (each logging to a file in the test's folder).

use crate::{Guard, binary};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Mosquitto's config for the tests and for sites that run their own: loopback listener,
/// password file, packet limit, a deep queue (the default of 1000 queued messages drops
/// silently), no persistence, the user to run as, and TLS files when given.
pub fn mosquitto_conf(
    port: u16,
    password_file: &Path,
    max_packet: usize,
    user: &str,
    tls: Option<&crate::TlsFiles>,
) -> String {
    let tls = tls.map_or(String::new(), |t| {
        format!(
            "cafile {}\ncertfile {}\nkeyfile {}\n",
            t.ca.display(),
            t.cert.display(),
            t.key.display()
        )
    });
    // TLS settings belong to the listener above them.
    format!(
        "per_listener_settings false\nset_tcp_nodelay true\nlistener {port} 127.0.0.1\n{tls}allow_anonymous false\n\
         password_file {}\nmax_packet_size {}\nmax_queued_messages 100000\nmax_queued_bytes 0\n\
         max_inflight_messages 100\npersistence false\nuser {user}\nlog_dest stderr\n",
        password_file.display(),
        max_packet + 4096
    )
}

/// One federation's settings and folder.
#[derive(Debug, Clone)]
pub struct Fed {
    /// The test's folder (configs, logs, data directories).
    pub dir: PathBuf,
    /// The port clients connect to (the proxy's, or the broker's).
    pub port: u16,
    /// Packet limit of clients and broker.
    pub max_packet: usize,
    /// Broker username and password.
    pub credentials: Option<(String, String)>,
    /// Digits CNN conv widths.
    pub conv: Vec<usize>,
    /// Digits CNN fc widths.
    pub fc: Vec<usize>,
    /// Rounds.
    pub rounds: u64,
    /// Sites a round waits for.
    pub min_sites: usize,
    /// Round deadline in seconds.
    pub deadline_secs: u64,
    /// `Local` or `Global`.
    pub bn_policy: String,
    /// The federation's encoding, both ways.
    pub encoding: unifed_protocol::Encoding,
    /// The algorithm as a TOML inline table (default `{ name = "fedavg" }`).
    pub algorithm: String,
    /// BN sharing policy: `none`, `affine` or `affine+stats`.
    pub bn_sharing: String,
    /// Seconds the aggregator keeps serving after the last round.
    pub linger_secs: u64,
    /// Seconds between the aggregator's re-publications of the retained manifest.
    pub manifest_every_secs: u64,
    /// Model chunk size.
    pub chunk_bytes: usize,
    /// Training images per site.
    pub train_samples: usize,
    /// Seconds between an agent's re-sends.
    pub resend_secs: u64,
    /// TLS: the CA file clients check the broker's certificate against.
    pub ca_file: Option<PathBuf>,
    /// Training images of particular sites (others: `train_samples`).
    pub samples: std::collections::BTreeMap<String, usize>,
    /// The built-in domain of particular sites (others: the domain the site is named after).
    pub domains: std::collections::BTreeMap<String, String>,
    /// Lines added at the top of particular sites' agent configs.
    pub agent_extra: std::collections::BTreeMap<String, String>,
    /// Lines added to the `[train]` table of particular sites' agent configs.
    pub train_extra: std::collections::BTreeMap<String, String>,
    /// The sites enrolled with the aggregator (each with its key from [`Fed::key_file`]).
    pub sites: Vec<String>,
    /// Sites whose keys the aggregator's config revokes.
    pub revoked: Vec<String>,
    /// Lines added to the aggregator's `[federation]` table.
    pub federation_extra: String,
    /// Lines added at the top of the aggregator's config (service settings).
    pub service_extra: String,
    /// Mutual TLS: a folder with `{who}.pem` and `{who}.key`, the client certificate of each
    /// site and of `aggregator`.
    pub client_certs: Option<PathBuf>,
}

impl Fed {
    /// A small, fast federation in `dir` reaching the broker on `port`.
    pub fn new(dir: &Path, port: u16, max_packet: usize) -> Fed {
        Fed {
            dir: dir.to_path_buf(),
            port,
            max_packet,
            credentials: None,
            conv: vec![4, 6, 8],
            fc: vec![64, 16],
            rounds: 3,
            min_sites: 3,
            deadline_secs: 300,
            bn_policy: "Local".into(),
            encoding: unifed_protocol::Encoding::F32,
            algorithm: "{ name = \"fedavg\" }".into(),
            bn_sharing: "none".into(),
            linger_secs: 3,
            manifest_every_secs: 30,
            chunk_bytes: 8192,
            train_samples: 48,
            resend_secs: 30,
            samples: Default::default(),
            domains: Default::default(),
            agent_extra: Default::default(),
            train_extra: Default::default(),
            ca_file: None,
            sites: ["grey", "texture", "lowres"].map(String::from).to_vec(),
            revoked: Vec::new(),
            federation_extra: String::new(),
            service_extra: String::new(),
            client_certs: None,
        }
    }

    /// The private key file of `who` (a site, or `aggregator`), made on first use as the site
    /// itself would make it; every device of a site shares it.
    pub fn key_file(&self, who: &str) -> PathBuf {
        let dir = self.dir.join("keys");
        std::fs::create_dir_all(&dir).expect("keys folder");
        let p = dir.join(format!("{who}.key"));
        unifed_protocol::SigningKey::load_or_create(&p).expect("key file");
        p
    }

    /// The agent config lines naming `site`'s identity key and pinning the aggregator's.
    pub fn identity_toml(&self, site: &str) -> String {
        format!(
            "identity = \"{}\"\naggregator_key = \"{}\"\n",
            self.key_file(site).display(),
            self.key("aggregator").public()
        )
    }

    /// The signing key of `who` (a site, or `aggregator`).
    pub fn key(&self, who: &str) -> unifed_protocol::SigningKey {
        unifed_protocol::SigningKey::load(&self.key_file(who)).expect("key file")
    }

    /// The initial model file (written on first use by `unifed-agent init`).
    pub fn model(&self) -> PathBuf {
        let p = self.dir.join("init.safetensors");
        if !p.exists() {
            let join = |v: &[usize]| {
                v.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let st = Command::new(binary("unifed-agent"))
                .args(["init", "--arch", "digits", "--conv"])
                .arg(join(&self.conv))
                .arg("--fc")
                .arg(join(&self.fc))
                .arg("--out")
                .arg(&p)
                .status()
                .expect("unifed-agent init");
            assert!(st.success(), "unifed-agent init failed");
        }
        p
    }

    /// The model spec written beside the initial model.
    pub fn spec(&self) -> unifed_protocol::ModelSpec {
        let p = unifed_protocol::spec_path(&self.model());
        serde_json::from_slice(&std::fs::read(p).expect("spec file")).expect("spec json")
    }

    /// The `[broker]` table of `who`'s config (a site, or `aggregator`): with its client
    /// certificate under mutual TLS.
    pub fn broker_toml_for(&self, who: &str) -> String {
        let mut s = self.broker_toml();
        if let Some(d) = &self.client_certs {
            s += &format!(
                "cert_file = \"{}\"\nkey_file = \"{}\"\n",
                d.join(format!("{who}.pem")).display(),
                d.join(format!("{who}.key")).display()
            );
        }
        s
    }

    /// The `[broker]` table of a config for this federation's broker.
    pub fn broker_toml(&self) -> String {
        let mut s = format!(
            "[broker]\nhost = \"127.0.0.1\"\nport = {}\nmax_packet_bytes = {}\nkeep_alive_secs = 5\n",
            self.port, self.max_packet
        );
        if let Some((u, p)) = &self.credentials {
            s += &format!("username = \"{u}\"\npassword = \"{p}\"\n");
        }
        if let Some(ca) = &self.ca_file {
            s += &format!("ca_file = \"{}\"\n", ca.display());
        }
        s
    }

    /// The aggregator's data directory.
    pub fn agg_dir(&self) -> PathBuf {
        self.dir.join("agg")
    }

    /// Writes the aggregator's config and starts `unifed-aggregator serve` (log: `agg.log`).
    pub fn aggregator(&self) -> Guard {
        let cfg = self.aggregator_config();
        spawn(
            Command::new(binary("unifed-aggregator"))
                .args(["serve", "--config"])
                .arg(&cfg),
            &self.dir.join("agg.log"),
        )
    }

    /// Writes the aggregator's config (`agg.toml`) and returns its path.
    pub fn aggregator_config(&self) -> PathBuf {
        let cfg = self.dir.join("agg.toml");
        std::fs::write(
            &cfg,
            format!(
                "data_dir = \"{}\"\nmodel = \"{}\"\nkey = \"{}\"\nchunk_bytes = {}\nlinger_secs = {}\nmanifest_every_secs = {}\n{}{}\n[federation]\nfederation = \"e2e\"\nalgorithm = {}\nrounds = {}\nmin_sites = {}\ndeadline_secs = {}\nfraction = 1.0\nsites = [{}]\nrevoked = [{}]\nencoding = {}\nbn_policy = \"{}\"\nbn_sharing = \"{}\"\nweighting = \"samples\"\nkeep_versions = 8\nmax_update_bytes = 268435456\nseed = 0\n{}",
                self.agg_dir().display(),
                self.model().display(),
                self.key_file("aggregator").display(),
                self.chunk_bytes,
                self.linger_secs,
                self.manifest_every_secs,
                self.service_extra,
                self.broker_toml_for("aggregator"),
                self.algorithm,
                self.rounds,
                self.min_sites,
                self.deadline_secs,
                self.sites
                    .iter()
                    .map(|id| format!("{{ id = \"{id}\", key = \"{}\" }}", self.key(id).public()))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.revoked
                    .iter()
                    .map(|id| format!("\"{}\"", self.key(id).public()))
                    .collect::<Vec<_>>()
                    .join(", "),
                toml_encoding(self.encoding),
                self.bn_policy,
                self.bn_sharing,
                self.federation_extra,
            ),
        )
        .expect("aggregator config");
        cfg
    }

    /// Every line of the aggregator's audit log.
    pub fn audit(&self) -> Vec<unifed_aggregator::store::AuditEntry> {
        unifed_aggregator::store::Store::open(&self.agg_dir())
            .expect("the aggregator's data directory")
            .audit_entries()
            .expect("the audit log")
    }

    /// Sites whose update of `round` the aggregator holds, sorted: accepted, or answered as a
    /// duplicate (an aggregator killed after spooling an update and before auditing it finds
    /// the update in its spool and answers the re-send as a duplicate).
    pub fn accepted(&self, round: u64) -> Vec<String> {
        let mut v: Vec<String> = self
            .audit()
            .into_iter()
            .filter(|e| (e.event == "accepted" || e.event == "duplicate") && e.round == round)
            .map(|e| e.site)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The state folder of `site`'s agent.
    pub fn site_dir(&self, site: &str) -> PathBuf {
        self.dir.join(site)
    }

    /// Writes the config of one device of `site` (data: the built-in domain of that name):
    /// `<device>.toml`, with state folder `<device>/` and the site key file `key` if given.
    pub fn device_config(&self, site: &str, device: &str, key: Option<&Path>) -> PathBuf {
        let cfg = self.dir.join(format!("{device}.toml"));
        let list = |v: &[usize]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let key = key.map_or(String::new(), |k| {
            format!("site_key = \"{}\"\n", k.display())
        });
        std::fs::write(
            &cfg,
            format!(
                "site = \"{site}\"\nfederation = \"e2e\"\nstate_dir = \"{}\"\nresend_secs = {}\nthreads = 1\n{}{}{key}[model]\nconv = [{}]\nfc = [{}]\n[train]\nbatch_size = 16\n{}\n{}\n[data]\nbuiltin = \"{}\"\ntrain_samples = {}\n",
                self.site_dir(device).display(),
                self.resend_secs,
                self.agent_extra.get(site).map_or("", |x| x.as_str()),
                self.identity_toml(site),
                list(&self.conv),
                list(&self.fc),
                self.train_extra.get(site).map_or("", |x| x.as_str()),
                self.broker_toml_for(site),
                self.domains.get(site).map_or(site, |d| d.as_str()),
                self.samples.get(site).copied().unwrap_or(self.train_samples),
            ),
        )
        .expect("agent config");
        cfg
    }

    /// Writes `site`'s config and starts `unifed-agent train` (log: `<site>.log`, appended
    /// across restarts).
    pub fn agent(&self, site: &str) -> Guard {
        let cfg = self.device_config(site, site, None);
        spawn(
            Command::new(binary("unifed-agent"))
                .args(["train", "--config"])
                .arg(&cfg),
            &self.dir.join(format!("{site}.log")),
        )
    }

    /// Waits up to `limit` for the process `what` to exit successfully; fails the test with
    /// every log otherwise.
    pub fn wait_ok(&self, g: &mut Guard, what: &str, limit: std::time::Duration) {
        let st = g.wait_for(limit);
        assert!(
            st.is_some_and(|s| s.success()),
            "{what}: {st:?}\n{}",
            self.logs()
        );
    }

    /// Waits up to `limit` for a line containing `needle` in the log `<name>.log`.
    pub fn wait_line(&self, name: &str, needle: &str, limit: std::time::Duration) -> bool {
        self.wait_any(&[name], needle, limit)
    }

    /// Waits up to `limit` for a line containing `needle` in any of the logs `<name>.log`
    /// (each checked at least once).
    pub fn wait_any(&self, names: &[&str], needle: &str, limit: std::time::Duration) -> bool {
        let t0 = std::time::Instant::now();
        loop {
            let found = names.iter().any(|n| {
                std::fs::read_to_string(self.dir.join(format!("{n}.log")))
                    .is_ok_and(|t| t.contains(needle))
            });
            if found {
                return true;
            }
            if t0.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Every log file of the test's folder, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            let mut files: Vec<_> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            files.sort();
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                out += &format!("==== {} (last 40 lines)\n", f.display());
                for l in tail.iter().rev() {
                    out += l;
                    out.push('\n');
                }
            }
        }
        out
    }
}

fn spawn(cmd: &mut Command, log: &Path) -> Guard {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    let g = f.try_clone().expect("log file");
    Guard(
        cmd.env("RUST_LOG", "info,rumqttc=warn")
            .env("UNIFED_REPORT", "1")
            .stdout(Stdio::from(f))
            .stderr(Stdio::from(g))
            .spawn()
            .expect("spawning a workspace binary"),
    )
}

/// An encoding as the aggregator's TOML config spells it.
fn toml_encoding(e: unifed_protocol::Encoding) -> String {
    use unifed_protocol::Encoding::*;
    match e {
        F32 => "\"F32\"".into(),
        F16 => "\"F16\"".into(),
        Q8 => "\"Q8\"".into(),
        Ternary { block } => format!("{{ Ternary = {{ block = {block} }} }}"),
        TernaryQ8 { block } => format!("{{ TernaryQ8 = {{ block = {block} }} }}"),
        TopK { per_mille } => format!("{{ TopK = {{ per_mille = {per_mille} }} }}"),
        TopKQ8 { per_mille } => format!("{{ TopKQ8 = {{ per_mille = {per_mille} }} }}"),
    }
}
