//! The CPU backend's convolution, max pooling and strided copies against plain loops.
//! `third_party/burn-flex` patches the first two (im2col through reused scratch, a 2x2 pooling
//! fast path, pooling without indices for inference) and its tensor allocation, so these
//! check the patched kernels on every shape class they take: full and partial windows,
//! padding, strides, dilation, groups, ties, NaN, and transposed views read whole, in windows
//! and in batches. Batch normalisation, which the
//! patched backend runs in two passes, and a convolution's weight gradient, whose operands it
//! lays out without burn's copies, are checked bit for bit against burn's compositions; the
//! input gradient (its batch items in parallel on reused buffers) against plain loops.

use crate::common;

use burn::tensor::module::{conv2d, max_pool2d, max_pool2d_with_indices};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{Tensor, TensorData};
use common::{device, noise};

/// Deterministic values in [-1, 1) ([`common::noise`]); with `levels`, rounded to steps of
/// 1 / `levels` (so windows hold ties).
fn values(n: usize, seed: u64, levels: Option<u32>) -> Vec<f32> {
    let v = noise(n, seed);
    match levels {
        Some(l) => v
            .into_iter()
            .map(|x| (x * l as f32).round() / l as f32)
            .collect(),
        None => v,
    }
}

/// Max pooling of `x` ([n, c, h, w]) by the backend's rule, in loops: each window's valid
/// positions in row-major order, the first taken, then any larger one or NaN. Values and
/// indices (row-major in the unpadded plane).
#[allow(clippy::too_many_arguments)]
fn naive_pool(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    d: [usize; 2],
) -> (Vec<[usize; 4]>, Vec<f32>, Vec<i64>) {
    let out = |i: usize, a: usize| (i + 2 * p[a] - d[a] * (k[a] - 1) - 1) / s[a] + 1;
    let (oh, ow) = (out(h, 0), out(w, 1));
    let (mut vals, mut idx) = (Vec::new(), Vec::new());
    for plane in 0..n * c {
        for y in 0..oh {
            for x0 in 0..ow {
                let (mut m, mut at) = (f32::NEG_INFINITY, -1i64);
                for ky in 0..k[0] {
                    for kx in 0..k[1] {
                        let iy = (y * s[0] + ky * d[0]) as isize - p[0] as isize;
                        let ix = (x0 * s[1] + kx * d[1]) as isize - p[1] as isize;
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let i = iy as usize * w + ix as usize;
                        let v = x[plane * h * w + i];
                        if at < 0 || v > m || v.is_nan() {
                            (m, at) = (v, i as i64);
                        }
                    }
                }
                vals.push(m);
                idx.push(at);
            }
        }
    }
    (vec![[n, c, oh, ow]], vals, idx)
}

#[test]
fn max_pooling_gives_the_values_and_indices_of_plain_loops_on_every_window_shape() {
    let dev = device();
    // (shape, kernel, stride, padding, dilation): full 2x2 windows (the fast path: even and
    // odd sizes, stride 2 and overlapping stride 1, several depth planes), then windows with
    // padding, dilation or another size (the general path).
    // The fast path takes f32 rows of stride 2 four windows at a time: rows of 14 windows
    // (three groups and two left), 3 and 4, and of 21 (five and one left) in a plane of 29
    // rows.
    type Case = ([usize; 4], [usize; 2], [usize; 2], [usize; 2], [usize; 2]);
    let cases: [Case; 9] = [
        ([2, 3, 28, 28], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 7, 9], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 8, 8], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([2, 2, 29, 43], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 6, 5], [2, 2], [1, 1], [0, 0], [1, 1]),
        ([1, 1, 2, 2], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 9, 8], [3, 3], [2, 2], [1, 1], [1, 1]),
        ([1, 2, 9, 9], [2, 2], [2, 2], [0, 0], [2, 2]),
        ([2, 1, 5, 7], [2, 3], [1, 2], [1, 0], [1, 1]),
    ];
    for (case, &(shape, k, s, p, d)) in cases.iter().enumerate() {
        let len = shape.iter().product();
        // Few distinct values, so windows tie; a NaN now and then, twice in some windows;
        // infinities, and negative zeros beside the zeros the rounding gives.
        let mut x = values(len, case as u64 + 1, Some(5));
        for i in (3..len).step_by(37) {
            x[i] = f32::NAN;
            if i + 1 < len && i % 2 == 0 {
                x[i + 1] = f32::NAN;
            }
        }
        for i in (5..len).step_by(23) {
            x[i] = [f32::INFINITY, f32::NEG_INFINITY, -0.0][i % 3];
        }
        let t = Tensor::<4>::from_data(TensorData::new(x.clone(), shape), &dev);
        let options = MaxPoolOptions::new(k)
            .with_stride(s)
            .with_padding(p)
            .with_dilation(d);
        // Without indices (inference) the backend computes none: the same values.
        let alone = max_pool2d(t.clone(), options.clone());
        let (out, idx) = max_pool2d_with_indices(t, options);
        let (want_shape, want, want_idx) = naive_pool(&x, shape, k, s, p, d);
        assert_eq!(vec![alone.dims()], want_shape, "case {case}");
        let alone: Vec<f32> = alone.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(vec![out.dims()], want_shape, "case {case}");
        let got: Vec<f32> = out.into_data().try_to_vec::<f32>().unwrap();
        let got_idx: Vec<i64> = idx.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(got.len(), want.len(), "case {case}");
        for (i, ((g, a), w)) in got.iter().zip(&alone).zip(&want).enumerate() {
            for (g, what) in [(g, "with indices"), (a, "without indices")] {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "case {case}, output {i} {what}: {g} against {w}"
                );
            }
        }
        assert_eq!(got_idx, want_idx, "case {case}");
    }
}

