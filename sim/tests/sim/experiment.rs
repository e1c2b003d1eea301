//! The experiment runner on a small preset: the runs, the tables computed from them
//! (best-on-validation selection, mean over sites, local - global BN), resuming from finished
//! runs, and refusing runs of other settings.

use std::path::Path;
use unifed_models::data::BuiltinData;
use unifed_sim::experiment::{Preset, RunResult, run};

const PRESET: &str = r#"
name = "tiny"
algorithms = [{ name = "fedavg" }, { name = "fedprox", mu = 0.01 }]
policies = ["local", "global"]
seeds = 1
rounds = 2
sizes = { train = 32, val = 16, test = 16 }
model = { conv = [4, 6, 8], fc = [32, 16] }
"#;

/// [`PRESET`] with FedAvg under `local` BN only.
fn fedavg_local() -> String {
    PRESET
        .replace(
            "algorithms = [{ name = \"fedavg\" }, { name = \"fedprox\", mu = 0.01 }]",
            "algorithms = [{ name = \"fedavg\" }]",
        )
        .replace(
            "policies = [\"local\", \"global\"]",
            "policies = [\"local\"]",
        )
}

fn preset(text: &str, dir: &Path) -> Preset {
    let p = dir.join("preset.toml");
    std::fs::write(&p, text).unwrap();
    Preset::load(&p).unwrap()
}

