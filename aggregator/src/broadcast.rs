//! A model version's broadcast written from the model's tensors whenever its bytes are needed
//! (once for its hash, once as its chunks are sealed), so the aggregator never holds the
//! payload as bytes: on the 2-core VM a fresh 57 MB payload buffer cost the fold 0.1 s of page
//! faults each round.

use std::sync::Arc;
use unifed_protocol::PayloadSource;
use unifed_protocol::encoding::{EncodedTensorRef, Values};
use unifed_protocol::messages::ServerExtras;

/// The postcard [`unifed_protocol::messages::ServerBroadcast`] of one model version, written
/// from the model it shares with the aggregator (which copies the model before changing it
/// only while this is still held). Little-endian machines only, where an `f32` slice is the
/// wire's bytes.
pub(crate) struct ModelBroadcast {
    version: u64,
    /// Each tensor sent: its name, its shape and its index in `model`.
    tensors: Vec<(String, Vec<u32>, usize)>,
    model: Arc<Vec<Vec<f32>>>,
    extras: ServerExtras,
}

impl ModelBroadcast {
    /// Model `version`: the tensors `tensors` (name, shape, index in `model`) of `model`, and
    /// `extras`.
    pub(crate) fn new(
        version: u64,
        tensors: Vec<(String, Vec<u32>, usize)>,
        model: Arc<Vec<Vec<f32>>>,
        extras: ServerExtras,
    ) -> ModelBroadcast {
        ModelBroadcast {
            version,
            tensors,
            model,
            extras,
        }
    }
}

impl PayloadSource for ModelBroadcast {
    fn write_payload(&self, out: &mut dyn FnMut(&[u8])) {
        let weights: Vec<EncodedTensorRef<'_>> = self
            .tensors
            .iter()
            .map(|(name, shape, i)| EncodedTensorRef {
                name: name.clone(),
                shape: shape.clone(),
                values: Values::F32(bytemuck::cast_slice(&self.model[*i])),
            })
            .collect();
        // Postcard writes a struct as its fields in order: the tuple is the broadcast's bytes.
        postcard::serialize_with_flavor(&(self.version, &weights, &self.extras), Pieces(out))
            .expect("postcard cannot fail on a derived Serialize of plain data");
    }
}

/// A postcard output that hands each piece on as it is written.
struct Pieces<'a>(&'a mut dyn FnMut(&[u8]));

impl postcard::ser_flavors::Flavor for Pieces<'_> {
    type Output = ();

    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        (self.0)(&[byte]);
        Ok(())
    }

    fn try_extend(&mut self, bytes: &[u8]) -> postcard::Result<()> {
        (self.0)(bytes);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}