/// A convolution's geometry: input [n, c, h, w], weight [o, c / groups, kh, kw], stride,
/// padding, dilation and groups.
#[derive(Clone, Copy)]
struct Geometry {
    x: [usize; 4],
    w: [usize; 4],
    s: [usize; 2],
    p: [usize; 2],
    d: [usize; 2],
    groups: usize,
}

impl Geometry {
    /// The output's shape.
    fn out(&self) -> [usize; 4] {
        let [n, _, h, w] = self.x;
        let [o, _, kh, kw] = self.w;
        let (s, p, d) = (self.s, self.p, self.d);
        let out = |i: usize, k: usize, a: usize| (i + 2 * p[a] - d[a] * (k - 1) - 1) / s[a] + 1;
        [n, o, out(h, kh, 0), out(w, kw, 1)]
    }

    /// Every product of the convolution, in loops: `tap(output, input, weight)` with the flat
    /// indices of an output value, the input value it multiplies (padding skipped) and the
    /// weight.
    fn each_tap(&self, mut tap: impl FnMut(usize, usize, usize)) {
        let ([n, c, h, w], [o, cg, kh, kw], (s, p, d)) = (self.x, self.w, (self.s, self.p, self.d));
        let [_, _, oh, ow] = self.out();
        let og = o / self.groups;
        for b in 0..n {
            for oc in 0..o {
                let ic0 = oc / og * cg;
                for yy in 0..oh {
                    for xx in 0..ow {
                        let at = ((b * o + oc) * oh + yy) * ow + xx;
                        for ci in 0..cg {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (yy * s[0] + ky * d[0]) as isize - p[0] as isize;
                                    let ix = (xx * s[1] + kx * d[1]) as isize - p[1] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let input =
                                        ((b * c + ic0 + ci) * h + iy as usize) * w + ix as usize;
                                    tap(at, input, ((oc * cg + ci) * kh + ky) * kw + kx);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The convolution of `x` by `weight` in loops, in f64.
    fn conv(&self, x: &[f32], weight: &[f32]) -> Vec<f64> {
        let mut y = vec![0.0f64; self.out().iter().product()];
        self.each_tap(|o, i, k| y[o] += f64::from(x[i]) * f64::from(weight[k]));
        y
    }

    /// The input gradient in loops, in f64: each output gradient value times each weight it
    /// was multiplied by, added where its input came from.
    fn input_grad(&self, dy: &[f32], weight: &[f32]) -> Vec<f64> {
        let mut dx = vec![0.0f64; self.x.iter().product()];
        self.each_tap(|o, i, k| dx[i] += f64::from(dy[o]) * f64::from(weight[k]));
        dx
    }
}

#[test]
fn convolution_gives_the_sums_of_plain_loops_with_padding_strides_dilation_and_groups() {
    let dev = device();
    // (input, weight, stride, padding, dilation, groups). The first has no padding and large
    // values: the next ones, padded, would show any of them left in reused scratch where
    // their padding should be zeros. burn-flex's im2col GEMM takes the kernel as its left
    // operand where an im2col row holds at least 4 values per output channel and the kernel
    // at most 512 Ki values (`kernel_left` in `third_party/burn-flex`): the first, third,
    // fourth, fifth, sixth and seventh cases do; the last two do not (rows too short, kernel
    // too large), and the second takes the path for few input channels. Without groups or
    // dilation along the width, a kernel row's taps are copied as one run of the input row,
    // cut where the padding starts (the seventh: stride 2, cut on both sides).
    type Case = (
        [usize; 4],
        [usize; 4],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        usize,
    );
    let cases: [Case; 9] = [
        ([2, 8, 12, 12], [32, 8, 5, 5], [1, 1], [0, 0], [1, 1], 1),
        ([2, 3, 12, 12], [64, 3, 5, 5], [1, 1], [2, 2], [1, 1], 1),
        ([2, 64, 7, 7], [32, 64, 5, 5], [1, 1], [2, 2], [1, 1], 1),
        ([1, 8, 11, 9], [16, 8, 3, 3], [2, 2], [1, 1], [1, 1], 1),
        ([1, 8, 10, 10], [16, 4, 3, 3], [1, 1], [1, 1], [1, 1], 2),
        ([1, 6, 13, 13], [12, 6, 3, 3], [1, 2], [2, 1], [2, 2], 1),
        ([1, 8, 11, 13], [16, 8, 5, 5], [2, 2], [2, 2], [1, 1], 1),
        ([2, 16, 9, 9], [64, 16, 3, 3], [1, 1], [1, 1], [1, 1], 1),
        ([1, 512, 5, 5], [128, 512, 4, 4], [1, 1], [1, 1], [1, 1], 1),
    ];
    for (case, &(xs, ws, s, p, d, groups)) in cases.iter().enumerate() {
        let scale = if case == 0 { 1.0e6 } else { 1.0 };
        let x: Vec<f32> = values(xs.iter().product(), 100 + case as u64, None)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        let w = values(ws.iter().product(), 200 + case as u64, None);
        let geometry = Geometry {
            x: xs,
            w: ws,
            s,
            p,
            d,
            groups,
        };
        let (want_shape, want) = (geometry.out(), geometry.conv(&x, &w));
        let y = conv2d(
            Tensor::<4>::from_data(TensorData::new(x, xs), &dev),
            Tensor::<4>::from_data(TensorData::new(w, ws), &dev),
            None,
            ConvOptions::new(s, p, d, groups),
        );
        assert_eq!(y.dims(), want_shape, "case {case}");
        let got: Vec<f32> = y.into_data().try_to_vec::<f32>().unwrap();
        let bound = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-5 * bound.max(1.0),
                "case {case}, output {i}: {g} against {w}"
            );
        }
    }
}

#[test]
fn transposed_views_are_laid_out_as_plain_loops_lay_them_out() {
    let dev = device();
    // (rows, cols) of the stored matrix: edges that are not whole blocks of 8, and one over a
    // million values (split across threads).
    for (case, &(r, c)) in [(1, 1), (3, 17), (8, 8), (19, 33), (1100, 1001)]
        .iter()
        .enumerate()
    {
        let x = values(r * c, 300 + case as u64, None);
        let t = Tensor::<2>::from_data(TensorData::new(x.clone(), [r, c]), &dev);
        let want: Vec<f32> = (0..c)
            .flat_map(|j| (0..r).map(move |i| (i, j)))
            .map(|(i, j)| x[i * c + j])
            .collect();
        let got: Vec<f32> = t.clone().transpose().into_data().try_to_vec().unwrap();
        assert_eq!(got, want, "case {case}");
        // A window of the transposed view: the same values from an offset.
        if r > 4 && c > 6 {
            let window = t.transpose().slice([2..c - 3, 1..r - 2]);
            let got: Vec<f32> = window.into_data().try_to_vec().unwrap();
            let want: Vec<f32> = (2..c - 3)
                .flat_map(|j| (1..r - 2).map(move |i| (i, j)))
                .map(|(i, j)| x[i * c + j])
                .collect();
            assert_eq!(got, want, "case {case}, window");
        }
    }
    // A batch of matrices, each transposed.
    let (b, r, c) = (3, 70, 50);
    let x = values(b * r * c, 400, None);
    let t = Tensor::<3>::from_data(TensorData::new(x.clone(), [b, r, c]), &dev);
    let got: Vec<f32> = t.swap_dims(1, 2).into_data().try_to_vec().unwrap();
    let want: Vec<f32> = (0..b)
        .flat_map(|k| (0..c).flat_map(move |j| (0..r).map(move |i| (k, i, j))))
        .map(|(k, i, j)| x[(k * r + i) * c + j])
        .collect();
    assert_eq!(got, want);
}

/// A `[1, c, 1, ...]` shape of rank `D`, for per-channel values broadcast over `x`.
fn per_channel_shape<const D: usize>(c: usize) -> [usize; D] {
    let mut s = [1; D];
    s[1] = c;
    s
}

/// burn's composition of `batch_norm_train` (burn-backend 0.22.1's default, which the patched
/// backend replaces with two passes), out of tensor operations: output, mean, variance.
fn composed_train<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    eps: f64,
) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
    let c = x.dims()[1];
    let m = x.shape().num_elements() / c;
    let pc = per_channel_shape::<D>(c);
    let mean = x
        .clone()
        .swap_dims(0, 1)
        .reshape([c, m])
        .mean_dim(1)
        .reshape(pc);
    let centered = x.clone() - mean.clone();
    let var = (centered.clone() * centered)
        .swap_dims(0, 1)
        .reshape([c, m])
        .mean_dim(1);
    let (mean, var): (Tensor<1>, Tensor<1>) = (mean.reshape([c]), var.reshape([c]));
    let std = (var.clone().reshape(pc) + eps).sqrt();
    let out = (x - mean.clone().reshape(pc)) / std * gamma.reshape(pc) + beta.reshape(pc);
    (out, mean, var)
}

/// burn's composition of `batch_norm_train_backward`: the gradients of x, gamma and beta.
fn composed_backward<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    mean: Tensor<1>,
    var: Tensor<1>,
    eps: f64,
    dy: Tensor<D>,
) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
    let c = x.dims()[1];
    let m = x.shape().num_elements() / c;
    let pc = per_channel_shape::<D>(c);
    let inv_std = (var + eps).sqrt().recip().reshape(pc);
    let normalized = (x - mean.reshape(pc)) * inv_std.clone();
    let og: Tensor<2> = dy.clone().swap_dims(0, 1).reshape([c, m]);
    let ng: Tensor<2> = (dy.clone() * normalized.clone())
        .swap_dims(0, 1)
        .reshape([c, m]);
    let beta_grad = og.clone().sum_dim(1).reshape([c]);
    let gamma_grad = ng.clone().sum_dim(1).reshape([c]);
    let mean_grad = og.mean_dim(1).reshape(pc);
    let mean_norm_grad = ng.mean_dim(1).reshape(pc);
    let scale = gamma.reshape(pc) * inv_std;
    let x_grad = scale * ((dy - mean_grad) - normalized * mean_norm_grad);
    (x_grad, gamma_grad, beta_grad)
}

