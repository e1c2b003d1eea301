//! `unifed-agent doctor` and `config check` on a good site and on the misconfigurations a site's
//! staff make: each is named, with the exit code of its class.

use std::path::{Path, PathBuf};
use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_unifed-agent"))
}

/// Runs `unifed-agent args`, giving its exit code and stdout with stderr.
fn run(args: &[&str]) -> (i32, String) {
    let out = agent().args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A site of two classes (`a`, `b`), six training and two test images each, a small digits
/// CNN, its identity, and a broker address that takes connections (the listener returned).
struct Site {
    dir: tempfile::TempDir,
    _broker: std::net::TcpListener,
    good: String,
}

impl Site {
    fn new() -> Site {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for (split, n) in [("train", 6u8), ("test", 2)] {
            for class in ["a", "b"] {
                let folder = d.join("data").join(split).join(class);
                std::fs::create_dir_all(&folder).unwrap();
                for i in 0..n {
                    image::GrayImage::from_fn(28, 28, |x, y| {
                        image::Luma([((x * 7 + y * 3) as u8).wrapping_mul(i + 1)])
                    })
                    .save(folder.join(format!("{i}.png")))
                    .unwrap();
                }
            }
        }
        let init = d.join("init.safetensors");
        let (code, text) = run(&[
            "init",
            "--conv",
            "2,2,2",
            "--fc",
            "4,4",
            "--classes",
            "a,b",
            "--out",
            &init.to_string_lossy(),
        ]);
        assert_eq!(code, 0, "{text}");
        let (code, text) = run(&[
            "identity",
            "--key",
            &d.join("keys/site.key").to_string_lossy(),
        ]);
        assert_eq!(code, 0, "{text}");
        let (_, aggregator) = run(&["identity", "--key", &d.join("agg.key").to_string_lossy()]);
        let broker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = broker.local_addr().unwrap().port();
        let good = format!(
            "site = \"s\"\nfederation = \"f\"\nstate_dir = \"state\"\nidentity = \"keys/site.key\"\n\
             aggregator_key = \"{}\"\nspec = \"init.safetensors.spec.json\"\nthreads = 1\n\
             [broker]\nhost = \"127.0.0.1\"\nport = {port}\n\
             [data]\nfolder = \"data\"\n",
            aggregator.lines().next().unwrap()
        );
        Site {
            dir,
            _broker: broker,
            good,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// `doctor` on the config `text` (written beside the site's files).
    fn doctor(&self, text: &str) -> (i32, String) {
        let cfg = self.path("site.toml");
        std::fs::write(&cfg, text).unwrap();
        run(&["doctor", "--config", &cfg.to_string_lossy()])
    }

    /// Asserts that `doctor` fails with `code` on `text` and says `what`; then undoes `undo`.
    fn fails(&self, text: &str, code: i32, what: &str) {
        let (c, out) = self.doctor(text);
        assert_eq!(c, code, "{what}: {out}");
        assert!(out.contains(what), "wanted `{what}`: {out}");
    }
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn doctor_passes_a_good_site_and_names_each_planted_misconfiguration() {
    let site = Site::new();
    let (code, out) = site.doctor(&site.good);
    assert_eq!(code, 0, "{out}");
    for check in [
        "config", "identity", "backend", "model", "data", "state", "disk", "broker",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with("ok") && l.contains(check)),
            "{check}: {out}"
        );
    }
    let good = &site.good;
    // 1-2. The file: an unknown key and a wrong type, each with its line.
    site.fails(
        &good.replace("threads = 1\n", "threads = 1\nresend_seconds = 3\n"),
        2,
        "site.toml:8:1: unknown field `resend_seconds`",
    );
    site.fails(
        &good.replace("threads = 1", "threads = \"one\""),
        2,
        "site.toml:7:11: invalid type",
    );
    // 3. A file it names is not there.
    site.fails(
        &good.replace("keys/site.key", "keys/gone.key"),
        2,
        "`identity`: no file",
    );
    // 4. The identity key readable by others.
    chmod(&site.path("keys/site.key"), 0o644);
    site.fails(good, 3, "chmod 600");
    chmod(&site.path("keys/site.key"), 0o600);
    // 5. A backend this build does not have.
    site.fails(
        &good.replace("threads = 1", "threads = 1\nbackend = \"cuda\""),
        5,
        "backend",
    );
    // 6. A class folder the model does not know.
    let cat = site.path("data/train/cat");
    std::fs::create_dir_all(&cat).unwrap();
    std::fs::copy(site.path("data/train/a/0.png"), cat.join("0.png")).unwrap();
    site.fails(good, 6, "label `cat`");
    std::fs::remove_dir_all(&cat).unwrap();
    // 7. Too few images of a class to train on.
    for i in 0..4 {
        std::fs::remove_file(site.path(&format!("data/train/b/{i}.png"))).unwrap();
    }
    site.fails(good, 6, "`b` 2");
    for i in 0..4 {
        std::fs::copy(
            site.path("data/train/a/0.png"),
            site.path(&format!("data/train/b/{i}.png")),
        )
        .unwrap();
    }
    // 8. Nothing listens at the broker's address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let port_line = good.lines().find(|l| l.starts_with("port")).unwrap();
    site.fails(
        &good.replace(port_line, &format!("port = {port}")),
        9,
        "broker",
    );
    // 9. A CA file that holds no certificate.
    std::fs::write(site.path("ca.pem"), "not a certificate\n").unwrap();
    site.fails(
        &good.replace("[broker]\n", "[broker]\nca_file = \"ca.pem\"\n"),
        9,
        "ca.pem",
    );
    // 10. The state folder's place is taken by a file.
    std::fs::write(site.path("taken"), b"").unwrap();
    site.fails(&good.replace("\"state\"", "\"taken\""), 7, "taken");
    // 11-13. Device profiles: one this build or machine cannot serve (a GPU profile here), a
    // memory budget past the machine's, and a profile that does not exist.
    site.fails(
        &good.replace("threads = 1", "threads = 1\nprofile = \"desktop-gpu\""),
        5,
        "vulkan",
    );
    site.fails(
        &good.replace("threads = 1", "threads = 1\nmemory_budget_mib = 1000000000"),
        5,
        "memory budget 1000000000 MiB",
    );
    site.fails(
        &good.replace("threads = 1", "threads = 1\nprofile = \"toaster\""),
        2,
        "no device profile `toaster`",
    );
    let (code, out) =
        site.doctor(&good.replace("threads = 1", "threads = 1\nprofile = \"x86-cpu\""));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("ok   profile    x86-cpu: memory budget 1024 MiB"),
        "{out}"
    );
    // And the good config still passes; `config check` agrees on the file's problems.
    assert_eq!(site.doctor(good).0, 0);
    let cfg = site.path("site.toml");
    std::fs::write(
        &cfg,
        good.replace("threads = 1", "threads = \"one\"\nthreds = 1"),
    )
    .unwrap();
    let (code, out) = run(&["config", "check", "--config", &cfg.to_string_lossy()]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(":7:11: invalid type") && out.contains(":8:1: unknown field `threds`"),
        "{out}"
    );
}

#[test]
fn config_init_writes_the_commented_example_once_and_it_checks_once_its_files_exist() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("agent.toml");
    let (code, out) = run(&["config", "init", "--out", &cfg.to_string_lossy()]);
    assert_eq!(code, 0, "{out}");
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        text.contains("# ") && text.contains("state_dir = \"run/grey\""),
        "{text}"
    );
    let (code, out) = run(&["config", "init", "--out", &cfg.to_string_lossy()]);
    assert_ne!(code, 0, "overwrote: {out}");
    // Its identity and spec are made by other commands: check names both, with their lines.
    let (code, out) = run(&["config", "check", "--config", &cfg.to_string_lossy()]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("`identity`: no file") && out.contains("`spec`: no file"),
        "{out}"
    );
    let key = dir.path().join("run/grey/identity.key");
    assert_eq!(run(&["identity", "--key", &key.to_string_lossy()]).0, 0);
    let spec = dir.path().join("run/init.safetensors");
    assert_eq!(run(&["init", "--out", &spec.to_string_lossy()]).0, 0);
    let (code, out) = run(&["config", "check", "--config", &cfg.to_string_lossy()]);
    assert_eq!(code, 0, "{out}");
}
