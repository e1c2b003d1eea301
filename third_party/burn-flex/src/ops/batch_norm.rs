//! UniFed Edge patch: batch normalisation in two passes over the input.
//!
//! burn's default `batch_norm_train` and `batch_norm_train_backward` are compositions of tensor
//! operations: each transposes the input (or the gradient) to `[channels, rest]` with a full
//! copy, and allocates a full-size tensor for every intermediate (about a dozen passes over the
//! data). Here one pass works out each channel's statistics and a second writes the result.
//!
//! The results are **bit-identical** to the compositions: every element goes through the same
//! f32 operations in the same order, the per-channel values (`sqrt`, `recip` and products) are
//! computed by the same tensor operations, and each channel's sum is taken by the same kernel,
//! over the same values in the same order, as `mean_dim` takes it over a row of the transposed
//! copy. Where that row would not be a plain contiguous row (rank 2, or one value per channel
//! and sample) the compositions run as before.

use alloc::vec;
use alloc::vec::Vec;
use burn_backend::ops::{BatchNormTrain, BatchNormTrainBackward, FloatTensorOps};
use burn_backend::{DType, Scalar, TensorMetadata};
use burn_std::{Bytes, Shape};

use crate::{Flex, FlexTensor, Layout};

/// The sum of a contiguous row, as `mean_dim` takes it over the last axis of a contiguous
/// tensor (`reduce::reduce_last_dim_f32`).
fn row_sum(row: &[f32]) -> f32 {
    #[cfg(feature = "simd")]
    {
        let mut out = [0.0f32];
        crate::simd::kernels::sum_rows_f32(row, &mut out, 1, row.len());
        out[0]
    }
    #[cfg(not(feature = "simd"))]
    {
        row.iter().copied().sum()
    }
}

/// The values of a `[channels]` tensor.
fn values(t: FlexTensor) -> Vec<f32> {
    let t = t.to_contiguous();
    let start = t.layout().start_offset();
    let n = t.layout().num_elements();
    let data: &[f32] = t.storage();
    data[start..start + n].to_vec()
}

/// A `[channels]` tensor of `v`.
fn channels_tensor(v: Vec<f32>) -> FlexTensor {
    let shape = Shape::new([v.len()]);
    FlexTensor::new(Bytes::from_elems(v), Layout::contiguous(shape), DType::F32)
}

/// Whether the fused kernels take `x`: f32 of rank 2 or more and not empty, and for training
/// (`train`) rank 3 or more with at least two values per channel and sample, where
/// `swap_dims(0, 1)` and a reshape give plain contiguous rows.
pub fn applies(x: &FlexTensor, train: bool) -> bool {
    let shape = x.shape();
    let rank = shape.num_dims();
    if x.dtype() != DType::F32 || rank < 2 || shape.num_elements() == 0 {
        return false;
    }
    !train || (rank >= 3 && shape.num_elements() / (shape[0] * shape[1]) >= 2)
}

/// `x`'s shape as `(batch, channels, values per channel and sample)`.
fn split(x: &FlexTensor) -> (usize, usize, usize) {
    let shape = x.shape();
    let (batch, channels) = (shape[0], shape[1]);
    (batch, channels, shape.num_elements() / (batch * channels))
}

/// Runs `f(c, row_a, row_b)` for every channel, in parallel when the tensor is large, with
/// per-thread row buffers of `rows` values; returns the results in channel order.
fn per_channel<R: Send>(
    channels: usize,
    rows: usize,
    f: impl Fn(usize, &mut [f32], &mut [f32]) -> R + Sync + Send,
) -> Vec<R> {
    #[cfg(feature = "rayon")]
    if channels * rows >= super::PARALLEL_THRESHOLD {
        use rayon::prelude::*;
        return (0..channels)
            .into_par_iter()
            .map_init(
                || (vec![0.0f32; rows], vec![0.0f32; rows]),
                |(a, b), c| f(c, a, b),
            )
            .collect();
    }
    let (mut a, mut b) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    (0..channels).map(|c| f(c, &mut a, &mut b)).collect()
}

/// Calls `f(c, at, plane)` on every channel plane of `data` (`[batch, channels, spatial]`),
/// `at` being the plane's offset, in parallel over samples when the tensor is large.
fn per_plane(
    data: &mut [f32],
    channels: usize,
    spatial: usize,
    f: impl Fn(usize, usize, &mut [f32]) + Sync + Send,
) {
    let sample = channels * spatial;
    let run = |n: usize, dst: &mut [f32]| {
        for (c, plane) in dst.chunks_exact_mut(spatial).enumerate() {
            f(c, n * sample + c * spatial, plane);
        }
    };
    #[cfg(feature = "rayon")]
    if data.len() >= super::PARALLEL_THRESHOLD {
        use rayon::prelude::*;
        data.par_chunks_mut(sample)
            .enumerate()
            .for_each(|(n, dst)| run(n, dst));
        return;
    }
    for (n, dst) in data.chunks_mut(sample).enumerate() {
        run(n, dst);
    }
}

