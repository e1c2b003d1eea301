//! A model's tensors as flat named `f32` vectors in PyTorch's state_dict names and layouts:
//! the contract between a model on a device and the protocol and aggregator.
//!
//! BatchNorm tensors are recognised by the type of the layer that owns them (burn's
//! `BatchNorm`), never by name. burn's own layout stays behind this boundary: a linear weight,
//! stored `[in, out]` by burn, is exported `[out, in]` as in PyTorch; BN `gamma`/`beta` become
//! `weight`/`bias`.
//!
//! burn shares BN running statistics between clones of a model and a visitor can read them
//! one update stale; every function here first calls `valid()`, which folds pending updates in
//! and returns unshared running states, so reads are current and writes reach only the copy.

use crate::bn::BN_CONTAINER;
use crate::error::StateError;
use crate::net::Net;
use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use std::collections::{BTreeMap, HashMap};
use unifed_protocol::{EncodedTensor, ModelSpec, SpecHash, TensorKind, TensorSpec};

const LINEAR_CONTAINER: &str = "Struct:Linear";

/// One tensor in PyTorch name and layout, with its values.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// state_dict name.
    pub name: String,
    /// Shape (PyTorch layout).
    pub shape: Vec<usize>,
    /// BN or not.
    pub kind: TensorKind,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl NamedTensor {
    /// The tensor in a wire encoding, with error feedback through `residual` when given (see
    /// [`unifed_protocol::encode`]).
    pub fn encode(
        &self,
        encoding: unifed_protocol::Encoding,
        residual: Option<&mut Vec<f32>>,
    ) -> unifed_protocol::EncodedTensor {
        unifed_protocol::encode(
            &self.name,
            &self.wire_shape(),
            &self.data,
            encoding,
            residual,
        )
    }

    /// The tensor plus `residual` (the last error-feedback residual; empty: none) in a wire
    /// encoding, summed in the tensor's own buffer, which then holds the next residual (see
    /// [`unifed_protocol::encode_leaving_error`]): `residual` itself is left as it was, without
    /// a copy of it. The values move out of the tensor (it is left empty). Returns the encoded
    /// tensor and the next residual.
    pub fn encode_fed(
        &mut self,
        encoding: unifed_protocol::Encoding,
        residual: &[f32],
    ) -> (unifed_protocol::EncodedTensor, Vec<f32>) {
        let shape = self.wire_shape();
        let mut x = std::mem::take(&mut self.data);
        if !residual.is_empty() {
            x.iter_mut().zip(residual).for_each(|(v, r)| *v += r);
        }
        let e = unifed_protocol::encode_leaving_error(&self.name, &shape, &mut x, encoding);
        (e, x)
    }

    /// The tensor in exact f32 with its value bytes borrowed from its own values (no copy), or
    /// `None` on a big-endian machine, where they are not the wire's little-endian bytes.
    pub fn exact_le(&self) -> Option<unifed_protocol::EncodedTensorRef<'_>> {
        cfg!(target_endian = "little").then(|| unifed_protocol::EncodedTensor {
            name: self.name.clone(),
            shape: self.wire_shape(),
            values: unifed_protocol::Values::F32(bytemuck::cast_slice(&self.data)),
        })
    }

    /// The shape as the wire writes it.
    fn wire_shape(&self) -> Vec<u32> {
        self.shape.iter().map(|&d| d as u32).collect()
    }
}

/// A model's tensors (all of them, or a subset such as the non-BN ones), tagged with the hash
/// of the spec they belong to.
#[derive(Debug, Clone, PartialEq)]
pub struct StateDict {
    /// Hash of the model spec these tensors were taken from.
    pub spec_hash: SpecHash,
    /// Tensors in spec order.
    pub tensors: Vec<NamedTensor>,
}

/// Which tensors an operation touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Select {
    /// Every tensor.
    All,
    /// Everything outside BN layers (what FedBN averages).
    NonBn,
    /// Every BN tensor (affine and statistics).
    Bn,
    /// BN weight and bias only.
    BnAffine,
    /// BN running mean and variance only.
    BnStats,
}

impl Select {
    /// Whether a tensor of `kind` is selected.
    pub fn keeps(self, kind: TensorKind) -> bool {
        match self {
            Select::All => true,
            Select::NonBn => !kind.is_bn(),
            Select::Bn => kind.is_bn(),
            Select::BnAffine => kind.is_bn_affine(),
            Select::BnStats => kind.is_bn_stat(),
        }
    }
}

