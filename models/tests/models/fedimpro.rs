//! FedImpro on the site: every model of the zoo splits into parts that compose to its forward
//! pass, the running statistics follow Eq. 7 class by class, synthetic features follow the
//! federation's Gaussian of their class and train the head alone, and a site's rounds send its
//! statistics, keep them, and survive a restart bit for bit.

use crate::common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::Tensor;
use common::*;
use unifed_models::bn::BnPass;
use unifed_models::client::ClientState;
use unifed_models::decoupled::{Decoupler, feature_width};
use unifed_models::site::Site;
use unifed_models::state::{Select, export};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnnConfig, Net, ResNetConfig, Stem, seeded};
use unifed_protocol::messages::{
    BnPolicy, ClassStats, Download, FeatureStats, Objective, ServerExtras, SiteExtras,
};
use unifed_protocol::{Encoding, Id, ModelSpec};

/// Asserts that `high(low(x))` is the model's forward pass at every split point, bit for bit,
/// that `low` gives rows of [`feature_width`] values, and that the spec alone gives the same
/// widths (what the aggregator checks sites' statistics against) and none elsewhere.
fn composes<N: Net>(net: &N, spec: &ModelSpec, n: usize) {
    let d = device();
    let x = tensor2(&[n, net.input_numel()], noise(n * net.input_numel(), 3), &d);
    let full = values(net.forward(x.clone(), &mut BnPass::standard()));
    let points = net.split_points();
    assert!(!points.is_empty());
    for p in 0..=points.last().unwrap() + 2 {
        let from_spec = unifed_protocol::spec::feature_width(spec, p);
        if !points.contains(&p) {
            assert_eq!(from_spec, None, "{}: split {p}", spec.architecture);
            continue;
        }
        let h = net.low(x.clone(), p, &mut BnPass::standard());
        assert_eq!(h.dims(), [n, feature_width(net, p, &d)], "split {p}");
        assert_eq!(
            from_spec,
            Some(h.dims()[1]),
            "{}: split {p}",
            spec.architecture
        );
        let split = values(net.high(h, p, &mut BnPass::standard()));
        assert_eq!(split, full, "split {p}");
    }
}

#[test]
fn every_model_of_the_zoo_splits_into_parts_that_compose_to_its_forward_pass() {
    let d = device();
    let cnn = seeded(&d, 1, |d| {
        DigitsCnnConfig {
            conv: [4, 6, 8],
            fc: [16, 12],
            ..Default::default()
        }
        .init(d)
    });
    assert_eq!(cnn.split_points(), vec![1, 2, 3, 4, 5]);
    // conv1 + pool: 4 x 14 x 14; conv2 + pool: 6 x 7 x 7; conv3: 8 x 7 x 7; fc1, fc2.
    let widths: Vec<usize> = (1..=5).map(|p| feature_width(&cnn, p, &d)).collect();
    assert_eq!(widths, vec![4 * 196, 6 * 49, 8 * 49, 16, 12]);
    composes(&cnn, &spec(&cnn, 10, image_input(3, 28, 28)), 3);
    let (mlp, mlp_spec) = mlp_net(2, 4, [6, 5], 3);
    assert_eq!(mlp.split_points(), vec![1, 2]);
    composes(&mlp, &mlp_spec, 4);
    // ResNet-18 with each stem, on sides that do not halve evenly.
    for (stem, size) in [(Stem::Cifar, [16, 16]), (Stem::Imagenet, [33, 35])] {
        let cfg = ResNetConfig {
            in_channels: 1,
            size,
            classes: 4,
            width: 4,
            stem,
            split: 2,
        };
        let net = seeded(&d, 5, |d| cfg.init(d));
        assert_eq!(net.split_points(), vec![1, 3, 5, 7, 9, 11, 13, 15, 17]);
        let input = image_input(1, size[0] as u32, size[1] as u32);
        composes(&net, &spec(&net, 4, input), 2);
    }
}

/// Runs of FedImpro over 3 classes of 2 features, momentum 0.5.
fn decoupler(global: Option<FeatureStats>) -> Decoupler {
    Decoupler::new((1, 2, 3), (0.5, 0.0), global, None).unwrap()
}

fn stats(classes: Vec<Option<([f32; 2], [f32; 2])>>) -> FeatureStats {
    FeatureStats {
        width: 2,
        classes: classes
            .into_iter()
            .map(|c| {
                c.map(|(m, v)| ClassStats {
                    mean: m.to_vec(),
                    var: v.to_vec(),
                })
            })
            .collect(),
    }
}

