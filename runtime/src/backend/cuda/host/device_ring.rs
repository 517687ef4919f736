//! [`Device`]'s ring-attention launches (context parallelism, `ring_attention.cu`), split from
//! `device_layers.rs` for length. Same rules: every view checked against the sizes the kernel
//! addresses (dtypes by the launch's signature check); the K/V message, `qkv`, `y`, `dy` and
//! `dqkv` bf16, the running output, dQ, dK/dV, `lse` and `delta` f32. The kernels need no
//! scratch.

use super::device::Device;
use super::launch::{self, i32_of, n64, RING_MAXD};
use super::views::{need, DMut, DRef};
use super::{GpuError, KArg, Launcher};
use crate::backend::RingShape;

type V<'a, L> = DRef<'a, <L as Launcher>::Buf>;
type M<'a, L> = DMut<'a, <L as Launcher>::Buf>;

/// The read views of a backward step.
pub(super) struct BackwardViews<'a, B> {
    pub qkv: DRef<'a, B>,
    pub kv: DRef<'a, B>,
    pub dy: DRef<'a, B>,
    pub lse: DRef<'a, B>,
    pub delta: DRef<'a, B>,
}

/// A shape the kernels take: kv heads dividing the query heads, a head of at most
/// `32 × RING_MAXD`, something to do.
fn check(s: &RingShape) -> Result<(), GpuError> {
    if s.hkv == 0 || !s.hq.is_multiple_of(s.hkv) {
        return Err(GpuError::shape(
            "ring attention",
            format!("kv heads {} must divide query heads {}", s.hkv, s.hq),
        ));
    }
    if s.hd == 0 || s.hd > 32 * RING_MAXD {
        return Err(GpuError::Unsupported {
            what: format!(
                "ring attention with head size {} (its kernels take 1..={})",
                s.hd,
                32 * RING_MAXD
            ),
            fix: "use a head size of at most 128, or re-plan with CP 1".into(),
        });
    }
    if s.b == 0 || s.chunk == 0 {
        return Err(GpuError::shape("ring attention", "empty batch or chunk"));
    }
    Ok(())
}

