//! Views of device buffers for [`Device`](super::Device): read and write ranges of one buffer,
//! token ids with their rows grouped by token, and the size checks every launch makes.

use std::marker::PhantomData;

use super::{GpuError, HostData, KArg, Launcher};

/// Token ids on the device, with their rows grouped by token (host-sorted, for the embedding
/// backward's one thread per (token, channel)).
pub struct DeviceIds<B> {
    pub ids: B,
    /// Row indices sorted by token, rows ascending within a token.
    pub(super) order: B,
    /// Bucket `b` is `order[starts[b] .. starts[b + 1]]`.
    pub(super) starts: B,
    /// The token of each bucket.
    pub(super) tokens: B,
    pub(super) buckets: usize,
    /// Tokens (rows).
    pub n: usize,
}

/// A read view: `len` elements of `buf` from element `at`.
#[derive(Debug)]
pub struct DRef<'a, B> {
    pub buf: &'a B,
    pub at: usize,
    pub len: usize,
}

impl<B> Clone for DRef<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for DRef<'_, B> {}

/// A write view: exclusive over its range for `'a` (made from `&mut` buffers, split disjointly).
#[derive(Debug)]
pub struct DMut<'a, B> {
    pub buf: &'a B,
    pub at: usize,
    pub len: usize,
    pub(super) _excl: PhantomData<&'a mut B>,
}

impl<'a, B> DRef<'a, B> {
    pub fn arg(&self) -> KArg<'a, B> {
        KArg::At(self.buf, self.at)
    }
}

impl<'a, B> DMut<'a, B> {
    pub fn arg(&self) -> KArg<'a, B> {
        KArg::At(self.buf, self.at)
    }
}

/// `got` elements where the kernel addresses `want`.
pub(super) fn need(what: &str, got: usize, want: usize) -> Result<(), GpuError> {
    match got == want {
        true => Ok(()),
        false => Err(GpuError::shape(
            what,
            format!("a view of {got} elements where {want} are addressed"),
        )),
    }
}

/// `n / width` rows, when `n` is a whole number of rows.
pub(super) fn rows(what: &str, n: usize, width: usize) -> Result<usize, GpuError> {
    match width > 0 && n.is_multiple_of(width) {
        true => Ok(n / width),
        false => Err(GpuError::shape(
            what,
            format!("{n} elements are not rows of {width}"),
        )),
    }
}

impl<B> DeviceIds<B> {
    /// Uploads `ids` with their rows grouped by token (a stable sort: rows stay ascending).
    pub fn upload<L: Launcher<Buf = B>>(launcher: &L, ids: Vec<u32>) -> Result<Self, GpuError> {
        let n = u32::try_from(ids.len()).map_err(|_| GpuError::Unsupported {
            what: format!("{} tokens in one micro-batch", ids.len()),
            fix: "a smaller micro-batch or sequence".into(),
        })?;
        let mut order: Vec<u32> = (0..n).collect();
        order.sort_by_key(|&r| ids[r as usize]); // stable: rows stay ascending per token
        let (mut starts, mut tokens) = (vec![0u32], Vec::new());
        for (k, &r) in order.iter().enumerate() {
            let t = ids[r as usize];
            if tokens.last() != Some(&t) {
                if k > 0 {
                    starts.push(k as u32);
                }
                tokens.push(t);
            }
        }
        starts.push(n);
        let buckets = tokens.len();
        // Never an empty upload: an empty micro-batch keeps one unused element.
        let nonempty = |mut v: Vec<u32>| {
            if v.is_empty() {
                v.push(0);
            }
            v
        };
        let up = |v: Vec<u32>| launcher.upload(HostData::U32(&nonempty(v)));
        Ok(DeviceIds {
            ids: up(ids)?,
            order: up(order)?,
            starts: up(starts)?,
            tokens: up(tokens)?,
            buckets,
            n: n as usize,
        })
    }
}