/// Asserts that two tensors hold the same f32 values bit for bit, naming the first that
/// differs.
fn assert_same_bits<const D: usize>(got: Tensor<D>, want: Tensor<D>, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (got.into_data(), want.into_data());
    let (g, w) = (
        g.try_to_vec::<f32>().expect("f32"),
        w.try_to_vec::<f32>().expect("f32"),
    );
    let differ = g
        .iter()
        .zip(&w)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
        panic!(
            "{what}: {differ} of {} values differ, the first at {i}: {} against {}",
            g.len(),
            g[i],
            w[i]
        );
    }
}

/// Checks the backend's batch norm (training forward through autodiff, its backward, and
/// inference with given statistics) bit for bit against burn's compositions on `shape`.
fn check_batch_norm<const D: usize>(shape: [usize; D], seed: u64) {
    let dev = device();
    let ad = dev.clone().autodiff();
    let numel: usize = shape.iter().product();
    let c = shape[1];
    // Values off zero and of uneven scale, so the mean and variance matter.
    let xs: Vec<f32> = noise(numel, seed).iter().map(|v| 3.0 * v + 0.7).collect();
    let gs = noise(c, seed + 1);
    let bs = noise(c, seed + 2);
    let dys = noise(numel, seed + 3);
    let eps = 1e-5;
    let t = |v: &[f32], dev: &burn::tensor::Device| -> Tensor<D> {
        Tensor::from_data(TensorData::new(v.to_vec(), shape), dev)
    };
    let t1 = |v: &[f32], dev: &burn::tensor::Device| -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [c]), dev)
    };
    let what = format!("batch norm on {shape:?}");

    let (out, mean, var) = composed_train(t(&xs, &dev), t1(&gs, &dev), t1(&bs, &dev), eps);
    let (x_grad, gamma_grad, beta_grad) = composed_backward(
        t(&xs, &dev),
        t1(&gs, &dev),
        mean.clone(),
        var.clone(),
        eps,
        t(&dys, &dev),
    );

    let x = t(&xs, &ad).require_grad();
    let gamma = t1(&gs, &ad).require_grad();
    let beta = t1(&bs, &ad).require_grad();
    let r = burn::tensor::module::batch_norm_train(x.clone(), gamma.clone(), beta.clone(), eps);
    assert_same_bits(r.mean.inner(), mean.clone(), &format!("{what}: mean"));
    assert_same_bits(
        r.variance.inner(),
        var.clone(),
        &format!("{what}: variance"),
    );
    assert_same_bits(r.output.clone().inner(), out, &format!("{what}: output"));
    // The backward of `sum(output * dy)` hands the layer exactly `dy`.
    let grads = (r.output * t(&dys, &ad)).sum().backward();
    let grad = |g: Option<Tensor<1>>| g.expect("a gradient");
    let x_got = x.grad(&grads).expect("a gradient of x");
    assert_same_bits(x_got, x_grad, &format!("{what}: x grad"));
    assert_same_bits(
        grad(gamma.grad(&grads)),
        gamma_grad,
        &format!("{what}: gamma grad"),
    );
    assert_same_bits(
        grad(beta.grad(&grads)),
        beta_grad,
        &format!("{what}: beta grad"),
    );

    // Inference with given statistics, against `((x - mean) / sqrt(var + eps)) * gamma + beta`.
    let pc = per_channel_shape::<D>(c);
    let want = (t(&xs, &dev) - mean.clone().reshape(pc)) / (var.clone().reshape(pc) + eps).sqrt()
        * t1(&gs, &dev).reshape(pc)
        + t1(&bs, &dev).reshape(pc);
    let got = burn::tensor::module::batch_norm(
        t(&xs, &dev),
        t1(&gs, &dev),
        t1(&bs, &dev),
        mean,
        var,
        eps,
    );
    assert_same_bits(got, want, &format!("{what}: inference"));
}

