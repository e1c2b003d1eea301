//! The hostile site's other attacks, with its key, on a connection of their own: a steady
//! flood of small signed updates the aggregator must refuse and audit (item 5), and after each
//! of its rounds is answered, two chunk sets of the open round begun and never finished
//! (item 7's upload share) and the first chunks of its two latest earlier uploads replayed
//! (item 4).

use super::Shared;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use unifed_net::{BrokerConfig, Client, NetEvent, Qos};
use unifed_protocol::auth::Keyring;
use unifed_protocol::chunking::CHUNK_BYTES;
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::messages::{Chunk, LocalReport, RoundManifest, SiteExtras, SiteUpdate};
use unifed_protocol::topics::Topics;
use unifed_protocol::{RunId, SpecHash};

/// Bytes each never-finished chunk set claims.
const JUNK_SET_BYTES: u64 = 48 << 20;
/// Chunks of each never-finished set sent.
const JUNK_CHUNKS: u32 = 8;

/// The round the aggregator announced last.
#[derive(Debug, Clone, Copy)]
struct Current {
    round: u64,
    version: u64,
    run: RunId,
}

/// Floods `per_second` signed messages a second, and after each answered round begins the
/// junk sets and replays first chunks, until `stop` turns true.
pub async fn run(
    broker: BrokerConfig,
    who: super::site::Identity,
    (spec_hash, claim, per_second): (SpecHash, u64, u32),
    shared: Arc<Mutex<Shared>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let topics = Topics::new(&who.federation);
    let options = broker
        .options(&format!("{}-flood", who.site), None)
        .map_err(anyhow::Error::msg)?;
    let (client, mut rx) = unifed_net::spawn_event_loop(options, vec![topics.manifest()]);
    let aggregator = Keyring::aggregator(who.aggregator);
    let update_topic = topics.update(&who.site);
    let signer = Signer {
        who: &who,
        spec_hash,
    };
    let mut current: Option<Current> = None;
    let mut junked: u64 = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            ev = rx.recv() => match ev {
                None => break,
                Some(NetEvent::Message { payload, .. }) => {
                    let m = aggregator
                        .open(&payload, 1 << 20)
                        .ok()
                        .and_then(|e| e.payload_as::<RoundManifest>().ok());
                    if let Some(m) = m.filter(|m| !m.finished) {
                        current = Some(Current { round: m.round, version: m.model_version, run: m.run });
                    }
                }
                Some(_) => {}
            },
            _ = tick.tick() => {
                let Some(at) = current else { continue };
                // Item 5: small updates of the next round and of the last closed one, each
                // refused (a wrong round, a closed round or a duplicate) and audited.
                for _ in 0..per_second.div_ceil(10) {
                    n += 1;
                    let round = if n.is_multiple_of(2) { at.round + 1 } else { at.round.saturating_sub(1).max(1) };
                    let u = SiteUpdate::<Vec<u8>> {
                        round,
                        base_version: at.version,
                        samples: claim,
                        delta: vec![],
                        bn: vec![],
                        report: LocalReport::default(),
                        extras: SiteExtras::None,
                    };
                    let signed = signer.sign(MessageKind::SiteUpdate, at, round, &u);
                    let sent = publish(&client, &update_topic, signed).await;
                    super::tally(&shared, |t| t.refused_floods += u64::from(sent));
                }
                let answered = {
                    let s = shared.lock().unwrap_or_else(|p| p.into_inner());
                    s.answers.iter().any(|(r, _)| *r == at.round)
                };
                if answered && junked < at.round {
                    junked = at.round;
                    junk_and_replay(&client, &update_topic, at, &signer, &shared).await;
                }
            }
        }
    }
    let _ = client.disconnect().await;
    Ok(())
}

/// Item 7: two chunk sets of the open round that are never finished; item 4: the first chunks
/// of the site's two latest earlier uploads again.
async fn junk_and_replay(
    client: &Client,
    topic: &str,
    at: Current,
    signer: &Signer<'_>,
    shared: &Mutex<Shared>,
) {
    let count = JUNK_SET_BYTES.div_ceil(CHUNK_BYTES as u64) as u32;
    for set in 0..2u64 {
        let mut hash = [0u8; 32];
        hash[..8].copy_from_slice(&at.round.to_le_bytes());
        hash[8..16].copy_from_slice(&set.to_le_bytes());
        hash[16] = 0xa5;
        for index in 0..JUNK_CHUNKS {
            let c = Chunk {
                payload_hash: hash,
                index,
                count,
                total_len: JUNK_SET_BYTES,
                data: vec![index as u8; CHUNK_BYTES],
            };
            let signed = signer.sign(MessageKind::UpdateChunk, at, at.round, &c);
            let sent = publish(client, topic, signed).await;
            super::tally(shared, |t| t.junk_chunks += u64::from(sent));
        }
    }
    let firsts: Vec<Vec<u8>> = {
        let s = shared.lock().unwrap_or_else(|p| p.into_inner());
        let n = s.first_chunks.len();
        // The latest is this round's own; the two before it are of earlier rounds.
        s.first_chunks[n.saturating_sub(3)..n.saturating_sub(1)].to_vec()
    };
    for f in firsts {
        let sent = publish(client, topic, f).await;
        super::tally(shared, |t| t.own_first_chunk_replays += u64::from(sent));
    }
}

/// Signs as the hostile site, in the run and from the model version of the round it follows.
struct Signer<'a> {
    who: &'a super::site::Identity,
    spec_hash: SpecHash,
}

impl Signer<'_> {
    fn sign<T: serde::Serialize>(
        &self,
        kind: MessageKind,
        at: Current,
        round: u64,
        body: &T,
    ) -> Vec<u8> {
        self.who.key.sign(
            &Envelope::new(
                kind,
                self.who.federation.clone(),
                self.who.site.clone(),
                round,
                at.version,
                self.spec_hash,
                body,
            )
            .in_run(at.run),
        )
    }
}

async fn publish(client: &Client, topic: &str, payload: Vec<u8>) -> bool {
    client
        .publish(topic, Qos::AtLeastOnce, false, payload)
        .await
        .is_ok()
}
