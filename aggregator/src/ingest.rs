//! Sites' update chunks, taken in by a task of their own: each chunk is opened (signature,
//! sender, federation), spooled ([`SpooledUploads`]) and receipted here, so a site's upload
//! window keeps moving while the core's loop spools a whole update or folds a round (a few
//! hundred milliseconds each, during which every site's upload used to wait for its receipts).
//! A complete set goes to the core's loop as a [`Complete`] update.

use crate::core::Admission;
use crate::uploads::{Received, SpooledUploads};
use tokio::sync::{mpsc, watch};
use unifed_net::NetEvent;
use unifed_protocol::envelope::MessageKind;
use unifed_protocol::ids::Id;
use unifed_protocol::messages::{ChunkRef, UpdateReceipt};

/// A site's update whose chunks have all arrived, still on disk: the core's loop reads it
/// when it takes it, so updates waiting for the core cost no memory.
#[derive(Debug)]
pub struct Complete {
    /// The site whose topic it came on.
    pub site: String,
    /// The update envelope's chunk set.
    pub set: Received,
}

/// A receipt to send: the site, and what it acknowledges.
pub type Receipt = (Id, UpdateReceipt);

/// What the task needs, apart from its input.
pub struct Ingest {
    /// Incomplete uploads.
    pub uploads: SpooledUploads,
    /// How a chunk is opened; the core's loop sends a new one when revocations change.
    pub admission: watch::Receiver<Admission>,
    /// Largest chunk envelope taken.
    pub limit: usize,
    /// The topic prefix of updates (`…/update/`), the site's id after it.
    pub prefix: String,
    /// Where complete updates go: a bounded queue, so sets waiting for the core (files
    /// outside the per-site share of `uploads`) take at most its capacity times a set's
    /// bytes of disk; a full queue holds this task back until the core takes one.
    pub complete: mpsc::Sender<Complete>,
}

impl Ingest {
    /// Takes in the update chunks of `input` until it or the core's loop is gone; `receipt`
    /// sends each receipt (an error ends the task, as it would end the service).
    pub async fn run<F, Fut>(mut self, mut input: mpsc::UnboundedReceiver<NetEvent>, receipt: F)
    where
        F: Fn(Receipt) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        while let Some(ev) = input.recv().await {
            let NetEvent::Message { topic, payload } = ev else {
                continue;
            };
            let Some(site) = topic.strip_prefix(&self.prefix) else {
                continue;
            };
            let now = crate::service::now_ms();
            // A chunk is checked before it takes any disk: signature, sender, federation.
            let opened = {
                let admission = self.admission.borrow();
                Id::new(site).map_err(|e| e.to_string()).and_then(|id| {
                    let env = admission.admit(&id, &payload, self.limit)?;
                    Ok((id, env))
                })
            };
            let taken = opened.and_then(|(id, env)| {
                // Only a chunk's bytes are its update's: the core takes a complete set as
                // signed in its chunks (`Arrival::SignedChunks`).
                if env.kind != MessageKind::UpdateChunk {
                    return Err(format!(
                        "a {:?} message where an update chunk was expected",
                        env.kind
                    ));
                }
                let c = env.payload_as::<ChunkRef>().map_err(|e| e.to_string())?;
                let r = UpdateReceipt {
                    round: env.round,
                    payload_hash: c.payload_hash,
                    index: c.index,
                };
                // Inline: one positioned write of a chunk into the page cache (a quarter of a
                // millisecond); `block_in_place` would hand this worker's other tasks to a new
                // thread for every chunk.
                self.uploads
                    .insert(&id, c, now)
                    .map(|done| (id, r, done))
                    .map_err(|e| e.to_string())
            });
            self.uploads.expire(now);
            match taken {
                Ok((id, r, done)) => {
                    // Receipt first: the site's upload window moves on.
                    if let Err(e) = receipt((id, r)).await {
                        tracing::error!(error = %e, "update receipts cannot be sent; taking no more chunks");
                        return;
                    }
                    if let Some(set) = done {
                        let done = Complete {
                            site: site.to_string(),
                            set,
                        };
                        if self.complete.send(done).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => tracing::warn!(site, error = %e, "update chunk dropped"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_protocol::SpecHash;
    use unifed_protocol::auth::{Keyring, SigningKey};
    use unifed_protocol::chunking::{chunks, payload_hash};
    use unifed_protocol::envelope::Envelope;

    fn id(s: &str) -> Id {
        Id::new(s).unwrap()
    }

    /// Only update chunks signed by the site of their topic are kept and receipted, whatever
    /// else the site signed: a set completes from them alone and goes to the core.
    #[test]
    fn only_the_topic_sites_update_chunks_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        let key = SigningKey::from_seed([5; 32]);
        let mut ring = Keyring::default();
        ring.enrol(id("a"), key.public());
        let (_admit_tx, admission) = watch::channel(Admission::new(ring, id("fed")));
        let (complete, mut completed) = mpsc::channel(4);
        let ingest = Ingest {
            uploads: SpooledUploads::open(&dir.path().join("in"), 1 << 20, 60_000).unwrap(),
            admission,
            limit: 1 << 20,
            prefix: "u/".into(),
            complete,
        };
        fn sign<T: serde::Serialize>(kind: MessageKind, k: &SigningKey, body: &T) -> Vec<u8> {
            let fed = Id::new("fed").unwrap();
            let a = Id::new("a").unwrap();
            k.sign(&Envelope::new(kind, fed, a, 1, 0, SpecHash([3; 32]), body))
        }
        let payload: Vec<u8> = (0..3_000).map(|i| (i % 251) as u8).collect();
        let other = SigningKey::from_seed([6; 32]);
        // A chunk of other bytes in a message of another kind the site signed, sent on its
        // update topic: not an update chunk.
        let mut first = chunks(&payload, 1_000).next().unwrap();
        first.data[0] ^= 1;
        let mut input = vec![("u/a", sign(MessageKind::ModelChunk, &key, &first))];
        for c in chunks(&payload, 1_000) {
            // Signed by another key, and on another site's topic: refused.
            input.push(("u/a", sign(MessageKind::UpdateChunk, &other, &c)));
            input.push(("u/b", sign(MessageKind::UpdateChunk, &key, &c)));
            input.push(("u/a", sign(MessageKind::UpdateChunk, &key, &c)));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        for (topic, payload) in input {
            tx.send(NetEvent::Message {
                topic: topic.into(),
                payload: payload.into(),
            })
            .unwrap();
        }
        drop(tx);
        let receipts = std::sync::Mutex::new(Vec::new());
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(ingest.run(rx, |(site, r)| {
                receipts.lock().unwrap().push((site.to_string(), r.index));
                async { Ok(()) }
            }));
        assert_eq!(
            receipts.into_inner().unwrap(),
            vec![
                ("a".to_string(), 0),
                ("a".to_string(), 1),
                ("a".to_string(), 2)
            ]
        );
        let done = completed.try_recv().unwrap();
        assert_eq!(done.site, "a");
        assert_eq!(done.set.hash(), payload_hash(&payload));
        assert_eq!(done.set.read().unwrap(), payload);
        assert!(completed.try_recv().is_err());
    }
}
