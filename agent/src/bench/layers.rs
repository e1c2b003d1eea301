//! Per-layer times of the digits CNN (`bench --layers`): each layer of the model alone, on an
//! input of the shape it sees in training, forward and forward plus backward, in burn and in
//! PyTorch from one list of layers. The whole-model figures say how far burn is behind; these
//! say where.

use burn::nn::conv::Conv2dConfig;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::{BatchNormConfig, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Distribution, Tensor};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use unifed_models::zoo::DigitsCnnConfig;

/// What a layer computes (the JSON form `scripts/torch_bench.py --layers` reads too).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// A 2-D convolution of a square kernel, stride 1, zero padding on every side, with bias.
    Conv {
        /// Output channels.
        out_channels: usize,
        /// Kernel height and width.
        kernel: usize,
        /// Padding on each side.
        padding: usize,
    },
    /// BatchNorm in training mode over the input's second dimension.
    BatchNorm,
    /// ReLU.
    Relu,
    /// 2x2 max pooling, stride 2.
    MaxPool2,
    /// A fully connected layer with bias.
    Linear {
        /// Output features.
        out_features: usize,
    },
}

/// One layer of the model as a benchmark sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// The layer's name in the model (`conv1`, `bn4`, ...).
    pub name: String,
    /// The input's shape, batch first.
    pub input: Vec<usize>,
    /// Whether the input needs a gradient (every layer's but the first's).
    pub grad_input: bool,
    /// What the layer computes.
    #[serde(flatten)]
    pub op: Op,
}

/// The layers of the digits CNN `cfg` at batch size `batch`, in the order a forward pass runs
/// them (the model's `forward` in `unifed_models::zoo::digits`).
pub fn digits_layers(cfg: &DigitsCnnConfig, batch: usize) -> Vec<Layer> {
    let [h, w] = cfg.size;
    let [c1, c2, c3] = cfg.conv;
    let [f1, f2] = cfg.fc;
    let mut out = Vec::new();
    let mut push = |name: String, input: Vec<usize>, op: Op| {
        let grad_input = !out.is_empty();
        out.push(Layer {
            name,
            input,
            grad_input,
            op,
        });
    };
    let conv = |out_channels| Op::Conv {
        out_channels,
        kernel: 5,
        padding: 2,
    };
    let stages = [
        (cfg.in_channels, c1, h, w, true),
        (c1, c2, h / 2, w / 2, true),
        (c2, c3, h / 4, w / 4, false),
    ];
    for (i, (cin, cout, h, w, pool)) in stages.into_iter().enumerate() {
        let i = i + 1;
        push(format!("conv{i}"), vec![batch, cin, h, w], conv(cout));
        push(format!("bn{i}"), vec![batch, cout, h, w], Op::BatchNorm);
        push(format!("relu{i}"), vec![batch, cout, h, w], Op::Relu);
        if pool {
            push(format!("pool{i}"), vec![batch, cout, h, w], Op::MaxPool2);
        }
    }
    let flat = c3 * (h / 4) * (w / 4);
    for (i, (a, b)) in [(flat, f1), (f1, f2)].into_iter().enumerate() {
        let i = i + 1;
        push(
            format!("fc{i}"),
            vec![batch, a],
            Op::Linear { out_features: b },
        );
        push(format!("bn{}", i + 3), vec![batch, b], Op::BatchNorm);
        push(format!("relu{}", i + 3), vec![batch, b], Op::Relu);
    }
    push(
        "fc3".into(),
        vec![batch, f2],
        Op::Linear {
            out_features: cfg.classes,
        },
    );
    out
}

/// The figures of one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerTime {
    /// The layer's name.
    pub name: String,
    /// Milliseconds per forward pass (with the sum of its output).
    pub fwd_ms: f64,
    /// Milliseconds per forward and backward pass (the backward of the sum seeds it).
    pub fwd_bwd_ms: f64,
}

/// The mean milliseconds of `iters` calls of `f` after `warmup` untimed ones.
fn mean_ms(warmup: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let t0 = Instant::now();
    for _ in 0..iters {
        f();
    }
    t0.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64
}

/// A tensor of N(0, 1) values of `shape` on `device`, tracked for a gradient if `grad`.
fn input<const D: usize>(
    shape: &[usize],
    device: &Device,
    grad: bool,
) -> Result<Tensor<D>, String> {
    let dims: [usize; D] = shape
        .try_into()
        .map_err(|_| format!("input shape {shape:?} is not {D}-dimensional"))?;
    let x = Tensor::random(dims, Distribution::Normal(0.0, 1.0), device);
    Ok(if grad { x.require_grad() } else { x })
}

