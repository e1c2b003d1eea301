//! The `unifed-aggregator` binary's config commands: `config init` writes the commented example,
//! `config check` names every problem of a file with its line and column, and `new-run` puts a
//! federation's state aside.

use std::process::Command;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_unifed-aggregator"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn config_check_names_each_problem_of_the_example_where_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("aggregator.toml");
    let cfg_s = cfg.to_string_lossy().to_string();
    assert_eq!(run(&["config", "init", "--out", &cfg_s]).0, 0);
    assert_ne!(run(&["config", "init", "--out", &cfg_s]).0, 0, "overwrote");
    // As written, its model and key do not exist yet: each named at its line.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let line_of = |key: &str| {
        text.lines()
            .position(|l| l.starts_with(&format!("{key} =")))
            .unwrap()
            + 1
    };
    let (code, out) = run(&["config", "check", "--config", &cfg_s]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(&format!(":{}:1: `model`: no file", line_of("model"))),
        "{out}"
    );
    assert!(
        out.contains(&format!(":{}:1: `key`: no file", line_of("key"))),
        "{out}"
    );
    // An unknown key, a wrong type and a federation that cannot run, all at once.
    let bad = text
        .replace("linger_secs = 30", "linger_seconds = 30")
        .replace("chunk_bytes = 261120", "chunk_bytes = \"big\"")
        .replace("min_sites = ", "min_sites = 0 #");
    std::fs::write(&cfg, &bad).unwrap();
    let (code, out) = run(&["config", "check", "--config", &cfg_s]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("unknown field `linger_seconds`"), "{out}");
    assert!(out.contains("invalid type: string \"big\""), "{out}");
    assert!(out.lines().count() >= 2, "{out}");
}

#[test]
fn new_run_puts_the_state_aside_and_says_when_there_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("aggregator.toml");
    let cfg_s = cfg.to_string_lossy().to_string();
    assert_eq!(run(&["config", "init", "--out", &cfg_s]).0, 0);
    let (code, out) = run(&["new-run", "--config", &cfg_s]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("holds no federation"), "{out}");
}
