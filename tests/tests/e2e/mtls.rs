//! Mutual TLS and the per-site ACL with the real brokers. On Mosquitto with the config
//! `unifed-aggregator mosquitto-config` generates: a site cannot read another site's topics or
//! publish on them (or on the manifest), a client without a certificate of the federation's CA
//! is refused, and a federation runs through it. On the embedded broker with `--tls-cert`,
//! `--tls-key` and `--tls-client-ca`: a client without a certificate is refused, one with a
//! certificate gets in, even while silent connections hold handshakes open. A test CA is made here; no key is committed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;
use unifed_aggregator::store::Store;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Guard, binary, certificates, mosquitto, mosquitto_available, serial};
use unifed_net::{BrokerConfig, Client, NetEvent, Qos};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Connects to the broker on `port` over TLS as `who` (its certificate from `certs`, none for
/// `None`), subscribed to `subs`; returns the client and its events once connected, or the
/// connection error after `wait`.
async fn connect(
    port: u16,
    certs: &Path,
    who: Option<&str>,
    subs: Vec<String>,
    wait: Duration,
) -> Result<(Client, UnboundedReceiver<NetEvent>), String> {
    // The client ids the services use (Mosquitto replaces them by the certificate's name).
    let id = match who {
        Some("aggregator") => "unifed-aggregator-e2e".to_string(),
        Some(w) => format!("unifed-agent-{w}"),
        None => "unifed-agent-none".to_string(),
    };
    connect_as(port, certs, who, &id, subs, wait).await
}

/// [`connect`] with MQTT client id `id`.
async fn connect_as(
    port: u16,
    certs: &Path,
    who: Option<&str>,
    id: &str,
    subs: Vec<String>,
    wait: Duration,
) -> Result<(Client, UnboundedReceiver<NetEvent>), String> {
    let mut b = BrokerConfig::new("127.0.0.1", port);
    b.ca_file = Some(certs.join("ca.pem"));
    if let Some(w) = who {
        b.cert_file = Some(certs.join(format!("{w}.pem")));
        b.key_file = Some(certs.join(format!("{w}.key")));
    }
    let subs_len = subs.len();
    let (client, mut rx) = unifed_net::spawn_event_loop(b.options(id, None)?, subs);
    let subs = subs_len;
    let end = tokio::time::Instant::now() + wait;
    let mut last = String::from("no answer");
    let (mut connected, mut subscribed) = (false, 0);
    loop {
        if connected && subscribed == subs {
            return Ok((client, rx));
        }
        match tokio::time::timeout_at(end, rx.recv()).await {
            Ok(Some(NetEvent::Connected)) => connected = true,
            Ok(Some(NetEvent::Subscribed)) => subscribed += 1,
            Ok(Some(NetEvent::Disconnected(e))) => last = e,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                let _ = client.disconnect().await;
                return Err(last);
            }
        }
    }
}