impl<L: Launcher + Sync + 'static> Device<L>
where
    L::Buf: Send + Sync,
{
    /// The shape's scalars as the step kernels take them: `B, chunk, hq, hkv, hd`, then the
    /// four chunk indices and the scale.
    fn ring_scalars<'a>(
        s: &RingShape,
        q: [usize; 2],
        k: [usize; 2],
    ) -> Result<Vec<KArg<'a, L::Buf>>, GpuError> {
        let mut a = vec![
            KArg::I32(i32_of(s.b, "batch")?),
            KArg::I32(i32_of(s.chunk, "chunk")?),
            KArg::I32(i32_of(s.hq, "heads")?),
            KArg::I32(i32_of(s.hkv, "kv heads")?),
            KArg::I32(i32_of(s.hd, "head size")?),
        ];
        for c in q.into_iter().chain(k) {
            a.push(KArg::I32(i32_of(c, "chunk index")?));
        }
        a.push(KArg::F32(s.scale()));
        Ok(a)
    }

    fn rows_len(s: &RingShape, width: usize) -> usize {
        s.b * s.rows() * width
    }

    pub(super) fn ring_pack_kv_impl(
        &self,
        kv: M<'_, L>,
        qkv: V<'_, L>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        check(s)?;
        need("ring K/V message", kv.len, s.kv_len())?;
        need("ring qkv", qkv.len, Self::rows_len(s, s.qkv_width()))?;
        self.run(
            "ring_attention",
            "ring_pack_kv",
            launch::elementwise(s.kv_len() as u64),
            &[
                kv.arg(),
                qkv.arg(),
                KArg::I64(n64(s.b * s.rows())),
                KArg::I32(i32_of(s.hq, "heads")?),
                KArg::I32(i32_of(s.hkv, "kv heads")?),
                KArg::I32(i32_of(s.hd, "head size")?),
            ],
        )
    }

    pub(super) fn ring_forward_step_impl(
        &self,
        o: M<'_, L>,
        lse: M<'_, L>,
        qkv: V<'_, L>,
        kv: V<'_, L>,
        q: [usize; 2],
        k: [usize; 2],
        s: &RingShape,
    ) -> Result<(), GpuError> {
        check(s)?;
        need("ring output", o.len, Self::rows_len(s, s.y_width()))?;
        need("ring log-sum-exp", lse.len, s.lse_len())?;
        need("ring qkv", qkv.len, Self::rows_len(s, s.qkv_width()))?;
        need("ring K/V message", kv.len, s.kv_len())?;
        let mut args = vec![o.arg(), lse.arg(), qkv.arg(), kv.arg()];
        args.extend(Self::ring_scalars(s, q, k)?);
        self.run(
            "ring_attention",
            "ring_forward_step",
            launch::per_warp(s.lse_len() as u64)?,
            &args,
        )
    }

    pub(super) fn ring_softmax_delta_impl(
        &self,
        delta: M<'_, L>,
        y: V<'_, L>,
        dy: V<'_, L>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        check(s)?;
        let n = Self::rows_len(s, s.y_width());
        need("ring delta", delta.len, s.lse_len())?;
        need("ring y", y.len, n)?;
        need("ring dy", dy.len, n)?;
        // attention.cu's delta, on the rank's rows as the sequence: the same layout.
        self.run(
            "attention",
            "attention_delta",
            launch::per_warp(s.lse_len() as u64)?,
            &[
                delta.arg(),
                dy.arg(),
                y.arg(),
                KArg::I32(i32_of(s.b, "batch")?),
                KArg::I32(i32_of(s.rows(), "rows")?),
                KArg::I32(i32_of(s.hq, "heads")?),
                KArg::I32(i32_of(s.hd, "head size")?),
            ],
        )
    }

    pub(super) fn ring_backward_step_impl(
        &self,
        dq: M<'_, L>,
        dkv: M<'_, L>,
        v: BackwardViews<'_, L::Buf>,
        q: [usize; 2],
        k: [usize; 2],
        s: &RingShape,
    ) -> Result<(), GpuError> {
        check(s)?;
        let y_len = Self::rows_len(s, s.y_width());
        need("ring dq", dq.len, y_len)?;
        need("ring dK/dV message", dkv.len, s.kv_len())?;
        need("ring qkv", v.qkv.len, Self::rows_len(s, s.qkv_width()))?;
        need("ring K/V message", v.kv.len, s.kv_len())?;
        need("ring dy", v.dy.len, y_len)?;
        need("ring log-sum-exp", v.lse.len, s.lse_len())?;
        need("ring delta", v.delta.len, s.lse_len())?;
        let reads = || {
            [
                v.qkv.arg(),
                v.kv.arg(),
                v.dy.arg(),
                v.lse.arg(),
                v.delta.arg(),
            ]
        };
        let rows_kv = (s.b * s.hkv * s.rows()) as u64;
        for (function, out, warps) in [
            ("ring_backward_dq", dq.arg(), s.lse_len() as u64),
            ("ring_backward_dkv", dkv.arg(), rows_kv),
        ] {
            let mut args = vec![out];
            args.extend(reads());
            args.extend(Self::ring_scalars(s, q, k)?);
            self.run("ring_attention", function, launch::per_warp(warps)?, &args)?;
        }
        Ok(())
    }

    pub(super) fn ring_unpack_impl(
        &self,
        dqkv: M<'_, L>,
        dq: V<'_, L>,
        dkv: V<'_, L>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        check(s)?;
        let n = Self::rows_len(s, s.qkv_width());
        need("ring dqkv", dqkv.len, n)?;
        need("ring dq", dq.len, Self::rows_len(s, s.y_width()))?;
        need("ring dK/dV message", dkv.len, s.kv_len())?;
        self.run(
            "ring_attention",
            "ring_unpack",
            launch::elementwise(n as u64),
            &[
                dqkv.arg(),
                dq.arg(),
                dkv.arg(),
                KArg::I64(n64(s.b * s.rows())),
                KArg::I32(i32_of(s.hq, "heads")?),
                KArg::I32(i32_of(s.hkv, "kv heads")?),
                KArg::I32(i32_of(s.hd, "head size")?),
            ],
        )
    }
}
