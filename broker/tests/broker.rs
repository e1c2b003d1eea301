//! The broker binary: starts on a free loopback port, carries a packet of half a megabyte,
//! and comes back on the same port after a kill, where a client reconnects and re-subscribes.

use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::time::timeout;

/// The broker's process, killed when the test ends, passed or failed.
struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(listen: &str) -> (Broker, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_unifed-broker"))
        .args(["--listen", listen, "--max-packet-bytes", "1048576"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("unexpected first line `{line}`"));
    (Broker(child), addr)
}

fn client(id: &str, addr: SocketAddr) -> (AsyncClient, EventLoop) {
    let mut o = MqttOptions::new(id, addr.ip().to_string(), addr.port());
    o.set_max_packet_size(2 << 20, 2 << 20);
    o.set_keep_alive(Duration::from_secs(5));
    AsyncClient::new(o, 16)
}

/// Polls until a publish arrives, re-subscribing on every ConnAck; gives up after 20 s.
async fn next_publish(c: &AsyncClient, ev: &mut EventLoop, topic: &str) -> Vec<u8> {
    timeout(Duration::from_secs(20), async {
        loop {
            match ev.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    c.subscribe(topic, QoS::AtLeastOnce).await.unwrap()
                }
                Ok(Event::Incoming(Packet::Publish(p))) => return p.payload.to_vec(),
                Ok(_) => {}
                // The broker is down: back off before the event loop reconnects.
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .expect("no publish within 20 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_carries_large_packets_and_survives_a_restart_on_its_port() {
    let (broker, addr) = start("127.0.0.1:0");
    assert!(addr.ip().is_loopback() && addr.port() != 0);
    let (sub, mut sub_ev) = client("sub", addr);
    let (publ, mut pub_ev) = client("pub", addr);
    tokio::spawn(async move {
        loop {
            if pub_ev.poll().await.is_err() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let payload: Vec<u8> = (0..512 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    // Publish after the subscription is in place: the first ConnAck triggers it.
    let topic = "unifed/v1/t/test";
    let (p2, pl) = (publ.clone(), payload.clone());
    let sender = tokio::spawn(async move {
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            p2.publish(topic, QoS::AtLeastOnce, false, pl.clone())
                .await
                .unwrap();
        }
    });
    assert_eq!(next_publish(&sub, &mut sub_ev, topic).await, payload);
    sender.abort();

    drop(broker);
    let (broker, again) = start(&addr.to_string());
    assert_eq!(again, addr);
    let p3 = publ.clone();
    let sender = tokio::spawn(async move {
        for i in 0..100u8 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = p3
                .publish(topic, QoS::AtLeastOnce, false, vec![i; 1000])
                .await;
        }
    });
    let got = next_publish(&sub, &mut sub_ev, topic).await;
    assert_eq!(got.len(), 1000);
    sender.abort();
    drop(broker);
}

/// Publishes of every size around the one from which the broker writes a payload from its own
/// buffer (4 KiB), many sent at once so that the broker writes several in one call, reach a
/// subscriber whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_of_every_size_arrive_whole_and_in_order_when_relayed_together() {
    let (broker, addr) = start("127.0.0.1:0");
    let (sub, mut sub_ev) = client("sub", addr);
    let (publ, mut pub_ev) = client("pub", addr);
    tokio::spawn(async move { while pub_ev.poll().await.is_ok() {} });
    let topic = "unifed/v1/t/sizes";
    let sizes = [
        0, 1, 100, 4095, 4096, 4097, 5000, 261_000, 7, 300_000, 4096, 12,
    ];
    let sent: Vec<Vec<u8>> = (0..4)
        .flat_map(|round| {
            sizes.iter().enumerate().map(move |(k, &n)| {
                (0..n)
                    .map(|i| (i * 31 + k * 7 + round) as u8)
                    .collect::<Vec<u8>>()
            })
        })
        .collect();
    let mut got = Vec::new();
    timeout(Duration::from_secs(30), async {
        loop {
            match sub_ev.poll().await.unwrap() {
                Event::Incoming(Packet::ConnAck(_)) => {
                    sub.subscribe(topic, QoS::AtLeastOnce).await.unwrap()
                }
                // Subscribed: everything goes out at once.
                Event::Incoming(Packet::SubAck(_)) => {
                    for p in &sent {
                        publ.publish(topic, QoS::AtLeastOnce, false, p.clone())
                            .await
                            .unwrap();
                    }
                }
                Event::Incoming(Packet::Publish(p)) => {
                    got.push(p.payload.to_vec());
                    if got.len() == sent.len() {
                        return;
                    }
                }
                _ => {}
            }
        }
    })
    .await
    .expect("every publish within 30 s");
    assert_eq!(got.len(), sent.len());
    for (i, (g, s)) in got.iter().zip(&sent).enumerate() {
        assert!(
            g == s,
            "publish {i}: {} bytes arrived for {}",
            g.len(),
            s.len()
        );
    }
    drop(broker);
}

#[test]
fn a_bad_setting_is_refused_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_unifed-broker"))
        .args(["--listen", "127.0.0.1:0", "--max-packet-bytes", "10"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 1024"));
    let out = Command::new(env!("CARGO_BIN_EXE_unifed-broker"))
        .args(["--listen", "127.0.0.1:0", "--user", "nocolon"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("user:password"));
}