/// Copies channel `c` of every sample of `x` (`[batch, channels, spatial]`) into `row`,
/// samples one after another: the row `swap_dims(0, 1)` and a reshape to
/// `[channels, batch * spatial]` give.
fn gather(x: &[f32], c: usize, channels: usize, spatial: usize, row: &mut [f32]) {
    for (n, dst) in row.chunks_exact_mut(spatial).enumerate() {
        let at = (n * channels + c) * spatial;
        dst.copy_from_slice(&x[at..at + spatial]);
    }
}

/// `batch_norm` (normalisation with given statistics) in one pass, in `x`'s own buffer when
/// nothing else holds it. `x` must be one [`applies`] takes (`train` false).
pub fn batch_norm(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
) -> FlexTensor {
    let (_, channels, spatial) = split(&x);
    // As the composition: std = sqrt(variance + epsilon), then ((x - mean) / std) * gamma + beta.
    let std = values(Flex::float_sqrt(Flex::float_add_scalar(
        variance,
        Scalar::Float(epsilon),
    )));
    let (mean, gamma, beta) = (values(mean), values(gamma), values(beta));
    let mut out = x.into_contiguous();
    per_plane(out.storage_mut(), channels, spatial, |c, _, plane| {
        let (m, s, g, b) = (mean[c], std[c], gamma[c], beta[c]);
        for v in plane {
            *v = ((*v - m) / s) * g + b;
        }
    });
    out
}

/// `batch_norm_train` in two passes. `x` must be one [`applies`] takes (`train` true).
pub fn batch_norm_train(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
) -> BatchNormTrain<Flex> {
    let (batch, channels, spatial) = split(&x);
    let rows = batch * spatial;
    let x = x.into_contiguous();
    let src: &[f32] = x.storage();
    // Pass 1: each channel's mean = sum / n, then variance = sum((v - mean) * (v - mean)) / n,
    // the squares taken in the input's layout and summed over the transposed row.
    let stats = per_channel(channels, rows, |c, row, _| {
        gather(src, c, channels, spatial, row);
        let mean = row_sum(row) / rows as f32;
        for v in row.iter_mut() {
            let d = *v - mean;
            *v = d * d;
        }
        (mean, row_sum(row) / rows as f32)
    });
    let mean = channels_tensor(stats.iter().map(|s| s.0).collect());
    let variance = channels_tensor(stats.iter().map(|s| s.1).collect());
    // Pass 2: the normalisation, as `batch_norm` with these statistics (in a copy of the input
    // where autodiff keeps it for the backward pass).
    let output = batch_norm(x, gamma, beta, mean.clone(), variance.clone(), epsilon);
    BatchNormTrain::new(output, mean, variance)
}

/// `batch_norm_train_backward` in two passes, the input's gradient written over the output's
/// where nothing else holds it. `x` must be one [`applies`] takes (`train` true), and
/// `output_grad` of its shape.
pub fn batch_norm_train_backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
    output_grad: FlexTensor,
) -> BatchNormTrainBackward<Flex> {
    let (batch, channels, spatial) = split(&x);
    let rows = batch * spatial;
    // As the composition: inv_std = recip(sqrt(variance + epsilon)), scale = gamma * inv_std.
    let inv_std = Flex::float_recip(Flex::float_sqrt(Flex::float_add_scalar(
        variance,
        Scalar::Float(epsilon),
    )));
    let scale = values(Flex::float_mul(gamma, inv_std.clone()));
    let inv_std = values(inv_std);
    let mean = values(mean);
    let x = x.into_contiguous();
    let xv: &[f32] = x.storage();
    let mut grad = output_grad.into_contiguous();
    // Pass 1: per channel, the sums of the gradient and of gradient * normalised input
    // (normalised = (x - mean) * inv_std), over the transposed rows.
    let sums = {
        let gv: &[f32] = grad.storage();
        per_channel(channels, rows, |c, dy, prod| {
            gather(gv, c, channels, spatial, dy);
            gather(xv, c, channels, spatial, prod);
            let (m, is) = (mean[c], inv_std[c]);
            for (p, &g) in prod.iter_mut().zip(dy.iter()) {
                *p = g * ((*p - m) * is);
            }
            (row_sum(dy), row_sum(prod))
        })
    };
    let n = rows as f32;
    // Pass 2: x_grad = scale * ((dy - mean(dy)) - normalised * mean(dy * normalised)).
    per_plane(grad.storage_mut(), channels, spatial, |c, at, plane| {
        let (m, is, sc) = (mean[c], inv_std[c], scale[c]);
        let (mean_grad, mean_norm_grad) = (sums[c].0 / n, sums[c].1 / n);
        for (g, &v) in plane.iter_mut().zip(&xv[at..at + spatial]) {
            let normalised = (v - m) * is;
            *g = sc * ((*g - mean_grad) - normalised * mean_norm_grad);
        }
    });
    BatchNormTrainBackward::new(
        grad,
        channels_tensor(sums.iter().map(|s| s.1).collect()),
        channels_tensor(sums.iter().map(|s| s.0).collect()),
    )
}

