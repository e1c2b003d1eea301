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

/// A site's identifier.
pub type SiteId = Id;
/// A federation's identifier.
pub type FederationId = Id;
