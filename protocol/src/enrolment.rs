//! Enrolment requests: how a site asks to join a federation without its private key leaving it.
//! The site makes its key and a request (`unifed-agent enrol`), signed by that key (proof it
//! holds it); a person carries the request to the coordinator, compares the fingerprint over
//! another channel, and approves it (`unifed-aggregator approve`). A rotation request names the
//! key it replaces and is signed by it too, so only the holder of the enrolled key can rotate.

use crate::auth::{PublicKey, SigningKey};
use serde::{Deserialize, Serialize};

/// The context of an enrolment request's signatures.
const CONTEXT: &str = "enrolment request v1";

/// A site's request to be enrolled in a federation, or to rotate its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrolmentRequest {
    /// The federation's id.
    pub federation: String,
    /// The site's id.
    pub site: String,
    /// The key to enrol.
    pub key: PublicKey,
    /// When the request was made, milliseconds since the Unix epoch.
    pub made_ms: u64,
    /// The enrolled key this one replaces (a rotation), if any.
    #[serde(default)]
    pub previous: Option<PublicKey>,
    /// `key`'s signature of the request, hex.
    pub signature: String,
    /// `previous`'s signature of the request, hex (a rotation).
    #[serde(default)]
    pub previous_signature: Option<String>,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnrolmentError {
    /// A signature does not verify (the request was altered, or not made by the key's holder).
    #[error("the request's signature by {0} does not verify")]
    BadSignature(String),
    /// A rotation without the replaced key's signature.
    #[error("a rotation must be signed by the key it replaces")]
    Unvouched,
}

impl EnrolmentRequest {
    /// A request by `key` for `site` in `federation`, made now; a rotation when `previous`
    /// (the enrolled key it replaces) is given.
    pub fn new(
        federation: &str,
        site: &str,
        key: &SigningKey,
        previous: Option<&SigningKey>,
    ) -> EnrolmentRequest {
        let made_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut r = EnrolmentRequest {
            federation: federation.into(),
            site: site.into(),
            key: key.public(),
            made_ms,
            previous: previous.map(SigningKey::public),
            signature: String::new(),
            previous_signature: None,
        };
        let statement = r.statement();
        r.signature = hex(&key.sign_statement(CONTEXT, &statement));
        r.previous_signature = previous.map(|p| hex(&p.sign_statement(CONTEXT, &statement)));
        r
    }

    /// The bytes both signatures cover: every field but the signatures.
    fn statement(&self) -> Vec<u8> {
        let previous = self.previous.map(|p| p.to_string()).unwrap_or_default();
        format!(
            "{}\n{}\n{}\n{}\n{}",
            self.federation, self.site, self.key, self.made_ms, previous
        )
        .into_bytes()
    }

    /// Checks the request's signatures: by `key`, and by `previous` for a rotation.
    pub fn verify(&self) -> Result<(), EnrolmentError> {
        let statement = self.statement();
        let signed = |key: &PublicKey, sig: &str| {
            unhex(sig).is_some_and(|s| key.verifies_statement(CONTEXT, &statement, &s))
        };
        if !signed(&self.key, &self.signature) {
            return Err(EnrolmentError::BadSignature(self.key.fingerprint()));
        }
        if let Some(previous) = &self.previous {
            let sig = self
                .previous_signature
                .as_deref()
                .ok_or(EnrolmentError::Unvouched)?;
            if !signed(previous, sig) {
                return Err(EnrolmentError::BadSignature(previous.fingerprint()));
            }
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> SigningKey {
        SigningKey::from_seed([n; 32])
    }

    #[test]
    fn a_request_verifies_and_any_change_to_it_does_not() {
        let r = EnrolmentRequest::new("fed", "grey", &key(1), None);
        assert_eq!(r.verify(), Ok(()));
        let json = serde_json::to_string(&r).unwrap();
        let back: EnrolmentRequest = serde_json::from_str(&json).unwrap();
        assert_eq!(back.verify(), Ok(()));
        for changed in [
            EnrolmentRequest {
                site: "texture".into(),
                ..r.clone()
            },
            EnrolmentRequest {
                federation: "other".into(),
                ..r.clone()
            },
            EnrolmentRequest {
                key: key(2).public(),
                ..r.clone()
            },
            EnrolmentRequest {
                made_ms: r.made_ms + 1,
                ..r.clone()
            },
        ] {
            assert!(matches!(
                changed.verify(),
                Err(EnrolmentError::BadSignature(_))
            ));
        }
        let bad = EnrolmentRequest {
            signature: "zz".into(),
            ..r
        };
        assert!(bad.verify().is_err());
    }

    #[test]
    fn a_rotation_needs_the_replaced_keys_signature() {
        let r = EnrolmentRequest::new("fed", "grey", &key(2), Some(&key(1)));
        assert_eq!(r.verify(), Ok(()));
        assert_eq!(r.previous, Some(key(1).public()));
        let unvouched = EnrolmentRequest {
            previous_signature: None,
            ..r.clone()
        };
        assert_eq!(unvouched.verify(), Err(EnrolmentError::Unvouched));
        // A thief's own key cannot stand in for the enrolled one.
        let forged = EnrolmentRequest::new("fed", "grey", &key(2), Some(&key(3)));
        let claimed = EnrolmentRequest {
            previous: Some(key(1).public()),
            ..forged
        };
        assert!(matches!(
            claimed.verify(),
            Err(EnrolmentError::BadSignature(_))
        ));
    }
}
