//! Checkpoints exported from PyTorch load, and give PyTorch's logits (eval mode with stored
//! statistics, and train-mode BN with batch statistics).

use crate::common;

use common::*;
use unifed_models::bn::{BnPass, BnStart, StreamEstimator};
use unifed_models::checkpoint;
use unifed_models::state::{Select, import, validate};
use unifed_models::zoo::{DigitsCnnConfig, MlpConfig, Net, ResNetConfig, Stem};
use unifed_protocol::{Input, ModelSpec};

fn check<N: Net>(name: &str, net: N, spec: ModelSpec) {
    let d = device();
    let weights = fixtures().join(format!("{name}.safetensors"));
    let io = fixtures().join(format!("{name}-io.safetensors"));
    let state = checkpoint::load(&weights, &spec).unwrap();
    validate(&state, &spec, Select::All).unwrap();
    let net = import(&net, &spec, &state, Select::All).unwrap();
    let (shape, input) = read_tensor(&io, "input");
    let (_, want) = read_tensor(&io, "logits");
    let got = values(net.forward(tensor2(&shape, input.clone(), &d), &mut BnPass::standard()));
    let err = max_abs_diff(&got, &want);
    assert!(
        err < 1e-4,
        "{name}: eval logits differ from PyTorch by {err}"
    );
    // Train-mode BN (batch statistics) equals stream re-estimation with tau = 0.
    let (_, want_train) = read_tensor(&io, "logits_train");
    let mut est = StreamEstimator::new(0.0, BnStart::Stored).unwrap();
    let got = values(est.forward(&net, tensor2(&shape, input, &d)).unwrap());
    let err = max_abs_diff(&got, &want_train);
    assert!(
        err < 1e-4,
        "{name}: train-mode logits differ from PyTorch by {err}"
    );
}

#[test]
fn pytorch_mlp_checkpoint_gives_pytorchs_logits() {
    let net = MlpConfig {
        inputs: 20,
        hidden: [16, 16],
        classes: 3,
    }
    .init(&device());
    let spec = spec(&net, 3, Input::Features { len: 20 });
    check("mlp", net, spec);
}

#[test]
fn pytorch_digits_cnn_checkpoint_gives_pytorchs_logits() {
    let net = DigitsCnnConfig {
        conv: [4, 6, 8],
        fc: [32, 16],
        ..Default::default()
    }
    .init(&device());
    let spec = spec(&net, 10, image_input(3, 28, 28));
    check("digits_small", net, spec);
}

#[test]
fn pytorch_resnet18_checkpoints_give_pytorchs_logits() {
    let cfg = ResNetConfig {
        in_channels: 1,
        size: [32, 32],
        classes: 5,
        width: 8,
        stem: Stem::Cifar,
        split: 2,
    };
    let net = cfg.init(&device());
    let spec = spec(&net, 5, image_input(1, 32, 32));
    check("resnet18_small", net, spec);
    let cfg = ResNetConfig {
        size: [64, 64],
        stem: Stem::Imagenet,
        ..cfg
    };
    let net = cfg.init(&device());
    let spec2 = common::spec(&net, 5, image_input(1, 64, 64));
    check("resnet18_imagenet_small", net, spec2);
}

#[test]
fn a_pytorch_checkpoint_for_another_shape_is_refused_with_the_tensor_named() {
    let net = MlpConfig {
        inputs: 21,
        hidden: [16, 16],
        classes: 3,
    }
    .init(&device());
    let spec = spec(&net, 3, Input::Features { len: 21 });
    match checkpoint::load(&fixtures().join("mlp.safetensors"), &spec) {
        Err(unifed_models::error::StateError::WrongShape { name, .. }) => {
            assert_eq!(name, "fc1.weight")
        }
        other => panic!("expected WrongShape, got {other:?}"),
    }
}