fn json(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("internal.json")).unwrap()).unwrap()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn a_preset_runs_every_combination_writes_the_tables_and_resumes_from_finished_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let data = BuiltinData::load().unwrap();
    let p = preset(PRESET, dir.path());
    let mut lines = Vec::new();
    let done = run(&p, &data, &out, 1, |l| lines.push(l.to_string())).unwrap();
    assert_eq!((done.trained, done.reused), (4, 0));
    // One progress line per round of every run, each with an estimate of the time left.
    assert_eq!(lines.len(), 8);
    assert!(lines.iter().all(|l| l.contains("left")), "{lines:?}");

    let j = json(&out);
    let names: Vec<&str> = j["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["method"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "FedBN",
            "FedAvg",
            "FedProx (local BN)",
            "FedProx (global BN)"
        ]
    );
    // The tables are what the run files say: each site's test accuracy at the round of its
    // best validation accuracy, and the final round's.
    for (m, (alg, policy)) in j["methods"].as_array().unwrap().iter().zip([
        ("fedavg", "local"),
        ("fedavg", "global"),
        ("fedprox", "local"),
        ("fedprox", "global"),
    ]) {
        let file = out.join(format!("runs/{alg}-{policy}-seed0.json"));
        let r: RunResult = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        assert_eq!(r.sites.len(), 5);
        assert_eq!((r.rounds.len(), r.val.len()), (2, 2));
        let best: Vec<f64> = (0..5)
            .map(|k| {
                let pick = if r.val[1][k] > r.val[0][k] { 1 } else { 0 };
                r.rounds[pick].accuracy[k]
            })
            .collect();
        let got: Vec<f64> =
            serde_json::from_value(m["best_on_val"]["per_seed_per_site"][0].clone()).unwrap();
        assert_eq!(got, best);
        let last: Vec<f64> =
            serde_json::from_value(m["final"]["per_seed_per_site"][0].clone()).unwrap();
        assert_eq!(last, r.rounds[1].accuracy);
        assert!(best.iter().chain(&last).all(|a| (0.0..=1.0).contains(a)));
    }
    // local - global per algorithm, from the means over sites.
    let means = |i: usize, key: &str| -> f64 {
        serde_json::from_value::<Vec<f64>>(j["methods"][i][key]["mean_over_sites_per_seed"].clone())
            .unwrap()[0]
    };
    let gain: Vec<f64> =
        serde_json::from_value(j["local_minus_global"][0]["final_per_seed"].clone()).unwrap();
    assert_eq!(gain, vec![means(0, "final") - means(1, "final")]);
    assert_eq!(
        means(0, "final"),
        mean(
            &serde_json::from_value::<Vec<f64>>(
                j["methods"][0]["final"]["per_seed_per_site"][0].clone()
            )
            .unwrap()
        )
    );
    let md = std::fs::read_to_string(out.join("internal.md")).unwrap();
    assert!(md.contains("| FedBN | best on val |"), "{md}");
    // Loss curves: each site's reported training loss and test loss per round, and their mean,
    // charted with the accuracy per site.
    let r: RunResult =
        serde_json::from_slice(&std::fs::read(out.join("runs/fedavg-local-seed0.json")).unwrap())
            .unwrap();
    let train: Vec<Vec<f64>> =
        serde_json::from_value(j["methods"][0]["train_loss_per_round"]["per_site"].clone())
            .unwrap();
    for (k, site) in train.iter().enumerate() {
        for (i, v) in site.iter().enumerate() {
            let reported = r.rounds[i].train_loss[k].unwrap();
            assert!(reported.is_finite() && reported > 0.0);
            assert_eq!(*v, reported);
        }
    }
    let mean_test: Vec<f64> =
        serde_json::from_value(j["methods"][0]["test_loss_per_round"]["mean"].clone()).unwrap();
    assert!((mean_test[1] - mean(&r.rounds[1].test_loss)).abs() < 1e-12);
    for f in [
        "internal.svg",
        "internal-loss.svg",
        "charts/fedbn.svg",
        "charts/fedprox-local-bn-loss.svg",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }

    // Started again, it trains nothing and writes the same tables.
    let before = std::fs::read(out.join("internal.json")).unwrap();
    let done = run(&p, &data, &out, 1, |_| {}).unwrap();
    assert_eq!((done.trained, done.reused), (0, 4));
    assert_eq!(std::fs::read(out.join("internal.json")).unwrap(), before);
    // A second seed trains only the new runs.
    let two = preset(&PRESET.replace("seeds = 1", "seeds = 2"), dir.path());
    let done = run(&two, &data, &out, 1, |_| {}).unwrap();
    assert_eq!((done.trained, done.reused), (4, 4));
    assert_eq!(json(&out)["methods"][0]["seeds"], serde_json::json!([0, 1]));
    // A run made under the old shuffle rule (its settings name none) counts as not run: it is
    // trained again, under the rule in force, and the others are reused.
    let file = out.join("runs/fedavg-global-seed1.json");
    let mut old: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(old["settings"]["shuffle"], "splitmix64(seed, round, site)");
    old["settings"].as_object_mut().unwrap().remove("shuffle");
    std::fs::write(&file, serde_json::to_vec(&old).unwrap()).unwrap();
    let done = run(&two, &data, &out, 1, |_| {}).unwrap();
    assert_eq!((done.trained, done.reused), (1, 7));
    let again: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(
        again["settings"]["shuffle"],
        "splitmix64(seed, round, site)"
    );
    // Runs of other settings are refused, naming the file, never mixed in.
    let longer = preset(&PRESET.replace("rounds = 2", "rounds = 3"), dir.path());
    let err = run(&longer, &data, &out, 1, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("fedavg-local-seed0.json"), "{err}");
}

#[test]
fn a_bad_preset_is_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.toml");
    for (text, needle) in [
        (PRESET.replace("rounds = 2", "roundz = 2"), "roundz"),
        (PRESET.replace("val = 16", "val = 0"), "sizes.val"),
        (
            PRESET.replace("mu = 0.01", "mu = -1.0"),
            "FedProx mu must be finite and non-negative",
        ),
        (
            PRESET.replace("\"global\"", "\"shared\""),
            "unknown bn_policy `shared`",
        ),
    ] {
        std::fs::write(&p, text).unwrap();
        let err = format!("{:#}", Preset::load(&p).unwrap_err());
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn the_committed_presets_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/experiments");
    let mut n = 0;
    let data = BuiltinData::load().unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = Preset::load(&e.unwrap().path()).unwrap();
        assert!(p.seeds >= 1 && !p.algorithms.is_empty());
        // A label-skewed preset's draw must leave every site enough images.
        if matches!(p.data, unifed_sim::experiment::DataSource::Dirichlet(_)) {
            let (_, sites) = unifed_sim::experiment::load_sites(&p, &data).unwrap();
            assert_eq!(sites.len(), 10);
        }
        n += 1;
    }
    assert!(n >= 1);
}

