//! The trait every model of the zoo implements: a representation ([`Net::features`]) and a
//! classifier over it ([`Net::head`]), each BN layer routed through [`crate::bn::norm`].

use crate::bn::BnPass;
use burn::module::Module;
use burn::tensor::Tensor;

/// A model of the zoo.
pub trait Net: Module + Clone + core::fmt::Debug + Send + 'static {
    /// Architecture identifier with its configuration, as written in the model spec.
    fn architecture(&self) -> String;

    /// Number of input values per sample.
    fn input_numel(&self) -> usize;

    /// Input -> representation (the vector the classifier reads), `[n, repr]`.
    fn features(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2>;

    /// Representation -> logits `[n, classes]`.
    fn head(&self, h: Tensor<2>) -> Tensor<2>;

    /// The places the model can be split into a low-level part and a high-level head
    /// (FedImpro), each the number of weight layers (convolutions and linear layers) in the low
    /// part, ascending; every model has at least one.
    fn split_points(&self) -> Vec<usize>;

    /// Input -> the low-level part's output at split point `split` (one of
    /// [`Net::split_points`]), one flat row per sample `[n, width]`.
    fn low(&self, x: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2>;

    /// The low-level part's output at `split`, as [`Net::low`] gives it -> logits. For every
    /// split point, `high(low(x))` is [`Net::forward`].
    fn high(&self, h: Tensor<2>, split: usize, bn: &mut BnPass) -> Tensor<2>;

    /// Input -> logits.
    fn forward(&self, x: Tensor<2>, bn: &mut BnPass) -> Tensor<2> {
        let h = self.features(x, bn);
        self.head(h)
    }

    /// Maps a burn parameter path to its PyTorch state_dict name where the two differ in more
    /// than BN's `gamma`/`beta` (e.g. ResNet's `downsample.conv` -> `downsample.0`).
    fn torch_path(&self, burn_path: &str) -> String {
        burn_path.to_string()
    }
}
