//! The envelope every message travels in: magic, protocol version and message kind in a fixed
//! header, then the sender's identity, round, model version, spec hash, run, payload and an
//! optional signature. postcard is not self-describing, so this header is what lets old and
//! new peers refuse each other's messages cleanly.

use crate::ids::{FederationId, RunId, SiteId};
use crate::spec::SpecHash;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The four bytes every envelope starts with.
pub const MAGIC: [u8; 4] = *b"UFED";

/// The protocol version this crate speaks; peers refuse envelopes of any other version.
/// Version 9 signs and identifies payloads with BLAKE3 where 8 used SHA-256; version 10 sends
/// a round model's chunks once for every site on the shared `chunks/model` topic, which a
/// version-9 site does not read; version 11 adds FedCD's objective and mask gradients; version
/// 12 adds the status a site sends once it holds the federation's final model; version 13
/// signs every message with the run of the federation it belongs to ([`RunId`]); version 14
/// adds FedImpro's objective and per-class feature statistics.
pub const PROTOCOL_VERSION: u16 = 14;

/// Bytes before the postcard body: magic, version and kind.
const HEADER_LEN: usize = 8;

/// What an envelope's payload is. Append-only: a discriminant, once used, never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum MessageKind {
    /// A [`crate::RoundManifest`].
    RoundManifest = 1,
    /// A [`crate::Chunk`] of the model payload.
    ModelChunk = 2,
    /// A [`crate::ChunkRequest`].
    ChunkRequest = 3,
    /// A [`crate::SiteUpdate`].
    SiteUpdate = 4,
    /// An [`crate::UpdateAnswer`].
    UpdateAnswer = 5,
    /// A [`crate::SiteStatus`].
    SiteStatus = 6,
    /// A [`crate::ServerBroadcast`].
    ServerBroadcast = 7,
    /// A [`crate::Chunk`] of a site update too large for one packet.
    UpdateChunk = 8,
    /// An [`crate::OnboardRequest`] (package description or registry entry wanted).
    OnboardRequest = 9,
    /// Reserved: BN contributions ride inside [`crate::SiteUpdate`]`::bn` (one per version,
    /// delivered as reliably as the update itself).
    BnContribution = 10,
    /// A [`crate::Chunk`] of a [`crate::RegistryEntry`] a site stores in the registry.
    RegistryPut = 11,
    /// A [`crate::Chunk`] of a [`crate::RegistryEntry`] the registry sends back.
    RegistryEntry = 12,
    /// An [`crate::OnboardReply`].
    OnboardReply = 13,
    /// An [`crate::UpdateReceipt`]: the aggregator holds one chunk of a site's update (the
    /// site's upload window moves on).
    UpdateReceipt = 14,
    /// A [`crate::ModelDelta`] (travels in [`MessageKind::ModelChunk`]s, like the model).
    ModelDelta = 15,
}

impl MessageKind {
    /// The kind with wire value `v`, or `None` if this version does not know it.
    pub fn from_u16(v: u16) -> Option<Self> {
        use MessageKind::*;
        Some(match v {
            1 => RoundManifest,
            2 => ModelChunk,
            3 => ChunkRequest,
            4 => SiteUpdate,
            5 => UpdateAnswer,
            6 => SiteStatus,
            7 => ServerBroadcast,
            8 => UpdateChunk,
            9 => OnboardRequest,
            10 => BnContribution,
            11 => RegistryPut,
            12 => RegistryEntry,
            13 => OnboardReply,
            14 => UpdateReceipt,
            15 => ModelDelta,
            _ => return None,
        })
    }

    /// The kind's wire value.
    pub fn as_u16(self) -> u16 {
        self as u16
    }
}

