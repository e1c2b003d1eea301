//! The CPU backend's convolution, max pooling and strided copies against plain loops.
//! `third_party/burn-flex` patches the first two (im2col through reused scratch, a 2x2 pooling
//! fast path) and its tensor allocation, so these check the patched kernels on every shape
//! class they take: full and partial windows, padding, strides, dilation, groups, ties, NaN,
//! and transposed views read whole, in windows and in batches.

mod common;

use burn::tensor::module::{conv2d, max_pool2d_with_indices};
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
    type Case = ([usize; 4], [usize; 2], [usize; 2], [usize; 2], [usize; 2]);
    let cases: [Case; 7] = [
        ([2, 3, 28, 28], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 7, 9], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 6, 5], [2, 2], [1, 1], [0, 0], [1, 1]),
        ([1, 1, 2, 2], [2, 2], [2, 2], [0, 0], [1, 1]),
        ([1, 2, 9, 8], [3, 3], [2, 2], [1, 1], [1, 1]),
        ([1, 2, 9, 9], [2, 2], [2, 2], [0, 0], [2, 2]),
        ([2, 1, 5, 7], [2, 3], [1, 2], [1, 0], [1, 1]),
    ];
    for (case, &(shape, k, s, p, d)) in cases.iter().enumerate() {
        let len = shape.iter().product();
        // Few distinct values, so windows tie; a NaN now and then, twice in some windows.
        let mut x = values(len, case as u64 + 1, Some(5));
        for i in (3..len).step_by(37) {
            x[i] = f32::NAN;
            if i + 1 < len && i % 2 == 0 {
                x[i + 1] = f32::NAN;
            }
        }
        let t = Tensor::<4>::from_data(TensorData::new(x.clone(), shape), &dev);
        let options = MaxPoolOptions::new(k)
            .with_stride(s)
            .with_padding(p)
            .with_dilation(d);
        let (out, idx) = max_pool2d_with_indices(t, options);
        let (want_shape, want, want_idx) = naive_pool(&x, shape, k, s, p, d);
        assert_eq!(vec![out.dims()], want_shape, "case {case}");
        let got: Vec<f32> = out.into_data().try_to_vec::<f32>().unwrap();
        let got_idx: Vec<i64> = idx.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(got.len(), want.len(), "case {case}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "case {case}, output {i}: {g} against {w}"
            );
        }
        assert_eq!(got_idx, want_idx, "case {case}");
    }
}

/// 2-D convolution of `x` ([n, c, h, w]) by `weight` ([o, c / groups, kh, kw]) in loops, in
/// f64.
#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    weight: &[f32],
    [o, cg, kh, kw]: [usize; 4],
    s: [usize; 2],
    p: [usize; 2],
    d: [usize; 2],
    groups: usize,
) -> ([usize; 4], Vec<f64>) {
    let out = |i: usize, k: usize, a: usize| (i + 2 * p[a] - d[a] * (k - 1) - 1) / s[a] + 1;
    let (oh, ow) = (out(h, kh, 0), out(w, kw, 1));
    let og = o / groups;
    let mut y = vec![0.0f64; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for yy in 0..oh {
                for xx in 0..ow {
                    let mut acc = 0.0f64;
                    for ci in 0..cg {
                        let ic = g * cg + ci;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (yy * s[0] + ky * d[0]) as isize - p[0] as isize;
                                let ix = (xx * s[1] + kx * d[1]) as isize - p[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * c + ic) * h + iy as usize) * w + ix as usize];
                                let wv = weight[((oc * cg + ci) * kh + ky) * kw + kx];
                                acc += f64::from(xv) * f64::from(wv);
                            }
                        }
                    }
                    y[((b * o + oc) * oh + yy) * ow + xx] = acc;
                }
            }
        }
    }
    ([n, o, oh, ow], y)
}

#[test]
fn convolution_gives_the_sums_of_plain_loops_with_padding_strides_dilation_and_groups() {
    let dev = device();
    // (input, weight, stride, padding, dilation, groups). The first has no padding and large
    // values: the next ones, padded, would show any of them left in reused scratch where
    // their padding should be zeros.
    type Case = (
        [usize; 4],
        [usize; 4],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        usize,
    );
    let cases: [Case; 6] = [
        ([2, 8, 12, 12], [32, 8, 5, 5], [1, 1], [0, 0], [1, 1], 1),
        ([2, 3, 12, 12], [64, 3, 5, 5], [1, 1], [2, 2], [1, 1], 1),
        ([2, 64, 7, 7], [32, 64, 5, 5], [1, 1], [2, 2], [1, 1], 1),
        ([1, 8, 11, 9], [16, 8, 3, 3], [2, 2], [1, 1], [1, 1], 1),
        ([1, 8, 10, 10], [16, 4, 3, 3], [1, 1], [1, 1], [1, 1], 2),
        ([1, 6, 13, 13], [12, 6, 3, 3], [1, 2], [2, 1], [2, 2], 1),
    ];
    for (case, &(xs, ws, s, p, d, groups)) in cases.iter().enumerate() {
        let scale = if case == 0 { 1.0e6 } else { 1.0 };
        let x: Vec<f32> = values(xs.iter().product(), 100 + case as u64, None)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        let w = values(ws.iter().product(), 200 + case as u64, None);
        let (want_shape, want) = naive_conv(&x, xs, &w, ws, s, p, d, groups);
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