/// The broker on `port` refuses a client without a certificate and one with a certificate of
/// another CA.
async fn refuses_strangers(port: u16, certs: &Path) {
    let wait = Duration::from_secs(5);
    assert!(connect(port, certs, None, vec![], wait).await.is_err());
    assert!(
        connect(port, certs, Some("stranger"), vec![], wait)
            .await
            .is_err()
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every message `rx` gets within `wait`, as (topic, payload text).
async fn drain(rx: &mut UnboundedReceiver<NetEvent>, wait: Duration) -> Vec<(String, String)> {
    let mut got = Vec::new();
    let end = tokio::time::Instant::now() + wait;
    while let Ok(Some(ev)) = tokio::time::timeout_at(end, rx.recv()).await {
        if let NetEvent::Message { topic, payload } = ev {
            got.push((topic, String::from_utf8_lossy(&payload).into_owned()));
        }
    }
    got
}

#[test]
fn on_mosquitto_with_the_generated_acl_a_site_reaches_only_its_own_topics() {
    if !mosquitto_available() {
        return;
    }
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    certificates(&certs, &["aggregator", "grey", "texture"]);
    let port = free_port();
    let fed = two_sites_over_mtls(dir.path(), port, &certs);

    // The broker config, generated from the federation's own config.
    let out = dir.path().join("mosquitto");
    let st = Command::new(binary("unifed-aggregator"))
        .arg("mosquitto-config")
        .arg("--config")
        .arg(fed.aggregator_config())
        .arg("--ca")
        .arg(certs.join("ca.pem"))
        .arg("--cert")
        .arg(certs.join("server.pem"))
        .arg("--key")
        .arg(certs.join("server.key"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    let conf = out.join("mosquitto.conf");
    let text = std::fs::read_to_string(&conf).unwrap();
    for line in [
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
        "allow_anonymous false",
    ] {
        assert!(text.contains(line), "{line}");
    }
    // Mosquitto drops to the `mosquitto` user unless told to stay.
    let user = String::from_utf8(Command::new("id").arg("-un").output().unwrap().stdout).unwrap();
    std::fs::write(
        &conf,
        format!("{text}user {}\nlog_dest stderr\n", user.trim()),
    )
    .unwrap();
    let _broker = Guard(
        Command::new(mosquitto().unwrap())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("mosquitto.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "mosquitto did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let ns = "unifed/v1/e2e";
    runtime().block_on(async {
        let wait = Duration::from_secs(5);
        refuses_strangers(port, &certs).await;
        let (agg, mut agg_rx) = connect(
            port,
            &certs,
            Some("aggregator"),
            vec![format!("{ns}/update/+"), format!("{ns}/manifest")],
            wait,
        )
        .await
        .unwrap();
        let (texture, mut texture_rx) = connect(
            port,
            &certs,
            Some("texture"),
            vec![format!("{ns}/ack/texture"), format!("{ns}/chunks/model")],
            wait,
        )
        .await
        .unwrap();
        let (grey, mut grey_rx) = connect(
            port,
            &certs,
            Some("grey"),
            vec![
                format!("{ns}/ack/texture"),
                format!("{ns}/update/+"),
                format!("{ns}/ack/grey"),
                format!("{ns}/chunks/model"),
            ],
            wait,
        )
        .await
        .unwrap();
        let publish = |c: &Client, topic: &str, text: &str| {
            let (c, topic, text) = (c.clone(), topic.to_string(), text.to_string());
            async move {
                c.publish(topic, Qos::AtLeastOnce, false, text.into_bytes())
                    .await
                    .unwrap()
            }
        };
        publish(&grey, &format!("{ns}/update/texture"), "grey as texture").await;
        publish(&grey, &format!("{ns}/manifest"), "grey's manifest").await;
        publish(&grey, &format!("{ns}/update/grey"), "grey's own").await;
        publish(&texture, &format!("{ns}/update/texture"), "texture's own").await;
        publish(&agg, &format!("{ns}/ack/texture"), "answer to texture").await;
        publish(&agg, &format!("{ns}/ack/grey"), "answer to grey").await;
        // Model chunks for every site: enrolled sites read them, and only the aggregator
        // writes them.
        publish(&agg, &format!("{ns}/chunks/model"), "a shared chunk").await;
        publish(&grey, &format!("{ns}/chunks/model"), "grey's forged chunk").await;
        let to_agg = drain(&mut agg_rx, Duration::from_secs(2)).await;
        let to_texture = drain(&mut texture_rx, Duration::from_millis(500)).await;
        let to_grey = drain(&mut grey_rx, Duration::from_millis(500)).await;
        let texts = |v: &[(String, String)]| v.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>();
        let mut got = texts(&to_agg);
        got.sort();
        assert_eq!(got, ["grey's own", "texture's own"], "{to_agg:?}");
        assert_eq!(texts(&to_texture), ["answer to texture", "a shared chunk"]);
        // grey's subscriptions to texture's answers and to every update got it nothing.
        assert_eq!(
            texts(&to_grey),
            ["answer to grey", "a shared chunk"],
            "{to_grey:?}\n{}",
            std::fs::read_to_string(dir.path().join("mosquitto.log")).unwrap_or_default()
        );
        for c in [agg, texture, grey] {
            let _ = c.disconnect().await;
        }
    });

    // The federation itself runs through the ACL.
    let accepted = accepted_in_a_run(&fed, &["grey", "texture"]);
    assert_eq!(
        accepted,
        4,
        "2 sites x 2 rounds over mutual TLS\n{}",
        fed.logs()
    );
}

/// `unifed-broker` on a free loopback port with mutual TLS under the CA of `certs` (and
/// `extra` arguments): the process and its port.
fn embedded_mtls(certs: &Path, extra: &[&str]) -> (Guard, u16) {
    let mut child = Guard(
        Command::new(binary("unifed-broker"))
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .arg("--tls-cert")
            .arg(certs.join("server.pem"))
            .arg("--tls-key")
            .arg(certs.join("server.key"))
            .arg("--tls-client-ca")
            .arg(certs.join("ca.pem"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().rsplit(':').next().unwrap().parse().unwrap();
    (child, port)
}

#[test]
fn the_embedded_broker_with_mutual_tls_refuses_a_client_without_a_certificate() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let certs: PathBuf = dir.path().to_path_buf();
    certificates(&certs, &["grey"]);
    let (_child, port) = embedded_mtls(&certs, &[]);
    // A client that opens connections and never speaks does not stall the others' handshakes.
    let _silent: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    runtime().block_on(async {
        let wait = Duration::from_secs(5);
        refuses_strangers(port, &certs).await;
        let (c, _rx) = connect(port, &certs, Some("grey"), vec![], wait)
            .await
            .unwrap();
        let _ = c.disconnect().await;
    });
    // Half a TLS config is refused before the broker starts.
    let st = Command::new(binary("unifed-broker"))
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(certs.join("server.pem"))
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!st.success());
}

/// Resources a stranger without a certificate could exhaust on the embedded broker's mutual-TLS
/// port: silent connections (no handshake) from one address held every connection slot for
/// the handshake timeout, so a site with a valid certificate could not get in. Now a handshake
/// takes no slot of an established client, one address has at most 8 handshakes in progress,
/// and handshakes time out after 5 s: 200 silent connections from 127.0.0.2 leave a site on
/// 127.0.0.1 free to connect (a broker of 32 slots here).
#[test]
fn silent_connections_from_one_address_do_not_keep_certified_clients_out() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let certs: PathBuf = dir.path().to_path_buf();
    certificates(&certs, &["grey"]);
    let (_child, port) = embedded_mtls(&certs, &["--max-connections", "32"]);
    let silent: Vec<tokio::net::TcpStream> = runtime().block_on(async {
        let mut v = Vec::new();
        for _ in 0..200 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            if let Ok(c) = s.connect(([127, 0, 0, 1], port).into()).await {
                v.push(c);
            }
        }
        v
    });
    assert!(silent.len() >= 100, "{} silent connections", silent.len());
    runtime().block_on(async {
        let (c, _rx) = connect(port, &certs, Some("grey"), vec![], Duration::from_secs(4))
            .await
            .expect("the certified site got in");
        let _ = c.disconnect().await;
    });
    drop(silent);
}

/// The embedded broker enforces what the generated Mosquitto ACL states, from the client
/// certificate's name: grey's certificate cannot use texture's client id (and so cannot take
/// over its session), cannot subscribe to every update, to texture's answers or to `#`, and its
/// publish on texture's update topic closes its connection before the aggregator sees it; its
/// own topics work, and a federation of two sites runs through it.
#[test]
fn the_embedded_broker_with_mutual_tls_keeps_each_site_to_its_own_topics_and_client_ids() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    certificates(&certs, &["aggregator", "grey", "texture"]);
    let (_broker, port) = embedded_mtls(&certs, &["--max-packet-bytes", "65536"]);
    let fed = two_sites_over_mtls(dir.path(), port, &certs);
    let ns = "unifed/v1/e2e";
    runtime().block_on(async {
        let wait = Duration::from_secs(3);
        let grey = Some("grey");
        let taken = connect_as(port, &certs, grey, "unifed-agent-texture", vec![], wait).await;
        assert!(taken.is_err(), "grey used texture's client id");
        for filter in [
            format!("{ns}/update/+"),
            format!("{ns}/ack/texture"),
            "#".into(),
        ] {
            let r = connect(port, &certs, grey, vec![filter.clone()], wait).await;
            assert!(r.is_err(), "{filter}");
        }
        let subs = vec![format!("{ns}/update/+")];
        let (agg, mut agg_rx) = connect(port, &certs, Some("aggregator"), subs, wait)
            .await
            .unwrap();
        let own = || vec![format!("{ns}/ack/grey")];
        let (c, mut grey_rx) = connect(port, &certs, grey, own(), wait).await.unwrap();
        let forged = b"grey as texture".to_vec();
        let topic = format!("{ns}/update/texture");
        c.publish(topic, Qos::AtLeastOnce, false, forged)
            .await
            .unwrap();
        // The connection is closed for it.
        let mut closed = false;
        let end = tokio::time::Instant::now() + wait;
        while let Ok(Some(ev)) = tokio::time::timeout_at(end, grey_rx.recv()).await {
            if matches!(ev, NetEvent::Disconnected(_)) {
                closed = true;
                break;
            }
        }
        assert!(closed, "grey's connection stayed open");
        let _ = c.disconnect().await;
        let (c, _rx) = connect(port, &certs, grey, own(), wait).await.unwrap();
        let topic = format!("{ns}/update/grey");
        c.publish(topic, Qos::AtLeastOnce, false, b"grey's own".to_vec())
            .await
            .unwrap();
        let got = drain(&mut agg_rx, Duration::from_secs(2)).await;
        let texts: Vec<String> = got.into_iter().map(|(_, p)| p).collect();
        assert_eq!(texts, ["grey's own"]);
        for c in [agg, c] {
            let _ = c.disconnect().await;
        }
    });
    let accepted = accepted_in_a_run(&fed, &["grey", "texture"]);
    assert_eq!(
        accepted,
        4,
        "2 sites x 2 rounds through the policy\n{}",
        fed.logs()
    );
}

/// Runs `fed`'s aggregator and the agents of `sites` to their end; the updates it accepted.
fn accepted_in_a_run(fed: &Fed, sites: &[&str]) -> usize {
    let mut agg = fed.aggregator();
    let mut agents: Vec<_> = sites.iter().map(|s| fed.agent(s)).collect();
    for (a, s) in agents.iter_mut().zip(sites) {
        fed.wait_ok(a, s, Duration::from_secs(240));
    }
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));
    Store::open(&fed.agg_dir())
        .unwrap()
        .audit_entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "accepted")
        .count()
}

/// A federation of grey and texture, two rounds, on the broker at `port`, each service with
/// its certificate from `certs`.
fn two_sites_over_mtls(dir: &Path, port: u16, certs: &Path) -> Fed {
    let mut fed = Fed::new(dir, port, 32 << 10);
    fed.ca_file = Some(certs.join("ca.pem"));
    fed.client_certs = Some(certs.to_path_buf());
    fed.rounds = 2;
    fed.min_sites = 2;
    fed.sites = vec!["grey".into(), "texture".into()];
    fed
}