/// Why bytes are not a valid envelope (or a payload is not the type asked for).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the fixed header.
    #[error("message truncated: shorter than the 8-byte envelope header")]
    Truncated,
    /// The first four bytes are not [`MAGIC`].
    #[error("not a UniFed message: bad magic bytes")]
    BadMagic,
    /// The envelope speaks another protocol version.
    #[error("protocol version {0} is not supported (this peer speaks version {PROTOCOL_VERSION})")]
    UnsupportedVersion(u16),
    /// The message kind is unknown to this version.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// The postcard body (or payload) does not decode.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Bytes left over after the body (or payload).
    #[error("{0} unexpected bytes after the end of the message")]
    TrailingBytes(usize),
    /// The message is larger than the receiver accepts.
    #[error("message of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Size of the message.
        len: usize,
        /// The receiver's limit.
        limit: usize,
    },
}

/// A message on the wire: who sent what, for which round and model, plus the payload. Its
/// payload and signature are owned (`Vec<u8>`, the default) or slices of the received bytes
/// ([`EnvelopeRef`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<B = Vec<u8>> {
    /// What the payload is.
    pub kind: MessageKind,
    /// Federation the message belongs to.
    pub federation: FederationId,
    /// Site (or aggregator) that sent it.
    pub sender: SiteId,
    /// Round the message is about.
    pub round: u64,
    /// Model version the message is about.
    pub model_version: u64,
    /// Spec hash of the federation's model.
    pub spec_hash: SpecHash,
    /// The run of the federation the message belongs to (a site's: the run of the manifest it
    /// follows).
    pub run: RunId,
    /// The postcard-encoded payload, of the type `kind` names.
    pub payload: B,
    /// The sender's ed25519 signature over everything else (see [`crate::auth`]); receivers
    /// refuse a message without a valid one.
    pub signature: Option<B>,
}

/// An [`Envelope`] read in place: its payload and signature are slices of the received bytes.
/// What a receiver checks and routes, without copying a chunk-sized payload first.
pub type EnvelopeRef<'a> = Envelope<&'a [u8]>;

/// The envelope after its fixed header, as postcard writes it.
#[derive(Serialize)]
struct BodyRef<'a> {
    federation: &'a FederationId,
    sender: &'a SiteId,
    round: u64,
    model_version: u64,
    spec_hash: &'a SpecHash,
    run: RunId,
    #[serde(with = "serde_bytes")]
    payload: &'a [u8],
    signature: Option<&'a [u8]>,
}

/// [`MAGIC`], version and kind, in a buffer with room for a body around a payload of
/// `payload_len` bytes (and the signature appended later).
fn header(kind: MessageKind, payload_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + 160 + payload_len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&kind.as_u16().to_le_bytes());
    out
}

/// The envelope after its fixed header as it is read: payload and signature borrowed from the
/// bytes, so whether bytes are an envelope, and whether signed, is told without copying a large
/// payload. Its fields must be [`BodyRef`]'s, in the same order.
#[derive(Deserialize)]
struct Body<'a> {
    federation: FederationId,
    sender: SiteId,
    round: u64,
    model_version: u64,
    spec_hash: SpecHash,
    run: RunId,
    #[serde(with = "serde_bytes")]
    payload: &'a [u8],
    #[serde(borrow)]
    signature: Option<&'a [u8]>,
}

/// Whether `bytes` are a whole envelope of this version with an empty signature slot (as
/// [`Envelope::encode`] writes an unsigned one), read without copying the payload.
#[cfg(feature = "std")]
pub(crate) fn is_unsigned_encoding(bytes: &[u8]) -> bool {
    Envelope::peek_kind(bytes).is_some()
        && matches!(
            postcard::take_from_bytes::<Body>(&bytes[HEADER_LEN..]),
            Ok((Body { signature: None, .. }, rest)) if rest.is_empty()
        )
}

impl Envelope {
    /// An unsigned envelope around `payload`, postcard-encoded, of no run yet
    /// ([`Envelope::in_run`] sets it).
    ///
    /// # Panics
    /// If `payload`'s `Serialize` impl fails under postcard; derived impls of plain data (every
    /// message type of this crate) never do.
    pub fn new<T: Serialize>(
        kind: MessageKind,
        federation: FederationId,
        sender: SiteId,
        round: u64,
        model_version: u64,
        spec_hash: SpecHash,
        payload: &T,
    ) -> Envelope {
        Envelope {
            kind,
            federation,
            sender,
            round,
            model_version,
            spec_hash,
            run: RunId::default(),
            payload: postcard::to_allocvec(payload)
                .expect("postcard cannot fail on a derived Serialize of plain data"),
            signature: None,
        }
    }

