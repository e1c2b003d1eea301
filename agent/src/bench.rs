//! The speed benchmark: training and inference samples/s of the FedBN digits CNN (batch 32)
//! on every compiled backend, peak RSS, and PyTorch on the same threads when available.

use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use unifed_models::backend::{Backend, Device, cpu_threads};
use unifed_models::bn::BnPass;
use unifed_models::zoo::{DigitsCnnConfig, Net, seeded};

mod layers;
mod samples;

use samples::Samples;

/// Options of the benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Timed training steps; inference times as many batches of 32 and a fifth as many of 256.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Untimed warm-up steps first, of training and of each inference batch size (GPU backends
    /// compile and autotune kernels then).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Backends to measure (default: every compiled one), e.g. `flex,vulkan`.
    #[arg(long, value_delimiter = ',')]
    backends: Vec<String>,
    /// Device of the PyTorch reference: `cpu` (same threads) or `cuda`.
    #[arg(long, default_value = "cpu")]
    torch_device: String,
    /// Result file (JSON).
    #[arg(long, default_value = "results/bench.json")]
    out: PathBuf,
    /// Python interpreter with torch for the reference (used alone when given; default: the
    /// first of $UNIFED_TORCH_PYTHON, .venv/bin/python and python3 that imports torch).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The reference script (default: `scripts/torch_bench.py` of the source tree this binary
    /// was built from; give it on a machine that runs a copied binary). It imports
    /// `make_torch_fixtures.py` from its own folder.
    #[arg(long)]
    torch_script: Option<PathBuf>,
    /// Skip the PyTorch reference.
    #[arg(long)]
    no_torch: bool,
    /// CPU thread counts to measure one after the other in one run, e.g. `2,all` (`all`: every
    /// core); burn's CPU backend runs in a child process per count (its thread pool is fixed at
    /// start), PyTorch with the same count. Default: the threads of this process only.
    #[arg(long, value_delimiter = ',')]
    thread_counts: Vec<String>,
    /// Also time each layer of the model alone, forward and forward plus backward (`--steps`
    /// passes each after `--warmup`), in burn and in PyTorch on the same threads (CPU backend
    /// only), to show where the time goes.
    #[arg(long)]
    layers: bool,
}