/// Tracks the module path and owning layer type while a visitor walks a model, so a tensor's
/// kind comes from its layer's type.
#[derive(Default)]
pub(crate) struct Walker {
    path: Vec<String>,
    owners: Vec<String>,
}

impl Walker {
    pub(crate) fn enter(&mut self, name: &str, container: &str) {
        // An enum of models (`AnyNet`) adds its variant as a level: not part of tensor names.
        if !container.starts_with("Enum:") {
            self.path.push(name.to_string());
        }
        self.owners.push(container.to_string());
    }

    pub(crate) fn exit(&mut self) {
        if self.owners.pop().is_some_and(|o| !o.starts_with("Enum:")) {
            self.path.pop();
        }
    }

    /// (PyTorch name, kind, is a linear weight) of the parameter being visited in `net`, when
    /// `select` keeps it.
    pub(crate) fn kept<N: Net>(
        &self,
        net: &N,
        select: Select,
    ) -> Option<(String, TensorKind, bool)> {
        let (path, kind, linear_w) = self.current();
        select
            .keeps(kind)
            .then(|| (torch_name(net, &path, kind), kind, linear_w))
    }

    /// (burn path, kind, is a linear weight) of the parameter being visited.
    pub(crate) fn current(&self) -> (String, TensorKind, bool) {
        let owner = self.owners.last().map(String::as_str).unwrap_or("");
        let field = self.path.last().map(String::as_str).unwrap_or("");
        let kind = if owner == BN_CONTAINER {
            match field {
                "gamma" => TensorKind::BnWeight,
                "beta" => TensorKind::BnBias,
                "running_mean" => TensorKind::BnRunningMean,
                "running_var" => TensorKind::BnRunningVar,
                _ => TensorKind::NonBn,
            }
        } else {
            TensorKind::NonBn
        };
        (
            self.path.join("."),
            kind,
            owner == LINEAR_CONTAINER && field == "weight",
        )
    }
}

pub(crate) fn torch_name<N: Net>(net: &N, burn_path: &str, kind: TensorKind) -> String {
    let mut name = net.torch_path(burn_path);
    match kind {
        TensorKind::BnWeight => {
            if let Some(stem) = name.strip_suffix(".gamma") {
                name = format!("{stem}.weight");
            }
        }
        TensorKind::BnBias => {
            if let Some(stem) = name.strip_suffix(".beta") {
                name = format!("{stem}.bias");
            }
        }
        _ => {}
    }
    name
}

struct Reader<'a, N: Net> {
    net: &'a N,
    walk: Walker,
    with_data: bool,
    /// The tensors read; the others are skipped without reading their values.
    select: Select,
    out: Vec<NamedTensor>,
}

impl<N: Net> ModuleVisitor for Reader<'_, N> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.walk.enter(name, container_type);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.walk.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some((name, kind, linear_w)) = self.walk.kept(self.net, self.select) else {
            return;
        };
        let (shape, data) = if self.with_data {
            let mut t = param.val();
            if linear_w {
                t = t.swap_dims(0, 1);
            }
            let shape = t.dims().to_vec();
            let data = t
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("float parameter");
            (shape, data)
        } else {
            let mut shape = param.lazy_shape().to_vec();
            if linear_w {
                shape.swap(0, 1);
            }
            (shape, Vec::new())
        };
        self.out.push(NamedTensor {
            name,
            shape,
            kind,
            data,
        });
    }
}

/// Writes one tensor's values, a block of rows at a time (see [`export_blocks`]).
type BlockWriter =
    Box<dyn FnOnce(usize, &mut dyn FnMut(&[f32]) -> std::io::Result<()>) -> std::io::Result<()>>;

/// Collects, by name, a writer of each parameter's values in blocks (holding the parameter's
/// tensor by reference, not a copy of its values).
struct Blocks<'a, N: Net> {
    net: &'a N,
    walk: Walker,
    select: Select,
    /// In visiting order.
    out: Vec<(String, BlockWriter)>,
}

impl<N: Net> ModuleVisitor for Blocks<'_, N> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.walk.enter(name, container_type);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.walk.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some((name, _, linear_w)) = self.walk.kept(self.net, self.select) else {
            return;
        };
        let t = param.val();
        self.out.push((
            name,
            Box::new(move |block, emit| {
                #[cfg(feature = "flex")]
                if let Some(done) = flex_blocks(&t, linear_w, block, emit) {
                    return done;
                }
                device_blocks(&t, linear_w, block, emit)
            }),
        ));
    }
}