#[test]
fn the_runner_takes_a_folder_of_domains_it_has_never_seen_without_code_changes() {
    use unifed_models::data::{Domain, SplitSizes};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("domains");
    let data = BuiltinData::load().unwrap();
    let sizes = SplitSizes {
        train: 24,
        val: 12,
        test: 12,
        ..SplitSizes::default()
    };
    // Two sites under names the runner has never seen, as PNG files in class folders.
    for (name, d) in [("hospital-a", Domain::Grey), ("hospital-b", Domain::Noisy)] {
        let dd = data.domain(d, &sizes, 0).unwrap();
        for (split, s) in [("train", &dd.train), ("val", &dd.val), ("test", &dd.test)] {
            s.write_folder(&root.join(name).join(split)).unwrap();
        }
    }
    let text = PRESET
        .replace("name = \"tiny\"", "name = \"folder\"")
        .replace(
            "algorithms = [{ name = \"fedavg\" }, { name = \"fedprox\", mu = 0.01 }]",
            "algorithms = [{ name = \"fedavg\" }]",
        )
        + &format!("data = {{ folder = {:?} }}\n", root.display().to_string());
    let p = preset(&text, dir.path());
    let out = dir.path().join("out");
    let done = run(&p, &data, &out, 1, |_| {}).unwrap();
    assert_eq!((done.trained, done.reused), (2, 0));
    let j = json(&out);
    assert_eq!(j["sites"], serde_json::json!(["hospital-a", "hospital-b"]));
    // The table names the splits the folder holds, not the preset's sizes.
    let md = std::fs::read_to_string(out.join("internal.md")).unwrap();
    assert!(
        md.contains("; 24 training, 12 validation and 12 test images per site."),
        "{md}"
    );
    let gain = &j["local_minus_global"][0];
    assert_eq!(gain["algorithm"]["name"], "fedavg");
    let r: RunResult =
        serde_json::from_slice(&std::fs::read(out.join("runs/fedavg-local-seed0.json")).unwrap())
            .unwrap();
    assert_eq!((r.rounds.len(), r.rounds[0].accuracy.len()), (2, 2));

    // A domain without validation images, or a single domain, is refused by name.
    std::fs::remove_dir_all(root.join("hospital-b/val")).unwrap();
    let again = dir.path().join("again");
    let err = format!("{:#}", run(&p, &data, &again, 1, |_| {}).unwrap_err());
    assert!(
        err.contains("hospital-b") && err.contains("validation"),
        "{err}"
    );
    std::fs::remove_dir_all(root.join("hospital-b")).unwrap();
    let err = format!("{:#}", run(&p, &data, &again, 1, |_| {}).unwrap_err());
    assert!(err.contains("at least two"), "{err}");
}

#[test]
fn every_internal_run_trains_before_any_held_out_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = BuiltinData::load().unwrap();
    let text = fedavg_local().replace("seeds = 1", "seeds = 2") + "[external]\n";
    let p = preset(&text, dir.path());
    let mut lines = Vec::new();
    let done = run(&p, &data, &dir.path().join("out"), 1, |l| {
        lines.push(l.to_string())
    })
    .unwrap();
    // Two internal runs (seeds 0 and 1), then five held-out domains for each seed.
    assert_eq!(done.trained, 12);
    let firsts: Vec<&String> = lines.iter().filter(|l| l.contains("round 1/2")).collect();
    assert_eq!(firsts.len(), 12);
    assert!(
        firsts[..2].iter().all(|l| !l.contains("held out")),
        "{firsts:?}"
    );
    assert!(firsts[1].contains("seed 1"), "{firsts:?}");
    assert!(
        firsts[2..].iter().all(|l| l.contains("held out")),
        "{firsts:?}"
    );
    assert!(
        firsts[2..7].iter().all(|l| l.contains("seed 0")),
        "{firsts:?}"
    );
}