    /// The envelope, of run `run`.
    pub fn in_run(mut self, run: RunId) -> Envelope {
        self.run = run;
        self
    }

    /// The unsigned wire bytes of the envelope [`Envelope::new`] would make with these fields,
    /// the payload serialised once, straight into them: the same bytes as
    /// `Envelope::new(..).encode()` without a second copy of a large payload (a site's update).
    pub fn encode_new<T: Serialize>(
        kind: MessageKind,
        federation: &FederationId,
        sender: &SiteId,
        at: (RunId, u64, u64),
        spec_hash: SpecHash,
        payload: &T,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        Self::append_new(&mut out, kind, federation, sender, at, spec_hash, payload);
        out
    }

    /// [`Envelope::encode_new`]'s bytes appended to `out` (which grows once, by their length):
    /// many envelopes written one after another into one buffer. `at` is the run, round and
    /// model version.
    pub fn append_new<T: Serialize>(
        out: &mut Vec<u8>,
        kind: MessageKind,
        federation: &FederationId,
        sender: &SiteId,
        at: (RunId, u64, u64),
        spec_hash: SpecHash,
        payload: &T,
    ) {
        const PLAIN: &str = "postcard cannot fail on a derived Serialize of plain data";
        let len = postcard::experimental::serialized_size(payload).expect(PLAIN);
        let written: Result<(), core::convert::Infallible> =
            Self::append_new_with(out, kind, federation, sender, at, spec_hash, len, |out| {
                *out = postcard::to_extend(payload, core::mem::take(out)).expect(PLAIN);
                Ok(())
            });
        let Ok(()) = written;
    }

    /// [`Envelope::append_new`] of a payload of `len` bytes that `write` appends itself (for
    /// one written from its sources as it goes rather than serialised from one value). `write`
    /// must append exactly `len` bytes; if it fails, `out` is left as it was.
    #[allow(clippy::too_many_arguments)]
    pub fn append_new_with<E>(
        out: &mut Vec<u8>,
        kind: MessageKind,
        federation: &FederationId,
        sender: &SiteId,
        (run, round, model_version): (RunId, u64, u64),
        spec_hash: SpecHash,
        len: usize,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<(), E> {
        const PLAIN: &str = "postcard cannot fail on a derived Serialize of plain data";
        let start = out.len();
        out.reserve(HEADER_LEN + 160 + len);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.extend_from_slice(&kind.as_u16().to_le_bytes());
        // The fields of `BodyRef` in order; the payload as its byte string: length, then bytes.
        let head = (
            federation,
            sender,
            round,
            model_version,
            &spec_hash,
            run,
            len,
        );
        *out = postcard::to_extend(&head, core::mem::take(out)).expect(PLAIN);
        let at = out.len();
        if let Err(e) = write(out) {
            out.truncate(start);
            return Err(e);
        }
        assert_eq!(
            out.len() - at,
            len,
            "the payload's writer wrote another length"
        );
        *out = postcard::to_extend(&None::<&[u8]>, core::mem::take(out)).expect(PLAIN);
        Ok(())
    }

    /// The wire bytes: [`MAGIC`], version and kind as little-endian `u16`, then the postcard
    /// body.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with(self.signature.as_deref())
    }

    /// The wire bytes with an empty signature slot: what a signature covers.
    #[cfg(feature = "std")]
    pub(crate) fn encode_unsigned(&self) -> Vec<u8> {
        self.encode_with(None)
    }