/// Values [`device_blocks`] reads back from a GPU at a time (8 MiB of f32).
const DEVICE_READ: usize = 2 << 20;

/// [`Blocks`]' writer for a tensor of any other backend (a GPU's) or layout: the values as
/// `export` reads them (a linear weight in PyTorch's `[out, in]`), read back whole rows of about
/// [`DEVICE_READ`] values at a time and handed on in blocks of whole rows. On a GPU each read is
/// a copy on the device and a transfer to the host: in blocks of [`READ_BLOCK`] values the digits
/// CNN's 57 MB took over a thousand reads (two rows of `fc1` each), and a site's checkpoint and
/// its encode about a second each (H200, five agents). One read per tensor took 0.11-0.12 s, but
/// the agents then peaked 50-100 MiB higher (590-644 against 536-548 MiB) in every phase after
/// the first read, likely the GPU runtime keeping the host buffers of `fc1`'s 51 MB read.
fn device_blocks<const D: usize>(
    t: &Tensor<D>,
    transpose: bool,
    block: usize,
    emit: &mut dyn FnMut(&[f32]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let t = if transpose {
        t.clone().swap_dims(0, 1)
    } else {
        t.clone()
    };
    let dims = t.dims();
    let rows = dims.first().copied().unwrap_or(1);
    let per_row = dims.iter().skip(1).product::<usize>().max(1);
    let step = (DEVICE_READ / per_row).max(1);
    let mut r = 0;
    while r < rows {
        let k = step.min(rows - r);
        let part = if k == rows {
            t.clone()
        } else {
            t.clone().narrow(0, r, k)
        };
        let values = part
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("float parameter");
        values
            .chunks((block / per_row).max(1) * per_row)
            .try_for_each(&mut *emit)?;
        r += k;
    }
    Ok(())
}

/// Values of a transposed weight [`flex_blocks`] lays out at once (4 MiB): about 160 rows of
/// the digits CNN's `fc1`, so each 4 KiB page of the source is visited once per 160 rows.
#[cfg(feature = "flex")]
const TRANSPOSE_VALUES: usize = 1 << 20;

/// [`Blocks`]' writer for a tensor of burn-flex, read straight from its storage: a contiguous
/// tensor is handed on as slices of it (no copy), and a transposed view of a contiguous matrix
/// (a trained linear weight read in PyTorch's order) is laid out by [`transpose_into`], a tile
/// of rows at a time (at most [`TRANSPOSE_VALUES`]). Through burn's strided copy, in blocks of 2
/// rows that used an eighth of each cache line they read, reading the trained digits CNN
/// (57 MB) took 37-41 ms; this way 16-18 ms. `None` for any other tensor (another backend or
/// dtype, other strides): the caller reads it through burn.
#[cfg(feature = "flex")]
fn flex_blocks<const D: usize>(
    t: &Tensor<D>,
    transpose: bool,
    block: usize,
    emit: &mut dyn FnMut(&[f32]) -> std::io::Result<()>,
) -> Option<std::io::Result<()>> {
    let t = t.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
    if t.dtype() != burn::tensor::DType::F32 {
        return None;
    }
    let t = match (transpose, D) {
        (false, _) => t,
        (true, 2) => t.transpose(0, 1),
        (true, _) => return None,
    };
    let layout = t.layout();
    let storage: &[f32] = t.storage();
    let per_row = layout.shape().iter().skip(1).product::<usize>().max(1);
    // Whole rows, about `block` values at a time, as burn's own read hands them on.
    let piece = (block / per_row).max(1) * per_row;
    if let Some((start, end)) = layout.contiguous_offsets() {
        let values = storage.get(start..end)?;
        return Some(values.chunks(piece).try_for_each(&mut *emit));
    }
    // A transposed view of a contiguous matrix: `rows` side by side in each source row, the
    // values of a row `col_stride` apart.
    let (rows, cols, row_stride, col_stride) = layout.as_2d_strides()?;
    let col_stride = usize::try_from(col_stride).ok()?;
    let base = layout.start_offset();
    let last = (cols.checked_sub(1)?)
        .checked_mul(col_stride)?
        .checked_add(rows.checked_sub(1)?)?
        .checked_add(base)?;
    if row_stride != 1 || col_stride < rows || last >= storage.len() {
        return None;
    }
    let tile = (TRANSPOSE_VALUES / cols).clamp(8, rows.next_multiple_of(8)) / 8 * 8;
    let mut buf = vec![0.0f32; tile.min(rows) * cols];
    let mut r = 0;
    while r < rows {
        let k = tile.min(rows - r);
        let out = &mut buf[..k * cols];
        transpose_into(&storage[base + r..], col_stride, k, cols, out);
        if let Err(e) = out.chunks(piece).try_for_each(&mut *emit) {
            return Some(Err(e));
        }
        r += k;
    }
    Some(Ok(()))
}

/// Lays out `out[j * cols + c] = src[c * stride + j]` for `j < rows`, `c < cols`: a matrix
/// stored column by column (`stride` apart) as rows. Blocks of 8 x 8 are read 8 values at a
/// time and written 8 at a time (the compiler turns them into vector shuffles); the edges one
/// value at a time.
#[cfg(feature = "flex")]
fn transpose_into(src: &[f32], stride: usize, rows: usize, cols: usize, out: &mut [f32]) {
    const B: usize = 8;
    let (whole_r, whole_c) = (rows / B * B, cols / B * B);
    for c0 in (0..whole_c).step_by(B) {
        for j0 in (0..whole_r).step_by(B) {
            let mut a = [[0f32; B]; B];
            for (i, a) in a.iter_mut().enumerate() {
                a.copy_from_slice(&src[(c0 + i) * stride + j0..][..B]);
            }
            let mut t = [[0f32; B]; B];
            for (i, a) in a.iter().enumerate() {
                for (j, &v) in a.iter().enumerate() {
                    t[j][i] = v;
                }
            }
            for (j, t) in t.iter().enumerate() {
                out[(j0 + j) * cols + c0..][..B].copy_from_slice(t);
            }
        }
    }
    // The last rows (all columns), then the last columns of the other rows.
    for c in 0..cols {
        for j in whole_r..rows {
            out[j * cols + c] = src[c * stride + j];
        }
    }
    for c in whole_c..cols {
        for j in 0..whole_r {
            out[j * cols + c] = src[c * stride + j];
        }
    }
}

/// Values a model is best read in by [`export_blocks`] and [`export_blocks_in_order`]: a block
/// of the digits CNN's `fc1` weight read in PyTorch's order (transposed) is 2 rows, 50 KiB,
/// which comes from the heap and reuses it. Larger blocks are mapped fresh for each read under
/// the agents' lean allocation, and a model of 57 MB took 52-57 ms to read in blocks of 256 Ki
/// values or more, against 39-40 ms in blocks of 16-32 Ki (one row, 4-8 Ki: 80 ms).
pub const READ_BLOCK: usize = 16 << 10;

/// Calls `f(name, values)` for every tensor of `net` that `select` keeps, in name order (the
/// data order of a [`crate::checkpoint::Layout`]), with the values [`export`] gives a block of
/// whole rows (about `block` values) at a time, each read from the model as it goes: the model
/// is never copied whole. Stops at the first error `f` gives.
pub fn export_blocks<N: Net>(
    net: &N,
    select: Select,
    block: usize,
    f: impl FnMut(&str, &[f32]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    blocks_of(net, select, block, true, f)
}

/// [`export_blocks`] in visiting order, the order of [`export`]'s tensors.
pub fn export_blocks_in_order<N: Net>(
    net: &N,
    select: Select,
    block: usize,
    f: impl FnMut(&str, &[f32]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    blocks_of(net, select, block, false, f)
}

fn blocks_of<N: Net>(
    net: &N,
    select: Select,
    block: usize,
    by_name: bool,
    mut f: impl FnMut(&str, &[f32]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let synced = net.valid();
    let mut b = Blocks {
        net: &synced,
        walk: Walker::default(),
        select,
        out: Vec::new(),
    };
    synced.visit(&mut b);
    if by_name {
        b.out.sort_by(|x, y| x.0.cmp(&y.0));
    }
    for (name, write) in b.out {
        write(block, &mut |values| f(&name, values))?;
    }
    Ok(())
}

/// The selected tensors of `net` as [`export`] lists them (names, PyTorch shapes, kinds), with
/// no values read.
pub fn export_layout<N: Net>(net: &N, spec: &ModelSpec, select: Select) -> StateDict {
    let mut r = Reader {
        net,
        walk: Walker::default(),
        with_data: false,
        select,
        out: Vec::new(),
    };
    net.visit(&mut r);
    StateDict {
        spec_hash: spec.hash(),
        tensors: r.out,
    }
}

/// Every tensor of `net` (name, PyTorch shape, kind) in visiting order, without reading values.
pub fn tensor_specs<N: Net>(net: &N) -> Vec<TensorSpec> {
    let mut r = Reader {
        net,
        walk: Walker::default(),
        with_data: false,
        select: Select::All,
        out: Vec::new(),
    };
    net.visit(&mut r);
    r.out
        .into_iter()
        .map(|t| TensorSpec {
            name: t.name,
            shape: t.shape,
            kind: t.kind,
        })
        .collect()
}

/// Exports the selected tensors of `net` as flat `f32` vectors in PyTorch names and layouts.
pub fn export<N: Net>(net: &N, spec: &ModelSpec, select: Select) -> StateDict {
    let synced = net.valid();
    let mut r = Reader {
        net: &synced,
        walk: Walker::default(),
        with_data: true,
        select,
        out: Vec::new(),
    };
    synced.visit(&mut r);
    StateDict {
        spec_hash: spec.hash(),
        tensors: r.out,
    }
}

/// Validates `state` against `spec`: the hash, every name known, every shape and length right,
/// and every tensor `select` needs present.
pub fn validate(state: &StateDict, spec: &ModelSpec, select: Select) -> Result<(), StateError> {
    let expected = spec.hash();
    if state.spec_hash != expected {
        return Err(StateError::SpecHashMismatch {
            expected: expected.to_string(),
            found: state.spec_hash.to_string(),
        });
    }
    let mut seen = HashMap::new();
    for t in &state.tensors {
        let s = spec
            .tensor(&t.name)
            .ok_or_else(|| StateError::Unexpected(t.name.clone()))?;
        if s.shape != t.shape {
            return Err(StateError::WrongShape {
                name: t.name.clone(),
                expected: s.shape.clone(),
                found: t.shape.clone(),
            });
        }
        if t.data.len() != s.numel() {
            return Err(StateError::WrongLength {
                name: t.name.clone(),
                expected: s.numel(),
                found: t.data.len(),
            });
        }
        seen.insert(t.name.as_str(), ());
    }
    if let Some(missing) = spec
        .tensors
        .iter()
        .find(|s| select.keeps(s.kind) && !seen.contains_key(s.name.as_str()))
    {
        return Err(StateError::Missing(missing.name.clone()));
    }
    Ok(())
}

struct Writer<'a, 'k, N: Net, B = Vec<u8>> {
    net: &'a N,
    walk: Walker,
    values: Values<'a, B>,
    /// Where each tensor an encoded import decodes is also copied, if anywhere.
    keep: Option<&'k mut dyn Keep>,
    /// A tensor whose values failed to decode after their check (see [`CheckedImport`]).
    failed: Option<String>,
    select: Select,
}

/// The tensors a [`Writer`] writes in: borrowed (each copied as it goes in), owned (each moved
/// in, so the import holds no second copy) or encoded (each decoded from its message's bytes
/// once the old tensor has gone, so the import holds no decoded copy of the message).
enum Values<'a, B> {
    Borrowed(HashMap<&'a str, &'a NamedTensor>),
    Owned(HashMap<String, NamedTensor>),
    Encoded(HashMap<&'a str, &'a EncodedTensor<B>>),
}

/// Where a tensor's new values come from.
enum Source<'a, B> {
    Ready(Vec<f32>, Vec<usize>),
    Encoded(&'a EncodedTensor<B>),
}

impl<N: Net, B: AsRef<[u8]>> ModuleMapper for Writer<'_, '_, N, B> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.walk.enter(name, container_type);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.walk.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((name, _, linear_w)) = self.walk.kept(self.net, self.select) else {
            return param;
        };
        let source = match &mut self.values {
            Values::Borrowed(v) => match v.get(name.as_str()) {
                Some(src) => Source::Ready(src.data.clone(), src.shape.clone()),
                None => return param,
            },
            Values::Owned(v) => match v.remove(name.as_str()) {
                Some(src) => Source::Ready(src.data, src.shape),
                None => return param,
            },
            Values::Encoded(v) => match v.get(name.as_str()) {
                Some(&src) => Source::Encoded(src),
                None => return param,
            },
        };
        let (keep, failed) = (&mut self.keep, &mut self.failed);
        param.map(|t| {
            let rg = t.is_require_grad();
            let device = t.device();
            // The old tensor goes before the new one is made (or decoded).
            drop(t);
            let (data, shape) = match source {
                Source::Ready(data, shape) => (data, shape),
                Source::Encoded(e) => {
                    let shape = e.shape.iter().map(|&d| d as usize).collect::<Vec<_>>();
                    let data = unifed_protocol::decode(e).unwrap_or_else(|err| {
                        failed.get_or_insert_with(|| err.to_string());
                        vec![0.0; shape.iter().product()]
                    });
                    if let Some(k) = keep.as_deref_mut() {
                        k.keep(&name, &data);
                    }
                    (data, shape)
                }
            };
            from_torch::<D>(data, shape, linear_w, &device).set_require_grad(rg)
        })
    }
}

/// Where an import keeps a copy of each tensor it decodes into the model.
pub trait Keep {
    /// Keeps a copy of tensor `name`'s values.
    fn keep(&mut self, name: &str, values: &[f32]);
}

impl Keep for BTreeMap<String, Vec<f32>> {
    fn keep(&mut self, name: &str, values: &[f32]) {
        self.insert(name.to_string(), values.to_vec());
    }
}

/// The encoded tensors of a message (a broadcast) checked for an import of the tensors that
/// `select` keeps: every name in the spec with the spec's shape, every value decodable
/// ([`unifed_protocol::check`]), and every kept tensor of the spec present. Tensors that
/// `select` does not keep are ignored; of a name given twice, the last counts.
pub struct CheckedImport<'a, B> {
    tensors: HashMap<&'a str, &'a EncodedTensor<B>>,
    select: Select,
}