#[test]
fn the_external_table_holds_each_domain_out_in_turn_and_scores_it_three_ways() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let data = BuiltinData::load().unwrap();
    let text = PRESET.replace(
        "algorithms = [{ name = \"fedavg\" }, { name = \"fedprox\", mu = 0.01 }]",
        "algorithms = [{ name = \"fedavg\" }]",
    ) + "external = { stream = { tau = 0.5, batch_size = 8, start = \"stored\" } }\n";
    let p = preset(&text, dir.path());
    let done = run(&p, &data, &out, 1, |_| {}).unwrap();
    // Two internal runs, and five held-out domains under each of two policies.
    assert_eq!((done.trained, done.reused), (12, 0));
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("external.json")).unwrap()).unwrap();
    let domains: Vec<String> = serde_json::from_value(j["domains"].clone()).unwrap();
    assert_eq!(domains, ["grey", "texture", "lowres", "fonts", "noisy"]);
    for (m, name) in j["methods"]
        .as_array()
        .unwrap()
        .iter()
        .zip(["FedBN", "FedAvg"])
    {
        assert_eq!(m["method"], name);
        for key in ["deployed", "stream", "calibrate"] {
            let v: Vec<Vec<f64>> =
                serde_json::from_value(m[key]["per_domain_per_seed"].clone()).unwrap();
            assert_eq!(v.len(), 5);
            assert!(v.iter().flatten().all(|a| (0.0..=1.0).contains(a)));
            let mean: Vec<f64> =
                serde_json::from_value(m[key]["mean_over_domains_per_seed"].clone()).unwrap();
            let want = v.iter().map(|d| d[0]).sum::<f64>() / 5.0;
            assert!((mean[0] - want).abs() < 1e-12);
        }
    }
    // Also from the onboarding package: under global BN it is the global model, so each of
    // its estimates is the model's own; under local BN the training sites' BN pooled (the
    // default `affine+stats`), a start of its own.
    let per_domain = |m: &serde_json::Value, key: &str| -> Vec<Vec<f64>> {
        serde_json::from_value(m[key]["per_domain_per_seed"].clone()).unwrap()
    };
    let (fedbn, fedavg) = (&j["methods"][0], &j["methods"][1]);
    for (own, package) in [
        ("deployed", "package"),
        ("stream", "package + stream"),
        ("calibrate", "package + calibrate"),
    ] {
        assert_eq!(
            per_domain(fedavg, own),
            per_domain(fedavg, package),
            "{package}"
        );
        let v = per_domain(fedbn, package);
        assert_eq!(v.len(), 5);
        assert!(v.iter().flatten().all(|a| (0.0..=1.0).contains(a)));
    }
    assert_ne!(per_domain(fedbn, "deployed"), per_domain(fedbn, "package"));
    // Each held-out run trained on the four other domains.
    let r: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.join("runs/external/fedavg-local-seed0-texture.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(r["held_out"], "texture");
    assert!(r["package"]["calibrate"].is_number(), "{r}");
    assert_eq!(r["package"]["bn_sharing"], "affine+stats");
    assert!(
        std::fs::read_to_string(out.join("external.md"))
            .unwrap()
            .contains("| FedBN | stream |")
    );
    // Started again, nothing is trained.
    let done = run(&p, &data, &out, 1, |_| {}).unwrap();
    assert_eq!((done.trained, done.reused), (0, 12));

    // With one held-out run missing, a report keeps the other domains' cells and leaves the
    // mean over domains empty for that method, naming the seeds it holds.
    std::fs::remove_file(out.join("runs/external/fedavg-global-seed0-fonts.json")).unwrap();
    let done = unifed_sim::experiment::report(&p, &data, &out).unwrap();
    assert_eq!((done.trained, done.reused, done.missing), (0, 11, 1));
    let part: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("external.json")).unwrap()).unwrap();
    assert_eq!(part["methods"][0]["deployed"], j["methods"][0]["deployed"]);
    let fedavg = &part["methods"][1]["deployed"];
    assert_eq!(
        fedavg["seeds_per_domain"],
        serde_json::json!([[0], [0], [0], [], [0]])
    );
    assert_eq!(fedavg["seeds"], serde_json::json!([]));
    let md = std::fs::read_to_string(out.join("external.md")).unwrap();
    assert!(md.contains("9 of 10 held-out runs have finished"), "{md}");
    assert!(
        md.contains("| FedAvg | deployed |") && md.contains("not run yet"),
        "{md}"
    );
    // A cell of one seed says so instead of showing a spread of zero.
    assert!(md.contains(" (1 seed) |") && !md.contains("(0.00)"), "{md}");
}