    fn encode_with(&self, signature: Option<&[u8]>) -> Vec<u8> {
        let out = header(self.kind, self.payload.len());
        let body = BodyRef {
            federation: &self.federation,
            sender: &self.sender,
            round: self.round,
            model_version: self.model_version,
            spec_hash: &self.spec_hash,
            run: self.run,
            payload: &self.payload,
            signature,
        };
        postcard::to_extend(&body, out)
            .expect("postcard cannot fail on ids, integers and byte strings")
    }

    /// Parses wire bytes, checking in order: length, magic, version, kind, body, trailing bytes.
    pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
        EnvelopeRef::read(bytes).map(EnvelopeRef::into_owned)
    }

    /// The kind named in the fixed header of `bytes`, if they start with this version's
    /// header: enough to route a message before it is decoded and its signature checked.
    pub fn peek_kind(bytes: &[u8]) -> Option<MessageKind> {
        if bytes.len() < HEADER_LEN
            || bytes[..4] != MAGIC
            || bytes[4..6] != PROTOCOL_VERSION.to_le_bytes()
        {
            return None;
        }
        MessageKind::from_u16(u16::from_le_bytes([bytes[6], bytes[7]]))
    }

    /// Like [`Envelope::decode`], but refuses inputs longer than `limit` bytes before parsing.
    pub fn decode_limited(bytes: &[u8], limit: usize) -> Result<Envelope, DecodeError> {
        if bytes.len() > limit {
            return Err(DecodeError::TooLarge {
                len: bytes.len(),
                limit,
            });
        }
        Envelope::decode(bytes)
    }

    /// Decodes the payload as a `T`; the whole payload must be consumed.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        take_exact(&self.payload)
    }
}

impl<'a> EnvelopeRef<'a> {
    /// Parses wire bytes like [`Envelope::decode`], borrowing the payload and signature.
    pub fn read(bytes: &'a [u8]) -> Result<EnvelopeRef<'a>, DecodeError> {
        if bytes.len() < HEADER_LEN {
            return Err(DecodeError::Truncated);
        }
        if bytes[..4] != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let raw_kind = u16::from_le_bytes([bytes[6], bytes[7]]);
        let kind = MessageKind::from_u16(raw_kind).ok_or(DecodeError::UnknownKind(raw_kind))?;
        let body: Body = take_exact(&bytes[HEADER_LEN..])?;
        Ok(EnvelopeRef {
            kind,
            federation: body.federation,
            sender: body.sender,
            round: body.round,
            model_version: body.model_version,
            spec_hash: body.spec_hash,
            run: body.run,
            payload: body.payload,
            signature: body.signature,
        })
    }

    /// Decodes the payload as a `T`, which may borrow from it (a [`crate::ChunkRef`]); the
    /// whole payload must be consumed.
    pub fn payload_as<T: Deserialize<'a>>(&self) -> Result<T, DecodeError> {
        take_exact(self.payload)
    }

    /// The envelope with its payload and signature copied out of the received bytes.
    pub fn into_owned(self) -> Envelope {
        Envelope {
            kind: self.kind,
            federation: self.federation,
            sender: self.sender,
            round: self.round,
            model_version: self.model_version,
            spec_hash: self.spec_hash,
            run: self.run,
            payload: self.payload.to_vec(),
            signature: self.signature.map(<[u8]>::to_vec),
        }
    }
}

