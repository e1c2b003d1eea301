//! Access control on the embedded broker's mutual-TLS port, the policy the generated Mosquitto
//! ACL states: a client is known by its certificate's common name (a site id, or `aggregator`);
//! the aggregator uses every federation's namespace, and a site publishes only its own update,
//! status, chunk-request and onboarding-request topics and subscribes only to its own answers,
//! chunk and onboarding replies, the manifest and the model chunks sent to every site. Its MQTT
//! client id must be one of its own (so no one takes over another's session). The TLS front
//! reads each MQTT 3.1.1 packet's header as it relays it ([`guard`]) and closes the connection
//! at the first packet the identity may not send; the payloads pass unread.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The longest CONNECT or SUBSCRIBE packet read whole (they carry ids and filters only).
const MAX_CONTROL_PACKET: usize = 64 << 10;

/// Who a client is, by its certificate's common name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The aggregator (common name `aggregator`).
    Aggregator,
    /// A site, by its id.
    Site(String),
}

/// Why a client's connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum Denied {
    /// A packet the identity may not send.
    #[error("{0}")]
    Policy(String),
    /// The stream is not MQTT 3.1.1 as the policy reads it.
    #[error("malformed MQTT: {0}")]
    Malformed(String),
    /// Reading or writing failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Identity {
    /// The identity of a certificate's common name.
    pub fn from_common_name(cn: &str) -> Identity {
        if cn == "aggregator" {
            Identity::Aggregator
        } else {
            Identity::Site(cn.to_string())
        }
    }

    /// Whether the client may use MQTT client id `id`: the aggregator's are
    /// `unifed-aggregator-<federation>`; a site's are its id, `unifed-agent-<site>` and
    /// `unifed-onboard-<site>-<digits>`.
    pub fn may_use_client_id(&self, id: &str) -> bool {
        match self {
            Identity::Aggregator => id == "aggregator" || id.starts_with("unifed-aggregator-"),
            Identity::Site(s) => {
                id == s
                    || id.strip_prefix("unifed-agent-") == Some(s)
                    || id
                        .strip_prefix("unifed-onboard-")
                        .and_then(|r| r.strip_prefix(s.as_str()))
                        .and_then(|r| r.strip_prefix('-'))
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            }
        }
    }

    /// Whether the client may publish on `topic`.
    pub fn may_publish(&self, topic: &str) -> bool {
        match self {
            Identity::Aggregator => in_namespace(topic).is_some(),
            Identity::Site(s) => in_namespace(topic).is_some_and(|rest| {
                ["update", "status", "chunks/request", "onboard/request"]
                    .iter()
                    .any(|k| rest.strip_prefix(k).and_then(|r| r.strip_prefix('/')) == Some(s))
            }),
        }
    }

    /// Whether the client may subscribe to `filter`.
    pub fn may_subscribe(&self, filter: &str) -> bool {
        match self {
            Identity::Aggregator => {
                filter.starts_with("unifed/v1/") && !filter["unifed/v1/".len()..].starts_with('#')
            }
            Identity::Site(s) => in_namespace(filter).is_some_and(|rest| {
                rest == "manifest"
                    || rest == "chunks/model"
                    || ["ack", "chunks/reply", "onboard/reply"]
                        .iter()
                        .any(|k| rest.strip_prefix(k).and_then(|r| r.strip_prefix('/')) == Some(s))
            }),
        }
    }
}

/// The part of `topic` after `unifed/v1/<federation>/`, when the federation is one literal
/// level (no wildcard) and nothing after it is a wildcard either.
fn in_namespace(topic: &str) -> Option<&str> {
    let rest = topic.strip_prefix("unifed/v1/")?;
    let (fed, rest) = rest.split_once('/')?;
    let literal = |s: &str| !s.is_empty() && !s.contains(['+', '#']);
    (literal(fed) && literal(rest)).then_some(rest)
}

