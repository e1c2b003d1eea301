//! A small federation for the end-to-end tests: the initial model, the aggregator's and the
//! agents' config files, and their processes (each logging to a file in the test's folder).

use crate::{Guard, binary};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use unifed_agent::config::{AgentConfig, DataConfig};
use unifed_aggregator::service::ServiceConfig;
use unifed_aggregator::{Algorithm, EnrolledSite, FederationConfig, Weighting};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::DigitsCnnConfig;
use unifed_net::BrokerConfig;
use unifed_net::report::Report;
use unifed_protocol::messages::{BnPolicy, BnSharing};

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
    pub conv: [usize; 3],
    /// Digits CNN fc widths.
    pub fc: [usize; 2],
    /// Rounds.
    pub rounds: u64,
    /// Sites a round waits for.
    pub min_sites: usize,
    /// Round deadline in seconds.
    pub deadline_secs: u64,
    /// The BN policy.
    pub bn_policy: BnPolicy,
    /// The federation's encoding, both ways.
    pub encoding: unifed_protocol::Encoding,
    /// The algorithm (default FedAvg).
    pub algorithm: Algorithm,
    /// The BN sharing policy.
    pub bn_sharing: BnSharing,
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
    /// Whether each enrolled site is vouched for (enrolled with a `max_samples` of its own,
    /// here the federation's bound: its weight counts as it claims, as the in-process runner's
    /// sites do); off, every site's weight is capped at the round's lower-median claim.
    pub vouched: bool,
    /// The built-in domain of particular sites (others: the domain the site is named after).
    pub domains: std::collections::BTreeMap<String, String>,
    /// Typed edits of particular sites' agent configs, made after every other setting.
    pub agent_edits: BTreeMap<String, fn(&mut AgentConfig)>,
    /// The sites enrolled with the aggregator (each with its key from [`Fed::key_file`]).
    pub sites: Vec<String>,
    /// Sites whose keys the aggregator's config revokes.
    pub revoked: Vec<String>,
    /// A typed edit of the aggregator's config, made after every other setting.
    pub service_edit: Option<fn(&mut ServiceConfig)>,
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
            conv: [4, 6, 8],
            fc: [64, 16],
            rounds: 3,
            min_sites: 3,
            deadline_secs: 300,
            bn_policy: BnPolicy::Local,
            encoding: unifed_protocol::Encoding::F32,
            algorithm: Algorithm::FedAvg,
            bn_sharing: BnSharing::None,
            linger_secs: 3,
            manifest_every_secs: 30,
            chunk_bytes: 8192,
            train_samples: 48,
            resend_secs: 30,
            samples: Default::default(),
            vouched: true,
            domains: Default::default(),
            agent_edits: Default::default(),
            ca_file: None,
            sites: ["grey", "texture", "lowres"].map(String::from).to_vec(),
            revoked: Vec::new(),
            service_edit: None,
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

    /// The broker settings of `who`'s config (a site, or `aggregator`): with its client
    /// certificate under mutual TLS.
    pub fn broker_for(&self, who: &str) -> BrokerConfig {
        let mut b = self.broker();
        if let Some(d) = &self.client_certs {
            b.cert_file = Some(d.join(format!("{who}.pem")));
            b.key_file = Some(d.join(format!("{who}.key")));
        }
        b
    }

    /// The broker settings of a config for this federation's broker.
    pub fn broker(&self) -> BrokerConfig {
        let mut b = BrokerConfig::new("127.0.0.1", self.port);
        b.max_packet_bytes = self.max_packet;
        b.keep_alive_secs = 5;
        if let Some((u, p)) = &self.credentials {
            b.username = Some(u.clone());
            b.password = Some(p.clone());
        }
        b.ca_file = self.ca_file.clone();
        b
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

    /// The aggregator's config: this federation's settings, then [`Fed::service_edit`].
    pub fn service_config(&self) -> ServiceConfig {
        let sites = self
            .sites
            .iter()
            .map(|id| EnrolledSite {
                // Whatever a site claims, up to the federation's bound: its training images,
                // which a folder's data decides for itself.
                max_samples: self.vouched.then_some(u64::MAX),
                ..EnrolledSite::new(id, self.key(id).public())
            })
            .collect();
        let mut federation = FederationConfig::new("e2e", self.rounds, self.min_sites, sites);
        federation.algorithm = self.algorithm;
        federation.deadline_secs = self.deadline_secs;
        federation.revoked = self
            .revoked
            .iter()
            .map(|id| self.key(id).public())
            .collect();
        federation.encoding = self.encoding;
        federation.bn_policy = self.bn_policy;
        federation.bn_sharing = self.bn_sharing;
        federation.weighting = Weighting::Samples;
        federation.keep_versions = 8;
        federation.max_update_bytes = 256 << 20;
        let mut cfg = ServiceConfig {
            data_dir: self.agg_dir(),
            model: self.model(),
            key: self.key_file("aggregator"),
            chunk_bytes: self.chunk_bytes,
            linger_secs: self.linger_secs,
            manifest_every_secs: self.manifest_every_secs,
            max_upload_bytes: 1 << 30,
            broker: self.broker_for("aggregator"),
            federation,
        };
        if let Some(edit) = self.service_edit {
            edit(&mut cfg);
        }
        cfg
    }

    /// Writes the aggregator's config (`agg.toml`, serialised from
    /// [`Fed::service_config`]) and returns its path.
    pub fn aggregator_config(&self) -> PathBuf {
        let cfg = self.dir.join("agg.toml");
        write_toml(&cfg, &self.service_config());
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

    /// The sites the aggregator folded into `round`, sorted, as its typed `RoundClosed` report
    /// says (empty before the round closed). Unlike [`Fed::accepted`] it also names an update
    /// spooled by an aggregator killed before it audited it, which its restart folds.
    pub fn folded(&self, round: u64) -> Vec<String> {
        let mut v: Vec<String> = self
            .reports("agg")
            .into_iter()
            .find_map(|r| match r {
                Report::RoundClosed {
                    round: c, sites, ..
                } if c == round => Some(sites),
                _ => None,
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// The training images of `site`.
    pub fn samples_of(&self, site: &str) -> usize {
        self.samples
            .get(site)
            .copied()
            .unwrap_or(self.train_samples)
    }

    /// The state folder of `site`'s agent.
    pub fn site_dir(&self, site: &str) -> PathBuf {
        self.dir.join(site)
    }

    /// The config of one device of `site` (data: the built-in domain of that name): state
    /// folder `<device>/`, the site key file `key` if given, then [`Fed::agent_edits`] of
    /// `site`.
    pub fn agent_config(&self, site: &str, device: &str, key: Option<&Path>) -> AgentConfig {
        let mut cfg = AgentConfig {
            site: site.into(),
            federation: "e2e".into(),
            state_dir: self.site_dir(device),
            kernel_cache: None,
            profile: None,
            memory_budget_mib: None,
            backend: "flex".into(),
            spec: None,
            model: DigitsCnnConfig {
                conv: self.conv,
                fc: self.fc,
                ..DigitsCnnConfig::default()
            },
            train: TrainConfig {
                batch_size: 16,
                ..TrainConfig::default()
            },
            resend_secs: self.resend_secs,
            threads: Some(1),
            evaluate_each_model: false,
            evaluate_at: None,
            join_bn: Default::default(),
            site_key: key.map(Path::to_path_buf),
            identity: self.key_file(site),
            aggregator_key: self.key("aggregator").public(),
            broker: self.broker_for(site),
            data: DataConfig {
                builtin: Some(self.domains.get(site).map_or(site, |d| d.as_str()).into()),
                folder: None,
                train_samples: self.samples_of(site),
            },
        };
        if let Some(edit) = self.agent_edits.get(site) {
            edit(&mut cfg);
        }
        cfg
    }

    /// Writes [`Fed::agent_config`] as `<device>.toml` and returns its path.
    pub fn device_config(&self, site: &str, device: &str, key: Option<&Path>) -> PathBuf {
        let cfg = self.dir.join(format!("{device}.toml"));
        write_toml(&cfg, &self.agent_config(site, device, key));
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

    /// Writes `site`'s config and starts `unifed-agent run`, the agent as a service that stays
    /// up across federations (log: `<site>.log`, appended across restarts).
    pub fn service(&self, site: &str) -> Guard {
        let cfg = self.device_config(site, site, None);
        spawn(
            Command::new(binary("unifed-agent"))
                .args(["run", "--config"])
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

    /// Every typed report line ([`Report`]) in the log `<name>.log` so far.
    pub fn reports(&self, name: &str) -> Vec<Report> {
        std::fs::read_to_string(self.dir.join(format!("{name}.log")))
            .unwrap_or_default()
            .lines()
            .filter_map(Report::parse)
            .collect()
    }

    /// Waits up to `limit` for a typed report that `wanted` picks in any of the logs
    /// `<name>.log` (each read at least once), and gives the first log's name and the report.
    pub fn wait_report<'n>(
        &self,
        names: &[&'n str],
        wanted: impl Fn(&Report) -> bool,
        limit: std::time::Duration,
    ) -> Option<(&'n str, Report)> {
        let t0 = std::time::Instant::now();
        loop {
            for n in names {
                if let Some(r) = self.reports(n).into_iter().find(&wanted) {
                    return Some((n, r));
                }
            }
            if t0.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Waits up to `limit` for `wanted` in every one of the logs `<name>.log` after its first
    /// `after[i]` reports (a restarted process's log goes on after the killed one's); fails
    /// the test with every log otherwise.
    pub fn wait_each(
        &self,
        names: &[&str],
        after: &[usize],
        wanted: impl Fn(&Report) -> bool,
        limit: std::time::Duration,
    ) {
        let t0 = std::time::Instant::now();
        for (i, n) in names.iter().enumerate() {
            let skip = after.get(i).copied().unwrap_or(0);
            while !self.reports(n).iter().skip(skip).any(&wanted) {
                assert!(
                    t0.elapsed() < limit,
                    "{n} never reported what the test waits for\n{}",
                    self.logs()
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
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

/// Writes `value` as TOML to `path`.
pub fn write_toml(path: &Path, value: &impl serde::Serialize) {
    let text = toml::to_string(value).expect("a config serialises as TOML");
    std::fs::write(path, text).expect("writing a config");
}
