//! UniFed Edge patch: the weight gradient of a 2-D convolution without the copies of burn's
//! composition.
//!
//! burn's default `conv2d_weight_backward` swaps the batch and channel axes of the input and of
//! the output gradient and runs a convolution of the one by the other (`conv2d` with the batch
//! as channels and the gradient as the kernel). On burn-flex that convolution copies both
//! swapped tensors to contiguous buffers, lays the gradient out again as a GEMM operand and the
//! input again in channels-last order, all in fresh buffers, and its result is swapped back: for
//! the digits CNN's first layer the weight gradient took 12-15 ms on one thread against 5.5 for
//! its forward pass, with the same arithmetic.
//!
//! Here the two operands are laid out once each, straight from the tensors, and the same GEMMs
//! run on the same values: every im2col tile is built by the same function from the same
//! channels-last input, and multiplied by the same `gemm_f32` call with the same sizes, so the
//! result is **bit-identical** to the composition's. It is written straight into the
//! `[out, in, kh, kw]` layout. Where the composition's convolution would take another of
//! burn-flex's paths (1x1, depthwise, few channels, direct), or for groups, asymmetric padding
//! or another dtype, the composition runs as before.

use alloc::vec;
use alloc::vec::Vec;
use burn_backend::ops::conv::{calculate_conv_output_size, pad_asymmetric_conv_input};
use burn_backend::ops::{ConvOptions, FloatTensorOps, ModuleOps};
use burn_backend::{DType, TensorMetadata};
use burn_std::{Shape, Slice};

use super::conv;
use crate::{Flex, FlexTensor};

/// The weight gradient of `conv2d(x, weight)` given the output's gradient, for f32 and one
/// group with symmetric padding where the composition's convolution takes the im2col path;
/// `None` otherwise (the caller runs [`composed_conv2d_weight_backward`]).
pub fn conv2d_weight_backward_f32(
    x: &FlexTensor,
    weight_shape: &Shape,
    output_grad: &FlexTensor,
    options: &ConvOptions<2>,
) -> Option<FlexTensor> {
    if x.dtype() != DType::F32
        || output_grad.dtype() != DType::F32
        || options.groups != 1
        || options.is_asymmetric()
    {
        return None;
    }
    let (xs, gs) = (x.layout().shape(), output_grad.layout().shape());
    if xs.num_dims() != 4 || gs.num_dims() != 4 || weight_shape.num_dims() != 4 {
        return None;
    }
    let (batch, c_in, in_h, in_w) = (xs[0], xs[1], xs[2], xs[3]);
    let (c_out, out_h, out_w) = (gs[1], gs[2], gs[3]);
    let (kernel_h, kernel_w) = (weight_shape[2], weight_shape[3]);
    if gs[0] != batch || weight_shape[0] != c_out || weight_shape[1] != c_in {
        return None;
    }
    if [batch, c_in, in_h, in_w, c_out, out_h, out_w].contains(&0) {
        return None;
    }
    // The composition's convolution as conv3d sees it: the input as [c_in, batch, 1, h, w],
    // the gradient as its kernel [c_out, batch, 1, out_h, out_w], stride and dilation swapped;
    // its output is [c_in, c_out, rows, cols], of which the first kernel_h x kernel_w positions
    // are the gradient.
    let [pad_h, pad_w] = options.padding_begin();
    let (stride, dilation) = (options.dilation, options.stride);
    let rows = calculate_conv_output_size(out_h, stride[0], pad_h, dilation[0], in_h);
    let cols = calculate_conv_output_size(out_w, stride[1], pad_w, dilation[1], in_w);
    let geometry = conv::Im2col {
        out: [1, rows, cols],
        kernel: [1, out_h, out_w],
        stride: [1, stride[0], stride[1]],
        dilation: [1, dilation[0], dilation[1]],
        pad: [0, pad_h, pad_w],
        input: [1, in_h, in_w],
        channels: batch,
        channels_per_group: batch,
        out_channels_per_group: c_out,
    };
    let opts = ConvOptions::new(geometry.stride, geometry.pad, geometry.dilation, 1);
    let x3 = [c_in, batch, 1, in_h, in_w];
    let w3 = [c_out, batch, 1, out_h, out_w];
    if !conv::takes_im2col_path(&x3, &w3, &opts) || rows < kernel_h || cols < kernel_w {
        return None;
    }
    conv::weight_grad_im2col(x, output_grad, &geometry, [kernel_h, kernel_w])
}