/// postcard-decodes a `T` that must use every byte of `bytes`.
fn take_exact<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, DecodeError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Id;
    use crate::messages::{ChunkRequest, Payload, SiteState, SiteStatus};
    use alloc::format;
    use alloc::vec;

    fn envelope() -> Envelope {
        Envelope::new(
            MessageKind::ChunkRequest,
            Id::new("fed-1").unwrap(),
            Id::new("site.a").unwrap(),
            3,
            7,
            SpecHash([0xab; 32]),
            &ChunkRequest {
                model_version: 7,
                indices: vec![1, 5, 9],
                payload: Payload::Model,
                alone: false,
            },
        )
    }

    #[test]
    fn an_envelope_survives_a_round_trip() {
        let e = envelope();
        let bytes = e.encode();
        assert_eq!(&bytes[..4], b"UFED");
        assert_eq!(bytes[4..6], PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(bytes[6..8], 3u16.to_le_bytes());
        assert_eq!(Envelope::decode(&bytes), Ok(e.clone()));
        let req: ChunkRequest = e.payload_as().unwrap();
        assert_eq!(req.indices, vec![1, 5, 9]);

        let mut signed = e;
        signed.signature = Some(vec![9; 64]);
        assert_eq!(Envelope::decode(&signed.encode()), Ok(signed));
    }

    #[test]
    fn the_kind_is_read_from_the_header_alone() {
        let bytes = envelope().encode();
        assert_eq!(Envelope::peek_kind(&bytes), Some(MessageKind::ChunkRequest));
        assert_eq!(
            Envelope::peek_kind(&bytes[..HEADER_LEN]),
            Some(MessageKind::ChunkRequest)
        );
        assert_eq!(Envelope::peek_kind(&bytes[..HEADER_LEN - 1]), None);
        let mut old = bytes.clone();
        old[4..6].copy_from_slice(&(PROTOCOL_VERSION - 1).to_le_bytes());
        assert_eq!(Envelope::peek_kind(&old), None);
        let mut unknown = bytes;
        unknown[6..8].copy_from_slice(&99u16.to_le_bytes());
        assert_eq!(Envelope::peek_kind(&unknown), None);
    }

    #[test]
    fn every_kind_round_trips_through_its_wire_value() {
        for v in 0..=20u16 {
            match MessageKind::from_u16(v) {
                Some(k) => assert_eq!(k.as_u16(), v),
                None => assert!(v == 0 || v > 14),
            }
        }
        assert_eq!(MessageKind::OnboardReply.as_u16(), 13);
        assert_eq!(MessageKind::SiteUpdate.as_u16(), 4);
    }

    #[test]
    fn short_input_is_truncated() {
        let bytes = envelope().encode();
        for n in 0..HEADER_LEN {
            assert_eq!(Envelope::decode(&bytes[..n]), Err(DecodeError::Truncated));
        }
    }

    #[test]
    fn wrong_magic_is_refused() {
        let mut bytes = envelope().encode();
        bytes[0] = b'X';
        assert_eq!(Envelope::decode(&bytes), Err(DecodeError::BadMagic));
    }

    #[test]
    fn encoding_a_new_envelope_in_one_pass_gives_the_same_bytes() {
        for payload in [vec![], vec![7u8; 3], vec![1u8; 300], vec![2u8; 70_000]] {
            let e = Envelope::new(
                MessageKind::SiteUpdate,
                Id::new("fed-1").unwrap(),
                Id::new("site.a").unwrap(),
                3,
                7,
                SpecHash([0xab; 32]),
                &(payload.clone(), 5u64, "x"),
            )
            .in_run(RunId {
                created_ms: 1_795_000_000_000,
                nonce: u64::MAX - 3,
            });
            let direct = Envelope::encode_new(
                MessageKind::SiteUpdate,
                &e.federation,
                &e.sender,
                (e.run, 3, 7),
                SpecHash([0xab; 32]),
                &(payload, 5u64, "x"),
            );
            assert_eq!(direct, e.encode());
        }
    }

    #[test]
    fn a_message_from_another_protocol_version_is_refused_cleanly() {
        // Version 1 had no typed plans and reports, version 2 no control variates, version 3
        // no signatures, version 4 no model deltas, version 5 no MOON, FedDC or Per-FedAvg
        // objectives, version 6 no announced upload window, version 7 no ternary block size,
        // version 8 signed and hashed with SHA-256, version 9 sent every site its own copy of
        // the model's chunks, version 10 had no FedCD, version 11 no final status of a site,
        // version 12 no run, version 13 no FedImpro: all are refused by a version 14 peer, as is
        // a future version 15.
        for other in [1u16, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15] {
            let mut bytes = envelope().encode();
            bytes[4..6].copy_from_slice(&other.to_le_bytes());
            let err = Envelope::decode(&bytes).unwrap_err();
            assert_eq!(err, DecodeError::UnsupportedVersion(other));
            assert_eq!(
                err.to_string(),
                format!("protocol version {other} is not supported (this peer speaks version 14)")
            );
        }
    }

    #[test]
    fn an_unknown_kind_is_refused_cleanly() {
        let mut bytes = envelope().encode();
        bytes[6..8].copy_from_slice(&99u16.to_le_bytes());
        assert_eq!(Envelope::decode(&bytes), Err(DecodeError::UnknownKind(99)));
        bytes[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(Envelope::decode(&bytes), Err(DecodeError::UnknownKind(0)));
    }

    #[test]
    fn a_truncated_body_is_malformed() {
        let bytes = envelope().encode();
        for n in HEADER_LEN..bytes.len() {
            assert!(
                matches!(
                    Envelope::decode(&bytes[..n]),
                    Err(DecodeError::Malformed(_))
                ),
                "cut at {n}"
            );
        }
    }

    #[test]
    fn an_invalid_sender_id_is_malformed() {
        let e = envelope();
        let mut bytes = e.encode();
        // The federation id `fed-1` starts right after the header, behind its length byte.
        assert_eq!(&bytes[9..14], b"fed-1");
        bytes[10] = b'+';
        assert!(matches!(
            Envelope::decode(&bytes),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn bytes_after_the_body_are_refused() {
        let mut bytes = envelope().encode();
        bytes.extend_from_slice(&[0, 0, 0]);
        assert_eq!(Envelope::decode(&bytes), Err(DecodeError::TrailingBytes(3)));
    }

    #[test]
    fn an_oversized_message_is_refused_before_parsing() {
        let bytes = envelope().encode();
        let len = bytes.len();
        assert_eq!(
            Envelope::decode_limited(&bytes, len - 1),
            Err(DecodeError::TooLarge {
                len,
                limit: len - 1
            })
        );
        assert!(Envelope::decode_limited(&bytes, len).is_ok());
        // The limit wins even over garbage.
        assert!(matches!(
            Envelope::decode_limited(&[0; 100], 10),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_payload_claiming_two_to_the_sixty_bytes_fails_without_allocating_them() {
        let e = envelope();
        let mut bytes = Vec::from(&e.encode()[..HEADER_LEN]);
        let body = BodyRef {
            federation: &e.federation,
            sender: &e.sender,
            round: 1,
            model_version: 1,
            spec_hash: &e.spec_hash,
            run: e.run,
            payload: &[],
            signature: None,
        };
        let mut encoded = postcard::to_allocvec(&body).unwrap();
        // Drop the empty payload's length and the signature tag; claim 2^60 payload bytes.
        encoded.truncate(encoded.len() - 2);
        bytes.extend_from_slice(&encoded);
        let mut claim = 1u64 << 60;
        while claim >= 0x80 {
            bytes.push((claim as u8) | 0x80);
            claim >>= 7;
        }
        bytes.push(claim as u8);
        bytes.extend_from_slice(&[1, 2, 3]);
        assert!(matches!(
            Envelope::decode(&bytes),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn a_payload_of_the_wrong_type_or_with_extra_bytes_is_refused() {
        let e = Envelope::new(
            MessageKind::SiteStatus,
            Id::new("f").unwrap(),
            Id::new("s").unwrap(),
            0,
            0,
            SpecHash([0; 32]),
            &SiteStatus {
                state: SiteState::Online,
                detail: "ok".into(),
            },
        );
        assert!(e.payload_as::<SiteStatus>().is_ok());
        assert!(matches!(
            e.payload_as::<crate::messages::RoundManifest>(),
            Err(DecodeError::Malformed(_))
        ));
        let mut extra = e.clone();
        extra.payload.push(0);
        assert_eq!(
            extra.payload_as::<SiteStatus>(),
            Err(DecodeError::TrailingBytes(1))
        );
    }
}
