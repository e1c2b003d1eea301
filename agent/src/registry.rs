//! Onboarding over MQTT: a new site fetches a model version's onboarding package, registers its
//! calibrated BN state with the aggregator, and any other device of the site fetches it back.
//!
//! The BN state is sealed with ChaCha20-Poly1305 under a 256-bit key that only the site's
//! devices hold ([`SiteKey`]); the associated data binds the federation, site, model version and
//! spec hash, so the aggregator can neither read an entry nor pass one off as another's.

use anyhow::{Context, Result, bail};
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;
use unifed_net::{BrokerConfig, Client, NetEvent, Qos, spawn_event_loop};
use unifed_protocol::SpecHash;
use unifed_protocol::auth::{Keyring, PublicKey, SigningKey};
use unifed_protocol::chunking::{Reassembler, split};
use unifed_protocol::encoding::EncodedTensor;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{
    BnSharing, Chunk, ChunkRequest, OnboardError, OnboardReply, OnboardRequest, PackageInfo,
    RegistryEntry, Sealing, ServerBroadcast,
};
use unifed_protocol::topics::Topics;

/// A site's registry key: 32 bytes, stored as 64 hex digits in a file only the site's devices
/// hold.
#[derive(Clone)]
pub struct SiteKey([u8; 32]);

impl std::fmt::Debug for SiteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SiteKey(..)")
    }
}

impl SiteKey {
    /// A fresh key from the operating system's random source.
    pub fn generate() -> Self {
        SiteKey(ChaCha20Poly1305::generate_key(&mut OsRng).into())
    }

    /// Reads a key file (64 hex digits; surrounding whitespace ignored).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the site key {}", path.display()))?;
        let hex = text.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!(
                "{}: a site key is 64 hex digits (256 bits); found {} characters",
                path.display(),
                hex.len()
            );
        }
        let mut k = [0u8; 32];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(SiteKey(k))
    }

    /// Writes the key as hex to a new file (never overwriting one), readable by its owner only.
    pub fn save(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let mut f = o
            .open(path)
            .with_context(|| format!("creating {} (it must not exist yet)", path.display()))?;
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        writeln!(f, "{hex}").with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

/// What a registry entry is bound to: its federation, site, model version and spec hash.
fn associated_data(fed: &Id, site: &Id, version: u64, spec: &SpecHash) -> Vec<u8> {
    let mut a = b"unifed-registry-v1".to_vec();
    for s in [fed.as_str(), site.as_str()] {
        a.extend_from_slice(&(s.len() as u32).to_le_bytes());
        a.extend_from_slice(s.as_bytes());
    }
    a.extend_from_slice(&version.to_le_bytes());
    a.extend_from_slice(&spec.0);
    a
}

/// How a site proves who it is and knows its aggregator: its private signing key and the
/// aggregator's pinned public key.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The site's ed25519 key; every message the site sends is signed with it.
    pub key: SigningKey,
    /// The aggregator's public key: only messages it signed are taken.
    pub aggregator: PublicKey,
}

impl Identity {
    /// A keyring trusting only the aggregator.
    pub fn keyring(&self) -> Keyring {
        Keyring::aggregator(self.aggregator)
    }
}

/// Who an entry belongs to.
#[derive(Debug, Clone)]
pub struct Owner {
    /// Federation.
    pub federation: Id,
    /// Site.
    pub site: Id,
    /// Spec hash of the model.
    pub spec: SpecHash,
}

