//! Who sent a message: ed25519 identities, envelope signatures and the [`Keyring`] that checks
//! them before anything else is done with a message.
//!
//! Every site and the aggregator holds a [`SigningKey`] made on its own machine; only its
//! [`PublicKey`] leaves it. A sender signs the BLAKE3 digest, in a key derivation context of
//! its own, of the whole
//! envelope without its signature (magic, version, kind, federation, sender, round, model
//! version, spec hash and payload), so a signed message cannot be replayed into another
//! federation, round or kind, or claimed by another sender. A receiver opens bytes with its
//! keyring: the sender must be enrolled, its key not revoked and the signature valid.

use crate::envelope::{DecodeError, Envelope, EnvelopeRef};
use crate::ids::Id;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use sha2::{Digest, Sha256};

/// Length of an ed25519 signature.
pub const SIGNATURE_LEN: usize = 64;
/// The BLAKE3 key derivation context of every signed digest, so a signature over an envelope
/// means nothing else.
const DOMAIN: &str = "UniFed Edge 2026-11-26 envelope signature";
/// A signed envelope ends with `Some` (1), the signature's length (64, one varint byte) and
/// the signature; an unsigned one ends with `None` (0) in their place.
const SIGNED_TAIL: usize = 2 + SIGNATURE_LEN;

/// An ed25519 public key: how a site or the aggregator is known to its peers. Written
/// `ed25519:` and 64 hex digits in configs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    /// A short fingerprint a person can read out over the phone: the first 8 bytes of the key's
    /// SHA-256, as four groups of four hex digits.
    pub fn fingerprint(&self) -> String {
        let h = Sha256::digest(self.0);
        let hex = hex(&h[..8]);
        format!(
            "{}-{}-{}-{}",
            &hex[..4],
            &hex[4..8],
            &hex[8..12],
            &hex[12..]
        )
    }

    /// True if `signature` is this key's [`SigningKey::sign_statement`] of `bytes` in
    /// `context`.
    pub fn verifies_statement(&self, context: &str, bytes: &[u8], signature: &[u8]) -> bool {
        self.verifies(&statement_digest(context, bytes), signature)
    }

    /// True if `signature` is this key's signature of `digest`.
    fn verifies(&self, digest: &[u8; 32], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(digest, signature)
            .is_ok()
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ed25519:{}", hex(&self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.fingerprint())
    }
}

impl core::str::FromStr for PublicKey {
    type Err = PublicKeyError;

    fn from_str(s: &str) -> Result<Self, PublicKeyError> {
        let hex = s
            .trim()
            .strip_prefix("ed25519:")
            .ok_or_else(|| PublicKeyError::NoPrefix(s.into()))?;
        parse_hex32(hex)
            .map(PublicKey)
            .ok_or_else(|| PublicKeyError::BadHex(s.into()))
    }
}

/// Why a text is not a [`PublicKey`]: a key is written `ed25519:` and 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublicKeyError {
    /// The text does not start with `ed25519:`.
    #[error("a public key is `ed25519:` and 64 hex digits, got `{0}` (no `ed25519:`)")]
    NoPrefix(String),
    /// What follows `ed25519:` is not 64 hex digits.
    #[error("a public key is `ed25519:` and 64 hex digits, got `{0}`")]
    BadHex(String),
}

impl From<PublicKeyError> for String {
    fn from(e: PublicKeyError) -> String {
        format!("{e}")
    }
}

impl serde::Serialize for PublicKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PublicKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An ed25519 private key. It never leaves the machine that made it: it is not serialisable
/// and its `Debug` shows only the public key's fingerprint.
pub struct SigningKey {
    seed: [u8; 32],
    pair: Ed25519KeyPair,
}

impl SigningKey {
    /// The key of a 32-byte seed (the private key proper).
    pub fn from_seed(seed: [u8; 32]) -> SigningKey {
        let pair =
            Ed25519KeyPair::from_seed_unchecked(&seed).expect("every 32-byte seed is a valid key");
        SigningKey { seed, pair }
    }

