//! The `unifed-agent` binary end to end: its spec, data export from a base folder, and clear
//! errors on bad input.

use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_unifed-agent"))
}

/// Asserts that the command succeeded, showing its stderr when not.
fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts that the command failed and that its stderr says `what`.
fn failed_saying(out: &std::process::Output, what: &str) {
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(what), "{err}");
}

#[test]
fn spec_command_prints_the_digits_cnn_spec_with_its_hash() {
    let out = agent().args(["spec", "--arch", "digits"]).output().unwrap();
    succeeded(&out);
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
    succeeded(&out);
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
    failed_saying(&out, "truncated header");
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
    succeeded(&run);
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

/// Writes a small seeded model with `init` and returns its path.
fn small_model(dir: &std::path::Path) -> std::path::PathBuf {
    let model = dir.join("m.safetensors");
    let st = agent()
        .args(["init", "--conv", "4,6,8", "--fc", "32,16", "--out"])
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success());
    model
}

#[test]
fn calibrate_rewrites_only_the_bn_statistics_and_the_result_evaluates() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let out = dir.path().join("cal.safetensors");
    let o = agent()
        .args(["calibrate", "--builtin", "inverted", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    succeeded(&o);
    assert!(
        text.contains("calibrated every BN layer on 642 images"),
        "{text}"
    );
    assert!(text.contains("before") && text.contains("after"), "{text}");
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("cal.safetensors.spec.json")).unwrap(),
    )
    .unwrap();
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let (a, b) = (read(&model), read(&out));
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    let mut stats_changed = 0;
    for t in spec["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let kind = t["kind"].as_str().unwrap();
        let same = a.tensor(name).unwrap().data() == b.tensor(name).unwrap().data();
        if kind.starts_with("BnRunning") {
            stats_changed += usize::from(!same);
        } else {
            assert!(same, "{name} ({kind}) changed");
        }
    }
    assert_eq!(
        stats_changed, 10,
        "every running mean and variance of the 5 BN layers"
    );
    for bn in ["stored", "stream", "calibrate"] {
        let o = agent()
            .args(["evaluate", "--builtin", "inverted", "--bn", bn, "--model"])
            .arg(&out)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{bn}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.contains("% test accuracy on 1024 images"), "{text}");
    }
}

#[test]
fn calibration_input_errors_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let run = |args: &[&str]| {
        let o = agent()
            .args(args)
            .arg("--model")
            .arg(&model)
            .arg("--out")
            .arg(dir.path().join("x.safetensors"))
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&["calibrate", "--images", empty.to_str().unwrap()]);
    assert!(e.contains("empty"), "{e}");
    let e = run(&[
        "calibrate",
        "--builtin",
        "inverted",
        "--mode",
        "stream",
        "--batch-size",
        "1",
    ]);
    assert!(e.contains("batch"), "{e}");
    let e = run(&["calibrate", "--builtin", "inverted", "--mode", "sideways"]);
    assert!(e.contains("--mode `sideways`"), "{e}");
    let o = agent()
        .args([
            "calibrate",
            "--builtin",
            "inverted",
            "--out",
            "y",
            "--model",
        ])
        .arg(dir.path().join("missing.safetensors"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing.safetensors.spec.json"));
}

#[test]
fn predict_prints_a_class_and_probability_for_every_image_in_file_order() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let images = dir.path().join("images");
    std::fs::create_dir_all(&images).unwrap();
    for (i, name) in ["b.png", "a.png", "c.png"].iter().enumerate() {
        image::GrayImage::from_fn(28, 28, |x, y| {
            image::Luma([((x * 9 + y * 3 + i as u32 * 40) % 256) as u8])
        })
        .save(images.join(name))
        .unwrap();
    }
    std::fs::write(images.join("notes.txt"), "not an image").unwrap();
    for bn in ["stored", "stream", "calibrate"] {
        let o = agent()
            .args(["predict", "--batch-size", "3", "--bn", bn, "--model"])
            .arg(&model)
            .arg("--images")
            .arg(&images)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{bn}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "file,class,probability");
        assert_eq!(lines.len(), 4, "{text}");
        for (line, name) in lines[1..].iter().zip(["a.png", "b.png", "c.png"]) {
            let f: Vec<&str> = line.split(',').collect();
            assert!(f[0].ends_with(name), "{line}");
            assert!(f[1].parse::<u8>().is_ok_and(|c| c < 10), "{line}");
            let p: f64 = f[2].parse().unwrap();
            assert!((0.1..=1.0).contains(&p), "{line}");
        }
    }
}