impl<'a, B: AsRef<[u8]>> CheckedImport<'a, B> {
    /// Checks `tensors` against `spec` for an import of `select`, allocating nothing the size
    /// of a tensor.
    pub fn new(
        spec: &ModelSpec,
        tensors: &'a [EncodedTensor<B>],
        select: Select,
    ) -> Result<Self, StateError> {
        let mut checked = HashMap::new();
        for t in tensors {
            spec_of_encoded(spec, t)?;
            unifed_protocol::check(t)
                .map_err(|e| StateError::Mismatch(format!("tensor `{}`: {e}", t.name)))?;
            checked.insert(t.name.as_str(), t);
        }
        if let Some(missing) = spec
            .tensors
            .iter()
            .find(|s| select.keeps(s.kind) && !checked.contains_key(s.name.as_str()))
        {
            return Err(StateError::Missing(missing.name.clone()));
        }
        Ok(CheckedImport {
            tensors: checked,
            select,
        })
    }

    /// Writes the tensors into `net`, each decoded from the message's bytes once the model's
    /// old tensor has gone: the import holds one decoded tensor beyond the model, never a
    /// decoded copy of the message. With `keep`, each decoded tensor is also copied into it.
    /// The check made decoding infallible; should a tensor still fail to decode, the error
    /// names it and `net` holds zeros in its place.
    pub fn import_into<N: Net>(
        self,
        net: &mut N,
        keep: Option<&mut dyn Keep>,
    ) -> Result<(), StateError> {
        match write_into(net, Values::Encoded(self.tensors), self.select, keep) {
            Some(e) => Err(StateError::Mismatch(format!(
                "a tensor failed to decode after its check; the model is incomplete: {e}"
            ))),
            None => Ok(()),
        }
    }
}

