//! The aggregator's data directory. Every file carries a magic and a format version, ends with
//! a checksum of everything before it (`state.json` holds its own in a `checksum` field), and
//! is written atomically (temporary file, fsync, rename, fsync of the folder). A file whose
//! checksum fails was damaged or changed outside the aggregator and is never used:
//!
//! ```text
//! state.json                 round, model version, deadline, sampled sites, recent answers
//! models/v{N}.bin            model version N (all tensors, spec order), kept by retention
//! models/v{N}.strategy       the server strategy's state as of version N (FedOpt's moments,
//!                            SCAFFOLD's control variate), pruned with the model
//! models/v{N}.bn             the sites' pooled BN tensors behind version N's onboarding package
//!                            (BN sharing `affine` or `affine+stats`), pruned with the model
//! registry/{site}/v{N}.entry a site's registry entry (calibrated BN, sealed by the site),
//!                            pruned with model N
//! spool/r{R}/{site}.upd      an accepted update of round R (written before the accept): the
//!                            message it came in, then where its tensors lie (`spoolfile`)
//! audit.log                  append-only JSON lines: every accept and reject with its reason
//! ```

pub use crate::disk::{FORMAT_VERSION, StoreError, write_atomic};
use crate::disk::{corrupt, io};
use crate::sealed::{
    Reader, Sealed, SealedFile, SpooledTensor, read_open, read_sealed, read_sealed_optional,
    write_sealed,
};
use crate::spoolfile::{self, Placed};
pub use crate::spoolfile::{SpoolEntry, SpoolTensor};
use crate::strategy::{Contribution, Extras, StrategyState};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where files never read again wait to be deleted ([`Store::discard`]).
const TRASH: &str = "trash";

const MODEL_MAGIC: &[u8; 4] = b"UFEM";
/// Format versions of spool files: 2 added the typed report and algorithm extras of protocol 2;
/// 3 keeps the extras decoded (SCAFFOLD's control-variate delta); 4 added the checksum; 5 keeps
/// a lossy delta tensor in its wire form (17x smaller under ternary-q8); 6 keeps the message
/// the update arrived in at the head of the file, its exact tensors read from there, so that a
/// reassembled upload becomes the spool file (`spoolfile`). Versions 4 and 5 are still read.
const STRATEGY_MAGIC: &[u8; 4] = b"UFSS";
const SHARE_MAGIC: &[u8; 4] = b"UFEB";
const ENTRY_MAGIC: &[u8; 4] = b"UFER";
const HELD_MAGIC: &[u8; 4] = b"UFEH";
/// A site's answer remembered for re-sends after its round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosedRound {
    /// The round.
    pub round: u64,
    /// Sites whose update was accepted in it.
    pub accepted: Vec<String>,
}

/// The aggregator's persisted round state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// File format version.
    pub format_version: u32,
    /// Federation id.
    pub federation: String,
    /// Hex spec hash of the model.
    pub spec_hash: String,
    /// The open round (1-based); `rounds + 1` once finished.
    pub round: u64,
    /// Version of the current global model.
    pub model_version: u64,
    /// When the open round opened, ms since the epoch.
    pub opened_ms: u64,
    /// The open round's deadline, ms since the epoch.
    pub deadline_ms: u64,
    /// Sites sampled in the open round (empty: all may report).
    pub sampled: Vec<String>,
    /// True once every round has run.
    pub finished: bool,
    /// The last closed rounds' accepted sites, to answer late re-sends as before.
    pub recent: Vec<ClosedRound>,
    /// The federation's run, chosen when this state was created (a state written before runs
    /// existed gets one when it is next opened): every message is signed with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<unifed_protocol::RunId>,
    /// Hex SHA-256 of the file written with this field empty: a state edited by hand (which
    /// could silently drop acknowledged updates) is refused.
    #[serde(default)]
    pub checksum: String,
}