/// The thread counts `--thread-counts` names, in order, duplicates dropped (`all` is every
/// core).
fn thread_counts(list: &[String]) -> Result<Vec<usize>> {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out: Vec<usize> = Vec::new();
    for t in list {
        let n = match t.trim() {
            "all" => all,
            s => s
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| {
                    format!("--thread-counts: `{s}` is neither a positive count nor `all`")
                })?,
        };
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// burn's CPU figures at `threads` threads, measured by this binary in a child process.
fn cpu_row_in_child(backend: Backend, threads: usize, args: &Args) -> Result<Value> {
    let out = std::env::temp_dir().join(format!(
        "unifed-bench-{}-{threads}.json",
        std::process::id()
    ));
    let exe = std::env::current_exe().context("finding this executable")?;
    let status = Command::new(exe)
        .args(["--threads", &threads.to_string(), "bench", "--no-torch"])
        .args(["--backends", &backend.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(args.layers.then_some("--layers"))
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .context("starting the benchmark child")?;
    if !status.success() {
        anyhow::bail!("the benchmark child at {threads} threads failed ({status})");
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    let _ = std::fs::remove_file(&out);
    v["burn"]
        .get(0)
        .cloned()
        .context("the benchmark child wrote no burn figures")
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux: `clear_refs` 5); where
/// that fails the peak keeps counting from the start.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak RSS (`VmHWM`), MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The first `n` of `samples` as a batch on `device`: [n, 3 * 28 * 28] and labels.
fn batch(
    samples: &Samples,
    n: usize,
    device: &Device,
) -> (
    burn::tensor::Tensor<2>,
    burn::tensor::Tensor<1, burn::tensor::Int>,
) {
    use burn::tensor::{Tensor, TensorData};
    let (x, y) = samples.first(n);
    (
        Tensor::from_data(
            TensorData::new(x.to_vec(), [n, samples::SAMPLE_LEN]),
            device,
        ),
        Tensor::from_data(TensorData::new(y.to_vec(), [n]), device),
    )
}

/// burn's figures on `backend`: whole-model training and inference, and each layer alone when
/// `layers` and the backend is the CPU's.
fn bench_backend(backend: Backend, warmup: usize, steps: usize, layers: bool) -> Result<Value> {
    use burn::module::Module;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{GradientsParams, SgdConfig};
    let device = backend.device().map_err(anyhow::Error::msg)?;
    let ad = device.clone().autodiff();
    let mut model = seeded(&device, 0, |d| DigitsCnnConfig::default().init(d)).train();
    let mut optim = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&ad);
    let samples = Samples::new(256, &device);
    // The peak RSS is the model's: loading the images it was made from does not count.
    unifed_net::release_free_memory();
    reset_peak_rss();
    let (x, y) = batch(&samples, 32, &ad);
    let mut step = |model: burn_model::M| {
        let logits = model.forward(x.clone(), &mut BnPass::standard());
        let loss = loss_fn.forward(logits, y.clone());
        let _ = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.step(0.01, model, grads)
    };
    for _ in 0..warmup {
        model = step(model);
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        model = step(model);
    }
    let train = (steps * 32) as f64 / t0.elapsed().as_secs_f64();
    let eval = model.valid();
    let infer = |n: usize, warm: usize, iters: usize| {
        let (x, _) = batch(&samples, n, &device);
        let run = || {
            let out = eval.forward(x.clone(), &mut BnPass::standard());
            let _ = out.into_data();
        };
        for _ in 0..warm {
            run();
        }
        let t0 = Instant::now();
        for _ in 0..iters {
            run();
        }
        (n * iters) as f64 / t0.elapsed().as_secs_f64()
    };
    // Inference: `steps` timed batches of 32 and a fifth as many of 256 (at least one each),
    // after `warmup` untimed ones.
    let b32 = infer(32, warmup, steps.max(1));
    let b256 = infer(256, warmup, (steps / 5).max(1));
    let peak = peak_rss_mib();
    // A GPU's work is asynchronous, so its layers are not timed one by one.
    let layers = if layers && !backend.is_gpu() {
        let times = layers::digits_layers(&DigitsCnnConfig::default(), 32)
            .iter()
            .map(|l| layers::time_layer(l, &ad, warmup, steps))
            .collect::<Result<Vec<_>, String>>()
            .map_err(anyhow::Error::msg)?;
        Some(times)
    } else {
        None
    };
    Ok(json!({
        "framework": "burn 0.22.1",
        "backend": backend.to_string(),
        "threads": cpu_threads(),
        // Which kernels the CPU backend's matrix products ran on (Intel's AVX-512 or not).
        "avx512_kernels": (!backend.is_gpu()).then(unifed_models::backend::cpu_avx512),
        "train_samples_per_s": train,
        "infer_b32_samples_per_s": b32,
        "infer_b256_samples_per_s": b256,
        "peak_rss_mib": peak,
        "input": samples.what,
        "layers": layers,
    }))
}

mod burn_model {
    pub type M = unifed_models::zoo::DigitsCnn;
}

/// Prints each CPU row's layer times beside PyTorch's on the same threads.
fn print_layers(rows: &[Value], torch: &[Value]) {
    let times = |v: &Value| -> Vec<layers::LayerTime> {
        serde_json::from_value(v["layers"].clone()).unwrap_or_default()
    };
    for r in rows.iter().filter(|r| r["layers"].is_array()) {
        let ours = times(r);
        let theirs = torch
            .iter()
            .find(|t| t["threads"] == r["threads"])
            .map(times)
            .unwrap_or_default();
        println!(
            "\nLayers on {} thread(s), ms per pass (batch 32; each ends in a sum of its output):",
            r["threads"]
        );
        println!(
            "| layer | burn fwd | burn fwd+bwd | PyTorch fwd | PyTorch fwd+bwd | fwd+bwd burn - PyTorch |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        let (mut sum_ours, mut sum_theirs) = (0.0, 0.0);
        for l in &ours {
            let t = theirs.iter().find(|t| t.name == l.name);
            let (tf, tb) = t.map_or((f64::NAN, f64::NAN), |t| (t.fwd_ms, t.fwd_bwd_ms));
            sum_ours += l.fwd_bwd_ms;
            sum_theirs += tb;
            println!(
                "| {} | {:.2} | {:.2} | {tf:.2} | {tb:.2} | {:+.2} |",
                l.name,
                l.fwd_ms,
                l.fwd_bwd_ms,
                l.fwd_bwd_ms - tb
            );
        }
        println!(
            "| all | | {sum_ours:.1} | | {sum_theirs:.1} | {:+.1} |",
            sum_ours - sum_theirs
        );
    }
}

/// The first of the candidate interpreters that imports torch: `explicit` alone when given,
/// else $UNIFED_TORCH_PYTHON, `.venv/bin/python` and `python3`. The error names every
/// candidate and why it failed.
fn find_python(explicit: &Option<PathBuf>) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = match explicit {
        Some(p) => vec![p.clone()],
        None => std::env::var_os("UNIFED_TORCH_PYTHON")
            .map(PathBuf::from)
            .into_iter()
            .chain([PathBuf::from(".venv/bin/python"), PathBuf::from("python3")])
            .collect(),
    };
    let mut why = Vec::new();
    for p in candidates {
        match Command::new(&p).args(["-c", "import torch"]).output() {
            Ok(o) if o.status.success() => return Ok(p),
            Ok(o) => why.push(format!(
                "{} cannot import torch ({}: {})",
                p.display(),
                o.status,
                last_line(&o.stderr)
            )),
            Err(e) => why.push(format!("{} does not run ({e})", p.display())),
        }
    }
    Err(format!("no Python with torch: {}", why.join("; ")))
}

/// The last non-empty line of a process's output, for an error message.
fn last_line(out: &[u8]) -> String {
    String::from_utf8_lossy(out)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .trim()
        .to_string()
}

/// Runs the PyTorch reference with `py` on `threads` threads, timing the `layers` too when
/// given (their JSON list); its JSON line, or why there is none.
fn torch_reference(
    py: &Path,
    args: &Args,
    threads: usize,
    (layers, inputs): (Option<&str>, &Path),
) -> Result<Value, String> {
    println!(
        "benchmarking PyTorch with {} on {threads} thread(s) ...",
        py.display()
    );
    let script = args.torch_script.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch_bench.py")
    });
    let out = Command::new(py)
        .arg(&script)
        .args([
            "--threads",
            &threads.to_string(),
            "--steps",
            &args.steps.to_string(),
            "--warmup",
            &args.warmup.to_string(),
            "--device",
            &args.torch_device,
        ])
        .args(layers.into_iter().flat_map(|l| ["--layers", l]))
        .arg("--inputs")
        .arg(inputs)
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .output()
        .map_err(|e| format!("running {} {}: {e}", py.display(), script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed ({}): {}",
            py.display(),
            script.display(),
            out.status,
            last_line(&out.stderr)
        ));
    }
    let line = last_line(&out.stdout);
    serde_json::from_str::<Value>(&line).map_err(|e| {
        format!("the reference's last output line is not its JSON result ({e}): {line}")
    })
}

