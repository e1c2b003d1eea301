//! The spec decides the model: every architecture of the zoo is rebuilt from its spec with the
//! same tensor names, shapes and seeded values as when built directly.

use crate::common;

use common::*;
use unifed_models::state::{Select, export};
use unifed_models::zoo::{
    Arch, DigitsCnnConfig, MlpConfig, ResNetConfig, net_from_spec, seeded, spec_of,
};
use unifed_protocol::Input;

#[test]
fn every_architecture_is_rebuilt_from_its_spec_with_the_same_tensors() {
    let d = device();
    let mut resnet = ResNetConfig::new(3, [32, 32], 3);
    resnet.width = 8;
    let cases = [
        (
            Arch::DigitsCnn(DigitsCnnConfig {
                conv: [4, 6, 8],
                fc: [32, 16],
                ..Default::default()
            }),
            classes(10),
            image_input(3, 28, 28),
        ),
        (
            Arch::Mlp(MlpConfig::abide(12, 2)),
            vec!["control".into(), "autism".into()],
            Input::Features { len: 12 },
        ),
        (
            Arch::Resnet18(resnet),
            vec!["benign".into(), "malignant".into(), "normal".into()],
            image_input(3, 32, 32),
        ),
    ];
    for (arch, classes, input) in cases {
        let direct = seeded(&d, 9, |d| arch.init(d));
        let spec = spec_of(&direct, &classes, &input);
        let rebuilt = net_from_spec(&spec, &d, 9).unwrap();
        assert_eq!(spec_of(&rebuilt, &classes, &input), spec);
        assert_eq!(
            export(&rebuilt, &spec, Select::All),
            export(&direct, &spec, Select::All),
            "{}",
            spec.architecture
        );
        // The variant adds no level to a tensor's name.
        assert!(spec.tensors.iter().all(|t| !t.name.contains("Digits")
            && !t.name.contains("Resnet18")
            && !t.name.contains("Mlp")));
    }
}

#[test]
fn the_wrapped_digits_cnn_has_the_plain_digits_cnns_spec_and_values() {
    let d = device();
    let cfg = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    };
    let plain = seeded(&d, 3, |d| cfg.init(d));
    let any = seeded(&d, 3, |d| Arch::DigitsCnn(cfg.clone()).init(d));
    let input = image_input(3, 28, 28);
    let spec = spec_of(&plain, &classes(10), &input);
    assert_eq!(spec_of(&any, &classes(10), &input).hash(), spec.hash());
    assert_eq!(
        bits(&any, &spec, Select::All),
        bits(&plain, &spec, Select::All)
    );
}

#[test]
fn a_spec_that_no_model_fits_is_refused_with_the_reason() {
    let d = device();
    let net = seeded(&d, 0, |d| Arch::Mlp(MlpConfig::abide(12, 2)).init(d));
    let mut spec = spec_of(&net, &classes(2), &Input::Features { len: 12 });
    spec.tensors[0].shape = vec![16, 13];
    assert!(net_from_spec(&spec, &d, 0).is_err());
    let mut spec = spec_of(&net, &classes(2), &Input::Features { len: 12 });
    spec.architecture = "vgg16(in=3x32x32)".into();
    let err = net_from_spec(&spec, &d, 0).unwrap_err().to_string();
    assert!(err.contains("vgg16"), "{err}");
}