impl State {
    /// The JSON of this state with `checksum` filled in.
    fn to_json(&self) -> Vec<u8> {
        let mut s = self.clone();
        s.checksum = String::new();
        let body = serde_json::to_vec_pretty(&s).expect("state serialises");
        s.checksum = hex(&sha2::Sha256::digest(&body));
        serde_json::to_vec_pretty(&s).expect("state serialises")
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One line of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Format version of the line ([`FORMAT_VERSION`]).
    #[serde(default = "format_version")]
    pub v: u32,
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// The round.
    pub round: u64,
    /// The site.
    pub site: String,
    /// `accepted`, `rejected`, `duplicate`, `round-closed`, `damaged-file`, ...
    pub event: String,
    /// The reject reason or a detail.
    pub detail: String,
}

fn format_version() -> u32 {
    FORMAT_VERSION
}

/// A held model (every tensor in spec order) and the delta payload that gave it.
pub type Held = (Vec<Vec<f32>>, Vec<u8>);

/// Files the audit log is kept in: `audit.log` and the rotated `audit.log.1` (newest) to
/// `audit.log.3` (oldest), each at most a quarter of the audit's budget.
const AUDIT_FILES: usize = 4;

/// The data directory.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    /// Bytes the audit log may take on disk, its rotated files included (`u64::MAX`: no bound).
    audit_budget: u64,
}