/// Relays MQTT 3.1.1 packets from `from` (a client of identity `who`) to `to`, reading each
/// packet's header, and stops at the first the identity may not send: a CONNECT of another
/// protocol level or a client id not its own, a PUBLISH on a topic it may not write, a
/// SUBSCRIBE to a filter it may not read. The first packet must be a CONNECT. Returns at the
/// end of the client's stream.
pub async fn guard<R, W>(mut from: R, mut to: W, who: &Identity) -> Result<(), Denied>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut first = true;
    loop {
        let b0 = match from.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let (len, len_bytes) = remaining_length(&mut from).await?;
        let kind = b0 >> 4;
        if first && kind != 1 {
            return Err(Denied::Malformed(
                "the first packet is not a CONNECT".into(),
            ));
        }
        first = false;
        let mut head = vec![b0];
        head.extend_from_slice(&len_bytes);
        let copied = match kind {
            1 | 8 => {
                if len > MAX_CONTROL_PACKET {
                    return Err(Denied::Malformed(format!(
                        "a control packet of {len} bytes"
                    )));
                }
                let mut body = vec![0u8; len];
                from.read_exact(&mut body).await?;
                if kind == 1 {
                    check_connect(&body, who)?;
                } else {
                    check_subscribe(&body, who)?;
                }
                head.extend_from_slice(&body);
                len
            }
            3 => {
                let n = usize::from(from.read_u16().await?);
                if n + 2 > len {
                    return Err(Denied::Malformed("a topic longer than its packet".into()));
                }
                let mut topic = vec![0u8; n];
                from.read_exact(&mut topic).await?;
                let topic = String::from_utf8(topic)
                    .map_err(|_| Denied::Malformed("a topic that is not UTF-8".into()))?;
                if !who.may_publish(&topic) {
                    return Err(Denied::Policy(format!("may not publish on `{topic}`")));
                }
                head.extend_from_slice(&(n as u16).to_be_bytes());
                head.extend_from_slice(topic.as_bytes());
                n + 2
            }
            _ => 0,
        };
        to.write_all(&head).await?;
        let rest = (len - copied) as u64;
        let moved = tokio::io::copy(&mut (&mut from).take(rest), &mut to).await?;
        if moved != rest {
            return Ok(());
        }
    }
}

/// Reads an MQTT remaining length (1 to 4 bytes): the value and its bytes.
async fn remaining_length<R: AsyncRead + Unpin>(r: &mut R) -> Result<(usize, Vec<u8>), Denied> {
    let mut value = 0usize;
    let mut bytes = Vec::with_capacity(4);
    for i in 0..4 {
        let b = r.read_u8().await?;
        bytes.push(b);
        value |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok((value, bytes));
        }
    }
    Err(Denied::Malformed(
        "a remaining length of more than 4 bytes".into(),
    ))
}

/// A length-prefixed UTF-8 string at `at` of `b`, and where it ends.
fn string_at(b: &[u8], at: usize) -> Result<(&str, usize), Denied> {
    let bad = || Denied::Malformed("a string runs past its packet".into());
    let n = b.get(at..at + 2).ok_or_else(bad)?;
    let end = at + 2 + usize::from(u16::from_be_bytes([n[0], n[1]]));
    let s = b.get(at + 2..end).ok_or_else(bad)?;
    let s = std::str::from_utf8(s)
        .map_err(|_| Denied::Malformed("a string that is not UTF-8".into()))?;
    Ok((s, end))
}

/// Checks a CONNECT's body: MQTT 3.1.1 (level 4) and a client id the identity may use.
fn check_connect(body: &[u8], who: &Identity) -> Result<(), Denied> {
    let (name, at) = string_at(body, 0)?;
    let level = *body
        .get(at)
        .ok_or_else(|| Denied::Malformed("a short CONNECT".into()))?;
    if name != "MQTT" || level != 4 {
        return Err(Denied::Policy(format!(
            "protocol `{name}` level {level}, not MQTT 3.1.1"
        )));
    }
    // Level, flags and keep-alive, then the client id.
    let (id, _) = string_at(body, at + 4)?;
    if !who.may_use_client_id(id) {
        return Err(Denied::Policy(format!("may not use client id `{id}`")));
    }
    Ok(())
}

/// Checks a SUBSCRIBE's body: every filter one the identity may read.
fn check_subscribe(body: &[u8], who: &Identity) -> Result<(), Denied> {
    let mut at = 2;
    while at < body.len() {
        let (filter, end) = string_at(body, at)?;
        if !who.may_subscribe(filter) {
            return Err(Denied::Policy(format!("may not subscribe to `{filter}`")));
        }
        at = end + 1;
    }
    Ok(())
}

/// The common name of a DER certificate's subject (the last one, if it has several), read by
/// a minimal DER walk: Certificate, TBSCertificate, then past the version, serial, signature
/// algorithm, issuer and validity to the subject's attributes.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert, _) = tlv(der)?;
    let (_, mut tbs, _) = tlv(cert)?;
    let mut fields = Vec::new();
    while !tbs.is_empty() {
        let (tag, value, rest) = tlv(tbs)?;
        fields.push((tag, value));
        tbs = rest;
    }
    // Skip the explicit version ([0]) when present: serial, signature, issuer, validity, subject.
    let start = usize::from(fields.first()?.0 == 0xa0);
    let (tag, mut subject) = *fields.get(start + 4)?;
    if tag != 0x30 {
        return None;
    }
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    let mut found = None;
    while !subject.is_empty() {
        let (_, mut set, rest) = tlv(subject)?;
        subject = rest;
        while !set.is_empty() {
            let (_, attr, more) = tlv(set)?;
            set = more;
            let (_, oid, value) = tlv(attr)?;
            if oid == CN {
                let (_, v, _) = tlv(value)?;
                found = Some(String::from_utf8(v.to_vec()).ok()?);
            }
        }
    }
    found
}