    /// A fresh key from the operating system's random source.
    pub fn generate() -> Result<SigningKey, AuthError> {
        let mut seed = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut seed)
            .map_err(|_| AuthError::NoRandomness)?;
        Ok(SigningKey::from_seed(seed))
    }

    /// The public half.
    pub fn public(&self) -> PublicKey {
        let mut k = [0u8; 32];
        k.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey(k)
    }

    /// Signs the encoding of an unsigned envelope (as [`Envelope::encode`] writes it with no
    /// signature): the bytes come back with the signature in the envelope's signature slot,
    /// without re-encoding the payload.
    pub fn sign_encoded(&self, mut unsigned: Vec<u8>) -> Result<Vec<u8>, AuthError> {
        self.sign_tail(&mut unsigned, 0)?;
        Ok(unsigned)
    }

    /// Signs in place the unsigned envelope that `buf` holds from byte `start` to its end (as
    /// [`Envelope::append_new`] leaves it): [`SigningKey::sign_encoded`] of those bytes, with
    /// the bytes before `start` untouched.
    pub fn sign_tail(&self, buf: &mut Vec<u8>, start: usize) -> Result<(), AuthError> {
        let unsigned = buf.get(start..).ok_or(AuthError::NotAnUnsignedEnvelope)?;
        // A signature's last byte may be 0 like the empty slot's: the envelope is read (its
        // payload skipped, not copied) rather than its last byte looked at.
        if !crate::envelope::is_unsigned_encoding(unsigned) {
            return Err(AuthError::NotAnUnsignedEnvelope);
        }
        let digest = digest(&[unsigned]);
        let signature = self.pair.sign(&digest);
        buf.pop();
        buf.reserve_exact(SIGNED_TAIL);
        buf.push(1);
        buf.push(SIGNATURE_LEN as u8);
        buf.extend_from_slice(signature.as_ref());
        Ok(())
    }

    /// The wire bytes of `envelope`, signed by this key (any signature it had is replaced).
    pub fn sign(&self, envelope: &Envelope) -> Vec<u8> {
        self.sign_encoded(envelope.encode_unsigned())
            .expect("an unsigned encoding ends with the empty signature slot")
    }

    /// This key's signature of a statement `bytes` in `context` (not an envelope: a file a
    /// person carries, such as an enrolment request). The context keeps a statement's signature
    /// from meaning anything else, an envelope's included.
    pub fn sign_statement(&self, context: &str, bytes: &[u8]) -> [u8; SIGNATURE_LEN] {
        let digest = statement_digest(context, bytes);
        let mut out = [0u8; SIGNATURE_LEN];
        out.copy_from_slice(self.pair.sign(&digest).as_ref());
        out
    }

    /// The seed, for writing the key file.
    #[cfg(feature = "std")]
    fn seed_hex(&self) -> String {
        hex(&self.seed)
    }
}

impl Clone for SigningKey {
    fn clone(&self) -> Self {
        SigningKey::from_seed(self.seed)
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SigningKey({})", self.public().fingerprint())
    }
}

/// Why a message was refused by a [`Keyring`], or a key could not be made or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The bytes are not an envelope.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The envelope carries no signature.
    #[error("unsigned message from `{0}`")]
    Unsigned(Id),
    /// The sender is not enrolled.
    #[error("`{0}` is not an enrolled sender")]
    UnknownSender(Id),
    /// The sender's key is on the revocation list.
    #[error("the key of `{sender}` ({fingerprint}) is revoked")]
    Revoked {
        /// The sender.
        sender: Id,
        /// Its key's fingerprint.
        fingerprint: String,
    },
    /// The signature does not verify under the sender's enrolled key.
    #[error("bad signature on a message from `{0}`")]
    BadSignature(Id),
    /// Bytes handed to [`SigningKey::sign_encoded`] are not an unsigned envelope.
    #[error("only the encoding of an unsigned envelope can be signed")]
    NotAnUnsignedEnvelope,
    /// The operating system gave no random bytes for a new key.
    #[error("the operating system's random source failed")]
    NoRandomness,
}