#[test]
fn batch_norm_is_bit_identical_to_burns_composition_on_every_layout() {
    // A digits-CNN layer (large enough for the threaded passes), small ones, one sample, one
    // channel, two values per channel and sample, rank 3 and 5.
    check_batch_norm([32, 64, 28, 28], 1);
    check_batch_norm([4, 3, 5, 7], 2);
    check_batch_norm([1, 3, 4, 4], 3);
    check_batch_norm([4, 1, 3, 3], 4);
    check_batch_norm([3, 2, 2], 5);
    check_batch_norm([2, 3, 2, 2, 3], 6);
    // Where the fused kernels leave it to the composition: rank 2, one value per sample.
    check_batch_norm([6, 5], 7);
    check_batch_norm([4, 3, 1, 1], 8);
}

/// burn's composition for a convolution's weight gradient (`conv2d_weight_backward`'s
/// default): per group, the input with batch and channels swapped, convolved by the swapped
/// output gradient with stride and dilation swapped, swapped back and cut to the kernel.
fn composed_weight_grad(
    x: Tensor<4>,
    dy: Tensor<4>,
    [co, cig, kh, kw]: [usize; 4],
    [s, p, d]: [[usize; 2]; 3],
    groups: usize,
) -> Tensor<4> {
    let cog = co / groups;
    let parts: Vec<Tensor<4>> = (0..groups)
        .map(|g| {
            let xg = x.clone().swap_dims(0, 1).narrow(0, g * cig, cig);
            let dg = dy.clone().swap_dims(0, 1).narrow(0, g * cog, cog);
            conv2d(xg, dg, None, ConvOptions::new(d, p, s, 1))
                .swap_dims(0, 1)
                .slice([0..cog, 0..cig, 0..kh, 0..kw])
        })
        .collect();
    Tensor::cat(parts, 0)
}

