//! Blocking pipeline sends (DeepSpeed's pipeline engine, `deepspeed/runtime/pipe/engine.py`
//! `_exec_send_activations` / `_exec_recv_activations`: `p2p.send` / `p2p.recv` of the whole
//! activation on the compute stream). Each TP rank sends the whole `b·s·h` activation, not
//! Megatron's 1/TP scatter/gather slice, and the sender cannot compute while it sends: the
//! transfer joins the sending op (`Parts::p2p`), and the receiver gets the tensor when that op
//! ends (the edge itself then costs nothing, or it would be counted twice). The receiver's own
//! wait is the simulator's: its next op cannot start before the message has arrived.

use super::comm::GroupLink;
use super::pipeline::ChunkTime;

/// Adds the blocking sends of whole activations (`act` bytes) to the chunks of a `pp`-stage,
/// `v`-chunk pipeline (by virtual stage, `chunk · pp + stage`), and returns the edges' p2p
/// times: zero, since each transfer is inside its sender's op.
pub(super) fn whole_activation_sends(
    pp_next: &[GroupLink],
    act: f64,
    pp: usize,
    v: usize,
    chunks: &mut [ChunkTime],
) -> Vec<f64> {
    let last = pp * v - 1;
    for (vs, c) in chunks.iter_mut().enumerate() {
        let s = vs % pp;
        if vs < last {
            // The activation to the next virtual stage, over the link from stage s to s + 1.
            c.fwd.p2p += pp_next[s].p2p(act);
        }
        if vs > 0 {
            // The gradient back to the previous virtual stage, over the link from s − 1 to s.
            c.bwd.p2p += pp_next[(s + pp - 1) % pp].p2p(act);
        }
    }
    vec![0.0; pp]
}