/// Seals `tensors` (a site's BN state for model `version`) with `key`, or leaves them in
/// plaintext when `key` is `None`.
pub fn seal(
    key: Option<&SiteKey>,
    owner: &Owner,
    version: u64,
    tensors: &[EncodedTensor],
) -> RegistryEntry {
    let plain = postcard::to_allocvec(tensors).expect("tensors serialise");
    match key {
        None => RegistryEntry {
            model_version: version,
            sealing: Sealing::Plain,
            data: plain,
        },
        Some(k) => {
            let cipher = ChaCha20Poly1305::new(Key::from_slice(&k.0));
            let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
            let aad = associated_data(&owner.federation, &owner.site, version, &owner.spec);
            let data = cipher
                .encrypt(
                    &nonce,
                    Payload {
                        msg: &plain,
                        aad: &aad,
                    },
                )
                .expect("ChaCha20-Poly1305 encrypts any length we send");
            RegistryEntry {
                model_version: version,
                sealing: Sealing::ChaCha20Poly1305 {
                    nonce: nonce.into(),
                },
                data,
            }
        }
    }
}

/// Opens an entry sealed by [`seal`]: fails if the key is wrong or missing, or the entry was
/// altered or belongs to another site, federation, version or model. A site that holds a key
/// refuses plaintext entries, so a replaced entry cannot downgrade it.
pub fn open(
    key: Option<&SiteKey>,
    owner: &Owner,
    entry: &RegistryEntry,
) -> Result<Vec<EncodedTensor>> {
    let plain = match (&entry.sealing, key) {
        (Sealing::Plain, None) => entry.data.clone(),
        (Sealing::Plain, Some(_)) => bail!(
            "the registry entry of model v{} is not sealed, but this site seals its entries: \
             refusing it (it may have been replaced; calibrate again)",
            entry.model_version
        ),
        (Sealing::ChaCha20Poly1305 { .. }, None) => {
            bail!("the registry entry is sealed: set `site_key` in the agent config")
        }
        (Sealing::ChaCha20Poly1305 { nonce }, Some(k)) => {
            let cipher = ChaCha20Poly1305::new(Key::from_slice(&k.0));
            let aad = associated_data(
                &owner.federation,
                &owner.site,
                entry.model_version,
                &owner.spec,
            );
            cipher
                .decrypt(
                    Nonce::from_slice(nonce),
                    Payload {
                        msg: &entry.data,
                        aad: &aad,
                    },
                )
                .map_err(|_| {
                    anyhow::anyhow!(
                        "the registry entry of model v{} does not open with this site key (wrong \
                         key, or the entry was altered or is not this site's)",
                        entry.model_version
                    )
                })?
        }
    };
    postcard::from_bytes(&plain).context("decoding the registry entry's BN tensors")
}

/// Whether a sealed entry is required: everywhere but under `affine+stats`, where sites share
/// their statistics anyway.
pub fn must_seal(sharing: BnSharing) -> bool {
    sharing != BnSharing::AffineStats
}

/// The largest onboarding package of a model of `spec`: every tensor in f32, plus room for
/// names, shapes and framing.
pub fn max_package_bytes(spec: &unifed_protocol::ModelSpec) -> u64 {
    let values: u64 = spec.tensors.iter().map(|t| 4 * t.numel() as u64).sum();
    values + 256 * spec.tensors.len() as u64 + (1 << 16)
}

/// Fetches the onboarding package of `version` (the newest when `None`) in an MQTT session of
/// its own and decodes it for `spec` (bounded by [`max_package_bytes`]); `progress(done,
/// total)` follows the chunks.
pub async fn fetch_package(
    broker: &BrokerConfig,
    owner: Owner,
    identity: &Identity,
    spec: &unifed_protocol::ModelSpec,
    version: Option<u64>,
    progress: impl FnMut(u32, u32),
) -> Result<(PackageInfo, unifed_models::state::StateDict)> {
    let mut c = OnboardClient::connect(broker, owner, identity, Duration::from_secs(30)).await?;
    let r = c.package(version, max_package_bytes(spec), progress).await;
    c.close().await;
    let (info, b) = r?;
    let state = unifed_models::state::from_encoded(spec, &b.weights)
        .context("the onboarding package does not fit this agent's model")?;
    Ok((info, state))
}

/// How long one onboarding exchange may go without progress before it fails.
const STALL: Duration = Duration::from_secs(60);
/// Re-send period of an unanswered request.
const RESEND: Duration = Duration::from_secs(5);

