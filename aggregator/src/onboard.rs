//! The aggregator's side of onboarding: each model version's onboarding package (the global
//! non-BN weights with BN layers chosen by the BN sharing policy) and the registry of sites'
//! calibrated BN, which sites seal and the aggregator only stores and serves.

use crate::core::{Aggregator, CoreError};
use crate::store::StoreError;
use std::path::Path;
use unifed_protocol::chunking::{payload_hash, split};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnSharing, Chunk, OnboardError, OnboardReply, PackageInfo, RegistryEntry, Sealing,
    max_registry_entry_bytes,
};

impl Aggregator {
    /// The model versions on disk up to the current one: a version written by a round close
    /// that crashed before its commit is not served.
    fn committed_versions(&self) -> Result<Vec<u64>, CoreError> {
        let mut v = self.store.model_versions()?;
        v.retain(|&x| x <= self.state.model_version);
        Ok(v)
    }

    /// The largest registry entry accepted (see [`max_registry_entry_bytes`]).
    pub fn max_entry_bytes(&self) -> usize {
        max_registry_entry_bytes(&self.spec)
    }

    /// The onboarding package of model `version` (the current one when `None`): every tensor
    /// in exact f32, the non-BN ones global and the BN ones chosen by the BN sharing policy
    /// (the sites' pooled BN under `affine` and `affine+stats`, else the global model's own),
    /// cut into chunks. Versions pruned from disk are refused with the ones still held.
    pub fn package(
        &self,
        version: Option<u64>,
    ) -> Result<Result<(PackageInfo, Vec<Chunk>), OnboardError>, CoreError> {
        let available = self.committed_versions()?;
        let v = version.unwrap_or(self.state.model_version);
        if !available.contains(&v) {
            return Ok(Err(OnboardError::UnknownVersion {
                requested: v,
                available,
            }));
        }
        // The current model is served from memory, without a copy; older ones from disk.
        let loaded;
        let model: &[Vec<f32>] = if v == self.state.model_version {
            &self.model
        } else {
            loaded = match self.kept(self.store.load_model(v, &self.hash.0), v)? {
                Ok(m) => m,
                Err(e) => return Ok(Err(e)),
            };
            &loaded
        };
        let share = match self.kept(self.store.load_bn_share(v, &self.hash.0), v)? {
            Ok(share) => share.filter(|(_, share)| share.len() == self.share_idx.len()),
            Err(e) => return Ok(Err(e)),
        };
        let values = |i: usize| -> &[f32] {
            share
                .as_ref()
                .and_then(|(_, sh)| {
                    let k = self.share_idx.iter().position(|&j| j == i)?;
                    Some(sh[k].as_slice())
                })
                .unwrap_or(&model[i])
        };
        let payload = self.exact_broadcast(
            v,
            self.spec
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t, values(i))),
            unifed_protocol::messages::ServerExtras::None,
        );
        let bn_sites = share.as_ref().map_or_else(Vec::new, |(sites, _)| {
            sites.iter().filter_map(|s| Id::new(s).ok()).collect()
        });
        let chunks = split(&payload, self.chunk_bytes);
        let info = PackageInfo {
            model_version: v,
            bn_sharing: self.cfg.bn_sharing,
            bn_sites,
            chunk_count: chunks.len() as u32,
            payload_len: payload.len() as u64,
            // Every chunk carries the payload's hash (`split` gives at least one).
            payload_hash: chunks[0].payload_hash,
        };
        Ok(Ok((info, chunks)))
    }

    /// Stores `site`'s registry entry (a postcard [`RegistryEntry`]) durably and says so, or
    /// refuses it with the reason: malformed, too large, for a model version the federation
    /// has not reached, or in plaintext where the BN sharing policy does not let a site's
    /// statistics out (anything but `affine+stats`).
    pub fn registry_put(
        &self,
        site: &Id,
        bytes: &[u8],
        now_ms: u64,
    ) -> Result<OnboardReply, CoreError> {
        let refuse = |m: String| -> Result<OnboardReply, CoreError> {
            let (round, event) = (self.state.round, "registry-refused");
            self.audit_refusal(now_ms, round, site.as_str(), event, m.clone())?;
            Ok(OnboardReply::Error(OnboardError::Refused(m)))
        };
        if bytes.len() > self.max_entry_bytes() {
            return refuse(format!(
                "a registry entry of {} bytes is larger than this model's BN state could be ({} \
                 bytes at most)",
                bytes.len(),
                self.max_entry_bytes()
            ));
        }
        let entry: RegistryEntry = match postcard::from_bytes(bytes) {
            Ok(e) => e,
            Err(e) => return refuse(format!("malformed registry entry: {e}")),
        };
        if entry.model_version > self.state.model_version {
            return Ok(OnboardReply::Error(OnboardError::UnknownVersion {
                requested: entry.model_version,
                available: self.committed_versions()?,
            }));
        }
        if entry.sealing == Sealing::Plain && self.cfg.bn_sharing != BnSharing::AffineStats {
            return refuse(format!(
                "a plaintext BN state is refused under BN sharing policy `{}`: seal it with \
                 the site key",
                self.cfg.bn_sharing.name()
            ));
        }
        self.store
            .registry_put(site.as_str(), entry.model_version, bytes)?;
        self.audit(
            now_ms,
            self.state.round,
            site.as_str(),
            "registered",
            format!("model v{} ({} bytes)", entry.model_version, bytes.len()),
        )?;
        Ok(OnboardReply::Registered {
            model_version: entry.model_version,
            entry_hash: payload_hash(bytes),
        })
    }

    /// `site`'s stored registry entry for `version` (its newest when `None`), as stored.
    pub fn registry_get(
        &self,
        site: &Id,
        version: Option<u64>,
    ) -> Result<Result<Vec<u8>, OnboardError>, CoreError> {
        let available = self.store.registry_versions(site.as_str())?;
        let Some(v) = version.or(available.last().copied()) else {
            return Ok(Err(OnboardError::NotRegistered {
                requested: version,
                available,
            }));
        };
        match self.kept(self.store.registry_get(site.as_str(), v), v)? {
            Ok(Some(bytes)) => Ok(Ok(bytes)),
            Ok(None) => Ok(Err(OnboardError::NotRegistered {
                requested: version,
                available,
            })),
            Err(e) => Ok(Err(e)),
        }
    }

    /// What a request read from a kept file, or its refusal when the file could not be read:
    /// one request's failure is not the service's. A damaged file is set aside
    /// ([`Aggregator::set_aside`]) so no later request reads it again.
    fn kept<T>(
        &self,
        read: Result<T, StoreError>,
        requested: u64,
    ) -> Result<Result<T, OnboardError>, CoreError> {
        match read {
            Ok(t) => return Ok(Ok(t)),
            Err(StoreError::Corrupt { path, message }) => {
                self.set_aside(&path, &message, crate::clock::now_ms())?;
            }
            Err(e @ StoreError::Io { .. }) => {
                tracing::error!(error = %e, "a kept file could not be read; the request is refused");
            }
        }
        Ok(Err(OnboardError::Unreadable { requested }))
    }

    /// Sets the damaged kept file `path` aside (`corrupt/` in the data folder) and records it
    /// in the log and the audit. A file that cannot be moved stays, and is refused again by
    /// the next request that reads it.
    pub(crate) fn set_aside(&self, path: &Path, what: &str, now_ms: u64) -> Result<(), CoreError> {
        let to = match self.store.quarantine(path, now_ms) {
            Ok(to) => to.display().to_string(),
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "a damaged file could not be set aside");
                "nowhere: it could not be moved".into()
            }
        };
        tracing::error!(file = %path.display(), problem = what, to, "damaged kept file set aside; it is not served");
        self.audit(
            now_ms,
            self.state.round,
            "-",
            "damaged-file",
            format!("{}: {what}; set aside as {to}", path.display()),
        )
    }

    /// Checks every kept file a request may read (the model versions before the current one,
    /// their pooled BN, the sites' registry entries) and sets the damaged ones aside, so that a
    /// damaged file is found at start rather than by a request. Returns how many it set aside.
    pub(crate) fn verify_kept(&self) -> Result<usize, CoreError> {
        let now = crate::clock::now_ms();
        let mut damaged = Vec::new();
        for v in self.committed_versions()? {
            if v < self.state.model_version
                && let Err(StoreError::Corrupt { path, message }) =
                    self.store.load_model(v, &self.hash.0)
            {
                damaged.push((path, message));
            }
            if let Err(StoreError::Corrupt { path, message }) =
                self.store.load_bn_share(v, &self.hash.0)
            {
                damaged.push((path, message));
            }
        }
        for site in self.store.registry_sites()? {
            for v in self.store.registry_versions(&site)? {
                if let Err(StoreError::Corrupt { path, message }) =
                    self.store.registry_get(&site, v)
                {
                    damaged.push((path, message));
                }
            }
        }
        for (path, message) in &damaged {
            self.set_aside(path, message, now)?;
        }
        Ok(damaged.len())
    }
}
