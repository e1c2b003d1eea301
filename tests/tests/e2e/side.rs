//! The MQTT event loop's second receiver on the embedded broker: the messages its predicate
//! picks reach only the second receiver, in order, and everything else (connection events
//! included) only the first. The aggregator sends sites' update chunks this way to a task that
//! receipts them while its core is busy.

use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;
use unifed_e2e::{Broker, BrokerKind, serial};
use unifed_net::{BrokerConfig, NetEvent, Qos};

/// The (topic, payload) of every message `rx` gets within `wait`.
async fn drain(rx: &mut UnboundedReceiver<NetEvent>, wait: Duration) -> Vec<(String, Vec<u8>)> {
    let mut got = Vec::new();
    while let Ok(Some(ev)) = tokio::time::timeout(wait, rx.recv()).await {
        match ev {
            NetEvent::Message { topic, payload } => got.push((topic, payload.to_vec())),
            other => panic!("{other:?} on a side receiver"),
        }
    }
    got
}

#[test]
fn picked_messages_reach_only_the_side_receiver_in_order() {
    let _one = serial();
    let broker = Broker::start(BrokerKind::Embedded, 64 << 10);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let opts = BrokerConfig::new("127.0.0.1", broker.port)
            .options("side-probe", None)
            .unwrap();
        // Picked: topics under `t/chunk/`, and payloads that start with `C` anywhere.
        let (client, mut main, mut side) =
            unifed_net::spawn_event_loop_with_side(opts, vec!["t/#".into()], |topic, payload| {
                topic.starts_with("t/chunk/") || payload.first() == Some(&b'C')
            });
        match tokio::time::timeout(Duration::from_secs(20), main.recv()).await {
            Ok(Some(NetEvent::Connected)) => {}
            other => panic!("not connected: {other:?}"),
        }
        match tokio::time::timeout(Duration::from_secs(20), main.recv()).await {
            Ok(Some(NetEvent::Subscribed)) => {}
            other => panic!("not subscribed: {other:?}"),
        }
        let sent = [
            ("t/chunk/a", b"1".to_vec()),
            ("t/whole/a", b"2".to_vec()),
            ("t/whole/b", b"C3".to_vec()),
            ("t/chunk/b", vec![7u8; 40_000]),
            ("t/other", b"4".to_vec()),
        ];
        for (topic, payload) in &sent {
            client
                .publish(*topic, Qos::AtLeastOnce, false, payload.clone())
                .await
                .unwrap();
        }
        let wait = Duration::from_secs(3);
        let picked =
            |(t, p): &(&str, Vec<u8>)| t.starts_with("t/chunk/") || p.first() == Some(&b'C');
        let expect = |pick: bool| -> Vec<(String, Vec<u8>)> {
            sent.iter()
                .filter(|m| picked(m) == pick)
                .map(|(t, p)| (t.to_string(), p.clone()))
                .collect()
        };
        assert_eq!(drain(&mut side, wait).await, expect(true));
        assert_eq!(drain(&mut main, wait).await, expect(false));
        client.disconnect().await.unwrap();
    });
}