impl Store {
    /// Opens (creating if needed) the data directory `dir`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        // What a process stopped before its deleter finished (see `Store::discard`).
        let _ = fs::remove_dir_all(dir.join(TRASH));
        for sub in ["models", "spool", "registry", TRASH] {
            fs::create_dir_all(dir.join(sub)).map_err(|e| io(&dir.join(sub), e))?;
        }
        Ok(Store {
            dir: dir.into(),
            audit_budget: u64::MAX,
        })
    }

    /// This store, its audit log kept within `bytes` on disk: when `audit.log` would pass a
    /// quarter of them it is rotated to `audit.log.1` (and so on up to `audit.log.3`, whose
    /// lines are then dropped), so a flood of audited events costs the disk a bounded amount.
    pub fn with_audit_budget(mut self, bytes: u64) -> Self {
        self.audit_budget = bytes;
        self
    }

    /// The audit log's files, oldest first (those that exist).
    fn audit_files(&self) -> Vec<PathBuf> {
        let current = self.dir.join("audit.log");
        let mut v: Vec<PathBuf> = (1..AUDIT_FILES)
            .rev()
            .map(|k| self.dir.join(format!("audit.log.{k}")))
            .filter(|p| p.exists())
            .collect();
        v.push(current);
        v
    }

    /// Rotates the audit log: `audit.log.3` is dropped, each other file moves one up.
    fn rotate_audit(&self) -> Result<(), StoreError> {
        for k in (1..AUDIT_FILES).rev() {
            let from = if k == 1 {
                self.dir.join("audit.log")
            } else {
                self.dir.join(format!("audit.log.{}", k - 1))
            };
            let to = self.dir.join(format!("audit.log.{k}"));
            match fs::rename(&from, &to) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&from, e)),
                _ => {}
            }
        }
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(&self.dir, e))
    }

    /// Bytes free for this process on the directory's file system.
    pub fn free_bytes(&self) -> Result<u64, StoreError> {
        crate::disk::free_bytes(&self.dir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The persisted state, if any.
    pub fn load_state(&self) -> Result<Option<State>, StoreError> {
        let p = self.dir.join("state.json");
        if !p.exists() {
            return Ok(None);
        }
        let bytes = fs::read(&p).map_err(|e| io(&p, e))?;
        let s: State = serde_json::from_slice(&bytes).map_err(|e| corrupt(&p, e.to_string()))?;
        if s.format_version != FORMAT_VERSION {
            return Err(corrupt(
                &p,
                format!(
                    "format version {} is not {FORMAT_VERSION}",
                    s.format_version
                ),
            ));
        }
        if s.to_json() != bytes {
            return Err(corrupt(
                &p,
                "checksum mismatch: the state was changed outside the aggregator (an edited \
                 round or version could drop acknowledged updates); restore it from a backup",
            ));
        }
        Ok(Some(s))
    }

    /// Persists the state atomically.
    pub fn save_state(&self, s: &State) -> Result<(), StoreError> {
        write_atomic(&self.dir.join("state.json"), &s.to_json())
    }

    fn model_path(&self, version: u64) -> PathBuf {
        self.dir.join("models").join(format!("v{version}.bin"))
    }

    /// Writes model `version` (all tensors in spec order).
    pub fn save_model(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
        tensors: &[Vec<f32>],
    ) -> Result<(), StoreError> {
        let mut head = Vec::new();
        put_header(&mut head, MODEL_MAGIC, Some(spec_hash), version);
        let mut f = SealedFile::create(&self.model_path(version))?;
        f.put(&head)?;
        f.put_tensors(tensors)?;
        f.finish()
    }

    /// Reads model `version`, checking magic, format, spec hash and version.
    pub fn load_model(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
    ) -> Result<Vec<Vec<f32>>, StoreError> {
        read_sealed(&self.model_path(version), |r| {
            r.header(MODEL_MAGIC, Some(spec_hash), version)?;
            r.tensors()
        })
    }

    fn held_path(&self, version: u64) -> PathBuf {
        self.dir.join("models").join(format!("v{version}.held"))
    }

    /// Writes what sites following the model deltas hold at `version` (all tensors in spec
    /// order) and the delta payload that gives it (before the state naming the version is
    /// committed). Only federations with a lossy encoding keep one.
    pub fn save_held(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
        tensors: &[Vec<f32>],
        delta: &[u8],
    ) -> Result<(), StoreError> {
        let mut head = Vec::new();
        put_header(&mut head, HELD_MAGIC, Some(spec_hash), version);
        let mut f = SealedFile::create(&self.held_path(version))?;
        f.put(&head)?;
        f.put_tensors(tensors)?;
        f.put(&(delta.len() as u64).to_le_bytes())?;
        f.put(delta)?;
        f.finish()
    }

    /// Reads the held model and delta payload of `version`; `None` when none was written.
    pub fn load_held(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
    ) -> Result<Option<Held>, StoreError> {
        read_sealed_optional(&self.held_path(version), |r| {
            r.header(HELD_MAGIC, Some(spec_hash), version)?;
            let t = r.tensors()?;
            let n = usize::try_from(r.u64()?).map_err(|_| corrupt(r.path(), "delta length"))?;
            let delta = r.take(n)?.to_vec();
            Ok((t, delta))
        })
    }

    fn strategy_path(&self, version: u64) -> PathBuf {
        self.dir.join("models").join(format!("v{version}.strategy"))
    }

    /// Writes the strategy's state as of model `version` (before the state naming the version
    /// is committed).
    pub fn save_strategy(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
        state: &StrategyState,
    ) -> Result<(), StoreError> {
        let mut b = Vec::new();
        put_header(&mut b, STRATEGY_MAGIC, Some(spec_hash), version);
        b.extend(postcard::to_allocvec(state).expect("strategy state serialises"));
        write_sealed(&self.strategy_path(version), &b)
    }

    /// Reads the strategy's state as of model `version`; `None` when none was written.
    pub fn load_strategy(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
    ) -> Result<Option<StrategyState>, StoreError> {
        read_sealed_optional(&self.strategy_path(version), |r| {
            r.header(STRATEGY_MAGIC, Some(spec_hash), version)?;
            let n = usize::try_from(r.left()).map_err(|_| corrupt(r.path(), "too large"))?;
            let path = r.path().to_path_buf();
            postcard::from_bytes(r.take(n)?).map_err(|e| corrupt(&path, e.to_string()))
        })
    }

    /// Deletes model versions (and their pooled BN, strategy state and held model) older than the newest
    /// `keep` (see [`Store::discard`]).
    pub fn prune_models(&self, current: u64, keep: usize) -> Result<(), StoreError> {
        let d = self.dir.join("models");
        let mut old = Vec::new();
        for e in fs::read_dir(&d).map_err(|e| io(&d, e))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(v) = name
                .strip_prefix('v')
                .and_then(|n| {
                    n.strip_suffix(".bin")
                        .or_else(|| n.strip_suffix(".bn"))
                        .or_else(|| n.strip_suffix(".strategy"))
                        .or_else(|| n.strip_suffix(".held"))
                })
                .and_then(|n| n.parse::<u64>().ok())
                && v + (keep as u64) <= current
            {
                old.push(e.path());
            }
        }
        self.discard(old)
    }

    /// The model versions on disk, ascending.
    pub fn model_versions(&self) -> Result<Vec<u64>, StoreError> {
        versions_in(&self.dir.join("models"), ".bin")
    }

    fn share_path(&self, version: u64) -> PathBuf {
        self.dir.join("models").join(format!("v{version}.bn"))
    }

    /// Writes the pooled BN tensors behind version `version`'s onboarding package and the
    /// sites they came from.
    pub fn save_bn_share(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
        sites: &[String],
        tensors: &[Vec<f32>],
    ) -> Result<(), StoreError> {
        let mut b = Vec::new();
        put_header(&mut b, SHARE_MAGIC, Some(spec_hash), version);
        b.extend_from_slice(&(sites.len() as u32).to_le_bytes());
        for s in sites {
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        let mut f = SealedFile::create(&self.share_path(version))?;
        f.put(&b)?;
        f.put_tensors(tensors)?;
        f.finish()
    }

    /// Reads the pooled BN of version `version`: `None` if it has none (policy `none`, or
    /// version 0).
    #[allow(clippy::type_complexity)]
    pub fn load_bn_share(
        &self,
        version: u64,
        spec_hash: &[u8; 32],
    ) -> Result<Option<(Vec<String>, Vec<Vec<f32>>)>, StoreError> {
        let p = self.share_path(version);
        read_sealed_optional(&p, |r| {
            r.header(SHARE_MAGIC, Some(spec_hash), version)?;
            let n = r.u32()? as usize;
            let mut sites = Vec::with_capacity(n.min(4096));
            for _ in 0..n {
                let len = r.u32()? as usize;
                let s = std::str::from_utf8(r.take(len)?)
                    .map_err(|_| corrupt(&p, "a site id is not UTF-8"))?;
                sites.push(s.to_string());
            }
            let t = r.tensors()?;
            Ok((sites, t))
        })
    }

    fn entry_path(&self, site: &str, version: u64) -> PathBuf {
        self.dir
            .join("registry")
            .join(site)
            .join(format!("v{version}.entry"))
    }

    /// Durably stores `site`'s registry entry (opaque bytes) for model `version`, replacing
    /// an earlier one of the same version.
    pub fn registry_put(&self, site: &str, version: u64, entry: &[u8]) -> Result<(), StoreError> {
        let d = self.dir.join("registry").join(site);
        fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
        let mut b = Vec::with_capacity(entry.len() + 24);
        put_header(&mut b, ENTRY_MAGIC, None, version);
        b.extend_from_slice(&(entry.len() as u64).to_le_bytes());
        b.extend_from_slice(entry);
        write_sealed(&self.entry_path(site, version), &b)?;
        File::open(self.dir.join("registry"))
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&self.dir.join("registry"), e))
    }

    /// `site`'s registry entry for model `version`, if stored.
    pub fn registry_get(&self, site: &str, version: u64) -> Result<Option<Vec<u8>>, StoreError> {
        read_sealed_optional(&self.entry_path(site, version), |r| {
            r.header(ENTRY_MAGIC, None, version)?;
            let len = usize::try_from(r.u64()?).map_err(|_| corrupt(r.path(), "truncated"))?;
            Ok(r.take(len)?.to_vec())
        })
    }

    /// Deletes every site's registry entries of model versions pruned by
    /// [`Store::prune_models`] (a calibrated BN is of no use without its version's weights).
    pub fn prune_registry(&self, current: u64, keep: usize) -> Result<(), StoreError> {
        let d = self.dir.join("registry");
        for site in fs::read_dir(&d).map_err(|e| io(&d, e))?.flatten() {
            let Some(name) = site.file_name().to_str().map(str::to_string) else {
                continue;
            };
            for v in self.registry_versions(&name)? {
                if v + (keep as u64) <= current {
                    let p = self.entry_path(&name, v);
                    fs::remove_file(&p).map_err(|e| io(&p, e))?;
                }
            }
        }
        Ok(())
    }

    /// The model versions `site` has registry entries for, ascending.
    pub fn registry_versions(&self, site: &str) -> Result<Vec<u64>, StoreError> {
        versions_in(&self.dir.join("registry").join(site), ".entry")
    }

    /// The sites with a registry folder, in order.
    pub fn registry_sites(&self) -> Result<Vec<String>, StoreError> {
        let d = self.dir.join("registry");
        let mut sites: Vec<String> = fs::read_dir(&d)
            .map_err(|e| io(&d, e))?
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        sites.sort();
        Ok(sites)
    }

    /// Moves the damaged kept file `path` (a model version, its pooled BN, a registry entry)
    /// into `corrupt/`, kept for inspection and never served again; returns where it went.
    pub fn quarantine(&self, path: &Path, now_ms: u64) -> Result<PathBuf, StoreError> {
        let d = self.dir.join("corrupt");
        fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
        let name = path
            .strip_prefix(&self.dir)
            .unwrap_or(path)
            .to_string_lossy()
            .replace('/', "-");
        let to = d.join(format!("{name}-{now_ms}"));
        fs::rename(path, &to).map_err(|e| io(path, e))?;
        if let Some(parent) = path.parent() {
            File::open(parent)
                .and_then(|f| f.sync_all())
                .map_err(|e| io(parent, e))?;
        }
        Ok(to)
    }

    fn spool_dir(&self, round: u64) -> PathBuf {
        self.dir.join("spool").join(format!("r{round}"))
    }

    pub(crate) fn spool_path(&self, round: u64, site: &str) -> PathBuf {
        self.spool_dir(round).join(format!("{site}.upd"))
    }

    /// Durably stores an accepted update (sample count, report, extras, delta as it arrived and
    /// shared BN tensors), adopting `c.staged` as the file when it can (see [`SpoolEntry`]).
    pub fn spool_put(&self, round: u64, site: &str, c: &SpoolEntry) -> Result<(), StoreError> {
        let sealed = self.spool_seal(round, site, c)?;
        self.spool_commit(sealed)
    }

    /// The slow half of [`Store::spool_put`]: the update written and synced, not yet in the
    /// spool (no fold sees it) until [`Store::spool_commit`]. Different sites' updates may be
    /// sealed side by side; one site's only one at a time.
    pub(crate) fn spool_seal(
        &self,
        round: u64,
        site: &str,
        c: &SpoolEntry,
    ) -> Result<Sealed, StoreError> {
        let d = self.spool_dir(round);
        fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
        spoolfile::seal(&d.join(format!("{site}.upd")), round, c)
    }

    /// Puts an update sealed by [`Store::spool_seal`] in the spool.
    pub(crate) fn spool_commit(&self, sealed: Sealed) -> Result<(), StoreError> {
        sealed.commit()?;
        File::open(self.dir.join("spool"))
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&self.dir.join("spool"), e))
    }

    /// The rounds with a spool folder, ascending.
    pub fn spool_rounds(&self) -> Result<Vec<u64>, StoreError> {
        let d = self.dir.join("spool");
        let mut v: Vec<u64> = fs::read_dir(&d)
            .map_err(|e| io(&d, e))?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_prefix('r')
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// Sites with a spooled update in `round`, sorted by site id.
    pub fn spool_sites(&self, round: u64) -> Result<Vec<String>, StoreError> {
        let d = self.spool_dir(round);
        if !d.exists() {
            return Ok(Vec::new());
        }
        let mut v: Vec<String> = fs::read_dir(&d)
            .map_err(|e| io(&d, e))?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_suffix(".upd")
                    .map(str::to_string)
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// Reads a spooled contribution.
    pub fn spool_get(&self, round: u64, site: &str) -> Result<Contribution, StoreError> {
        let p = self.spool_path(round, site);
        let f = File::open(&p).map_err(|e| io(&p, e))?;
        let (c, delta) = if spoolfile::starts_with_magic(&p, &f)? {
            read_legacy(&p, f, round)?
        } else {
            // Each exact tensor's values as they pass, a block at a time.
            let (footer, mut exact) = spoolfile::read(
                &p,
                f,
                round,
                |ft| {
                    Ok(ft
                        .delta
                        .iter()
                        .map(|t| match t {
                            Placed::InHead { count, .. } => Vec::with_capacity(*count),
                            Placed::Wire(_) => Vec::new(),
                        })
                        .collect::<Vec<Vec<f32>>>())
                },
                |exact, k, _, bytes| {
                    exact[k].extend(
                        bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    );
                    Ok(())
                },
            )?;
            let (report, extras) =
                postcard::from_bytes(&footer.typed).map_err(|e| corrupt(&p, e.to_string()))?;
            let delta = footer
                .delta
                .into_iter()
                .zip(exact.iter_mut())
                .map(|(t, v)| match t {
                    Placed::InHead { .. } => SpooledTensor::Dense(std::mem::take(v)),
                    Placed::Wire(w) => SpooledTensor::Wire(w),
                })
                .collect();
            let c = Contribution {
                samples: footer.samples,
                report,
                extras,
                delta: Vec::new(),
                bn: footer.bn,
            };
            (c, delta)
        };
        // Decoded only now that the checksum has passed.
        let mut c = c;
        c.delta = delta
            .into_iter()
            .map(|t| t.decode(&p))
            .collect::<Result<_, _>>()?;
        // Only finite values were ever accepted: anything else was written by someone else.
        if c.delta
            .iter()
            .chain(&c.bn)
            .flatten()
            .any(|v| !v.is_finite())
        {
            return Err(corrupt(&p, "holds a value that is not finite"));
        }
        Ok(c)
    }

    /// What `site`'s spooled update of `round` claims: its sample count and its delta's L2
    /// norm, from the footer (two positioned reads; the fold checks the whole file later). A
    /// file of an older format, which keeps no norm, is read whole for it.
    pub fn spool_claim(&self, round: u64, site: &str) -> Result<(u64, f64), StoreError> {
        let p = self.spool_path(round, site);
        let f = File::open(&p).map_err(|e| io(&p, e))?;
        if !spoolfile::starts_with_magic(&p, &f)? {
            let footer = spoolfile::footer(&p, &f, round)?;
            if let Some(norm) = footer.norm {
                return Ok((footer.samples, norm));
            }
        }
        let c = self.spool_get(round, site)?;
        let squares: f64 = c
            .delta
            .iter()
            .flatten()
            .map(|&v| (v as f64) * (v as f64))
            .sum();
        Ok((c.samples, squares.sqrt()))
    }

    /// Reads a spooled contribution without its delta (`delta` empty): its file is read and
    /// checked whole (checksum, format) as [`Store::spool_get`] does, but no delta value is
    /// kept.
    pub fn spool_summary(&self, round: u64, site: &str) -> Result<Contribution, StoreError> {
        let p = self.spool_path(round, site);
        let f = File::open(&p).map_err(|e| io(&p, e))?;
        if spoolfile::starts_with_magic(&p, &f)? {
            let mut c = self.spool_get(round, site)?;
            c.delta = Vec::new();
            return Ok(c);
        }
        let (footer, ()) = spoolfile::read(&p, f, round, |_| Ok(()), |_, _, _, _| Ok(()))?;
        let (report, extras) =
            postcard::from_bytes(&footer.typed).map_err(|e| corrupt(&p, e.to_string()))?;
        if footer.bn.iter().flatten().any(|v| !v.is_finite()) {
            return Err(corrupt(&p, "holds a value that is not finite"));
        }
        Ok(Contribution {
            samples: footer.samples,
            report,
            extras,
            delta: Vec::new(),
            bn: footer.bn,
        })
    }

    /// Checks `site`'s spooled update of `round` in full (checksum, format, finite values)
    /// without keeping it.
    pub fn spool_check(&self, round: u64, site: &str) -> Result<(), StoreError> {
        self.spool_get(round, site).map(drop)
    }

    /// Moves `site`'s spooled update of `round` out of the spool into `spool-corrupt/` (kept for
    /// inspection, never read again); returns where it went.
    pub fn spool_quarantine(
        &self,
        round: u64,
        site: &str,
        now_ms: u64,
    ) -> Result<PathBuf, StoreError> {
        let d = self.dir.join("spool-corrupt");
        fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
        let from = self.spool_path(round, site);
        let to = d.join(format!("r{round}-{site}-{now_ms}.upd"));
        fs::rename(&from, &to).map_err(|e| io(&from, e))?;
        File::open(self.spool_dir(round))
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&from, e))?;
        Ok(to)
    }

    /// Removes the spool of every round before `round` (see [`Store::discard`]).
    pub fn spool_clear_before(&self, round: u64) -> Result<(), StoreError> {
        let d = self.dir.join("spool");
        let mut old = Vec::new();
        for e in fs::read_dir(&d).map_err(|e| io(&d, e))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(r) = name.strip_prefix('r').and_then(|n| n.parse::<u64>().ok())
                && r < round
            {
                old.push(e.path());
            }
        }
        self.discard(old)
    }

    /// Takes `paths` (files or folders the aggregator never reads again) out of the store at
    /// once, renamed into `trash/`, and deletes them on a thread of its own. Unlinking a closed
    /// round's spool and a pruned model (six 57 MB files in the demo) frees their page cache,
    /// which held the fold 50-60 ms before it published the new model. What is left there when
    /// the process stops goes at the next start.
    fn discard(&self, paths: Vec<PathBuf>) -> Result<(), StoreError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if paths.is_empty() {
            return Ok(());
        }
        let trash = self.dir.join(TRASH);
        let mut moved = Vec::with_capacity(paths.len());
        for p in paths {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            let to = trash.join(format!("{n}.{name}"));
            fs::rename(&p, &to).map_err(|e| io(&p, e))?;
            moved.push(to);
        }
        std::thread::Builder::new()
            .name("discard".into())
            .spawn(move || {
                for p in moved {
                    let gone = match p.is_dir() {
                        true => fs::remove_dir_all(&p),
                        false => fs::remove_file(&p),
                    };
                    if let Err(e) = gone {
                        tracing::warn!(path = %p.display(), error = %e, "not deleted");
                    }
                }
            })
            .map_err(|e| io(&trash, e))?;
        Ok(())
    }

    /// Appends one line to the audit log and fsyncs it, on a line of its own after the torn
    /// last line a crash may have left; rotates the log first when the line would take
    /// `audit.log` past its share of the budget ([`Store::with_audit_budget`]).
    pub fn audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let p = self.dir.join("audit.log");
        let mut line = serde_json::to_vec(entry).expect("audit entry serialises");
        line.push(b'\n');
        let len = match fs::metadata(&p) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(io(&p, e)),
        };
        let share = self.audit_budget / AUDIT_FILES as u64;
        let len = if len > 0 && len + line.len() as u64 + 1 > share {
            self.rotate_audit()?;
            0
        } else {
            len
        };
        let mut f = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&p)
            .map_err(|e| io(&p, e))?;
        let mut last = [b'\n'];
        if len > 0 {
            f.read_exact_at(&mut last, len - 1).map_err(|e| io(&p, e))?;
        }
        if last[0] != b'\n' {
            line.insert(0, b'\n');
        }
        f.write_all(&line).map_err(|e| io(&p, e))?;
        f.sync_data().map_err(|e| io(&p, e))
    }

    /// The sites of the audit log's `event` lines of `round` (`-` for the round's own). Lines
    /// that do not parse (the torn last line of a crash) are skipped: this is a restart's
    /// check, not a reader's.
    pub fn audited(&self, round: u64, event: &str) -> Result<BTreeSet<String>, StoreError> {
        let mut sites = BTreeSet::new();
        for p in self.audit_files() {
            let text = match std::fs::read_to_string(&p) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(io(&p, e)),
            };
            sites.extend(
                text.lines()
                    .filter_map(|l| serde_json::from_str::<AuditEntry>(l).ok())
                    .filter(|e| e.round == round && e.event == event)
                    .map(|e| e.site),
            );
        }
        Ok(sites)
    }

    /// Every audit entry the log keeps, oldest first (its rotated files, then `audit.log`).
    pub fn audit_entries(&self) -> Result<Vec<AuditEntry>, StoreError> {
        let mut entries = Vec::new();
        for p in self.audit_files() {
            let mut s = String::new();
            if let Ok(mut f) = File::open(&p) {
                f.read_to_string(&mut s).map_err(|e| io(&p, e))?;
            }
            for l in s.lines().filter(|l| !l.is_empty()) {
                entries.push(serde_json::from_str(l).map_err(|e| corrupt(&p, e.to_string()))?);
            }
        }
        Ok(entries)
    }
}