#[test]
fn a_convolutions_weight_gradient_is_bit_identical_to_burns_composition_and_its_input_gradient_right()
 {
    let dev = device();
    let ad = dev.clone().autodiff();
    // (input, weight, stride, padding, dilation, groups). The digits CNN's three layers; a
    // stride, where the composition's output is larger than the kernel and is cut; dilation;
    // a rectangular kernel and input; a kernel so large the composition takes two tiles of
    // positions. Then three the backend leaves to the composition: few samples and output
    // channels, groups, and a 1x1 output.
    type Case = ([usize; 4], [usize; 4], [[usize; 2]; 3], usize);
    let cases: [Case; 10] = [
        ([32, 3, 28, 28], [64, 3, 5, 5], [[1, 1], [2, 2], [1, 1]], 1),
        (
            [32, 64, 14, 14],
            [64, 64, 5, 5],
            [[1, 1], [2, 2], [1, 1]],
            1,
        ),
        ([32, 64, 7, 7], [128, 64, 5, 5], [[1, 1], [2, 2], [1, 1]], 1),
        ([5, 6, 11, 9], [20, 6, 3, 3], [[2, 2], [1, 1], [1, 1]], 1),
        ([6, 5, 10, 10], [18, 5, 3, 3], [[1, 1], [2, 2], [2, 2]], 1),
        ([7, 4, 9, 13], [17, 4, 2, 4], [[1, 2], [1, 0], [1, 1]], 1),
        ([5, 2, 30, 30], [17, 2, 23, 23], [[1, 1], [0, 0], [1, 1]], 1),
        ([2, 3, 8, 8], [8, 3, 3, 3], [[1, 1], [1, 1], [1, 1]], 1),
        ([6, 8, 10, 10], [24, 4, 3, 3], [[1, 1], [1, 1], [1, 1]], 2),
        ([6, 5, 3, 3], [20, 5, 3, 3], [[1, 1], [0, 0], [1, 1]], 1),
    ];
    for (case, &(xs, ws, [s, p, d], groups)) in cases.iter().enumerate() {
        let seed = 300 + 10 * case as u64;
        let x = values(xs.iter().product(), seed, None);
        let w = values(ws.iter().product(), seed + 1, None);
        let geometry = Geometry {
            x: xs,
            w: ws,
            s,
            p,
            d,
            groups,
        };
        let out = geometry.out();
        let dy = values(out.iter().product(), seed + 2, None);
        let t = |v: &[f32], shape: [usize; 4], dev: &burn::tensor::Device| {
            Tensor::<4>::from_data(TensorData::new(v.to_vec(), shape), dev)
        };
        let want = composed_weight_grad(t(&x, xs, &dev), t(&dy, out, &dev), ws, [s, p, d], groups);
        // Through autodiff: the backward of `sum(out * dy)` hands the layer exactly `dy`.
        let weight = t(&w, ws, &ad).require_grad();
        let input = t(&x, xs, &ad).require_grad();
        let y = conv2d(
            input.clone(),
            weight.clone(),
            None,
            ConvOptions::new(s, p, d, groups),
        );
        let grads = (y * t(&dy, out, &ad)).sum().backward();
        let got = weight.grad(&grads).expect("a gradient of the weight");
        assert_same_bits(
            got,
            want,
            &format!("case {case}: weight gradient of {xs:?} by {ws:?}"),
        );
        // The input gradient (a transposed convolution, whose groups the backend runs in
        // parallel on reused buffers) against plain loops.
        let dx: Vec<f32> = input
            .grad(&grads)
            .expect("a gradient of the input")
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let want = geometry.input_grad(&dy, &w);
        let bound = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in dx.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-5 * bound,
                "case {case}, input gradient {i}: {g} against {w}"
            );
        }
    }
}
