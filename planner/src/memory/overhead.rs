//! The runtime's fixed memory on each rank besides the model's tensors, as named terms sized
//! by the cluster spec's `[overhead]` table (the presets cite their sizes), and on a CPU
//! cluster by Tessera's own runtime (memory/cpu_runtime.rs).

use super::cpu_runtime;
use crate::layout::Layout;
use crate::model::Model;
use crate::spec::{Cluster, DeviceKind, GIB};

/// The communicators with 2+ ranks that a rank of `stage` belongs to.
fn communicators(model: &Model, layout: &Layout, stage: u64) -> Vec<&'static str> {
    let mut comms = Vec::new();
    if layout.tp > 1 {
        comms.push("TP");
    }
    if layout.cp > 1 {
        // The CP ring, and the gradient group over DP × CP (Megatron-Core's groups).
        comms.push("CP");
        comms.push("DP × CP");
    }
    if layout.dp > 1 {
        comms.push("DP");
        if layout.sharding.hybrid && layout.sharding.zero_stage > 0 {
            comms.push("DP across nodes");
        }
    }
    if layout.pp > 1 {
        comms.push("PP");
        let end = stage == 0 || stage + 1 == layout.pp;
        if model.architecture.tied_embeddings && end {
            comms.push("tied embedding");
        }
    }
    comms
}

/// The fixed memory of the framework on a rank of `stage`, besides the tensors: the CUDA
/// context, the BLAS workspaces, NCCL's buffers per communicator the rank belongs to, and the
/// spec's `overhead.context_gib` for the rest, as `(term, bytes)`; on a CPU cluster also the
/// GEMM crate's packing slab and the communicator's activation messages. Sizes are the cluster
/// spec's (the presets cite theirs). Terms of 0 bytes are left out.
fn terms(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    stage: u64,
) -> [(&'static str, f64); 6] {
    let o = &cluster.overhead;
    let mib = 1024.0 * 1024.0;
    let comms = communicators(model, layout, stage).len() as f64;
    let cpu = cluster.device.kind == DeviceKind::Cpu;
    let (slab, messages) = match cpu {
        true => (
            cpu_runtime::gemm_slab(cluster),
            cpu_runtime::activation_messages(model, layout, stage),
        ),
        false => (0.0, 0.0),
    };
    [
        ("cuda_context", o.cuda_context_mib * mib),
        ("cublas_workspace", o.cublas_workspace_mib * mib),
        ("nccl_buffers", o.nccl_mib_per_communicator * mib * comms),
        ("runtime_context", o.context_gib * GIB),
        // Last, so that a GPU cluster's sum adds exact zeros after the same terms as before.
        ("gemm_packing", slab),
        ("activation_messages", messages),
    ]
}

/// The bytes of [`runtime_overheads`], without their reasons (the search's path).
pub fn runtime_overhead_bytes(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    stage: u64,
) -> f64 {
    terms(model, cluster, layout, stage)
        .iter()
        .map(|t| t.1)
        .sum()
}

/// The runtime's fixed memory on a rank of `stage` as named terms with their reasons, for the
/// memory report.
pub fn runtime_overheads(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    stage: u64,
) -> Vec<(&'static str, f64, String)> {
    let o = &cluster.overhead;
    terms(model, cluster, layout, stage)
        .into_iter()
        .filter(|&(name, bytes)| {
            let cpu = cluster.device.kind == DeviceKind::Cpu;
            bytes > 0.0 || name == "runtime_context" || (cpu && name == "gemm_packing")
        })
        .map(|(name, bytes)| {
            let why = match name {
                "cuda_context" => format!(
                    "the CUDA context: overhead.cuda_context_mib = {}",
                    o.cuda_context_mib
                ),
                "cublas_workspace" => format!(
                    "cuBLAS and cuBLASLt workspaces: overhead.cublas_workspace_mib = {}",
                    o.cublas_workspace_mib
                ),
                "nccl_buffers" => {
                    let comms = communicators(model, layout, stage);
                    format!(
                        "NCCL buffers of {} communicator(s) ({}) × overhead.nccl_mib_per_communicator = {}",
                        comms.len(),
                        comms.join(", "),
                        o.nccl_mib_per_communicator
                    )
                }
                "gemm_packing" => match cluster.device.l2_cache_kib {
                    Some(kib) => format!("the gemm crate's packing slab on the rank's thread, one L2 cache per core: [device] l2_cache_kib = {kib}"),
                    None => "the gemm crate's packing slab on the rank's thread (one L2 cache per core) is not counted: the cluster spec has no [device] l2_cache_kib (`tessera calibrate` writes this host's)".into(),
                },
                "activation_messages" => "the thread communicator's pooled messages of the activations: TP's collectives of a layer's output (TP + 1 chunks of 1/TP of b·s·h, f32) and the pipeline's sends (one b·s·h message each way the stage sends)".into(),
                _ => "the rest of the runtime's fixed memory: the cluster spec's overhead.context_gib"
                    .into(),
            };
            (name, bytes, why)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Sharding;
    use crate::spec::{self, ClusterOverrides, TrainingOverrides};
    use std::path::Path;

    /// NCCL's buffers count one communicator per group of 2+ ranks the rank is in: TP, DP and
    /// hybrid sharding's second DP group, PP, and on the end stages the tied embedding's.
    #[test]
    fn nccl_buffers_count_the_communicators_of_each_stage() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
        let model = spec::load_model(
            &root.join("models/gpt3-175b.toml"),
            TrainingOverrides::default(),
        )
        .unwrap();
        let cluster = spec::load_cluster(
            &root.join("clusters/dgx-a100-80g.toml"),
            ClusterOverrides {
                nodes: Some(8),
                devices: None,
            },
        )
        .unwrap();
        let per = cluster.overhead.nccl_mib_per_communicator * 1024.0 * 1024.0;
        let nccl = |layout: &Layout, stage: u64| {
            runtime_overheads(&model, &cluster, layout, stage)
                .into_iter()
                .find(|t| t.0 == "nccl_buffers")
                .map_or(0.0, |t| t.1 / per)
        };
        let hybrid = Layout {
            pp: 4,
            sharding: Sharding {
                zero_stage: 3,
                hybrid: true,
            },
            ..Layout::without_pipeline(2, 8, 3, 1)
        };
        // GPT-3's embeddings are tied: the first and last stages share a group.
        assert_eq!(nccl(&hybrid, 0), 5.0);
        assert_eq!(nccl(&hybrid, 1), 4.0);
        assert_eq!(nccl(&hybrid, 3), 5.0);
        // One rank: no communicator, no term.
        assert_eq!(nccl(&Layout::without_pipeline(1, 1, 0, 1), 0), 0.0);
        // TP only.
        assert_eq!(nccl(&Layout::without_pipeline(1, 8, 0, 1), 0), 1.0);
    }
}