/// The versions N of the files `v{N}{suffix}` in `dir`, ascending (none if `dir` is absent).
/// Checks that the footer of the spool file `p` describes a delta of tensors of `lens` values
/// (its lossy tensors are sized when decoded), naming the misfit.
pub(crate) fn footer_fits(
    p: &Path,
    ft: &spoolfile::Footer,
    lens: &[usize],
) -> Result<(), StoreError> {
    if ft.delta.len() != lens.len() {
        return Err(corrupt(
            p,
            format!(
                "holds {} delta tensors where the model has {}",
                ft.delta.len(),
                lens.len()
            ),
        ));
    }
    for (k, t) in ft.delta.iter().enumerate() {
        if let Placed::InHead { count, .. } = *t
            && count != lens[k]
        {
            return Err(corrupt(
                p,
                format!("delta tensor {k} holds {count} values, not {}", lens[k]),
            ));
        }
    }
    Ok(())
}

/// Checks the rest of a spool file's footer: finite shared BN values, a report and extras that
/// decode.
pub(crate) fn footer_sound(p: &Path, ft: &spoolfile::Footer) -> Result<(), StoreError> {
    if ft.bn.iter().flatten().any(|v| !v.is_finite()) {
        return Err(corrupt(p, "holds a value that is not finite"));
    }
    postcard::from_bytes::<(unifed_protocol::LocalReport, Extras)>(&ft.typed)
        .map_err(|e| corrupt(p, e.to_string()))?;
    Ok(())
}