/// Times `layer` on the autodiff `device` (a CPU backend: its operations finish before they
/// return, so wall time is their time).
pub fn time_layer(
    layer: &Layer,
    device: &Device,
    warmup: usize,
    iters: usize,
) -> Result<LayerTime, String> {
    let g = layer.grad_input;
    let s = &layer.input;
    // The forward pass, ending in the sum of the output.
    // The forward pass on a fixed input of the layer's shape, ending in the sum of the output.
    fn summed<const D: usize>(
        s: &[usize],
        device: &Device,
        grad: bool,
        layer: impl Fn(Tensor<D>) -> Tensor<D> + 'static,
    ) -> Result<Box<dyn Fn() -> Tensor<1>>, String> {
        let x = input::<D>(s, device, grad)?;
        Ok(Box::new(move || layer(x.clone()).sum()))
    }
    let fwd = match (&layer.op, s.len()) {
        (
            Op::Conv {
                out_channels,
                kernel,
                padding,
            },
            4,
        ) => {
            let p = *padding;
            let m = Conv2dConfig::new([s[1], *out_channels], [*kernel, *kernel])
                .with_padding(PaddingConfig2d::Explicit(p, p, p, p))
                .init(device);
            summed::<4>(s, device, g, move |x| m.forward(x))?
        }
        (Op::BatchNorm, 4) => {
            let m = BatchNormConfig::new(s[1]).init(device);
            summed::<4>(s, device, g, move |x| m.forward(x))?
        }
        (Op::BatchNorm, 2) => {
            let m = BatchNormConfig::new(s[1]).init(device);
            summed::<2>(s, device, g, move |x| m.forward(x))?
        }
        (Op::Relu, 4) => summed::<4>(s, device, g, relu)?,
        (Op::Relu, 2) => summed::<2>(s, device, g, relu)?,
        (Op::MaxPool2, 4) => {
            let m = MaxPool2dConfig::new([2, 2]).init();
            summed::<4>(s, device, g, move |x| m.forward(x))?
        }
        (Op::Linear { out_features }, 2) => {
            let m = LinearConfig::new(s[1], *out_features).init(device);
            summed::<2>(s, device, g, move |x| m.forward(x))?
        }
        (op, d) => {
            return Err(format!(
                "layer `{}`: {op:?} does not take a {d}-D input",
                layer.name
            ));
        }
    };
    let fwd_ms = mean_ms(warmup, iters, || {
        let _ = fwd();
    });
    let fwd_bwd_ms = mean_ms(warmup, iters, || {
        let _ = fwd().backward();
    });
    Ok(LayerTime {
        name: layer.name.clone(),
        fwd_ms,
        fwd_bwd_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digits_layers_follow_the_models_forward_pass_and_its_widths() {
        let cfg = DigitsCnnConfig {
            in_channels: 1,
            size: [32, 24],
            conv: [4, 6, 8],
            fc: [20, 12],
            classes: 5,
        };
        let layers = digits_layers(&cfg, 7);
        let names: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "conv1", "bn1", "relu1", "pool1", "conv2", "bn2", "relu2", "pool2", "conv3", "bn3",
                "relu3", "fc1", "bn4", "relu4", "fc2", "bn5", "relu5", "fc3"
            ]
        );
        let input = |name: &str| &layers.iter().find(|l| l.name == name).unwrap().input;
        assert_eq!(input("conv1"), &[7, 1, 32, 24]);
        assert_eq!(input("pool1"), &[7, 4, 32, 24]);
        assert_eq!(input("conv2"), &[7, 4, 16, 12]);
        assert_eq!(input("conv3"), &[7, 6, 8, 6]);
        assert_eq!(input("bn3"), &[7, 8, 8, 6]);
        assert_eq!(input("fc1"), &[7, 8 * 8 * 6]);
        assert_eq!(input("bn4"), &[7, 20]);
        assert_eq!(input("fc3"), &[7, 12]);
        // Only the data needs no gradient.
        assert!(layers.iter().all(|l| l.grad_input == (l.name != "conv1")));
    }

    #[test]
    fn a_layer_is_the_json_the_pytorch_script_reads() {
        let layers = digits_layers(&DigitsCnnConfig::default(), 32);
        let json = serde_json::to_value(&layers).unwrap();
        assert_eq!(
            json[0],
            serde_json::json!({"name": "conv1", "input": [32, 3, 28, 28], "grad_input": false,
                "kind": "conv", "out_channels": 64, "kernel": 5, "padding": 2})
        );
        assert_eq!(json[1]["kind"], "batch_norm");
        assert_eq!(json[2]["kind"], "relu");
        assert_eq!(json[3]["kind"], "max_pool2");
        assert_eq!(
            json[11],
            serde_json::json!({"name": "fc1", "input": [32, 6272], "grad_input": true,
                "kind": "linear", "out_features": 2048})
        );
        let back: Vec<Layer> = serde_json::from_value(json).unwrap();
        assert_eq!(back, layers);
    }

    #[test]
    fn a_layer_that_cannot_take_its_input_is_named() {
        let device = burn::tensor::Device::flex().autodiff();
        let layer = Layer {
            name: "odd".into(),
            input: vec![2, 3],
            grad_input: true,
            op: Op::MaxPool2,
        };
        let err = time_layer(&layer, &device, 0, 1).unwrap_err();
        assert!(err.contains("layer `odd`") && err.contains("2-D"), "{err}");
    }
}