#[test]
fn label_skew_spreads_the_pooled_domains_over_ten_sites_and_samples_half_of_them_each_round() {
    use unifed_sim::experiment::load_sites;
    let dir = tempfile::tempdir().unwrap();
    let data = BuiltinData::load().unwrap();
    let text = fedavg_local().replace(
        "sizes = { train = 32, val = 16, test = 16 }",
        "sizes = { train = 100, val = 20, test = 20 }",
    ) + "fraction = 0.5\ndata = { dirichlet = { alpha = 0.1, sites = 10 } }\n";
    let p = preset(&text, dir.path());
    // Every pooled image lands on one site, and the sites' label mixes are skewed: on average
    // one class holds well over the 10 % it would under an even spread.
    let (_, sites) = load_sites(&p, &data).unwrap();
    assert_eq!(sites.len(), 10);
    assert_eq!(sites[3].name, "site-03");
    let total: usize = sites.iter().map(|s| s.train.len()).sum();
    assert_eq!(total, 5 * 100);
    assert_eq!(sites.iter().map(|s| s.test.len()).sum::<usize>(), 5 * 20);
    let top_share: f64 = sites
        .iter()
        .map(|s| {
            let counts = s.train.class_counts(10);
            *counts.iter().max().unwrap() as f64 / s.train.len() as f64
        })
        .sum::<f64>()
        / 10.0;
    assert!(top_share > 0.4, "{top_share}");
    assert!(
        sites
            .iter()
            .all(|s| s.train.len() >= 10 && s.val.len() >= 2)
    );
    let out = dir.path().join("out");
    run(&p, &data, &out, 1, |_| {}).unwrap();
    let r: RunResult =
        serde_json::from_slice(&std::fs::read(out.join("runs/fedavg-local-seed0.json")).unwrap())
            .unwrap();
    for rec in &r.rounds {
        // Every site evaluates every model; five of the ten trained in each round.
        assert_eq!(rec.accuracy.len(), 10);
        assert_eq!(rec.train_loss.iter().filter(|l| l.is_some()).count(), 5);
    }
}