/// One DER TLV at the start of `b`: its tag, its value and the bytes after it.
fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *b.first()?;
    let first = *b.get(1)?;
    let (len, at) = if first & 0x80 == 0 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for k in 0..n {
            len = (len << 8) | usize::from(*b.get(2 + k)?);
        }
        (len, 2 + n)
    };
    let end = at.checked_add(len)?;
    Some((tag, b.get(at..end)?, b.get(end..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site() -> Identity {
        Identity::from_common_name("grey")
    }

    #[test]
    fn a_site_uses_its_own_topics_and_client_ids_only() {
        let s = site();
        for t in ["update", "status", "chunks/request", "onboard/request"] {
            assert!(s.may_publish(&format!("unifed/v1/demo/{t}/grey")), "{t}");
            assert!(
                !s.may_publish(&format!("unifed/v1/demo/{t}/texture")),
                "{t}"
            );
            assert!(!s.may_publish(&format!("unifed/v1/demo/{t}/grey-2")), "{t}");
        }
        for t in ["manifest", "chunks/model", "ack/grey", "update/grey"] {
            assert_eq!(
                s.may_subscribe(&format!("unifed/v1/demo/{t}")),
                t != "update/grey",
                "{t}"
            );
        }
        for f in [
            "unifed/v1/demo/ack/texture",
            "unifed/v1/demo/update/+",
            "unifed/v1/+/manifest",
            "unifed/v1/demo/#",
            "#",
        ] {
            assert!(!s.may_subscribe(f), "{f}");
        }
        assert!(!s.may_publish("unifed/v1/demo/manifest"));
        assert!(!s.may_publish("unifed/v1/demo/chunks/model"));
        for id in ["grey", "unifed-agent-grey", "unifed-onboard-grey-123"] {
            assert!(s.may_use_client_id(id), "{id}");
        }
        for id in [
            "unifed-agent-texture",
            "unifed-aggregator-demo",
            "unifed-onboard-grey-2-123",
            "unifed-onboard-grey-",
            "probe",
        ] {
            assert!(!s.may_use_client_id(id), "{id}");
        }
        let a = Identity::from_common_name("aggregator");
        assert!(a.may_subscribe("unifed/v1/demo/update/+"));
        assert!(a.may_publish("unifed/v1/demo/manifest"));
        assert!(!a.may_subscribe("#") && !a.may_subscribe("unifed/v1/#"));
        assert!(a.may_use_client_id("unifed-aggregator-demo"));
        assert!(!a.may_use_client_id("unifed-agent-grey"));
    }

    fn packet(kind: u8, flags: u8, body: &[u8]) -> Vec<u8> {
        let mut p = vec![(kind << 4) | flags];
        let mut n = body.len();
        loop {
            let mut b = (n % 128) as u8;
            n /= 128;
            if n > 0 {
                b |= 0x80;
            }
            p.push(b);
            if n == 0 {
                break;
            }
        }
        p.extend_from_slice(body);
        p
    }

    fn string(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    fn connect(id: &str) -> Vec<u8> {
        let mut b = string("MQTT");
        b.extend_from_slice(&[4, 2, 0, 60]);
        b.extend_from_slice(&string(id));
        packet(1, 0, &b)
    }

    fn publish(topic: &str, payload: &[u8]) -> Vec<u8> {
        let mut b = string(topic);
        b.extend_from_slice(payload);
        packet(3, 0, &b)
    }

    fn subscribe(filter: &str) -> Vec<u8> {
        let mut b = vec![0, 1];
        b.extend_from_slice(&string(filter));
        b.push(1);
        packet(8, 2, &b)
    }

    /// What `guard` forwards of `input` for `who`, and how it ended.
    fn relay(input: Vec<u8>, who: &Identity) -> (Vec<u8>, Result<(), String>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut out = Vec::new();
            let r = guard(&input[..], &mut out, who)
                .await
                .map_err(|e| e.to_string());
            (out, r)
        })
    }

    #[test]
    fn the_guard_forwards_allowed_packets_byte_for_byte_and_stops_at_the_first_denied() {
        let big = vec![7u8; 300_000];
        let ok: Vec<u8> = [
            connect("unifed-agent-grey"),
            subscribe("unifed/v1/demo/manifest"),
            publish("unifed/v1/demo/update/grey", &big),
            packet(12, 0, &[]),
        ]
        .concat();
        let (out, r) = relay(ok.clone(), &site());
        assert_eq!((out == ok, r), (true, Ok(())));
        for (bad, why) in [
            (connect("unifed-agent-texture"), "may not use client id"),
            (
                [connect("grey"), subscribe("unifed/v1/demo/update/+")].concat(),
                "may not subscribe",
            ),
            (
                [
                    connect("grey"),
                    publish("unifed/v1/demo/update/texture", &big),
                ]
                .concat(),
                "may not publish",
            ),
            (publish("unifed/v1/demo/update/grey", b"x"), "not a CONNECT"),
        ] {
            let (out, r) = relay(bad.clone(), &site());
            let err = r.unwrap_err();
            assert!(err.contains(why), "{err}");
            assert!(out.len() < bad.len(), "the denied packet was not forwarded");
        }
    }
}