#[test]
fn the_running_statistics_follow_eq_7_class_by_class() {
    let d = device();
    let mut run = decoupler(None).start(&d, 0);
    // Batch 1: class 0 at (1, 2) and (3, 6), class 1 at (5, 5); class 2 absent.
    let b1 = tensor2(&[3, 2], vec![1.0, 2.0, 3.0, 6.0, 5.0, 5.0], &d);
    run.observe(&b1, &[0, 0, 1]);
    // Batch 2: class 0 at (0, 0) and (2, 2), class 2 at (4, -4).
    let b2 = tensor2(&[3, 2], vec![0.0, 0.0, 2.0, 2.0, 4.0, -4.0], &d);
    run.observe(&b2, &[0, 2, 0]);
    // Batch 3: class 1 at (5, 5) and (7, 5); a label past the class count is skipped.
    let b3 = tensor2(&[3, 2], vec![5.0, 5.0, 7.0, 5.0, 9.0, 9.0], &d);
    run.observe(&b3, &[1, 1, 7]);
    let out = run.finish();
    // Class 0: batch 1 starts it (mean (2, 4), unbiased variance (2, 8)); batch 2's samples 0
    // and 2 are (0, 0) and (4, -4): mean (2, -2), variance (8, 8); blended half and half.
    // Class 1: batch 1's one sample starts its mean, batch 3 blends (6, 5) in and starts its
    // variance (2, 0). Class 2: one sample in one batch, no variance: not sent.
    let want = stats(vec![
        Some(([2.0, 1.0], [5.0, 8.0])),
        Some(([5.5, 5.0], [2.0, 0.0])),
        None,
    ]);
    assert_eq!(out.stats, want);
    assert_eq!(out.sent, out.stats, "no noise asked");
    assert_eq!(
        out.synthetic, 0,
        "no federation Gaussians: no synthetic feature"
    );
    // A class never seen is sent as absent.
    let mut run = decoupler(None).start(&d, 0);
    run.observe(&b1, &[0, 0, 1]);
    assert_eq!(run.finish().stats.classes[2], None);
}

#[test]
fn synthetic_features_follow_their_class_gaussian_and_skip_classes_it_lacks() {
    let d = device();
    let global = stats(vec![
        Some(([1.0, -2.0], [0.25, 4.0])),
        None,
        Some(([0.0, 0.0], [1.0, 1.0])),
    ]);
    let mut run = decoupler(Some(global)).start(&d, 7);
    // 4000 samples of class 0 and 10 of class 1, which has no Gaussian.
    let mut labels = vec![0usize; 4000];
    labels.extend([1; 10]);
    let (h, rows) = run.draw(&labels).unwrap();
    assert_eq!(rows.len(), 4000);
    assert!(rows.iter().all(|&k| k == 0));
    let v = values(h);
    for (j, (mean, var)) in [(1.0f64, 0.25f64), (-2.0, 4.0)].into_iter().enumerate() {
        let x: Vec<f64> = v.iter().skip(j).step_by(2).map(|&x| x as f64).collect();
        let m = x.iter().sum::<f64>() / x.len() as f64;
        let s = x.iter().map(|x| (x - m).powi(2)).sum::<f64>() / x.len() as f64;
        // Four standard errors of the mean and of the variance.
        assert!(
            (m - mean).abs() < 4.0 * (var / 4000.0).sqrt(),
            "feature {j}: mean {m}"
        );
        assert!(
            (s - var).abs() < 4.0 * var * (2.0f64 / 4000.0).sqrt(),
            "feature {j}: var {s}"
        );
    }
    // Fewer than two samples with a Gaussian: nothing to train the head's BN on.
    assert!(run.draw(&[0, 1, 1]).is_none());
    // The same seed draws the same features; another draws others.
    let again = |seed| {
        let global = stats(vec![Some(([1.0, -2.0], [0.25, 4.0])), None, None]);
        values(
            decoupler(Some(global))
                .start(&d, seed)
                .draw(&[0, 0])
                .unwrap()
                .0,
        )
    };
    assert_eq!(again(3), again(3));
    assert_ne!(again(3), again(4));
}

/// Gradients of every parameter of a model, by name order, as the step left them (`None`:
/// the loss did not reach it).
struct Grads<'a> {
    grads: &'a burn::tensor::Gradients,
    out: Vec<Option<f32>>,
}

impl ModuleVisitor for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let g = param
            .val()
            .grad(self.grads)
            .map(|g| g.abs().sum().into_data().iter::<f32>().next().unwrap());
        self.out.push(g);
    }
}