/// The senders a peer accepts messages from: enrolled ids with their keys, and revoked keys.
/// A site's keyring holds the aggregator's pinned key; the aggregator's holds every enrolled
/// site's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keyring {
    keys: BTreeMap<Id, PublicKey>,
    revoked: BTreeSet<PublicKey>,
}

impl Keyring {
    /// A keyring trusting exactly `sender` with `key` (a site pinning its aggregator).
    pub fn single(sender: Id, key: PublicKey) -> Keyring {
        let mut k = Keyring::default();
        k.enrol(sender, key);
        k
    }

    /// A keyring trusting only the aggregator, with its pinned `key`: what every site opens
    /// the aggregator's messages with.
    pub fn aggregator(key: PublicKey) -> Keyring {
        Keyring::single(
            Id::new(crate::ids::AGGREGATOR_ID).expect("the aggregator's id is valid"),
            key,
        )
    }

    /// Trusts `sender` with `key` (replacing an earlier key of the same sender).
    pub fn enrol(&mut self, sender: Id, key: PublicKey) {
        self.keys.insert(sender, key);
    }

    /// Refuses every message signed by `key`, whoever claims it.
    pub fn revoke(&mut self, key: PublicKey) {
        self.revoked.insert(key);
    }

    /// The enrolled key of `sender`.
    pub fn key_of(&self, sender: &Id) -> Option<&PublicKey> {
        self.keys.get(sender)
    }

    /// True if `sender` is enrolled and its key not revoked.
    pub fn admits(&self, sender: &Id) -> bool {
        self.keys
            .get(sender)
            .is_some_and(|k| !self.revoked.contains(k))
    }

    /// Decodes `bytes` (refused above `limit` before parsing) and checks its signature: the
    /// sender must be enrolled, its key not revoked, and the signature its key's over the
    /// whole envelope. The envelope is read in place: its payload is a slice of `bytes`
    /// ([`EnvelopeRef::into_owned`] copies it out).
    pub fn open<'a>(&self, bytes: &'a [u8], limit: usize) -> Result<EnvelopeRef<'a>, AuthError> {
        let (env, key, signature) = self.read_signed(bytes, limit)?;
        // A decoded envelope with a 64-byte signature ends with exactly SIGNED_TAIL bytes of it;
        // the signed bytes are the rest with the empty slot in its place.
        let d = digest(&[&bytes[..bytes.len() - SIGNED_TAIL], &[0]]);
        if !key.verifies(&d, signature) {
            return Err(AuthError::BadSignature(env.sender));
        }
        Ok(env)
    }

    /// [`Keyring::open`] of an envelope whose every byte came in chunks that were each opened
    /// with this keyring as the envelope's sender's (an update a site uploaded in chunks):
    /// each byte was signed by that sender with its place in the payload, so everything is
    /// checked but the envelope's own signature, which would hash the whole envelope again
    /// for nothing. The size, the encoding, a signature of the right length and an enrolled,
    /// unrevoked sender are checked as `open` checks them. The caller vouches for the chunks.
    pub fn open_signed_in_chunks<'a>(
        &self,
        bytes: &'a [u8],
        limit: usize,
    ) -> Result<EnvelopeRef<'a>, AuthError> {
        self.read_signed(bytes, limit).map(|(env, ..)| env)
    }

    /// `bytes` decoded (refused above `limit` before parsing), with its sender's enrolled and
    /// unrevoked key and its signature of the right length, not yet verified.
    fn read_signed<'a>(
        &self,
        bytes: &'a [u8],
        limit: usize,
    ) -> Result<(EnvelopeRef<'a>, &PublicKey, &'a [u8]), AuthError> {
        if bytes.len() > limit {
            return Err(DecodeError::TooLarge {
                len: bytes.len(),
                limit,
            }
            .into());
        }
        let env = EnvelopeRef::read(bytes)?;
        let Some(signature) = env.signature else {
            return Err(AuthError::Unsigned(env.sender));
        };
        let Some(key) = self.keys.get(&env.sender) else {
            return Err(AuthError::UnknownSender(env.sender));
        };
        if self.revoked.contains(key) {
            return Err(AuthError::Revoked {
                fingerprint: key.fingerprint(),
                sender: env.sender,
            });
        }
        if signature.len() != SIGNATURE_LEN {
            return Err(AuthError::BadSignature(env.sender));
        }
        Ok((env, key, signature))
    }
}