/// `src` (PyTorch layout) as a burn tensor on `device`: a linear weight is transposed back to
/// burn's `[in, out]`.
pub(crate) fn burn_tensor<const D: usize>(
    src: &NamedTensor,
    linear_w: bool,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    from_torch(src.data.clone(), src.shape.clone(), linear_w, device)
}

/// Values of `shape` in PyTorch layout as a burn tensor on `device` (see [`burn_tensor`]).
fn from_torch<const D: usize>(
    data: Vec<f32>,
    shape: Vec<usize>,
    linear_w: bool,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    let t = Tensor::<D>::from_data(TensorData::new(data, shape), device);
    if linear_w { t.swap_dims(0, 1) } else { t }
}

/// Returns a copy of `net` with the tensors of `state` that `select` keeps written in; every
/// other tensor is left bit-identical. `state` is validated against `spec` first (it must hold
/// every tensor `select` keeps).
pub fn import<N: Net>(
    net: &N,
    spec: &ModelSpec,
    state: &StateDict,
    select: Select,
) -> Result<N, StateError> {
    validate(state, spec, select)?;
    let copy = net.valid();
    let mut w = Writer {
        net: &copy,
        walk: Walker::default(),
        values: Values::<Vec<u8>>::Borrowed(
            state.tensors.iter().map(|t| (t.name.as_str(), t)).collect(),
        ),
        keep: None,
        failed: None,
        select,
    };
    Ok(copy.clone().map(&mut w))
}

