//! A site's update of exact `f32` deltas written into its envelope straight from the trained
//! model and the parked starting one, a block at a time: no model-sized delta is made beside the
//! envelope. On the demo's 2-core VM half of encoding an update was the kernel zeroing the
//! pages of that delta and of the envelope, and a quarter reading the trained model out.

use crate::park::Parked;
use crate::state::{READ_BLOCK, Select, export_blocks_in_order};
use crate::zoo::Net;
use unifed_protocol::SpecHash;
use unifed_protocol::TensorKind;
use unifed_protocol::encoding::{EncodedTensorRef, Encoding, Values};
use unifed_protocol::envelope::{Envelope, MessageKind};
use unifed_protocol::ids::Id;
use unifed_protocol::messages::SiteUpdate;

/// The encoding a tensor of `kind` travels in when the federation's update encoding is
/// `encoding`: BN running statistics always go as exact f32 without error feedback (a lossy
/// or error-fed variance can fold to a negative value and give NaN at inference).
pub fn encoding_for(kind: TensorKind, encoding: Encoding) -> Encoding {
    if kind.is_bn_stat() {
        Encoding::F32
    } else {
        encoding
    }
}

/// Why [`exact_update`] wrote no envelope.
#[derive(Debug)]
pub(crate) enum UpdateError {
    /// A delta value of the named tensor is NaN or infinite.
    NonFinite(String),
    /// The parked model could not be read, or does not hold the tensors `upd` lists.
    Park(std::io::Error),
}

/// The unsigned `SiteUpdate` envelope of `upd`, whose `delta` lists the tensors `select` keeps
/// of `net`, in [`crate::state::export`]'s order, each as exact `f32` with no values: each
/// tensor's values are written as `net`'s minus the parked ones, read a block at a time. The
/// bytes are those of [`Envelope::encode_new`] of the update with its values in place (a
/// little-endian machine's `f32` bytes are the wire's), in run `run`.
pub(crate) fn exact_update<N: Net>(
    net: &N,
    select: Select,
    base: &Parked,
    (federation, sender, spec_hash): (&Id, &Id, SpecHash),
    run: unifed_protocol::RunId,
    upd: &SiteUpdate<&[u8]>,
) -> Result<Vec<u8>, UpdateError> {
    const PLAIN: &str = "postcard cannot fail on a derived Serialize of plain data";
    // Postcard writes a struct as its fields one after the other, a sequence as its length
    // then its items, and a byte string as its length then its bytes: so the payload is these
    // pieces, each tensor's values' bytes after its head (its encoding with no values, whose
    // last byte is the empty byte string's length).
    let head = postcard::to_allocvec(&(upd.round, upd.base_version, upd.samples)).expect(PLAIN);
    let count = postcard::to_allocvec(&(upd.delta.len() as u64)).expect(PLAIN);
    let tensors: Vec<(Vec<u8>, usize)> = upd
        .delta
        .iter()
        .map(|t| {
            let mut h = postcard::to_allocvec(&EncodedTensorRef {
                name: t.name.clone(),
                shape: t.shape.clone(),
                values: Values::F32(&[][..]),
            })
            .expect(PLAIN);
            h.pop();
            let n: usize = t.shape.iter().map(|&d| d as usize).product();
            h.extend(postcard::to_allocvec(&(4 * n as u64)).expect(PLAIN));
            (h, n)
        })
        .collect();
    let tail = postcard::to_allocvec(&(&upd.bn, &upd.report, &upd.extras)).expect(PLAIN);
    let len = head.len()
        + count.len()
        + tensors.iter().map(|(h, n)| h.len() + 4 * n).sum::<usize>()
        + tail.len();

    let mut base = base.base().map_err(UpdateError::Park)?;
    let mut non_finite = None;
    let mut out = Vec::new();
    Envelope::append_new_with(
        &mut out,
        MessageKind::SiteUpdate,
        federation,
        sender,
        (run, upd.round, upd.base_version),
        spec_hash,
        len,
        |out| {
            out.extend_from_slice(&head);
            out.extend_from_slice(&count);
            // The tensor being written, and how many of its values are still to come.
            let mut next = upd.delta.iter().zip(&tensors);
            let mut current: Option<(&str, usize)> = None;
            let mut scratch: Vec<f32> = Vec::with_capacity(READ_BLOCK);
            let unexpected =
                |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
            export_blocks_in_order(net, select, READ_BLOCK, |name, values| {
                if current.is_none_or(|(at, _)| at != name) {
                    if let Some((at, left)) = current
                        && left > 0
                    {
                        return Err(unexpected(format!("`{at}` ended {left} values short")));
                    }
                    // A tensor with no values is its head alone: the model hands none of it.
                    let (t, n) = loop {
                        let Some((t, (h, n))) = next.next() else {
                            return Err(unexpected(format!("`{name}` is not in the update")));
                        };
                        out.extend_from_slice(h);
                        if t.name == name {
                            break (t, *n);
                        }
                        if *n > 0 {
                            return Err(unexpected(format!("`{name}` where `{}` was due", t.name)));
                        }
                    };
                    base.start(name, n)?;
                    current = Some((t.name.as_str(), n));
                }
                let (at, left) = current.as_mut().expect("set above");
                if values.len() > *left {
                    return Err(unexpected(format!("`{at}` has more values than its shape")));
                }
                *left -= values.len();
                scratch.clear();
                scratch.extend_from_slice(values);
                base.subtract_from(&mut scratch)?;
                if !scratch.iter().all(|v| v.is_finite()) {
                    non_finite = Some(name.to_string());
                    return Err(unexpected(format!(
                        "`{name}` holds a value that is not finite"
                    )));
                }
                out.extend_from_slice(bytemuck::cast_slice(&scratch));
                Ok(())
            })?;
            if let Some((at, left)) = current
                && left > 0
            {
                return Err(unexpected(format!("`{at}` ended {left} values short")));
            }
            for (t, (h, n)) in next {
                if *n > 0 {
                    return Err(unexpected(format!("`{}` was not in the model", t.name)));
                }
                out.extend_from_slice(h);
            }
            out.extend_from_slice(&tail);
            Ok(())
        },
    )
    .map_err(|e| match non_finite.take() {
        Some(name) => UpdateError::NonFinite(name),
        None => UpdateError::Park(e),
    })?;
    Ok(out)
}