// The compositions burn-backend 0.22.1 gives as `ModuleOps`' defaults, for the inputs the fused
// kernels leave (a default method cannot be called once it is overridden).

/// burn's default `batch_norm`.
pub fn composed_batch_norm(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
) -> FlexTensor {
    let rank = x.shape().num_dims();
    let channels = x.shape()[1];
    let mut dimensions = vec![1; rank];
    dimensions[1] = channels;
    let shape = Shape::from(dimensions);
    let gamma = Flex::float_reshape(gamma, shape.clone());
    let beta = Flex::float_reshape(beta, shape.clone());
    let mean = Flex::float_reshape(mean, shape.clone());
    let variance = Flex::float_reshape(variance, shape);
    let std = Flex::float_sqrt(Flex::float_add_scalar(variance, Scalar::Float(epsilon)));
    let normalized = Flex::float_div(Flex::float_sub(x, mean), std);
    Flex::float_add(Flex::float_mul(normalized, gamma), beta)
}

/// burn's default `batch_norm_train`.
pub fn composed_batch_norm_train(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
) -> BatchNormTrain<Flex> {
    let shape = x.shape();
    let channels = shape[1];
    let samples_per_channel = shape.num_elements() / channels;
    let flattened = Shape::new([channels, samples_per_channel]);
    let mut per_channel = vec![1; shape.num_dims()];
    per_channel[1] = channels;
    let mean = Flex::float_mean_dim(
        Flex::float_reshape(Flex::float_swap_dims(x.clone(), 0, 1), flattened.clone()),
        1,
    );
    let mean = Flex::float_reshape(mean, Shape::from(per_channel));
    let centered = Flex::float_sub(x.clone(), mean.clone());
    let variance = Flex::float_mean_dim(
        Flex::float_reshape(
            Flex::float_swap_dims(Flex::float_mul(centered.clone(), centered), 0, 1),
            flattened,
        ),
        1,
    );
    let mean = Flex::float_reshape(mean, Shape::new([channels]));
    let variance = Flex::float_reshape(variance, Shape::new([channels]));
    let output = <Flex as burn_backend::ops::ModuleOps<Flex>>::batch_norm(
        x,
        gamma,
        beta,
        mean.clone(),
        variance.clone(),
        epsilon,
    );
    BatchNormTrain::new(output, mean, variance)
}

/// burn's default `batch_norm_train_backward`.
pub fn composed_batch_norm_train_backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    variance: FlexTensor,
    epsilon: f64,
    output_grad: FlexTensor,
) -> BatchNormTrainBackward<Flex> {
    let shape = x.shape();
    let rank = shape.num_dims();
    let channels = shape[1];
    let flattened = Shape::new([channels, shape.num_elements() / channels]);
    let mut per_channel = vec![1; rank];
    per_channel[1] = channels;
    let per_channel = Shape::from(per_channel);

    let inv_std = Flex::float_reshape(
        Flex::float_recip(Flex::float_sqrt(Flex::float_add_scalar(
            variance,
            Scalar::Float(epsilon),
        ))),
        per_channel.clone(),
    );
    let normalized = Flex::float_mul(
        Flex::float_sub(x, Flex::float_reshape(mean, per_channel.clone())),
        inv_std.clone(),
    );
    let output_grad_flat = Flex::float_reshape(
        Flex::float_swap_dims(output_grad.clone(), 0, 1),
        flattened.clone(),
    );
    let normalized_grad_flat = Flex::float_reshape(
        Flex::float_swap_dims(Flex::float_mul(output_grad.clone(), normalized.clone()), 0, 1),
        flattened,
    );
    let beta_grad = Flex::float_sum_dim(output_grad_flat.clone(), 1);
    let gamma_grad = Flex::float_sum_dim(normalized_grad_flat.clone(), 1);
    let mean_grad =
        Flex::float_reshape(Flex::float_mean_dim(output_grad_flat, 1), per_channel.clone());
    let mean_normalized_grad = Flex::float_reshape(
        Flex::float_mean_dim(normalized_grad_flat, 1),
        per_channel.clone(),
    );
    let centred_grad = Flex::float_sub(output_grad, mean_grad);
    let projected = Flex::float_mul(normalized, mean_normalized_grad);
    let scale = Flex::float_mul(Flex::float_reshape(gamma, per_channel), inv_std);
    let x_grad = Flex::float_mul(scale, Flex::float_sub(centred_grad, projected));
    BatchNormTrainBackward::new(
        x_grad,
        Flex::float_reshape(gamma_grad, Shape::new([channels])),
        Flex::float_reshape(beta_grad, Shape::new([channels])),
    )
}