/// BLAKE3 of `parts` in the signature's derivation context: 3-4 times faster than SHA-256 with
/// its CPU instructions, on an update of 57 MB hashed by both sides.
/// The digest a statement's signature covers: BLAKE3 in a derivation context of its own,
/// never the envelopes'.
fn statement_digest(context: &str, bytes: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("UniFed Edge 2026-11-30 signed statement");
    h.update(&(context.len() as u64).to_le_bytes());
    h.update(context.as_bytes());
    h.update(bytes);
    h.finalize().into()
}

fn digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key(DOMAIN);
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    bytes
        .iter()
        .flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 15)]])
        .map(char::from)
        .collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(feature = "std")]
mod file {
    use super::{SigningKey, parse_hex32};
    use std::io::Write;
    use std::path::{Path, PathBuf};

    /// Why a key file could not be made or read.
    #[derive(Debug, thiserror::Error)]
    pub enum KeyFileError {
        /// The file could not be created, read or written.
        #[error("{path}: {source}")]
        Io {
            /// The file.
            path: PathBuf,
            /// The error.
            source: std::io::Error,
        },
        /// The file exists already (keys are never overwritten).
        #[error("{0} exists already; a key file is never overwritten")]
        Exists(PathBuf),
        /// The file is not 64 hex digits.
        #[error("{0}: a private key file holds 64 hex digits")]
        Malformed(PathBuf),
        /// Other users may read the file.
        #[error(
            "{path} may be read by other users (mode {mode:o}): run `chmod 600` on it, a private \
             key is its owner's only"
        )]
        Exposed {
            /// The file.
            path: PathBuf,
            /// Its permission bits.
            mode: u32,
        },
        /// The path names `$CREDENTIALS_DIRECTORY` but it is not set.
        #[error(
            "{0} names $CREDENTIALS_DIRECTORY, which is not set (systemd sets it for LoadCredential=)"
        )]
        NoCredentialsDirectory(PathBuf),
        /// No randomness for a new key.
        #[error("{0}")]
        Auth(#[from] super::AuthError),
    }

    /// `path` with a leading `$CREDENTIALS_DIRECTORY` (or `${CREDENTIALS_DIRECTORY}`) replaced by
    /// that variable, as systemd's `LoadCredential=` sets it.
    pub fn credential_path(path: &Path) -> Result<PathBuf, KeyFileError> {
        let s = path.to_string_lossy();
        for prefix in ["$CREDENTIALS_DIRECTORY/", "${CREDENTIALS_DIRECTORY}/"] {
            if let Some(rest) = s.strip_prefix(prefix) {
                let dir = std::env::var_os("CREDENTIALS_DIRECTORY")
                    .ok_or_else(|| KeyFileError::NoCredentialsDirectory(path.into()))?;
                return Ok(PathBuf::from(dir).join(rest));
            }
        }
        Ok(path.into())
    }

    impl SigningKey {
        /// Makes a new key and writes it to `path`, which must not exist, readable by its owner
        /// only.
        pub fn create(path: &Path) -> Result<SigningKey, KeyFileError> {
            let path = credential_path(path)?;
            // A fresh site's key folder (`run/grey/identity.key`) is made, owner-only.
            if let Some(parent) = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty() && !p.exists())
            {
                let mut b = std::fs::DirBuilder::new();
                b.recursive(true);
                #[cfg(unix)]
                std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
                b.create(parent).map_err(|source| KeyFileError::Io {
                    path: parent.into(),
                    source,
                })?;
            }
            let key = SigningKey::generate()?;
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
            let io = |source| KeyFileError::Io {
                path: path.clone(),
                source,
            };
            let mut f = o.open(&path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    KeyFileError::Exists(path.clone())
                } else {
                    io(e)
                }
            })?;
            writeln!(f, "{}", key.seed_hex()).map_err(io)?;
            f.sync_all().map_err(io)?;
            Ok(key)
        }

        /// Reads the key file at `path` (64 hex digits), refusing one that other users may
        /// read.
        pub fn load(path: &Path) -> Result<SigningKey, KeyFileError> {
            let path = credential_path(path)?;
            let io = |source| KeyFileError::Io {
                path: path.clone(),
                source,
            };
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&path).map_err(io)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(KeyFileError::Exposed { path, mode });
                }
            }
            let text = std::fs::read_to_string(&path).map_err(io)?;
            let seed = parse_hex32(text.trim()).ok_or(KeyFileError::Malformed(path))?;
            Ok(SigningKey::from_seed(seed))
        }

        /// Reads the key at `path`, or makes it there if there is no file yet.
        pub fn load_or_create(path: &Path) -> Result<SigningKey, KeyFileError> {
            match SigningKey::create(path) {
                Err(KeyFileError::Exists(_)) => SigningKey::load(path),
                r => r,
            }
        }
    }
}

