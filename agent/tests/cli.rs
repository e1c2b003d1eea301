//! The `unifed-agent` binary end to end: its spec, data export from a base folder, and clear
//! errors on bad input.

use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_unifed-agent"))
}

#[test]
fn spec_command_prints_the_digits_cnn_spec_with_its_hash() {
    let out = agent().args(["spec", "--arch", "digits"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["non_bn_params"], 14_213_578);
    assert_eq!(v["hash"].as_str().unwrap().len(), 64);
    assert_eq!(v["spec"]["tensors"].as_array().unwrap().len(), 32);
}

#[test]
fn a_domain_is_rendered_from_a_folder_of_other_digits() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    for d in [3u8, 7] {
        std::fs::create_dir_all(base.join(d.to_string())).unwrap();
        // A dark stroke on white paper; the loader inverts it so ink is bright.
        let img = image::GrayImage::from_fn(20, 20, |x, y| {
            image::Luma([if x == 10 || y == 5 + d as u32 { 0 } else { 255 }])
        });
        img.save(base.join(d.to_string()).join("a.png")).unwrap();
    }
    let out_dir = dir.path().join("out");
    let out = agent()
        .args(["data", "export", "--domain", "texture", "--base-folder"])
        .arg(&base)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for d in ["3", "7"] {
        let file = std::fs::read_dir(out_dir.join(d))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let img = image::open(file).unwrap();
        assert_eq!((img.width(), img.height()), (28, 28));
        assert!(img.color().has_color());
    }
}

#[test]
fn bad_input_gives_a_clear_error_and_a_failing_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let out = agent()
        .args(["data", "export", "--domain", "grey", "--base-folder"])
        .arg(&missing)
        .args(["--out", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not exist") && err.contains("nope"),
        "{err}"
    );
    let out = agent()
        .args([
            "data",
            "export",
            "--domain",
            "sepia",
            "--base-folder",
            "x",
            "--out",
            "y",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown domain `sepia`"));
    let out = agent()
        .args(["--backend", "cuda", "spec"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not compiled in"));
    let bad_idx = dir.path().join("bad.idx");
    std::fs::write(&bad_idx, [0u8, 0, 8, 3, 0, 0, 0, 5]).unwrap();
    let out = agent()
        .args(["data", "export", "--domain", "grey", "--base-images"])
        .arg(&bad_idx)
        .arg("--base-labels")
        .arg(&bad_idx)
        .args(["--out", "y"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("truncated header"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn init_writes_a_pytorch_style_checkpoint_with_the_spec_hash() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("init.safetensors");
    let run = agent()
        .args(["init", "--arch", "mlp", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let spec: serde_json::Value = serde_json::from_slice(
        &agent()
            .args(["spec", "--arch", "mlp"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header["__metadata__"]["unifed.spec_hash"], spec["hash"]);
    assert_eq!(header["fc1.weight"]["shape"], serde_json::json!([16, 100]));
    // PyTorch's BN counter is present so that load_state_dict(strict=True) accepts the file.
    assert_eq!(header["bn1.num_batches_tracked"]["dtype"], "I64");
    assert_eq!(header.as_object().unwrap().len(), 1 + 14 + 2);
}
