//! Prints, for every algorithm x BN policy x {f32, f32 with the starting model parked, q8
//! parked}, the hash of the final global model, of every site's final model and the rounds'
//! accuracies of a small 3-site, 3-round in-process federation: run it before and after a
//! refactor that must change no model byte, and compare the two outputs (`diff`).
//!
//! `cargo run --release -p unifed-sim --example model_hashes > hashes.txt`

use sha2::Digest;
use unifed_aggregator::{Algorithm, FederationConfig};
use unifed_models::backend::Device;
use unifed_models::data::{BuiltinData, Domain, SplitSizes};
use unifed_models::state::{Select, export};
use unifed_models::train::TrainConfig;
use unifed_models::zoo::{DigitsCnn, DigitsCnnConfig, seeded, spec_of};
use unifed_protocol::messages::BnPolicy;
use unifed_protocol::{Input, ModelSpec, Scaling};
use unifed_sim::Site;

fn setup(
    device: &Device,
    park: Option<&std::path::Path>,
) -> (ModelSpec, DigitsCnn, Vec<Site<DigitsCnn>>) {
    let cfg = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    };
    let input = Input::Image {
        channels: 3,
        height: 28,
        width: 28,
        scaling: Scaling::MinusOneToOne,
    };
    let classes: Vec<String> = (0..10).map(|d| d.to_string()).collect();
    let init = || seeded(device, 3, |d| cfg.init(d));
    let net0 = init();
    let spec = spec_of(&net0, &classes, &input);
    let data = BuiltinData::load().unwrap();
    let sites = [Domain::Grey, Domain::Texture, Domain::Lowres]
        .into_iter()
        .zip([48, 64, 40])
        .map(|(d, n)| {
            let dd = data
                .domain(
                    d,
                    &SplitSizes {
                        train: n,
                        val: 0,
                        test: 32,
                        unseen_test: 64,
                    },
                    0,
                )
                .unwrap();
            let mut s = Site::new(
                d.name(),
                init(),
                dd.train.dataset("train", &spec).unwrap(),
                dd.test.dataset("test", &spec).unwrap(),
            )
            .unwrap();
            if let Some(p) = park {
                s.park_base_in(p.join(d.name())).unwrap();
            }
            s
        })
        .collect();
    (spec, net0, sites)
}

fn hex(b: &[u8]) -> String {
    b.iter().take(8).map(|x| format!("{x:02x}")).collect()
}

fn site_hash(spec: &ModelSpec, s: &Site<DigitsCnn>) -> String {
    let mut h = sha2::Sha256::new();
    for t in export(&s.net, spec, Select::All).tensors {
        for v in t.data {
            h.update(v.to_le_bytes());
        }
    }
    hex(&h.finalize())
}

struct Last(String);
impl unifed_sim::Observer<DigitsCnn> for Last {
    fn message(&mut self, o: unifed_sim::Observed<'_>) {
        if let unifed_sim::Observed::Model { payload, .. } = o {
            self.0 = hex(&sha2::Sha256::digest(payload));
        }
    }
}

fn main() {
    let device = Device::flex();
    let mut lines = Vec::new();
    for algorithm in Algorithm::all() {
        let name = algorithm.name();
        for bn in [BnPolicy::Local, BnPolicy::Global] {
            for (enc, parked) in [
                (unifed_protocol::encoding::Encoding::F32, false),
                (unifed_protocol::encoding::Encoding::F32, true),
                (unifed_protocol::encoding::Encoding::Q8, true),
            ] {
                let dir = tempfile::tempdir().unwrap();
                let (spec, net0, mut sites) = setup(&device, parked.then(|| dir.path()));
                let fc = FederationConfig {
                    algorithm,
                    bn_policy: bn,
                    encoding: enc,
                    ..FederationConfig::new("test-fed", 3, 3, Vec::new())
                };
                let mut last = Last(String::new());
                let records = unifed_sim::run_federation(
                    fc,
                    unifed_sim::initial_model(&net0, &spec),
                    unifed_sim::Sites::new(&mut sites, &TrainConfig::default(), &device),
                    &mut last,
                )
                .unwrap();
                let accs: Vec<String> = records
                    .iter()
                    .map(|r| format!("{:?}", r.accuracy))
                    .collect();
                let sh: Vec<String> = sites.iter().map(|s| site_hash(&spec, s)).collect();
                lines.push(format!(
                    "{name} {bn:?} {enc:?} parked={parked} global={} sites={} acc={}",
                    last.0,
                    sh.join(","),
                    accs.join(";")
                ));
            }
        }
    }
    for l in &lines {
        println!("{l}");
    }
}
