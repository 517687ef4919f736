//! The `cuda-local` Comm: several ranks (threads) on ONE GPU, payloads moved through device
//! memory — NCCL refuses two ranks of a communicator on one device ("Duplicate GPU detected"),
//! so this is how a 3D plan is tested on a single GPU.
//!
//! It is [`ChannelComm`] with a [`DeviceCarrier`]: each rank has its own stream; a message is
//! copied host→device on the sender's stream, then device→device and device→host on the
//! receiver's (cudarc's event tracking orders the two streams). The collective algorithms are
//! LocalComm's, so results equal LocalComm's bit for bit.
//!
//! NOT YET RUN ON A GPU: `runtime/tests/cuda_local.rs` holds the 2×2×2 test; it skips here.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tessera_planner::Mesh;

use crate::backend::cuda::probe;
use crate::backend::GpuError;
use crate::comm::{channel_groups, Carrier, ChannelComm, CommError, RankGroups};

/// Moves payloads through the memory of one GPU; one per rank (its own stream).
pub struct DeviceCarrier {
    stream: Arc<CudaStream>,
}

/// A ChannelComm whose payloads travel through one GPU.
pub type CudaLocalComm = ChannelComm<DeviceCarrier>;

fn transport(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CommError {
    move |e| CommError::Transport {
        op,
        message: e.to_string(),
    }
}

impl Carrier for DeviceCarrier {
    /// `None` for an empty payload (a barrier): no zero-byte allocation.
    type Msg = Option<CudaSlice<f32>>;

    fn pack(&self, data: &[f32]) -> Result<Self::Msg, CommError> {
        if data.is_empty() {
            return Ok(None);
        }
        let buf = self
            .stream
            .clone_htod(data)
            .map_err(transport("cuda-local send (host to device)"))?;
        Ok(Some(buf))
    }

    fn unpack(&self, msg: Self::Msg, out: &mut [f32]) -> Result<(), CommError> {
        let Some(src) = msg else {
            return Ok(());
        };
        let mine = self
            .stream
            .clone_dtod(&src)
            .map_err(transport("cuda-local receive (device to device)"))?;
        let host = self
            .stream
            .clone_dtoh(&mine)
            .map_err(transport("cuda-local receive (device to host)"))?;
        self.stream
            .synchronize()
            .map_err(transport("cuda-local receive (synchronize)"))?;
        out.copy_from_slice(&host);
        Ok(())
    }
}

/// TP, DP and PP handles for every world rank of `mesh`, all on GPU `ordinal`; move entry r
/// into rank r's thread.
pub fn cuda_local_groups(
    mesh: &Mesh,
    ordinal: usize,
) -> Result<Vec<RankGroups<CudaLocalComm>>, GpuError> {
    let ctx = probe::open_context(ordinal)?;
    let streams = (0..mesh.world())
        .map(|_| {
            ctx.new_stream()
                .map_err(|e| probe::driver_err("creating a stream", e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    channel_groups(mesh, &|w| DeviceCarrier {
        stream: streams[w].clone(),
    })
    .map_err(|e| GpuError::Unsupported {
        what: format!("cannot build the cuda-local groups: {e}"),
        fix: "check the mesh".into(),
    })
}
