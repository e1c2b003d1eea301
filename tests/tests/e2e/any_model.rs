//! Any model of the zoo in a federation: a ResNet-18 whose spec (written by `unifed-agent init`
//! with non-digit class names read from a dataset folder) decides every site's model, trained
//! over MQTT by three sites from image folders; then evaluate, predict and calibrate on its
//! models.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use unifed_e2e::fed::Fed;
use unifed_e2e::{Broker, BrokerKind, binary, serial};
use unifed_models::data::{BuiltinData, Domain, DomainSplit, SplitSizes};

const SITES: [&str; 3] = ["grey", "texture", "fonts"];
const CLASSES: [&str; 3] = ["benign", "malignant", "normal"];

/// Writes `<root>/{train,val,test}/<class>/<n>.png` from a built-in domain's digits 0, 1 and 2,
/// the digits renamed to [`CLASSES`].
fn write_site(root: &Path, domain: &str) {
    let data = BuiltinData::load().unwrap();
    let sizes = SplitSizes {
        train: 743,
        val: 60,
        test: 300,
        ..SplitSizes::default()
    };
    let dd = data
        .domain(Domain::parse(domain).unwrap(), &sizes, 0)
        .unwrap();
    for (name, split) in [("train", &dd.train), ("val", &dd.val), ("test", &dd.test)] {
        let keep: Vec<usize> = (0..split.labels.len())
            .filter(|&i| split.labels[i] < 3)
            .collect();
        let three = DomainSplit {
            images: keep.iter().map(|&i| split.images[i].clone()).collect(),
            labels: keep.iter().map(|&i| split.labels[i]).collect(),
        };
        let dir = root.join(name);
        three.write_folder(&dir).unwrap();
        for (digit, class) in CLASSES.iter().enumerate() {
            std::fs::rename(dir.join(digit.to_string()), dir.join(class)).unwrap();
        }
    }
}

fn agent(args: &[&str]) -> String {
    let out = Command::new(binary("unifed-agent"))
        .args(args)
        .output()
        .expect("unifed-agent");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "unifed-agent {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The accuracy `unifed-agent evaluate` prints for `model` on a site's test folder.
fn accuracy(model: &Path, folder: &Path, bn: &str) -> f64 {
    let out = agent(&[
        "evaluate",
        "--model",
        &model.to_string_lossy(),
        "--folder",
        &folder.to_string_lossy(),
        "--bn",
        bn,
    ]);
    let pct = out
        .split("%")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no accuracy in {out}"));
    pct / 100.0
}

#[test]
fn a_resnet18_federation_of_image_folders_with_named_classes_learns_over_mqtt() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for s in SITES {
        write_site(&data.join(s), s);
    }
    let broker = Broker::start(BrokerKind::Embedded, 1 << 20);
    let mut fed = Fed::new(dir.path(), broker.port, 1 << 20);
    fed.sites = SITES.map(String::from).to_vec();
    fed.rounds = 10;
    fed.chunk_bytes = 256 << 10;
    // The initial model: a narrow ResNet-18 on 32x32 colour images, classes from a folder.
    let init = fed.dir.join("init.safetensors");
    agent(&[
        "init",
        "--arch",
        "resnet18",
        "--size",
        "32",
        "--channels",
        "3",
        "--width",
        "8",
        "--classes-from",
        &data.join("grey").to_string_lossy(),
        "--out",
        &init.to_string_lossy(),
    ]);
    let spec = fed.spec();
    assert!(
        spec.architecture.starts_with("resnet18("),
        "{}",
        spec.architecture
    );
    assert_eq!(spec.classes, CLASSES);
    let mut agg = fed.aggregator();
    let mut agents = Vec::new();
    for s in SITES {
        let cfg = fed.dir.join(format!("{s}.toml"));
        let mut agent = fed.agent_config(s, s, None);
        agent.spec = Some(unifed_protocol::spec_path(&init));
        agent.train.lr = 0.1;
        agent.train.epochs = 3;
        agent.data.builtin = None;
        agent.data.folder = Some(data.join(s));
        unifed_e2e::fed::write_toml(&cfg, &agent);
        agents.push(unifed_e2e::Guard(
            Command::new(binary("unifed-agent"))
                .args(["train", "--config"])
                .arg(&cfg)
                .stdout(std::fs::File::create(fed.dir.join(format!("{s}.log"))).unwrap())
                .stderr(std::fs::File::create(fed.dir.join(format!("{s}.err"))).unwrap())
                .spawn()
                .unwrap(),
        ));
    }
    for (a, s) in agents.iter_mut().zip(SITES) {
        fed.wait_ok(a, s, Duration::from_secs(600));
    }
    fed.wait_ok(&mut agg, "aggregator", Duration::from_secs(60));

    // Each site's final model (global weights, its own BN) beats the initial one on its test
    // images, and well above chance (1/3) on average.
    // The site's model is used as it lies in its state folder: the agent keeps the federation's
    // spec beside it, byte for byte the spec of the initial model.
    let ckpt = |s: &str| -> PathBuf {
        let p = fed.site_dir(s).join("model.safetensors");
        let read = |m: &std::path::Path| {
            serde_json::from_slice::<unifed_protocol::ModelSpec>(
                &std::fs::read(unifed_protocol::spec_path(m)).unwrap(),
            )
            .unwrap()
        };
        assert_eq!(read(&p), read(&init), "{s}");
        p
    };
    let mut mean = 0.0;
    for s in SITES {
        let before = accuracy(&init, &data.join(s), "stored");
        let after = accuracy(&ckpt(s), &data.join(s), "stored");
        eprintln!("{s}: test accuracy {before:.3} -> {after:.3}");
        assert!(after > before + 0.1, "{s}: {before} -> {after}");
        mean += after / SITES.len() as f64;
    }
    assert!(mean > 0.6, "mean final accuracy {mean}");
    // predict names the spec's classes; calibrate writes a model evaluate can use.
    let grey = ckpt("grey");
    let out = agent(&[
        "predict",
        "--model",
        &grey.to_string_lossy(),
        "--images",
        &data.join("grey/test/normal").to_string_lossy(),
    ]);
    let lines: Vec<&str> = out.lines().filter(|l| l.contains(".png,")).collect();
    assert!(!lines.is_empty(), "{out}");
    let normal = lines
        .iter()
        .filter(|l| l.split(',').nth(1) == Some("normal"))
        .count();
    assert!(
        lines
            .iter()
            .all(|l| CLASSES.contains(&l.split(',').nth(1).unwrap())),
        "{out}"
    );
    assert!(
        2 * normal > lines.len(),
        "{normal} of {} called normal",
        lines.len()
    );
    let cal = fed.dir.join("calibrated.safetensors");
    agent(&[
        "calibrate",
        "--model",
        &grey.to_string_lossy(),
        "--images",
        &data.join("texture/train/benign").to_string_lossy(),
        "--out",
        &cal.to_string_lossy(),
    ]);
    let acc = accuracy(&cal, &data.join("texture"), "stored");
    assert!((0.0..=1.0).contains(&acc));
}