/// PyTorch's figures at each of `counts` threads, on the samples burn's side measured on; or
/// why there are none.
fn torch_rows(args: &Args, counts: &[usize]) -> Result<(Vec<Value>, Option<String>)> {
    let mut torch = Vec::new();
    let mut torch_error = None;
    if args.no_torch {
        torch_error = Some("skipped (--no-torch)".to_string());
    } else {
        let spec = args.layers.then(|| {
            serde_json::to_string(&layers::digits_layers(&DigitsCnnConfig::default(), 32))
                .expect("a list of layers serialises")
        });
        match find_python(&args.python) {
            Ok(py) => {
                // The samples burn's side measured on, the same bytes for PyTorch's.
                let inputs = std::env::temp_dir()
                    .join(format!("unifed-bench-{}-samples.bin", std::process::id()));
                Samples::new(256, &Backend::Flex.device().map_err(anyhow::Error::msg)?)
                    .write(&inputs)?;
                for &n in counts {
                    match torch_reference(&py, args, n, (spec.as_deref(), &inputs)) {
                        Ok(v) => torch.push(v),
                        Err(why) => {
                            torch_error = Some(why);
                            break;
                        }
                    }
                }
                let _ = std::fs::remove_file(&inputs);
            }
            Err(why) => torch_error = Some(why),
        }
    }
    Ok((torch, torch_error))
}