/// [`import`] into `net` itself, consuming `state`: each tensor is moved in and the one it
/// replaces freed as it goes, so the import never holds two copies of the model. On an error
/// (from validating `state` first) `net` is unchanged.
pub fn import_into<N: Net>(
    net: &mut N,
    spec: &ModelSpec,
    state: StateDict,
    select: Select,
) -> Result<(), StateError> {
    validate(&state, spec, select)?;
    let owned = state
        .tensors
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    // Values that are already decoded cannot fail to decode.
    write_into(net, Values::<Vec<u8>>::Owned(owned), select, None);
    Ok(())
}

/// Writes `values` into `net` in place of the tensors `select` keeps, with each old tensor freed
/// before its new one is made; gives the error of a tensor that failed to decode, if any.
fn write_into<N: Net, B: AsRef<[u8]>>(
    net: &mut N,
    values: Values<'_, B>,
    select: Select,
    keep: Option<&mut dyn Keep>,
) -> Option<String> {
    // `valid()` syncs the running statistics into fresh ones; the stand-in then lets go of the
    // model's tensors, so that `copy` holds the only reference to each.
    let copy = net.valid();
    *net = stand_in(&copy);
    let mut w = Writer {
        net: &*net,
        walk: Walker::default(),
        values,
        keep,
        failed: None,
        select,
    };
    let written = copy.map(&mut w);
    let failed = w.failed.take();
    *net = written;
    failed
}