#[test]
fn the_synthetic_features_loss_trains_the_head_and_leaves_the_low_level_part_untouched() {
    let d = device();
    let ad = d.clone().autodiff();
    // MLP 4 -> 6 -> 5 -> 3, split after fc1: low = fc1 and bn1; the head = fc2, bn2, fc3.
    let (net, _) = mlp_net(5, 4, [6, 5], 3);
    let model = net.valid().train();
    let w = 6;
    let mean = |k: f32| vec![k; w];
    let global = FeatureStats {
        width: w as u32,
        classes: (0..3)
            .map(|k| {
                Some(ClassStats {
                    mean: mean(k as f32),
                    var: vec![1.0; w],
                })
            })
            .collect(),
    };
    let bn = |m: &unifed_models::zoo::Mlp| export(m, &spec_of_mlp(), Select::Bn);
    let before = bn(&net);
    let mut run = Decoupler::new((1, w, 3), (0.9, 0.0), Some(global), None)
        .unwrap()
        .start(&ad, 1);
    let loss_fn = CrossEntropyLossConfig::new().init(&ad);
    let loss = run
        .synthetic_loss(&model, &[0, 1, 2, 0, 1, 2], &loss_fn)
        .unwrap();
    let grads = loss.backward();
    let mut visit = Grads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut visit);
    // Parameters in field order: fc1 (weight, bias), bn1 (gamma, beta, running mean and
    // variance), fc2 (2), bn2 (4), fc3 (2).
    let got = visit.out;
    assert_eq!(got.len(), 14);
    assert!(
        got[..6].iter().all(|g| g.is_none_or(|g| g == 0.0)),
        "{got:?}"
    );
    for i in [6, 7, 8, 9, 12, 13] {
        assert!(got[i].is_some_and(|g| g > 0.0), "parameter {i}: {got:?}");
    }
    // The head's BN normalised the synthetic batch by itself and kept no statistic of it,
    // where a real training batch moves them.
    assert_eq!(bn(&model.valid()), before);
    let x = tensor2(&[6, 4], noise(24, 9), &ad);
    let _ = model.forward(x, &mut BnPass::standard());
    assert_ne!(bn(&model.valid()), before);
}

fn spec_of_mlp() -> ModelSpec {
    mlp_net(5, 4, [6, 5], 3).1
}

/// Model `version` (the non-BN tensors of `net`) with the federation's Gaussians `g`.
fn broadcast(
    net: &unifed_models::zoo::Mlp,
    spec: &ModelSpec,
    version: u64,
    g: Option<FeatureStats>,
) -> Download {
    common::broadcast(
        net,
        spec,
        version,
        g.map_or(ServerExtras::None, ServerExtras::FeatureStats),
    )
}

fn local<N: Net>(site: &Site<N>) -> Option<(u32, FeatureStats)> {
    match site.memory().unwrap().algorithm {
        ClientState::FedImpro { local, .. } => local,
        other => panic!("not FedImpro's state: {other:?}"),
    }
}