/// burn-backend's default `conv2d_weight_backward` (an overridden default cannot be called):
/// the convolution of the swapped input by the swapped gradient, per group.
pub fn composed_conv2d_weight_backward(
    x: FlexTensor,
    weight: FlexTensor,
    output_grad: FlexTensor,
    options: ConvOptions<2>,
) -> FlexTensor {
    let (x, options) = pad_asymmetric_conv_input::<Flex, 2>(x, options);
    let weight_shape = weight.shape();
    if options.groups == 1 {
        let x_swapped = Flex::float_swap_dims(x, 0, 1);
        let output_grad_swapped = Flex::float_swap_dims(output_grad, 0, 1);
        let weight_grad_swapped = Flex::conv2d(
            x_swapped,
            output_grad_swapped,
            None,
            ConvOptions::new(options.dilation, options.padding_begin(), options.stride, 1),
        );
        let mut weight_grad = Flex::float_swap_dims(weight_grad_swapped, 0, 1);
        if weight_grad.shape() != weight_shape {
            let slices: Vec<Slice> = (0..4).map(|d| Slice::from(0..weight_shape[d])).collect();
            weight_grad = Flex::float_slice(weight_grad, &slices);
        }
        return weight_grad;
    }
    let mut weight_grad = Flex::float_zeros(weight_shape.clone(), &weight.device(), weight.dtype().into());
    let [channels_out, increment_ci, kernel_size_1, kernel_size_2] = weight_shape.dims();
    let increment_co = channels_out / options.groups;
    let x_swapped = Flex::float_swap_dims(x, 0, 1);
    let output_grad_swapped = Flex::float_swap_dims(output_grad, 0, 1);
    for g in 0..options.groups {
        let (start_idx_ci, end_idx_ci) = (g * increment_ci, (g + 1) * increment_ci);
        let (start_idx_co, end_idx_co) = (g * increment_co, (g + 1) * increment_co);
        let x_slice = vec![Slice::new(start_idx_ci as isize, Some(end_idx_ci as isize), 1)];
        let x = Flex::float_slice(x_swapped.clone(), &x_slice);
        let grad_slice = vec![Slice::new(start_idx_co as isize, Some(end_idx_co as isize), 1)];
        let grad = Flex::float_slice(output_grad_swapped.clone(), &grad_slice);
        let mut weight_grad_tmp = Flex::conv2d(
            x,
            grad,
            None,
            ConvOptions::new(options.dilation, options.padding_begin(), options.stride, 1),
        );
        weight_grad_tmp = Flex::float_swap_dims(weight_grad_tmp, 0, 1);
        let [_, _, kernel_size_1_tmp, kernel_size_2_tmp] = weight_grad_tmp.shape().dims();
        if kernel_size_1_tmp != kernel_size_1 || kernel_size_2_tmp != kernel_size_2 {
            let slices = vec![
                Slice::from(0..increment_co),
                Slice::from(0..increment_ci),
                Slice::from(0..kernel_size_1),
                Slice::from(0..kernel_size_2),
            ];
            weight_grad_tmp = Flex::float_slice(weight_grad_tmp, &slices);
        }
        weight_grad = Flex::float_slice_assign(
            weight_grad,
            &[
                Slice::from(start_idx_co..end_idx_co),
                Slice::from(0..increment_ci),
                Slice::from(0..kernel_size_1),
                Slice::from(0..kernel_size_2),
            ],
            weight_grad_tmp,
        );
    }
    weight_grad
}