/// `net` with every float parameter replaced by a one-value tensor: a stand-in that holds none
/// of its weights (names and architecture only) while the model itself is elsewhere.
pub(crate) fn stand_in<N: Net>(net: &N) -> N {
    struct Hollow;
    impl ModuleMapper for Hollow {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| Tensor::zeros([1; D], &t.device()))
        }
    }
    // `valid()` gives the stand-in running statistics of its own: a clone would share them, and
    // the mapping would empty the model's.
    net.valid().map(&mut Hollow)
}

/// The spec of encoded tensor `t`: an error when the spec lacks it or gives it another shape.
pub fn spec_of_encoded<'s, B>(
    spec: &'s ModelSpec,
    t: &EncodedTensor<B>,
) -> Result<&'s unifed_protocol::TensorSpec, StateError> {
    let s = spec
        .tensor(&t.name)
        .ok_or_else(|| StateError::Unexpected(t.name.clone()))?;
    if t.shape.len() != s.shape.len()
        || t.shape.iter().zip(&s.shape).any(|(&a, &b)| a as usize != b)
    {
        return Err(StateError::WrongShape {
            name: t.name.clone(),
            expected: s.shape.clone(),
            found: t.shape.iter().map(|&d| d as usize).collect(),
        });
    }
    Ok(s)
}

/// The tensors of a message (a broadcast, an onboarding package, a registry entry) decoded into
/// a state dict of `spec`, in the message's order. A name outside the spec, a shape other than
/// the spec's (checked before anything is allocated) or undecodable values are errors naming
/// the tensor.
pub fn from_encoded<B: AsRef<[u8]>>(
    spec: &ModelSpec,
    tensors: &[EncodedTensor<B>],
) -> Result<StateDict, StateError> {
    let tensors = tensors
        .iter()
        .map(|t| {
            let s = spec_of_encoded(spec, t)?;
            Ok(NamedTensor {
                name: t.name.clone(),
                shape: s.shape.clone(),
                kind: s.kind,
                data: unifed_protocol::decode(t)
                    .map_err(|e| StateError::Mismatch(format!("tensor `{}`: {e}", t.name)))?,
            })
        })
        .collect::<Result<Vec<_>, StateError>>()?;
    Ok(StateDict {
        spec_hash: spec.hash(),
        tensors,
    })
}

/// Applies new non-BN weights (e.g. the federation's average) to a copy of `net`, leaving every
/// BN tensor (affine and statistics) bit-identical.
pub fn apply_non_bn<N: Net>(
    net: &N,
    spec: &ModelSpec,
    weights: &StateDict,
) -> Result<N, StateError> {
    import(net, spec, weights, Select::NonBn)
}

/// `new - reference`, tensor by tensor; both must hold the same names and shapes in the same order.
pub fn delta(new: &StateDict, reference: &StateDict) -> Result<StateDict, StateError> {
    let mut d = new.clone();
    subtract(&mut d, reference)?;
    Ok(d)
}