/// An MQTT session of a site's onboarding tool (`unifed-agent calibrate --config`,
/// `unifed-agent fetch-calibrated`).
pub struct OnboardClient {
    client: Client,
    rx: UnboundedReceiver<NetEvent>,
    topics: Topics,
    owner: Owner,
    key: SigningKey,
    keyring: Keyring,
    max_packet: usize,
    /// The federation's run, from its manifest: requests are signed with it (the latest run
    /// a manifest named).
    run: unifed_protocol::RunId,
}

fn describe(e: &OnboardError) -> String {
    match e {
        OnboardError::UnknownVersion {
            requested,
            available,
        } => format!(
            "the aggregator has no model version {requested} (it holds {})",
            list(available)
        ),
        OnboardError::NotRegistered {
            requested,
            available,
        } => format!(
            "no calibrated model of this site is registered{} (registered versions: {})",
            requested.map_or(String::new(), |v| format!(" for model version {v}")),
            list(available)
        ),
        OnboardError::Refused(m) => format!("the aggregator refused: {m}"),
        OnboardError::Unreadable { requested } => format!(
            "the aggregator could not read its copy of model version {requested} (a damaged \
             one is set aside for its operator): ask for another version, or again later"
        ),
    }
}

fn list(v: &[u64]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    }
}