fn versions_in(dir: &Path, suffix: &str) -> Result<Vec<u64>, StoreError> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut v: Vec<u64> = fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix('v')
                .and_then(|n| n.strip_suffix(suffix))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .collect();
    v.sort_unstable();
    Ok(v)
}

/// A spool file of format 4 or 5, read a block at a time: its contribution, and its delta
/// tensors still to decode (once the checksum has passed).
fn read_legacy(
    p: &Path,
    f: File,
    round: u64,
) -> Result<(Contribution, Vec<SpooledTensor>), StoreError> {
    read_open(p, f, |r| {
        let (version, samples) = spool_head(r, round)?;
        let delta = if version == 4 {
            r.tensors()?.into_iter().map(SpooledTensor::Dense).collect()
        } else {
            r.delta()?
        };
        let bn = r.tensors()?;
        let n = r.u32()? as usize;
        let (report, extras) =
            postcard::from_bytes(r.take(n)?).map_err(|e| corrupt(p, e.to_string()))?;
        let c = Contribution {
            samples,
            report,
            extras,
            delta: Vec::new(),
            bn,
        };
        Ok((c, delta))
    })
}

/// Writes the header [`Reader::header`] checks.
/// A spool file's head (formats 4 and 5): magic, a format version it reads (returned), the
/// round it must be of, and the sample count (returned).
pub(crate) fn spool_head(r: &mut Reader, round: u64) -> Result<(u32, u64), StoreError> {
    if r.take(4)? != spoolfile::MAGIC {
        return Err(corrupt(r.path(), "bad magic"));
    }
    let version = r.u32()?;
    if !(4..=5).contains(&version) {
        return Err(corrupt(
            r.path(),
            format!("format version {version} is not 6 (or 4 or 5, which it reads)"),
        ));
    }
    if r.u64()? != round {
        return Err(corrupt(
            r.path(),
            "round in the file differs from its folder",
        ));
    }
    Ok((version, r.u64()?))
}

fn put_header(b: &mut Vec<u8>, magic: &[u8; 4], spec_hash: Option<&[u8; 32]>, version: u64) {
    b.extend_from_slice(magic);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    if let Some(h) = spec_hash {
        b.extend_from_slice(h);
    }
    b.extend_from_slice(&version.to_le_bytes());
}