/// [`delta`] in place: `new` becomes `new - reference` in its own buffers.
pub fn subtract(new: &mut StateDict, reference: &StateDict) -> Result<(), StateError> {
    if new.spec_hash != reference.spec_hash {
        return Err(StateError::SpecHashMismatch {
            expected: reference.spec_hash.to_string(),
            found: new.spec_hash.to_string(),
        });
    }
    if new.tensors.len() != reference.tensors.len() {
        return Err(StateError::Mismatch(format!(
            "{} tensors against {}",
            new.tensors.len(),
            reference.tensors.len()
        )));
    }
    for (a, b) in new.tensors.iter_mut().zip(&reference.tensors) {
        if a.name != b.name || a.shape != b.shape {
            return Err(StateError::Mismatch(format!(
                "`{}` {:?} against `{}` {:?}",
                a.name, a.shape, b.name, b.shape
            )));
        }
        a.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x -= y);
    }
    Ok(())
}

/// `reference + delta`, the inverse of [`delta`].
pub fn add_delta(reference: &StateDict, delta: &StateDict) -> Result<StateDict, StateError> {
    let neg = StateDict {
        spec_hash: delta.spec_hash,
        tensors: delta
            .tensors
            .iter()
            .map(|t| NamedTensor {
                data: t.data.iter().map(|v| -v).collect(),
                ..t.clone()
            })
            .collect(),
    };
    self::delta(reference, &neg)
}

impl StateDict {
    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Only the tensors `select` keeps.
    pub fn filter(&self, select: Select) -> StateDict {
        StateDict {
            spec_hash: self.spec_hash,
            tensors: self
                .tensors
                .iter()
                .filter(|t| select.keeps(t.kind))
                .cloned()
                .collect(),
        }
    }

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;

    /// `transpose_into` lays out any shape as a naive loop does, the edges of 8 x 8 blocks too.
    #[test]
    fn a_matrix_stored_by_columns_is_laid_out_by_rows_whatever_its_shape() {
        for (rows, cols, stride) in [
            (1, 1, 1),
            (8, 8, 8),
            (13, 29, 16),
            (16, 7, 20),
            (37, 45, 40),
        ] {
            let src: Vec<f32> = (0..cols * stride).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut got = vec![f32::NAN; rows * cols];
            transpose_into(&src, stride, rows, cols, &mut got);
            let want: Vec<f32> = (0..rows)
                .flat_map(|j| (0..cols).map(move |c| (j, c)))
                .map(|(j, c)| src[c * stride + j])
                .collect();
            assert_eq!(got, want, "{rows} x {cols}, stride {stride}");
        }
    }

    /// A transposed view of a contiguous matrix (tiles of many rows: 70 x 20,000 spans several)
    /// and a contiguous tensor are read from burn-flex's storage, and in reads as a GPU's are,
    /// with the values burn's own copy gives, in pieces of whole rows of at most `block` values.
    #[test]
    fn a_tensor_is_read_in_blocks_of_whole_rows_as_burn_reads_it() {
        let d = burn::tensor::Device::flex();
        // 30,000 x 100 is more than one read of a GPU's (`DEVICE_READ`) either way round.
        for (ins, outs, block) in [
            (19, 27, 64),
            (20_000, 70, 50_000),
            (30_000, 100, 70_000),
            (5, 3, 1),
        ] {
            let values: Vec<f32> = (0..ins * outs).map(|i| (i as f32).sin()).collect();
            let w = Tensor::<2>::from_data(TensorData::new(values, [ins, outs]), &d);
            for transpose in [true, false] {
                let want = if transpose {
                    w.clone().swap_dims(0, 1)
                } else {
                    w.clone()
                };
                let per_row = want.dims()[1];
                let want = want.into_data().try_into_vec_as::<f32>().unwrap();
                for from_storage in [true, false] {
                    let mut got = Vec::new();
                    let mut pieces = Vec::new();
                    let mut emit = |v: &[f32]| {
                        got.extend_from_slice(v);
                        pieces.push(v.len());
                        Ok(())
                    };
                    if from_storage {
                        flex_blocks(&w, transpose, block, &mut emit).expect("a flex tensor")
                    } else {
                        device_blocks(&w, transpose, block, &mut emit)
                    }
                    .unwrap();
                    let how = if from_storage { "storage" } else { "reads" };
                    assert!(got == want, "{ins} x {outs}, transposed {transpose}, {how}");
                    for n in pieces {
                        assert_eq!(n % per_row, 0, "{n} values are not whole rows of {per_row}");
                        assert!(n <= block.max(per_row), "{n} values in a block of {block}");
                    }
                }
            }
        }
    }
}
