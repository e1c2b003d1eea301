//! Site and federation identifiers: short, and safe in MQTT topics and client ids.

use core::fmt;
use serde::{Deserialize, Serialize};

/// Longest identifier, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// The sender id of every message the aggregator sends; sites follow no other sender's
/// manifests, models or answers (telling a forged sender from the real one needs signatures).
pub const AGGREGATOR_ID: &str = "aggregator";

/// An identifier that is safe in topics and client ids: 1 to 64 bytes of `A-Z a-z 0-9 _ - .`,
/// not starting with `.` or `-` (so no `+ # $ /`, no spaces, no wildcards).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(
    try_from = "heapless::String<MAX_ID_LEN>",
    into = "heapless::String<MAX_ID_LEN>"
)]
pub struct Id(heapless::String<MAX_ID_LEN>);

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// Empty string.
    #[error("an id cannot be empty")]
    Empty,
    /// Longer than [`MAX_ID_LEN`].
    #[error("id is {0} bytes long, the limit is 64")]
    TooLong(usize),
    /// A character outside `A-Z a-z 0-9 _ - .`, or a leading `.`/`-`.
    #[error(
        "id contains `{0}`: only A-Z a-z 0-9 _ - . are allowed, and it cannot start with . or -"
    )]
    BadChar(char),
}

impl Id {
    /// Validates `s` as an identifier.
    pub fn new(s: &str) -> Result<Self, IdError> {
        if s.is_empty() {
            return Err(IdError::Empty);
        }
        if s.len() > MAX_ID_LEN {
            return Err(IdError::TooLong(s.len()));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            return Err(IdError::BadChar(c));
        }
        let first = s.chars().next().expect("non-empty");
        if first == '.' || first == '-' {
            return Err(IdError::BadChar(first));
        }
        let mut h = heapless::String::new();
        h.push_str(s).map_err(|_| IdError::TooLong(s.len()))?;
        Ok(Id(h))
    }

    /// The identifier as a string slice.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl TryFrom<heapless::String<MAX_ID_LEN>> for Id {
    type Error = IdError;
    fn try_from(s: heapless::String<MAX_ID_LEN>) -> Result<Self, IdError> {
        Id::new(s.as_str())
    }
}

impl From<Id> for heapless::String<MAX_ID_LEN> {
    fn from(id: Id) -> Self {
        id.0
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.as_str())
    }
}

/// A run of a federation: chosen when the aggregator creates the federation's state, so a
/// federation restarted with a fresh data folder, under the same id and keys, is another run.
/// Every message is signed with the run it belongs to, and peers take only their run's; a
/// later run (by its creation time, then its nonce) supersedes an earlier one at the sites.
///
/// On the wire it is 16 bytes (both numbers little-endian), so every message of every run is
/// as long; in JSON it is its `Display` form.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId {
    /// When the run's state was created, milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// A random number drawn then.
    pub nonce: u64,
}

#[cfg(feature = "std")]
impl RunId {
    /// A new run: created now, with a nonce from the operating system's random source (the
    /// clock's nanoseconds if it has none).
    pub fn fresh() -> RunId {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut nonce = [0u8; 8];
        if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce).is_err() {
            nonce = (since.as_nanos() as u64).to_le_bytes();
        }
        RunId {
            created_ms: since.as_millis() as u64,
            nonce: u64::from_le_bytes(nonce),
        }
    }
}

impl Serialize for RunId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            return s.collect_str(self);
        }
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.created_ms.to_le_bytes());
        b[8..].copy_from_slice(&self.nonce.to_le_bytes());
        b.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RunId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        if d.is_human_readable() {
            let text = alloc::string::String::deserialize(d)?;
            let bad = || D::Error::custom("a run is `<created ms>-<16 hex digits>`");
            let (ms, nonce) = text.split_once('-').ok_or_else(bad)?;
            return Ok(RunId {
                created_ms: ms.parse().map_err(|_| bad())?,
                nonce: u64::from_str_radix(nonce, 16).map_err(|_| bad())?,
            });
        }
        let b = <[u8; 16]>::deserialize(d)?;
        let half = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(RunId {
            created_ms: half(0),
            nonce: half(8),
        })
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{:016x}", self.created_ms, self.nonce)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({self})")
    }
}

/// A site's identifier.
pub type SiteId = Id;
/// A federation's identifier.
pub type FederationId = Id;