impl OnboardClient {
    /// Connects to `broker` as a device of `owner.site` (its own client id, so it never
    /// displaces the site's trainer) signing with `identity`, and waits up to `timeout` for the
    /// connection.
    pub async fn connect(
        broker: &BrokerConfig,
        owner: Owner,
        identity: &Identity,
        timeout: Duration,
    ) -> Result<Self> {
        let topics = Topics::new(&owner.federation);
        let id = format!("unifed-onboard-{}-{}", owner.site, std::process::id());
        let (client, mut rx) = spawn_event_loop(
            broker.options(&id, None).map_err(anyhow::Error::msg)?,
            vec![
                topics.onboard_reply(&owner.site),
                topics.chunk_reply(&owner.site),
                topics.manifest(),
            ],
        );
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last_error = String::from("no answer");
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(NetEvent::Connected)) => break,
                Ok(Some(NetEvent::Disconnected(e))) => last_error = e,
                Ok(Some(_)) => {}
                Ok(None) => bail!("the MQTT event loop stopped"),
                Err(_) => bail!(
                    "could not connect to the broker at {}:{} within {} s: {last_error}",
                    broker.host,
                    broker.port,
                    timeout.as_secs()
                ),
            }
        }
        let mut c = OnboardClient {
            client,
            rx,
            topics,
            owner,
            key: identity.key.clone(),
            keyring: identity.keyring(),
            max_packet: broker.max_packet_bytes,
            run: unifed_protocol::RunId::default(),
        };
        // The run every request is signed with, from the aggregator's (retained) manifest.
        while c.run == unifed_protocol::RunId::default() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                bail!(
                    "no round manifest from the aggregator within {} s (is it running, on this broker, for federation `{}`?)",
                    timeout.as_secs(),
                    c.owner.federation
                );
            }
            c.next(left.min(Duration::from_millis(500))).await?;
        }
        Ok(c)
    }

    async fn send(
        &self,
        topic: String,
        kind: MessageKind,
        version: u64,
        payload: &impl serde::Serialize,
    ) -> Result<()> {
        let env = Envelope::new(
            kind,
            self.owner.federation.clone(),
            self.owner.site.clone(),
            0,
            version,
            self.owner.spec,
            payload,
        )
        .in_run(self.run);
        self.client
            .publish(topic, Qos::AtLeastOnce, false, self.key.sign(&env))
            .await?;
        Ok(())
    }

    /// The next message for this session, or `None` after `wait`.
    async fn next(&mut self, wait: Duration) -> Result<Option<Envelope>> {
        match tokio::time::timeout(wait, self.rx.recv()).await {
            Err(_) => Ok(None),
            Ok(None) => bail!("the MQTT event loop stopped"),
            Ok(Some(NetEvent::Message { payload, .. })) => {
                match self.keyring.open(&payload, self.max_packet + 4096) {
                    Ok(e)
                        if e.federation == self.owner.federation
                            && e.kind == MessageKind::RoundManifest =>
                    {
                        self.run = self.run.max(e.run);
                        Ok(None)
                    }
                    Ok(e) if e.federation == self.owner.federation => Ok(Some(e.into_owned())),
                    Ok(e) => {
                        tracing::warn!(federation = %e.federation, "message of another federation ignored");
                        Ok(None)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "message refused");
                        Ok(None)
                    }
                }
            }
            Ok(Some(_)) => Ok(None),
        }
    }

    /// Sends `req` (again every 5 s) until `accept` takes an answer; fails after a minute
    /// without one.
    async fn exchange<T>(
        &mut self,
        req: &OnboardRequest,
        mut accept: impl FnMut(&Envelope) -> Result<Option<T>>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut sent: Option<Instant> = None;
        loop {
            if sent.is_none_or(|t| t.elapsed() > RESEND) {
                self.send(
                    self.topics.onboard_request(&self.owner.site),
                    MessageKind::OnboardRequest,
                    0,
                    req,
                )
                .await?;
                sent = Some(Instant::now());
            }
            if let Some(env) = self.next(Duration::from_millis(500)).await?
                && let Some(t) = accept(&env)?
            {
                return Ok(t);
            }
            if start.elapsed() > STALL {
                bail!(
                    "no answer from the aggregator within {} s (is it running, on this broker, for federation `{}`?)",
                    STALL.as_secs(),
                    self.owner.federation
                );
            }
        }
    }

    /// Fetches the onboarding package of `version` (the newest when `None`): its description
    /// and the model it carries (every tensor). `max_bytes` bounds the package (a model of the
    /// spec in f32 plus its names); `progress(done, total)` follows the chunks.
    pub async fn package(
        &mut self,
        version: Option<u64>,
        max_bytes: u64,
        mut progress: impl FnMut(u32, u32),
    ) -> Result<(PackageInfo, ServerBroadcast)> {
        let info = self
            .exchange(
                &OnboardRequest::Package {
                    model_version: version,
                },
                |env| {
                    if env.kind != MessageKind::OnboardReply {
                        return Ok(None);
                    }
                    match env.payload_as::<OnboardReply>()? {
                        OnboardReply::Package(p)
                            if version.is_none_or(|v| v == p.model_version) =>
                        {
                            Ok(Some(p))
                        }
                        OnboardReply::Error(
                            e @ (OnboardError::UnknownVersion { .. }
                            | OnboardError::Unreadable { .. }),
                        ) => {
                            bail!("{}", describe(&e))
                        }
                        _ => Ok(None),
                    }
                },
            )
            .await?;
        if info.payload_len > max_bytes
            || info.chunk_count == 0
            || u64::from(info.chunk_count) > info.payload_len.max(1)
        {
            bail!(
                "the aggregator describes a package of {} bytes in {} chunks; a model of this \
                 spec takes at most {max_bytes} bytes",
                info.payload_len,
                info.chunk_count
            );
        }
        let mut reasm = Reassembler::new(
            STALL.as_millis() as u64 * 10,
            unifed_protocol::chunking::held_for(info.payload_len, info.chunk_count),
        );
        let t0 = Instant::now();
        let mut last_progress = Instant::now();
        let mut requested: Option<Instant> = None;
        let mut outstanding: std::collections::BTreeSet<u32> = Default::default();
        let mut done = 0u32;
        progress(0, info.chunk_count);
        loop {
            if outstanding.is_empty() || requested.is_none_or(|t| t.elapsed() > RESEND) {
                let window =
                    unifed_protocol::chunking::fetch_window(info.payload_len, info.chunk_count);
                let indices: Vec<u32> = match reasm.missing(&info.payload_hash) {
                    Some(m) => m.into_iter().take(window).collect(),
                    None => (0..info.chunk_count).take(window).collect(),
                };
                outstanding = indices.iter().copied().collect();
                let req = ChunkRequest {
                    model_version: info.model_version,
                    indices,
                    payload: unifed_protocol::messages::Payload::Package,
                    alone: false,
                };
                self.send(
                    self.topics.chunk_request(&self.owner.site),
                    MessageKind::ChunkRequest,
                    info.model_version,
                    &req,
                )
                .await?;
                requested = Some(Instant::now());
            }
            if let Some(env) = self.next(Duration::from_millis(500)).await?
                && env.kind == MessageKind::ModelChunk
            {
                let c: Chunk = env.payload_as()?;
                if c.payload_hash != info.payload_hash {
                    continue;
                }
                outstanding.remove(&c.index);
                match reasm.insert(c.as_ref(), t0.elapsed().as_millis() as u64) {
                    Ok(Some(bytes)) => {
                        progress(info.chunk_count, info.chunk_count);
                        let b: ServerBroadcast = postcard::from_bytes(&bytes)
                            .context("decoding the onboarding package")?;
                        return Ok((info, b));
                    }
                    Ok(None) => {
                        done += 1;
                        last_progress = Instant::now();
                        progress(done, info.chunk_count);
                    }
                    Err(e) => tracing::warn!(error = %e, "package chunk dropped"),
                }
            }
            if last_progress.elapsed() > STALL {
                bail!(
                    "the onboarding package of model v{} stalled at {done} of {} chunks",
                    info.model_version,
                    info.chunk_count
                );
            }
        }
    }

    /// Stores `entry` in the aggregator's registry (in chunks, re-sent until answered) and
    /// returns the hash of the stored entry.
    pub async fn register(
        &mut self,
        entry: &RegistryEntry,
        chunk_bytes: usize,
    ) -> Result<[u8; 32]> {
        let bytes = postcard::to_allocvec(entry).expect("entry serialises");
        let chunks = split(
            &bytes,
            chunk_bytes
                .min(self.max_packet.saturating_sub(1024))
                .max(1024),
        );
        // Every chunk carries the entry's hash (`split` gives at least one).
        let want = chunks[0].payload_hash;
        let start = Instant::now();
        let mut sent: Option<Instant> = None;
        loop {
            if sent.is_none_or(|t| t.elapsed() > RESEND) {
                for c in &chunks {
                    self.send(
                        self.topics.onboard_request(&self.owner.site),
                        MessageKind::RegistryPut,
                        entry.model_version,
                        c,
                    )
                    .await?;
                }
                sent = Some(Instant::now());
            }
            if let Some(env) = self.next(Duration::from_millis(500)).await?
                && env.kind == MessageKind::OnboardReply
            {
                match env.payload_as::<OnboardReply>()? {
                    OnboardReply::Registered {
                        model_version,
                        entry_hash,
                    } if model_version == entry.model_version && entry_hash == want => {
                        return Ok(entry_hash);
                    }
                    OnboardReply::Error(e) => bail!("{}", describe(&e)),
                    _ => {}
                }
            }
            if start.elapsed() > STALL {
                bail!(
                    "the aggregator did not confirm the registry entry within {} s",
                    STALL.as_secs()
                );
            }
        }
    }

    /// This site's registry entry for `version` (its newest when `None`), of at most
    /// `max_bytes`.
    pub async fn registry_entry(
        &mut self,
        version: Option<u64>,
        max_bytes: usize,
    ) -> Result<RegistryEntry> {
        let mut reasm = Reassembler::new(STALL.as_millis() as u64 * 10, max_bytes);
        let t0 = Instant::now();
        self.exchange(
            &OnboardRequest::RegistryGet {
                model_version: version,
            },
            |env| match env.kind {
                MessageKind::OnboardReply => match env.payload_as::<OnboardReply>()? {
                    OnboardReply::Error(e) => bail!("{}", describe(&e)),
                    _ => Ok(None),
                },
                MessageKind::RegistryEntry => {
                    let c: Chunk = env.payload_as()?;
                    match reasm.insert(c.as_ref(), t0.elapsed().as_millis() as u64) {
                        Ok(Some(bytes)) => {
                            let e: RegistryEntry = postcard::from_bytes(&bytes)
                                .context("decoding the registry entry")?;
                            Ok(version.is_none_or(|v| v == e.model_version).then_some(e))
                        }
                        Ok(None) => Ok(None),
                        Err(e) => {
                            tracing::warn!(error = %e, "registry chunk dropped");
                            Ok(None)
                        }
                    }
                }
                _ => Ok(None),
            },
        )
        .await
    }

    /// Disconnects cleanly.
    pub async fn close(self) {
        let _ = self.client.disconnect().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::encoding::{Encoding, encode};

    fn owner(site: &str, spec: u8) -> Owner {
        Owner {
            federation: Id::new("fed").unwrap(),
            site: Id::new(site).unwrap(),
            spec: SpecHash([spec; 32]),
        }
    }

    #[test]
    fn a_sealed_entry_opens_only_with_its_key_owner_and_version() {
        let key = SiteKey::generate();
        let t = vec![encode(
            "bn.running_mean",
            &[3],
            &[0.5, -1.5, 2.25],
            Encoding::F32,
            None,
        )];
        let entry = seal(Some(&key), &owner("a", 1), 4, &t);
        assert!(matches!(entry.sealing, Sealing::ChaCha20Poly1305 { .. }));
        // The plaintext bytes of the tensor appear nowhere in the sealed entry.
        let plain: Vec<u8> = [0.5f32, -1.5, 2.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(
            !entry
                .data
                .windows(plain.len())
                .any(|w| w == plain.as_slice())
        );
        assert_eq!(open(Some(&key), &owner("a", 1), &entry).unwrap(), t);
        let err = |k: Option<&SiteKey>, o: &Owner, e: &RegistryEntry| {
            open(k, o, e).unwrap_err().to_string()
        };
        assert!(err(Some(&SiteKey::generate()), &owner("a", 1), &entry).contains("does not open"));
        assert!(err(Some(&key), &owner("b", 1), &entry).contains("does not open"));
        assert!(err(Some(&key), &owner("a", 2), &entry).contains("does not open"));
        let mut moved = entry.clone();
        moved.model_version = 5;
        assert!(err(Some(&key), &owner("a", 1), &moved).contains("does not open"));
        let mut flipped = entry.clone();
        flipped.data[0] ^= 1;
        assert!(err(Some(&key), &owner("a", 1), &flipped).contains("does not open"));
        assert!(err(None, &owner("a", 1), &entry).contains("site_key"));
        let plain_entry = seal(None, &owner("a", 1), 4, &t);
        assert_eq!(plain_entry.sealing, Sealing::Plain);
        assert_eq!(open(None, &owner("a", 1), &plain_entry).unwrap(), t);
        // A site with a key never takes a plaintext entry (a downgrade by whoever replaced it).
        assert!(err(Some(&key), &owner("a", 1), &plain_entry).contains("not sealed"));
    }

    #[test]
    fn a_key_file_round_trips_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("site.key");
        let k = SiteKey::generate();
        k.save(&p).unwrap();
        assert_eq!(SiteKey::load(&p).unwrap().0, k.0);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        let again = k.save(&p).unwrap_err().to_string();
        assert!(again.contains("must not exist"), "{again}");
        std::fs::write(dir.path().join("bad.key"), "abc\n").unwrap();
        let e = SiteKey::load(&dir.path().join("bad.key"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.key") && e.contains("64 hex digits"), "{e}");
    }
}
