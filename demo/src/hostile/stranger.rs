//! The stranger: a broker login and no key. It records everything on the broker during the
//! clean run, and during the attacked run replays all of it (the earlier run's manifests,
//! retained, and its uploads: item 3) and everything it hears again a while later (uploads of
//! earlier rounds and manifests: items 3 and 4), at a bounded rate, while it holds silent TCP
//! connections open to the broker (item 7).

use super::Shared;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unifed_net::{BrokerConfig, Client, NetEvent, Qos};
use unifed_protocol::ids::Id;
use unifed_protocol::topics::Topics;

/// Messages heard on the broker: every one up to `budget` bytes in all (small ones are kept
/// past it, up to as many bytes again).
#[derive(Debug, Default)]
pub struct Heard {
    /// Topic and payload, in the order heard.
    pub messages: Vec<(String, Bytes)>,
    /// Their bytes.
    pub bytes: usize,
}

impl Heard {
    fn keep(&mut self, topic: String, payload: Bytes, budget: usize) {
        let small = payload.len() <= 4096;
        if self.bytes + payload.len() <= budget || (small && self.bytes < 2 * budget) {
            self.bytes += payload.len();
            self.messages.push((topic, payload));
        }
    }
}

/// Bytes of the clean run a recorder keeps.
const RECORD_BYTES: usize = 512 << 20;
/// Bytes of the attacked run heard and not yet replayed that the stranger keeps.
const LIVE_BYTES: usize = 256 << 20;
/// How long the stranger waits before it replays what it heard: past the round it was sent in.
const REPLAY_AFTER: Duration = Duration::from_secs(20);

/// Records everything on the broker of `broker` until `stop` turns true.
pub async fn record(
    broker: BrokerConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Heard> {
    let options = broker
        .options("stranger-recorder", None)
        .map_err(anyhow::Error::msg)?;
    let (client, mut rx) = unifed_net::spawn_event_loop(options, vec!["#".into()]);
    let mut heard = Heard::default();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            ev = rx.recv() => match ev {
                None => break,
                Some(NetEvent::Message { topic, payload }) => heard.keep(topic, payload, RECORD_BYTES),
                Some(_) => {}
            },
        }
    }
    let _ = client.disconnect().await;
    Ok(heard)
}

/// How fast the stranger replays.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    /// Messages a second.
    pub messages: u32,
    /// Bytes a second.
    pub bytes: u64,
}

/// A budget refilled every tick.
struct Bucket {
    rate: Rate,
    messages: f64,
    bytes: f64,
}

impl Bucket {
    fn refill(&mut self, seconds: f64) {
        self.messages = (self.messages + seconds * f64::from(self.rate.messages))
            .min(f64::from(self.rate.messages));
        self.bytes = (self.bytes + seconds * self.rate.bytes as f64).min(self.rate.bytes as f64);
    }

    fn take(&mut self, len: usize) -> bool {
        if self.messages < 1.0 || self.bytes < len as f64 {
            return false;
        }
        self.messages -= 1.0;
        self.bytes -= len as f64;
        true
    }
}

