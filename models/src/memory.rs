//! What a site carries from round to round besides its model ([`Memory`]), and how a site
//! reads it back from a checkpoint with its two model-sized parts streamed into files.

use crate::client::ClientState;
use crate::park::{Kept, Stash};
use serde::de::{DeserializeSeed, Error as _, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What a site carries from round to round besides its model: the error-feedback residuals and
/// the broadcast a lossy encoding keeps, and its algorithm's state ([`ClientState`]). Persisted
/// beside the checkpoint. `T` is how the two parts a lossy encoding keeps (the residual and the
/// held broadcast, each model-sized) are kept: outside a site always in memory; inside one, in
/// files between uses when it parks ([`crate::site::Site::park_base_in`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory<T = BTreeMap<String, Vec<f32>>> {
    /// Error-feedback residual of each tensor, as of the last accepted update.
    pub residual: T,
    /// Under a lossy encoding, the broadcast tensors of the model version applied last, as the
    /// aggregator sent them (before any local training), and that version: the next model
    /// arrives as a delta to add to them.
    pub held: Option<(u64, T)>,
    /// The algorithm's state (SCAFFOLD's and FedDC's variates, MOON's previous local model,
    /// FedDC's drift), as of the last accepted update.
    pub algorithm: ClientState,
}

impl Memory<Kept> {
    /// Every tensor's values held in memory but the held broadcast's, in one fixed order (the
    /// residual's, then the algorithm's).
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Vec<f32>> {
        self.residual
            .values_mut()
            .chain(self.algorithm.values_mut())
    }

    /// The memory with every part in memory.
    pub(crate) fn load(&self) -> std::io::Result<Memory> {
        Ok(Memory {
            residual: self.residual.load()?,
            held: match &self.held {
                Some((v, h)) => Some((*v, h.load()?)),
                None => None,
            },
            algorithm: self.algorithm.clone(),
        })
    }
}

/// How a checkpoint lays out a [`Memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryLayout {
    /// The residual, the held broadcast and the typed [`ClientState`] (agent checkpoints from
    /// format version 6 on).
    Typed,
    /// The residual, `c_i`, the server's `c`, the held broadcast, MOON's previous model and
    /// FedDC's drift, each a field of its own (format versions 3 to 5): read into the
    /// [`ClientState`] of the one algorithm they hold ([`ClientState::from_fields`]).
    Fields,
}

/// Deserialises a [`Memory`] from its serialised form (a checkpoint's, laid out as `layout`
/// says) with the residual and the held broadcast written to stash files at the given paths as
/// their values are read (a block at a time, never whole in memory), or kept in memory without
/// a path.
pub(crate) struct MemorySeed {
    /// Where the residual goes.
    pub(crate) residual: Option<PathBuf>,
    /// Where the held broadcast goes.
    pub(crate) held: Option<PathBuf>,
    /// How the memory is laid out.
    pub(crate) layout: MemoryLayout,
}

/// [`Memory`]'s fields, in order.
const FIELDS: [&str; 3] = ["residual", "held", "algorithm"];

/// The fields of a memory laid out as [`MemoryLayout::Fields`], in order.
const OLD_FIELDS: [&str; 6] = [
    "residual",
    "control",
    "server_control",
    "held",
    "previous",
    "drift",
];

impl<'de> DeserializeSeed<'de> for MemorySeed {
    type Value = Memory<Kept>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Memory<Kept>, D::Error> {
        match self.layout {
            MemoryLayout::Typed => d.deserialize_struct("Memory", &FIELDS, self),
            MemoryLayout::Fields => d.deserialize_struct("Memory", &OLD_FIELDS, self),
        }
    }
}

impl<'de> Visitor<'de> for MemorySeed {
    type Value = Memory<Kept>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a site's memory")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Memory<Kept>, A::Error> {
        let missing = |i: usize| A::Error::invalid_length(i, &"the fields of a memory");
        let residual = seq
            .next_element_seed(KeptSeed(self.residual))?
            .ok_or_else(|| missing(0))?;
        if self.layout == MemoryLayout::Typed {
            return Ok(Memory {
                residual,
                held: seq
                    .next_element_seed(HeldSeed(self.held))?
                    .ok_or_else(|| missing(1))?,
                algorithm: seq.next_element()?.ok_or_else(|| missing(2))?,
            });
        }
        let control = seq.next_element()?.ok_or_else(|| missing(1))?;
        let server = seq.next_element()?.ok_or_else(|| missing(2))?;
        let held = seq
            .next_element_seed(HeldSeed(self.held))?
            .ok_or_else(|| missing(3))?;
        let previous = seq.next_element()?.ok_or_else(|| missing(4))?;
        let drift = seq.next_element()?.ok_or_else(|| missing(5))?;
        Ok(Memory {
            residual,
            held,
            algorithm: ClientState::from_fields(control, server, previous, drift),
        })
    }
}

/// A map of vectors by name, into a stash file at the path (values a block at a time) or into
/// memory.
struct KeptSeed(Option<PathBuf>);

impl<'de> DeserializeSeed<'de> for KeptSeed {
    type Value = Kept;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Kept, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for KeptSeed {
    type Value = Kept;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("vectors of f32 by name")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Kept, A::Error> {
        let Some(path) = self.0 else {
            let mut m = BTreeMap::new();
            while let Some((name, values)) = map.next_entry::<String, Vec<f32>>()? {
                m.insert(name, values);
            }
            return Ok(Kept::Here(m));
        };
        let file = |e: std::io::Error| A::Error::custom(format!("{}: {e}", path.display()));
        let mut w = Stash::create(&path).map_err(file)?;
        while let Some(name) = map.next_key::<String>()? {
            w.begin(&name);
            map.next_value_seed(Append(&mut w))?;
            w.end();
        }
        let stash = w.finish().map_err(file)?;
        // Nothing but empty vectors (an exact encoding's residual) needs no file.
        Ok(match stash.values() {
            0 => Kept::Here(stash.names().map(|n| (n.to_string(), Vec::new())).collect()),
            _ => Kept::Filed(stash),
        })
    }
}

/// A vector of `f32` appended to a stash being written, as its values are read.
struct Append<'a>(&'a mut crate::park::StashWriter);

impl<'de> DeserializeSeed<'de> for Append<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Append<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a vector of f32")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(v) = seq.next_element::<f32>()? {
            self.0.push(v);
        }
        Ok(())
    }
}

/// The held broadcast: `None`, or its version and its vectors (see [`KeptSeed`]).
struct HeldSeed(Option<PathBuf>);

impl<'de> DeserializeSeed<'de> for HeldSeed {
    type Value = Option<(u64, Kept)>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for HeldSeed {
    type Value = Option<(u64, Kept)>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an optional held broadcast")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_tuple(2, self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let missing = |i: usize| A::Error::invalid_length(i, &"a version and vectors");
        let version: u64 = seq.next_element()?.ok_or_else(|| missing(0))?;
        let kept = seq
            .next_element_seed(KeptSeed(self.0))?
            .ok_or_else(|| missing(1))?;
        Ok(Some((version, kept)))
    }
}