/// Prints burn's and PyTorch's rows as a table, and each burn row against PyTorch on the same
/// threads (a GPU row against the one reference); returns those ratios.
fn print_table(args: &Args, rows: &[Value], torch: &[Value]) -> Vec<Value> {
    let f = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    println!(
        "\n| framework | backend | threads | train samples/s (b32) | infer samples/s (b32) | infer samples/s (b256) | peak RSS MiB |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for r in rows.iter().chain(torch) {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.0} |",
            r.get("framework")
                .and_then(Value::as_str)
                .unwrap_or("pytorch"),
            r.get("backend").and_then(Value::as_str).unwrap_or("cpu"),
            r.get("threads").and_then(Value::as_u64).unwrap_or(0),
            f(r, "train_samples_per_s"),
            f(r, "infer_b32_samples_per_s"),
            f(r, "infer_b256_samples_per_s"),
            f(r, "peak_rss_mib")
        );
    }
    let mut ratios = Vec::new();
    // Each burn row against PyTorch on the same threads (a GPU row against the one reference).
    let threads = |v: &Value| v.get("threads").and_then(Value::as_u64);
    for r in rows {
        let cpu = r["backend"].as_str() == Some("flex");
        let Some(t) = torch
            .iter()
            .find(|t| !cpu || args.torch_device != "cpu" || threads(t) == threads(r))
        else {
            continue;
        };
        let ratio = json!({
            "backend": r["backend"],
            "threads": r["threads"],
            "train": f(r, "train_samples_per_s") / f(t, "train_samples_per_s"),
            "infer_b32": f(r, "infer_b32_samples_per_s") / f(t, "infer_b32_samples_per_s"),
            "infer_b256": f(r, "infer_b256_samples_per_s") / f(t, "infer_b256_samples_per_s"),
        });
        println!(
            "burn {} on {} thread(s) / PyTorch: train {:.2}x, infer b32 {:.2}x, infer b256 {:.2}x",
            r["backend"].as_str().unwrap_or("?"),
            threads(r).unwrap_or(0),
            f(&ratio, "train"),
            f(&ratio, "infer_b32"),
            f(&ratio, "infer_b256")
        );
        ratios.push(ratio);
    }
    ratios
}

pub fn run(args: &Args) -> Result<()> {
    let mut rows = Vec::new();
    let backends: Vec<Backend> = if args.backends.is_empty() {
        Backend::compiled()
    } else {
        args.backends
            .iter()
            .map(|b| b.parse().map_err(anyhow::Error::msg))
            .collect::<Result<_>>()?
    };
    let counts = thread_counts(&args.thread_counts)?;
    let counts = if counts.is_empty() {
        vec![cpu_threads()]
    } else {
        counts
    };
    for backend in backends {
        if backend == Backend::Flex && !args.thread_counts.is_empty() {
            for &n in &counts {
                println!("benchmarking burn on {backend} with {n} thread(s) ...");
                rows.push(cpu_row_in_child(backend, n, args)?);
            }
        } else {
            println!("benchmarking burn on {backend} ...");
            rows.push(
                bench_backend(backend, args.warmup, args.steps, args.layers)
                    .with_context(|| format!("backend {backend}"))?,
            );
        }
    }
    // PyTorch at every thread count (on CUDA once).
    let torch_counts = if args.torch_device == "cpu" {
        counts.clone()
    } else {
        vec![cpu_threads()]
    };
    let (torch, torch_error) = torch_rows(args, &torch_counts)?;
    if let Some(why) = &torch_error {
        println!("no PyTorch reference: {why}");
    }
    let ratios = print_table(args, &rows, &torch);
    if args.layers {
        print_layers(&rows, &torch);
    }
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    // The GPU, where there is one (best effort: nvidia-smi).
    let gpu = Command::new("nvidia-smi")
        .args(["--query-gpu=name,driver_version", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&json!({
            "cpu": host,
            "gpu": gpu,
            "steps": args.steps,
            "warmup": args.warmup,
            "burn": rows,
            "pytorch": torch,
            "pytorch_error": torch_error,
            "ratio_burn_over_pytorch": ratios,
        }))?,
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}
