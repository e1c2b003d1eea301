//! Checks shared by the end-to-end tests.
#![allow(dead_code)]

use unifed_e2e::fed::Fed;
use unifed_models::checkpoint;

/// Runs the federation `fed` describes (sites `sites`, algorithm `algorithm`) in process: the
/// aggregator core and one site driver per site over an in-memory transport. Checks that every
/// site ends with the bit-identical model, BN included, that its agent over MQTT ended with:
/// one client round for both.
pub fn same_as_in_process(fed: &Fed, sites: &[&str], algorithm: unifed_aggregator::Algorithm) {
    let (records, in_process, _) = in_process(fed, sites, algorithm, |s| s);
    assert_eq!(records.len() as u64, fed.rounds);
    same_models(fed, &in_process);
}

/// The sites folded into each round closed, in site order.
#[derive(Default)]
pub struct Closed(pub Vec<(u64, Vec<String>)>);

impl<N: unifed_models::zoo::Net> unifed_sim::Observer<N> for Closed {
    fn closed(&mut self, round: u64, sites: &[String]) {
        self.0.push((round, sites.to_vec()));
    }
}

/// Runs the federation `fed` describes in process, its sites set up by `adjust` (a site's own
/// training settings, a late joiner): the round records, the sites as they ended, and the
/// sites folded into each round.
pub fn in_process(
    fed: &Fed,
    sites: &[&str],
    algorithm: unifed_aggregator::Algorithm,
    adjust: impl for<'a> FnOnce(
        unifed_sim::Sites<'a, unifed_models::zoo::DigitsCnn>,
    ) -> unifed_sim::Sites<'a, unifed_models::zoo::DigitsCnn>,
) -> (
    Vec<unifed_sim::RoundRecord>,
    Vec<unifed_sim::Site<unifed_models::zoo::DigitsCnn>>,
    Closed,
) {
    use unifed_models::data::{BuiltinData, Domain, SplitSizes};
    use unifed_models::train::TrainConfig;
    use unifed_models::zoo::{DigitsCnnConfig, seeded};
    let spec = fed.spec();
    let device = unifed_models::backend::Backend::Flex.device().unwrap();
    let init = checkpoint::load(&fed.model(), &spec).unwrap();
    let initial = unifed_aggregator::GlobalModel {
        spec: spec.clone(),
        tensors: init.tensors.into_iter().map(|t| t.data).collect(),
    };
    let data = BuiltinData::load().unwrap();
    let model = DigitsCnnConfig {
        conv: fed.conv,
        fc: fed.fc,
        ..Default::default()
    };
    let mut in_process: Vec<_> = sites
        .iter()
        .map(|s| {
            let sizes = SplitSizes {
                train: fed.samples.get(*s).copied().unwrap_or(fed.train_samples),
                ..SplitSizes::default()
            };
            let dd = data.domain(Domain::parse(s).unwrap(), &sizes, 0).unwrap();
            unifed_sim::Site::new(
                s,
                seeded(&device, 0, |d| model.init(d)),
                dd.train.dataset("train", &spec).unwrap(),
                dd.test.dataset("test", &spec).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let cfg = unifed_aggregator::FederationConfig {
        bn_policy: fed.bn_policy,
        algorithm,
        encoding: fed.encoding,
        ..unifed_aggregator::FederationConfig::new("e2e", fed.rounds, fed.min_sites, Vec::new())
    };
    let tc = TrainConfig {
        batch_size: 16,
        ..TrainConfig::default()
    };
    let mut closed = Closed::default();
    let records = unifed_sim::run_federation(
        cfg,
        initial,
        adjust(unifed_sim::Sites::new(&mut in_process, &tc, &device)),
        &mut closed,
    )
    .unwrap();
    (records, in_process, closed)
}

/// Checks that every site of `in_process` ended with the bit-identical model, BN included,
/// that its agent over MQTT ended with.
pub fn same_models(fed: &Fed, in_process: &[unifed_sim::Site<unifed_models::zoo::DigitsCnn>]) {
    use unifed_models::state::{Select, export};
    let spec = fed.spec();
    for site in in_process {
        let mqtt = checkpoint::load(
            &fed.site_dir(site.id.as_str()).join("model.safetensors"),
            &spec,
        )
        .unwrap();
        let local = export(&site.net, &spec, Select::All);
        for (a, b) in mqtt.tensors.iter().zip(&local.tensors) {
            assert_eq!(a.name, b.name);
            assert!(
                a.data
                    .iter()
                    .zip(&b.data)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{}: {} differs between the MQTT agent and the in-process run",
                site.id,
                a.name
            );
        }
    }
}
