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