#[cfg(feature = "std")]
pub use file::{KeyFileError, credential_path};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::MessageKind;
    use crate::messages::{ChunkRequest, Payload};
    use crate::spec::SpecHash;
    use alloc::string::ToString;
    use alloc::vec;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    fn key(n: u8) -> SigningKey {
        SigningKey::from_seed([n; 32])
    }

    fn envelope(fed: &str, sender: &str, round: u64) -> Envelope {
        Envelope::new(
            MessageKind::ChunkRequest,
            id(fed),
            id(sender),
            round,
            7,
            SpecHash([3; 32]),
            &ChunkRequest {
                model_version: 7,
                indices: vec![1, 2],
                payload: Payload::Model,
                alone: false,
            },
        )
    }

    fn ring_of(sender: &str, k: &SigningKey) -> Keyring {
        Keyring::single(id(sender), k.public())
    }

    #[test]
    fn a_signed_envelope_opens_under_its_senders_key_and_decodes_to_itself() {
        let k = key(1);
        let e = envelope("fed", "site-a", 3);
        let bytes = k.sign(&e);
        assert_eq!(bytes.len(), e.encode().len() + SIGNATURE_LEN + 1);
        let opened = ring_of("site-a", &k).open(&bytes, 1 << 20).unwrap();
        assert_eq!(opened.payload, e.payload);
        assert_eq!(opened.signature.map(<[u8]>::len), Some(SIGNATURE_LEN));
        // Signing twice gives the same bytes (ed25519 is deterministic).
        assert_eq!(k.sign(&opened.into_owned()), bytes);
    }

    #[test]
    fn envelopes_appended_and_signed_in_one_buffer_are_those_signed_one_by_one() {
        let k = key(1);
        let chunk = |i: u32| crate::messages::Chunk {
            payload_hash: [9; 32],
            index: i,
            count: 300,
            total_len: 3000,
            data: vec![i as u8; 10],
        };
        let mut buf = b"kept".to_vec();
        let mut ends = Vec::new();
        // Indices on both sides of a varint's second byte.
        for i in [0, 127, 128, 299] {
            let start = buf.len();
            Envelope::append_new(
                &mut buf,
                MessageKind::ModelChunk,
                &id("fed"),
                &id("aggregator"),
                (crate::ids::RunId::default(), 2, 5),
                SpecHash([3; 32]),
                &chunk(i).as_ref(),
            );
            k.sign_tail(&mut buf, start).unwrap();
            let alone = k.sign(&Envelope::new(
                MessageKind::ModelChunk,
                id("fed"),
                id("aggregator"),
                2,
                5,
                SpecHash([3; 32]),
                &chunk(i),
            ));
            assert_eq!(&buf[start..], &alone[..], "chunk {i}");
            ends.push(buf.len());
        }
        assert_eq!(&buf[..4], b"kept");
        // Bytes that are not an unsigned envelope from `start` on are refused, untouched.
        let before = buf.clone();
        assert_eq!(
            k.sign_tail(&mut buf, 4),
            Err(AuthError::NotAnUnsignedEnvelope)
        );
        let past = buf.len() + 1;
        assert_eq!(
            k.sign_tail(&mut buf, past),
            Err(AuthError::NotAnUnsignedEnvelope)
        );
        assert_eq!(buf, before);
    }

    #[test]
    fn every_changed_byte_of_a_signed_envelope_is_refused() {
        let k = key(1);
        let ring = ring_of("site-a", &k);
        let bytes = k.sign(&envelope("fed", "site-a", 3));
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(ring.open(&b, 1 << 20).is_err(), "byte {i} flipped");
        }
    }

    #[test]
    fn another_key_another_sender_and_no_signature_are_refused_by_name() {
        let ring = ring_of("site-a", &key(1));
        let forged = key(2).sign(&envelope("fed", "site-a", 3));
        assert_eq!(
            ring.open(&forged, 1 << 20),
            Err(AuthError::BadSignature(id("site-a")))
        );
        let stranger = key(2).sign(&envelope("fed", "site-b", 3));
        assert_eq!(
            ring.open(&stranger, 1 << 20),
            Err(AuthError::UnknownSender(id("site-b")))
        );
        let unsigned = envelope("fed", "site-a", 3).encode();
        assert_eq!(
            ring.open(&unsigned, 1 << 20),
            Err(AuthError::Unsigned(id("site-a")))
        );
        let mut short = envelope("fed", "site-a", 3);
        short.signature = Some(vec![0; 63]);
        assert_eq!(
            ring.open(&short.encode(), 1 << 20),
            Err(AuthError::BadSignature(id("site-a")))
        );
    }

    /// Opening an envelope whose bytes came in signed chunks checks all that `open` checks but
    /// the signature's digest: the same errors for a stranger, no signature, a signature of the
    /// wrong length, a revoked key or too many bytes; a forged signature alone passes.
    #[test]
    fn opening_what_came_in_signed_chunks_checks_all_but_the_digest() {
        let k = key(1);
        let mut ring = ring_of("site-a", &k);
        let good = k.sign(&envelope("fed", "site-a", 3));
        let opened = ring.open_signed_in_chunks(&good, 1 << 20).unwrap();
        assert_eq!(opened, ring.open(&good, 1 << 20).unwrap());
        let forged = key(2).sign(&envelope("fed", "site-a", 3));
        assert_eq!(
            ring.open(&forged, 1 << 20),
            Err(AuthError::BadSignature(id("site-a")))
        );
        assert!(ring.open_signed_in_chunks(&forged, 1 << 20).is_ok());
        let mut short = envelope("fed", "site-a", 3);
        short.signature = Some(vec![0; 63]);
        for bytes in [
            key(2).sign(&envelope("fed", "site-b", 3)),
            envelope("fed", "site-a", 3).encode(),
            short.encode(),
        ] {
            assert_eq!(
                ring.open_signed_in_chunks(&bytes, 1 << 20),
                Err(ring.open(&bytes, 1 << 20).unwrap_err())
            );
        }
        assert!(matches!(
            ring.open_signed_in_chunks(&good, good.len() - 1),
            Err(AuthError::Decode(DecodeError::TooLarge { .. }))
        ));
        ring.revoke(k.public());
        assert!(matches!(
            ring.open_signed_in_chunks(&good, 1 << 20),
            Err(AuthError::Revoked { .. })
        ));
    }

    #[test]
    fn a_signature_does_not_carry_over_to_another_round_or_federation() {
        let k = key(1);
        let ring = ring_of("site-a", &k);
        let good = k.sign(&envelope("fed", "site-a", 3));
        let sig = ring
            .open(&good, 1 << 20)
            .unwrap()
            .signature
            .map(<[u8]>::to_vec);
        for mut moved in [envelope("fed", "site-a", 4), envelope("other", "site-a", 3)] {
            moved.signature = sig.clone();
            assert_eq!(
                ring.open(&moved.encode(), 1 << 20),
                Err(AuthError::BadSignature(id("site-a")))
            );
        }
    }

    #[test]
    fn a_revoked_key_is_refused_whoever_claims_it() {
        let k = key(1);
        let mut ring = ring_of("site-a", &k);
        ring.enrol(id("site-b"), k.public());
        ring.revoke(k.public());
        assert!(!ring.admits(&id("site-a")));
        let err = ring
            .open(&k.sign(&envelope("fed", "site-b", 3)), 1 << 20)
            .unwrap_err();
        assert_eq!(
            err,
            AuthError::Revoked {
                sender: id("site-b"),
                fingerprint: k.public().fingerprint()
            }
        );
        assert!(err.to_string().contains("revoked"));
    }

    #[test]
    fn public_keys_round_trip_through_their_text_and_fingerprints_differ() {
        let p = key(7).public();
        let text = p.to_string();
        assert!(text.starts_with("ed25519:") && text.len() == 8 + 64);
        assert_eq!(text.parse::<PublicKey>(), Ok(p));
        assert!(matches!(
            "ed25519:00".parse::<PublicKey>(),
            Err(PublicKeyError::BadHex(t)) if t == "ed25519:00"
        ));
        assert!(matches!(
            text[8..].parse::<PublicKey>(),
            Err(PublicKeyError::NoPrefix(_))
        ));
        let f = p.fingerprint();
        assert_eq!(f.len(), 19);
        assert_ne!(f, key(8).public().fingerprint());
        assert!(!alloc::format!("{:?}", key(7)).contains(&hex(&[7; 32])));
    }

    #[test]
    fn only_an_unsigned_encoding_can_be_signed() {
        let k = key(1);
        let signed = k.sign(&envelope("fed", "site-a", 3));
        assert_eq!(
            k.sign_encoded(signed),
            Err(AuthError::NotAnUnsignedEnvelope)
        );
        assert_eq!(
            k.sign_encoded(vec![0; 3]),
            Err(AuthError::NotAnUnsignedEnvelope)
        );
    }

    #[cfg(feature = "std")]
    #[test]
    fn key_files_are_private_never_overwritten_and_read_back() {
        let dir = std::env::temp_dir().join(alloc::format!("unifed-auth-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("site.key");
        let k = SigningKey::create(&path).unwrap();
        assert!(matches!(
            SigningKey::create(&path),
            Err(KeyFileError::Exists(_))
        ));
        assert_eq!(SigningKey::load(&path).unwrap().public(), k.public());
        assert_eq!(
            SigningKey::load_or_create(&path).unwrap().public(),
            k.public()
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert!(matches!(
                SigningKey::load(&path),
                Err(KeyFileError::Exposed { mode: 0o644, .. })
            ));
        }
        std::fs::write(dir.join("bad.key"), "12").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.join("bad.key"), std::fs::Permissions::from_mode(0o600))
                .unwrap();
        }
        assert!(matches!(
            SigningKey::load(&dir.join("bad.key")),
            Err(KeyFileError::Malformed(_))
        ));
        // A key in a folder that does not exist yet: the folder is made, owner-only.
        let nested = dir.join("run/grey/identity.key");
        let k = SigningKey::load_or_create(&nested).unwrap();
        assert_eq!(SigningKey::load(&nested).unwrap().public(), k.public());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode =
                |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&dir.join("run/grey")), 0o700);
            assert_eq!(mode(&nested), 0o600);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
