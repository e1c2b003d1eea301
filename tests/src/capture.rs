//! A loopback TCP proxy between the MQTT clients and the broker that records every PUBLISH
//! packet in both directions, parsed from the MQTT 3.1.1 byte stream: what the clients sent to
//! the broker, and what the broker delivered to each client. Unlike a `#` subscriber it cannot
//! miss a message, and it sees the bytes exactly as they crossed.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

/// One PUBLISH packet that crossed the proxy.
#[derive(Debug, Clone)]
pub struct Packet {
    /// True for client → broker, false for broker → client.
    pub to_broker: bool,
    /// The MQTT client id of the connection (from its CONNECT).
    pub client: String,
    /// Topic name.
    pub topic: String,
    /// The application payload.
    pub payload: Vec<u8>,
    /// Retain flag.
    pub retain: bool,
    /// DUP flag (a QoS 1 re-delivery).
    pub dup: bool,
}

/// The proxy: listens on `port`, forwards each connection to the broker's current port.
#[derive(Debug, Clone)]
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    upstream: Arc<AtomicU16>,
    packets: Arc<Mutex<Vec<Packet>>>,
}

impl Proxy {
    /// Starts a proxy on a free loopback port in front of the broker on `upstream`.
    pub fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let port = listener.local_addr().expect("proxy addr").port();
        let proxy = Proxy {
            port,
            upstream: Arc::new(AtomicU16::new(upstream)),
            packets: Arc::default(),
        };
        let p = proxy.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(broker) =
                    TcpStream::connect(("127.0.0.1", p.upstream.load(Ordering::SeqCst)))
                else {
                    // The broker is down: the client sees a refused connection.
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let id = Arc::new(Mutex::new(String::new()));
                for (from, to, to_broker) in [
                    (client.try_clone(), broker.try_clone(), true),
                    (broker.try_clone(), client.try_clone(), false),
                ] {
                    let (Ok(from), Ok(to)) = (from, to) else {
                        continue;
                    };
                    let (packets, id) = (p.packets.clone(), id.clone());
                    std::thread::spawn(move || pump(from, to, to_broker, &id, &packets));
                }
            }
        });
        proxy
    }

    /// Points new connections at the broker on `port` (after a broker restart elsewhere).
    pub fn set_upstream(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }

    /// Every PUBLISH recorded so far, in the order each direction saw them.
    pub fn packets(&self) -> Vec<Packet> {
        self.packets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Copies `from` to `to`, parsing packets on the way; closes both ends when either does.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    to_broker: bool,
    id: &Mutex<String>,
    packets: &Mutex<Vec<Packet>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some((len, packet)) = parse(&pending) {
            match packet {
                Parsed::Connect(client) => *id.lock().unwrap_or_else(|p| p.into_inner()) = client,
                Parsed::Publish {
                    topic,
                    payload,
                    retain,
                    dup,
                } => {
                    let client = id.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    packets
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Packet {
                            to_broker,
                            client,
                            topic,
                            payload,
                            retain,
                            dup,
                        });
                }
                Parsed::Other => {}
            }
            pending.drain(..len);
        }
        // Forward only after recording, so a packet seen by the receiver is already captured.
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

enum Parsed {
    Connect(String),
    Publish {
        topic: String,
        payload: Vec<u8>,
        retain: bool,
        dup: bool,
    },
    Other,
}

/// Parses one whole MQTT 3.1.1 packet at the start of `b`: its total length and content, or
/// `None` if more bytes are needed.
fn parse(b: &[u8]) -> Option<(usize, Parsed)> {
    let first = *b.first()?;
    let (mut len, mut mult, mut i) = (0usize, 1usize, 1usize);
    loop {
        let byte = *b.get(i)?;
        len += (byte & 0x7f) as usize * mult;
        mult *= 128;
        i += 1;
        if byte & 0x80 == 0 {
            break;
        }
    }
    let end = i + len;
    let body = b.get(i..end)?;
    let u16_at = |o: usize| -> usize { ((body[o] as usize) << 8) | body[o + 1] as usize };
    let parsed = match first >> 4 {
        1 => {
            // CONNECT: protocol name, level, flags, keep-alive, then the client id.
            let name = u16_at(0);
            let at = 2 + name + 4;
            let idl = u16_at(at);
            Parsed::Connect(String::from_utf8_lossy(&body[at + 2..at + 2 + idl]).into_owned())
        }
        3 => {
            let qos = (first >> 1) & 3;
            let tl = u16_at(0);
            let topic = String::from_utf8_lossy(&body[2..2 + tl]).into_owned();
            let start = 2 + tl + if qos > 0 { 2 } else { 0 };
            Parsed::Publish {
                topic,
                payload: body[start..].to_vec(),
                retain: first & 1 == 1,
                dup: first & 8 == 8,
            }
        }
        _ => Parsed::Other,
    };
    Some((end, parsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_qos1_publish_split_across_reads() {
        // PUBLISH, QoS 1, retain; topic "a/b"; packet id 7; payload "xyz".
        let pkt = [0x33, 10, 0, 3, b'a', b'/', b'b', 0, 7, b'x', b'y', b'z'];
        assert!(parse(&pkt[..5]).is_none());
        let (len, p) = parse(&pkt).unwrap();
        assert_eq!(len, pkt.len());
        let Parsed::Publish {
            topic,
            payload,
            retain,
            dup,
        } = p
        else {
            panic!("not a publish")
        };
        assert_eq!(
            (topic.as_str(), payload.as_slice(), retain, dup),
            ("a/b", &b"xyz"[..], true, false)
        );
    }

    #[test]
    fn parses_a_multi_byte_remaining_length() {
        let mut pkt = vec![
            0x30,
            0x80 | (203 % 128) as u8,
            (203 / 128) as u8,
            0,
            1,
            b't',
        ];
        pkt.extend(std::iter::repeat_n(9u8, 200));
        let (len, p) = parse(&pkt).unwrap();
        assert_eq!(len, 3 + 203);
        assert!(matches!(p, Parsed::Publish { payload, .. } if payload.len() == 200));
    }
}