#[test]
fn bench_names_why_there_is_no_pytorch_reference_instead_of_writing_null_alone() {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("python-without-torch");
    std::fs::write(
        &py,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &py,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )
    .unwrap();
    let out_file = dir.path().join("bench.json");
    let out = agent()
        .args([
            "--threads",
            "1",
            "bench",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--python",
        ])
        .arg(&py)
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out_file).unwrap()).unwrap();
    assert_eq!(v["pytorch"], serde_json::json!([]));
    let why = v["pytorch_error"].as_str().unwrap();
    assert!(
        why.contains("python-without-torch cannot import torch")
            && why.contains("No module named 'torch'"),
        "{why}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(why));
    assert!(v["burn"][0]["train_samples_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_measures_each_thread_count_in_one_run_and_names_a_bad_count() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("bench.json");
    let out = agent()
        .args(["bench", "--steps", "2", "--warmup", "1", "--no-torch"])
        .args(["--thread-counts", "1,all,1", "--out"])
        .arg(&out_file)
        .output()
        .unwrap();
    succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out_file).unwrap()).unwrap();
    let all = std::thread::available_parallelism().unwrap().get() as u64;
    let mut want = vec![1];
    if all > 1 {
        want.push(all);
    }
    let got: Vec<u64> = v["burn"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["threads"].as_u64().unwrap())
        .collect();
    assert_eq!(got, want);
    for r in v["burn"].as_array().unwrap() {
        assert!(r["train_samples_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }

    let out = agent()
        .args(["bench", "--no-torch", "--thread-counts", "2,none", "--out"])
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`none` is neither a positive count nor `all`"),
        "{err}"
    );
}

#[test]
fn bench_records_the_matrix_kernels_chosen_and_follows_the_override() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |what: &str| {
        cpuinfo
            .lines()
            .any(|l| l.split_whitespace().any(|w| w == what))
    };
    // The choice (and its variable) exists on x86 only; elsewhere the kernels are never AVX-512.
    let x86 = cfg!(any(target_arch = "x86", target_arch = "x86_64"));
    let avx512 = x86 && has("avx512f");
    let cases = [
        (None, avx512 && has("GenuineIntel")),
        (Some("on"), avx512),
        (Some("off"), false),
        (Some("maybe"), avx512 && has("GenuineIntel")),
    ];
    for (var, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let out_file = dir.path().join("bench.json");
        let mut cmd = agent();
        cmd.args(["bench", "--steps", "1", "--warmup", "0", "--no-torch"])
            .args(["--thread-counts", "1", "--out"])
            .arg(&out_file)
            .env_remove("UNIFED_CPU_AVX512");
        if let Some(v) = var {
            cmd.env("UNIFED_CPU_AVX512", v);
        }
        let out = cmd.output().unwrap();
        succeeded(&out);
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out_file).unwrap()).unwrap();
        assert_eq!(
            v["burn"][0]["avx512_kernels"], want,
            "UNIFED_CPU_AVX512={var:?}"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            err.contains("UNIFED_CPU_AVX512 is `maybe`: it takes `on` or `off`"),
            x86 && var == Some("maybe"),
            "{err}"
        );
    }
}

#[test]
fn bench_layers_times_every_layer_of_the_model_in_the_child_of_a_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("bench.json");
    let out = agent()
        .args([
            "bench",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no-torch",
            "--layers",
        ])
        .args(["--thread-counts", "1", "--out"])
        .arg(&out_file)
        .output()
        .unwrap();
    succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out_file).unwrap()).unwrap();
    let layers = v["burn"][0]["layers"].as_array().expect("layer times");
    let names: Vec<&str> = layers.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names.first(), Some(&"conv1"));
    assert_eq!(names.last(), Some(&"fc3"));
    assert_eq!(names.len(), 18, "{names:?}");
    for l in layers {
        assert!(l["fwd_ms"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["fwd_bwd_ms"].as_f64().unwrap() > 0.0, "{l}");
    }
    // The table names each layer.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("| conv2 |") && stdout.contains("| all |"),
        "{stdout}"
    );
}

#[test]
fn warmup_runs_the_sites_training_and_evaluation_and_leaves_its_state_alone() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let key = dir.path().join("site.key");
    let id = agent()
        .arg("identity")
        .arg("--key")
        .arg(&key)
        .output()
        .unwrap();
    succeeded(&id);
    let public = String::from_utf8_lossy(&id.stdout)
        .lines()
        .next()
        .unwrap()
        .to_string();
    let config = dir.path().join("site.toml");
    std::fs::write(
        &config,
        format!(
            "site = \"grey\"\nfederation = \"f\"\nstate_dir = {state:?}\nidentity = {key:?}\n\
             aggregator_key = \"{public}\"\n\
             [model]\nconv = [4, 6, 8]\nfc = [32, 16]\n\
             [train]\nbatch_size = 8\n\
             [broker]\nhost = \"127.0.0.1\"\nport = 1\n\
             [data]\nbuiltin = \"grey\"\ntrain_samples = 20\n"
        ),
    )
    .unwrap();
    let out = agent()
        .args(["warmup", "--passes", "3", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], "flex");
    // The CPU backend has no kernels to cache.
    assert!(v["kernel_cache"].is_null());
    let passes = v["passes"].as_array().unwrap();
    assert_eq!(passes.len(), 3);
    for p in passes {
        assert!(p["train_s"].as_f64().unwrap() > 0.0);
        assert!(p["evaluate_s"].as_f64().unwrap() > 0.0);
    }
    // Nothing of the site's state was written: a later `train` starts from scratch.
    assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0);

    // A config that names a backend this build lacks fails, naming the feature.
    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&bad, format!("backend = \"cuda\"\n{text}")).unwrap();
    let out = agent()
        .args(["warmup", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    failed_saying(&out, "--features cuda");
}

#[test]
fn identity_makes_its_key_folder_and_a_closed_pipe_ends_it_quietly() {
    let dir = tempfile::tempdir().unwrap();
    // A fresh checkout has no run/grey: the folder is made, and the key in it.
    let key = dir.path().join("run/grey/identity.key");
    let out = agent()
        .args(["identity", "--key", &key.to_string_lossy()])
        .output()
        .unwrap();
    succeeded(&out);
    let first = String::from_utf8(out.stdout).unwrap();
    assert!(first.starts_with("ed25519:"), "{first}");
    // `identity --key K | head -1`: the reader is gone before the command writes. It ends
    // with success and no panic (it printed the key before; nothing was lost).
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = agent()
        .args(["identity", "--key", &key.to_string_lossy()])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}
