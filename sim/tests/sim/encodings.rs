//! `unifed-sim encodings`: runs made side by side in separate folders join into one table with
//! `--merge --merge-from --report`, and runs of other settings are refused.

use std::path::Path;
use std::process::Command;

fn sim_rounds(rounds: &str, args: &[&str], out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_unifed-sim"))
        .arg("encodings")
        .args(["--rounds", rounds, "--train-samples", "8", "--seeds", "1"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("running unifed-sim")
}

fn sim(args: &[&str], out: &Path) -> std::process::Output {
    sim_rounds("1", args, out)
}

fn rows(out: &Path) -> Vec<serde_json::Value> {
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("encodings.json")).unwrap()).unwrap();
    j["rows"].as_array().unwrap().clone()
}

fn names(rows: &[serde_json::Value]) -> Vec<&str> {
    rows.iter()
        .map(|r| r["encoding"].as_str().unwrap())
        .collect()
}

#[test]
fn runs_made_in_separate_folders_join_into_one_table() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let ok = |o: std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    ok(sim(&["--encodings", "f32,ternaryq8"], &a));
    ok(sim(&["--encodings", "ternaryq8b64"], &b));
    let first = rows(&a);
    let second = rows(&b);
    assert_eq!(names(&first), ["f32", "ternaryq8"]);
    assert_eq!(names(&second), ["ternaryq8b64"]);

    // Joined: the reference first, every row as its own run measured it.
    let from = b.join("encodings.json");
    ok(sim(
        &[
            "--merge",
            "--merge-from",
            from.to_str().unwrap(),
            "--report",
        ],
        &a,
    ));
    let joined = rows(&a);
    assert_eq!(names(&joined), ["f32", "ternaryq8", "ternaryq8b64"]);
    assert_eq!(joined[0]["detail"], first[0]["detail"]);
    assert_eq!(joined[2]["detail"], second[0]["detail"]);
    // A scale per 64 values costs more bytes than per 256; both far below f32.
    let up = |r: &serde_json::Value| r["upload_bytes_per_site_per_round"].as_f64().unwrap();
    assert!(up(&joined[0]) > 15.0 * up(&joined[2]));
    assert!(up(&joined[2]) > up(&joined[1]));
    let reduction = joined[2]["upload_reduction_vs_reference"].as_f64().unwrap();
    assert!((reduction - up(&joined[0]) / up(&joined[2])).abs() < 1e-9);
    let md = std::fs::read_to_string(a.join("encodings.md")).unwrap();
    assert!(md.contains("| ternaryq8b64 | 1 |"), "{md}");
    // Seed by seed against the reference: the reference itself is +0.00.
    assert!(
        md.lines()
            .any(|l| l.starts_with("| f32 |") && l.ends_with("| +0.00 pt | +0.00 |")),
        "{md}"
    );

    // A file of other settings is refused by name.
    let other = dir.path().join("other");
    ok(sim_rounds("2", &["--encodings", "f32"], &other));
    let o = sim(
        &[
            "--merge",
            "--merge-from",
            other.join("encodings.json").to_str().unwrap(),
            "--report",
        ],
        &a,
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("other rounds, epochs, samples or seeds"),
        "{err}"
    );
}