#[test]
fn a_fedimpro_site_sends_its_statistics_keeps_them_and_resumes_bit_for_bit() {
    let (net, spec) = mlp_net(3, 4, [6, 5], 2);
    let fed = Id::new("fed").unwrap();
    let tc = TrainConfig {
        batch_size: 8,
        lr: 0.1,
        ..TrainConfig::default()
    };
    let objective = Objective::Decoupled {
        split: 1,
        beta: 0.9,
        noise: 0.01,
    };
    let m = |round| tiny_manifest(round, Encoding::F32, BnPolicy::Local, objective);
    let data = |n| unifed_models::data::Dataset {
        name: "d".into(),
        features: 4,
        x: noise(4 * n, 21),
        y: (0..n).map(|i| (i / 3) % 2).collect(),
    };
    let mut site = Site::new("a", net.clone(), data(24), data(16)).unwrap();
    // Statistics of another class count are refused before anything is applied.
    let three = FeatureStats {
        width: 6,
        classes: vec![None; 3],
    };
    assert!(
        site.receive(&spec, &m(1), &broadcast(&net, &spec, 0, Some(three)))
            .is_err()
    );
    // A split the model does not have is refused, naming the ones it has.
    let odd = tiny_manifest(
        1,
        Encoding::F32,
        BnPolicy::Local,
        Objective::Decoupled {
            split: 3,
            beta: 0.9,
            noise: 0.0,
        },
    );
    site.receive(&spec, &odd, &broadcast(&net, &spec, 0, None))
        .unwrap();
    let err = site
        .train_round(&spec, &fed, &odd, &tc, &device(), |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("[1, 2]"), "{err}");
    // Round 1: no federation Gaussians yet.
    site.receive(&spec, &m(1), &broadcast(&net, &spec, 0, None))
        .unwrap();
    let u1 = update(
        &site
            .train_round(&spec, &fed, &m(1), &tc, &device(), |_| {})
            .unwrap(),
    );
    let SiteExtras::FeatureStats(sent) = &u1.extras else {
        panic!("{:?}", u1.extras)
    };
    assert_eq!(sent.width, 6);
    assert!(sent.classes.iter().all(Option::is_some));
    assert_eq!(local(&site), None, "advanced before the answer");
    site.answered(1, true);
    let (split, kept) = local(&site).expect("an accepted update leaves the statistics");
    assert_eq!(split, 1);
    // What was sent is the kept statistics with noise of 0.01.
    let moved: Vec<f32> = kept
        .classes
        .iter()
        .zip(&sent.classes)
        .flat_map(|(k, s)| {
            let (k, s) = (k.as_ref().unwrap(), s.as_ref().unwrap());
            k.mean
                .iter()
                .zip(&s.mean)
                .map(|(a, b)| (a - b).abs())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        moved.iter().all(|d| *d < 0.06) && moved.iter().any(|d| *d > 0.0),
        "{moved:?}"
    );

    // Round 2 with the federation's Gaussians: a restored site sends the same bytes.
    site.receive(
        &spec,
        &m(2),
        &broadcast(&mlp_net(4, 4, [6, 5], 2).0, &spec, 1, Some(sent.clone())),
    )
    .unwrap();
    let state = export(&site.net, &spec, Select::All);
    let memory = site.memory().unwrap();
    let mut again = restored(&net, &spec, &state, memory, data(24), data(16));
    let bytes = same_round(&mut site, &mut again, &spec, &m(2), &tc);
    let u2 = update(&bytes);
    let SiteExtras::FeatureStats(sent2) = &u2.extras else {
        panic!("{:?}", u2.extras)
    };
    assert_ne!(sent2, sent);
    site.answered(2, true);
    again.answered(2, true);
    assert_eq!(local(&site), local(&again));
}

#[test]
fn noise_on_the_statistics_sent_keeps_variances_non_negative() {
    use rand::SeedableRng;
    let s = stats(vec![Some(([0.0, 0.0], [0.0, 1e-3])), None, None]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    assert_eq!(
        unifed_models::decoupled::with_noise(s.clone(), 0.0, &mut rng),
        s
    );
    let noisy = unifed_models::decoupled::with_noise(s.clone(), 0.5, &mut rng);
    let c = noisy.classes[0].as_ref().unwrap();
    assert!(c.var.iter().all(|v| *v >= 0.0));
    assert_ne!(c.mean, vec![0.0, 0.0]);
    assert_eq!(noisy.classes[1], None);
}

#[test]
fn the_dissimilarity_is_the_mean_squared_distance_to_the_sites_mean() {
    use unifed_models::decoupled::Dissimilarity;
    let mut d = Dissimilarity::default();
    d.add(&[1.0, 0.0]);
    assert_eq!(d.value(), None, "one site has no dissimilarity");
    d.add(&[3.0, 0.0]);
    d.add(&[2.0, 3.0]);
    // mean (2, 1): squared distances 2, 2 and 4.
    assert!((d.value().unwrap() - 8.0 / 3.0).abs() < 1e-12);
    assert_eq!(d.sites(), 3);
}

#[test]
fn head_gradients_cover_the_head_alone_and_leave_the_model_untouched() {
    use unifed_models::decoupled::head_gradients;
    let d = device();
    let (net, spec) = mlp_net(5, 4, [6, 5], 3);
    let data = unifed_models::data::Dataset {
        name: "d".into(),
        features: 4,
        x: noise(4 * 12, 3),
        y: (0..12).map(|i| i % 3).collect(),
    };
    let global = FeatureStats {
        width: 6,
        classes: (0..3)
            .map(|k| {
                Some(ClassStats {
                    mean: vec![k as f32; 6],
                    var: vec![1.0; 6],
                })
            })
            .collect(),
    };
    let before = export(&net, &spec, Select::All);
    let idx: Vec<usize> = (0..12).collect();
    let (real, mixed) = head_gradients(&net, &data, &idx, (1, &global), 0, &d)
        .unwrap()
        .unwrap();
    // The head after fc1: fc2 (6 x 5 + 5), bn2's gamma and beta (5 + 5), fc3 (5 x 3 + 3).
    assert_eq!((real.len(), mixed.len()), (63, 63));
    assert_ne!(real, mixed);
    assert!(real.iter().any(|g| *g != 0.0));
    assert_eq!(export(&net, &spec, Select::All), before);
    // Fewer than two samples with a Gaussian: nothing to compare.
    let one = FeatureStats {
        width: 6,
        classes: vec![global.classes[0].clone(), None, None],
    };
    assert!(
        head_gradients(&net, &data, &[0, 1, 2], (1, &one), 0, &d)
            .unwrap()
            .is_none()
    );
}