/// Replays `earlier` (the clean run) and what it hears, at `rate`, and holds `silent` idle
/// TCP connections to the broker, until `stop` turns true.
pub async fn replay(
    broker: BrokerConfig,
    (federation, earlier, rate, silent): (Id, Heard, Rate, usize),
    shared: Arc<Mutex<Shared>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let options = broker
        .options("stranger-replayer", None)
        .map_err(anyhow::Error::msg)?;
    let (client, mut rx) = unifed_net::spawn_event_loop(options, vec!["#".into()]);
    let manifest = Topics::new(&federation).manifest();
    // The earlier run's last manifest, retained: what wedged every agent (item 3).
    let last_manifest = earlier
        .messages
        .iter()
        .rev()
        .find(|(t, _)| *t == manifest)
        .map(|(_, p)| p.clone());
    let mut live: VecDeque<(Instant, String, Bytes)> = VecDeque::new();
    let mut live_bytes = 0usize;
    let mut next_earlier = 0usize;
    let mut bucket = Bucket {
        rate,
        messages: 0.0,
        bytes: 0.0,
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut connections = Silent::new(&broker, silent);
    let mut last_wedge: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            ev = rx.recv() => match ev {
                None => break,
                Some(NetEvent::Message { topic, payload }) => {
                    if live_bytes + payload.len() <= LIVE_BYTES {
                        live_bytes += payload.len();
                        live.push_back((Instant::now(), topic, payload));
                    }
                }
                Some(_) => {}
            },
            _ = tick.tick() => {
                bucket.refill(0.1);
                let opened = connections.hold();
                super::tally(&shared, |t| t.silent_connections += opened);
                if let Some(m) = &last_manifest
                    && last_wedge.is_none_or(|t| t.elapsed() > Duration::from_secs(10))
                {
                    last_wedge = Some(Instant::now());
                    let sent = publish(&client, &manifest, true, m.clone()).await;
                    super::tally(&shared, |t| t.earlier_run_manifests += u64::from(sent));
                }
                // Alternately the earlier run's messages, in a cycle, and what was heard here
                // at least REPLAY_AFTER ago.
                loop {
                    let due = live.front().is_some_and(|(t, _, _)| t.elapsed() >= REPLAY_AFTER);
                    let from_earlier = !earlier.messages.is_empty() && (!due || next_earlier.is_multiple_of(2));
                    if from_earlier {
                        let (topic, payload) = &earlier.messages[next_earlier % earlier.messages.len()];
                        if !bucket.take(payload.len()) {
                            break;
                        }
                        next_earlier += 1;
                        let sent = publish(&client, topic, false, payload.clone()).await;
                        super::tally(&shared, |t| t.earlier_run_replays += u64::from(sent));
                    } else if due {
                        let len = live.front().map_or(0, |(_, _, p)| p.len());
                        if !bucket.take(len) {
                            break;
                        }
                        let (_, topic, payload) = live.pop_front().expect("due");
                        live_bytes -= payload.len();
                        // An earlier manifest goes back retained, as the aggregator sent it.
                        let retain = topic == manifest;
                        let sent = publish(&client, &topic, retain, payload).await;
                        super::tally(&shared, |t| t.this_run_replays += u64::from(sent));
                    } else {
                        break;
                    }
                }
            }
        }
    }
    let _ = client.disconnect().await;
    Ok(())
}

/// Publishes at QoS 1; whether the client took it.
async fn publish(client: &Client, topic: &str, retain: bool, payload: Bytes) -> bool {
    client
        .publish(topic, Qos::AtLeastOnce, retain, payload.to_vec())
        .await
        .is_ok()
}

/// TCP connections to the broker that never send a byte, renewed every five seconds (the
/// broker may close an idle one; a new one takes its place).
struct Silent {
    address: String,
    count: usize,
    held: Vec<std::net::TcpStream>,
    since: Option<Instant>,
}

impl Silent {
    fn new(broker: &BrokerConfig, count: usize) -> Silent {
        Silent {
            address: format!("{}:{}", broker.host, broker.port),
            count,
            held: Vec::new(),
            since: None,
        }
    }

    /// Renews the connections when due; how many it opened.
    fn hold(&mut self) -> u64 {
        if self
            .since
            .is_some_and(|t| t.elapsed() < Duration::from_secs(5))
        {
            return 0;
        }
        self.since = Some(Instant::now());
        self.held.clear();
        for _ in 0..self.count {
            if let Ok(s) = std::net::TcpStream::connect(&self.address) {
                self.held.push(s);
            }
        }
        self.held.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replay budget holds a second's worth at most, by messages and by bytes.
    #[test]
    fn the_bucket_gives_a_second_of_messages_and_bytes_at_most() {
        let mut b = Bucket {
            rate: Rate {
                messages: 10,
                bytes: 1000,
            },
            messages: 0.0,
            bytes: 0.0,
        };
        assert!(!b.take(1));
        b.refill(5.0);
        let taken = (0..20).filter(|_| b.take(10)).count();
        assert_eq!(taken, 10);
        b.refill(5.0);
        assert!(!b.take(1001));
        assert!(b.take(600) && !b.take(600));
    }

    /// Past its budget a recording keeps small messages only, up to as many bytes again.
    #[test]
    fn a_recording_keeps_large_messages_within_its_budget_and_small_ones_past_it() {
        let mut h = Heard::default();
        for _ in 0..3 {
            h.keep("t".into(), Bytes::from(vec![0u8; 6000]), 10_000);
        }
        assert_eq!(h.messages.len(), 1);
        for _ in 0..4 {
            h.keep("t".into(), Bytes::from(vec![0u8; 4000]), 10_000);
        }
        assert_eq!((h.messages.len(), h.bytes), (5, 22_000));
    }
}