#[test]
fn runs_trained_two_at_a_time_equal_runs_trained_one_at_a_time_and_a_report_shows_what_is_missing()
{
    use unifed_sim::experiment::report;
    let dir = tempfile::tempdir().unwrap();
    let data = BuiltinData::load().unwrap();
    let p = preset(&PRESET.replace("seeds = 1", "seeds = 2"), dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    run(&p, &data, &one, 1, |_| {}).unwrap();
    let mut lines = Vec::new();
    let done = run(&p, &data, &two, 2, |l| lines.push(l.to_string())).unwrap();
    assert_eq!((done.trained, done.reused, done.missing), (8, 0, 0));
    assert_eq!(lines.len(), 16);
    // Seed by seed: every method's seed 0 is queued (and numbered) before any seed 1. (Which
    // job prints first depends on the two workers' timing, so the numbers are checked.)
    for l in &lines {
        let k: usize = l[1..l.find('/').unwrap()].parse().unwrap();
        let seed = if k <= 4 { "seed 0" } else { "seed 1" };
        assert!(l.contains(seed), "{lines:?}");
    }
    let read = |out: &Path, stem: &str| -> RunResult {
        let mut r: RunResult =
            serde_json::from_slice(&std::fs::read(out.join(format!("runs/{stem}.json"))).unwrap())
                .unwrap();
        // Wall-clock seconds are the only thing allowed to differ.
        r.val_seconds.clear();
        r.rounds.iter_mut().for_each(|x| x.seconds = 0.0);
        r
    };
    for alg in ["fedavg", "fedprox"] {
        for policy in ["local", "global"] {
            for seed in 0..2 {
                let stem = format!("{alg}-{policy}-seed{seed}");
                assert_eq!(read(&one, &stem), read(&two, &stem), "{stem}");
            }
        }
    }

    // A report trains nothing, writes what the finished runs say, and names what is missing.
    let part = dir.path().join("part");
    let err = report(&p, &data, &part).unwrap_err().to_string();
    assert!(err.contains("no run of tiny has finished"), "{err}");
    std::fs::create_dir_all(part.join("runs")).unwrap();
    for stem in [
        "fedavg-local-seed0",
        "fedavg-local-seed1",
        "fedavg-global-seed1",
        "fedprox-local-seed0",
    ] {
        let f = format!("runs/{stem}.json");
        std::fs::copy(one.join(&f), part.join(&f)).unwrap();
    }
    let done = report(&p, &data, &part).unwrap();
    assert_eq!((done.trained, done.reused, done.missing), (0, 4, 4));
    assert!(!part.join("runs/fedprox-global-seed0.json").exists());
    let j = json(&part);
    let seeds: Vec<serde_json::Value> = j["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seeds"].clone())
        .collect();
    assert_eq!(
        seeds,
        [
            serde_json::json!([0, 1]),
            serde_json::json!([1]),
            serde_json::json!([0]),
            serde_json::json!([])
        ]
    );
    assert_eq!(
        j["methods"][0]["final"],
        json(&one)["methods"][0]["final"],
        "a method with every seed has the cells of the full experiment"
    );
    // local - global pairs runs by seed: FedAvg's only pair is seed 1; FedProx has none.
    let gains = j["local_minus_global"].as_array().unwrap();
    assert_eq!(gains.len(), 1);
    assert_eq!(gains[0]["algorithm"]["name"], "fedavg");
    assert_eq!(gains[0]["seeds"], serde_json::json!([1]));
    let last = |stem: &str| mean(&read(&one, stem).rounds[1].accuracy);
    let gain: Vec<f64> = serde_json::from_value(gains[0]["final_per_seed"].clone()).unwrap();
    assert_eq!(
        gain,
        vec![last("fedavg-local-seed1") - last("fedavg-global-seed1")]
    );
    let md = std::fs::read_to_string(part.join("internal.md")).unwrap();
    assert!(md.contains("4 of 8 runs have finished"), "{md}");
    assert!(
        md.contains("| FedProx (global BN) | not run yet | 0 |"),
        "{md}"
    );
    assert!(md.contains("| FedAvg | 1 |"), "{md}");
}

#[test]
fn a_failed_run_stops_the_experiment_keeps_what_finished_and_the_rest_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = BuiltinData::load().unwrap();
    let p = preset(&PRESET.replace("seeds = 1", "seeds = 2"), dir.path());
    let written = |out: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(out.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json"))
            .collect();
        v.sort();
        v
    };
    for jobs in [1, 2] {
        let out = dir.path().join(format!("out{jobs}"));
        // The first run's result cannot be written: its temporary file's name is a folder.
        let blocked = out.join("runs/fedavg-local-seed0.json.tmp");
        std::fs::create_dir_all(&blocked).unwrap();
        let err = format!("{:#}", run(&p, &data, &out, jobs, |_| {}).unwrap_err());
        assert!(
            err.contains("[1/8] FedBN seed 0 failed")
                && err.contains("fedavg-local-seed0.json.tmp"),
            "{err}"
        );
        let kept = written(&out);
        assert!(!kept.contains(&"fedavg-local-seed0.json".to_string()));
        if jobs == 1 {
            // Alone, nothing runs after the failure.
            assert!(kept.is_empty(), "{kept:?}");
        }
        // Once the cause is gone, the experiment resumes and trains only what is missing.
        std::fs::remove_dir(&blocked).unwrap();
        let done = run(&p, &data, &out, jobs, |_| {}).unwrap();
        assert_eq!((done.trained, done.reused), (8 - kept.len(), kept.len()));
        assert_eq!(written(&out).len(), 8);
    }
}
