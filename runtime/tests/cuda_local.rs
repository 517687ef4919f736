//! Multi-rank runs on real GPUs (feature `cuda`), compared bit for bit with `LocalComm` on the
//! workload of `tessera_runtime::comm_parity` (a tensor-parallel transformer block forward and
//! backward, pipeline sends, ZeRO reduce-scatter / all-gather, all-reduce, broadcast, barriers):
//!
//! - `cuda-local`: a 2×2×2 mesh, 8 ranks as threads on ONE GPU, payloads through device memory;
//! - NCCL: one rank per visible GPU (at least two; NCCL refuses two ranks on one device).
//!
//! Without a GPU each test prints "skipped: …" and passes. NOT YET RUN ON A GPU.
#![cfg(feature = "cuda")]

use tessera_planner::Mesh;
use tessera_runtime::backend::cuda::local::cuda_local_groups;
use tessera_runtime::backend::cuda::nccl::{nccl_groups, new_ids};
use tessera_runtime::comm::{group_ids, local_groups};
use tessera_runtime::comm_parity::{run_all, workout};

fn assert_same(mesh: &Mesh, got: Vec<Result<Vec<f32>, String>>) {
    let want = run_all(local_groups(mesh).unwrap(), mesh);
    for (r, (w, g)) in want.into_iter().zip(got).enumerate() {
        let (w, g) = (w.unwrap(), g.unwrap_or_else(|e| panic!("rank {r}: {e}")));
        assert_eq!(w.len(), g.len(), "rank {r}");
        let diff = w
            .iter()
            .zip(&g)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            diff, None,
            "rank {r}: first value that differs from LocalComm"
        );
    }
}

#[test]
fn cuda_local_2x2x2_on_one_gpu_gives_localcomm_bits() {
    let mesh = Mesh::new(2, 2, 2, 8);
    let groups = match cuda_local_groups(&mesh, 0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    assert_same(&mesh, run_all(groups, &mesh));
}

#[test]
fn nccl_on_every_visible_gpu_gives_localcomm_bits() {
    let gpus = match tessera_runtime::backend::cuda::devices() {
        Ok(d) => d.len(),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    if gpus < 2 {
        eprintln!("skipped: NCCL needs two GPUs, {gpus} visible");
        return;
    }
    if let Err(e) = tessera_runtime::backend::cuda::probe_nccl() {
        eprintln!("skipped: {e}");
        return;
    }
    // TP 2 (the workload's block has 2 kv heads), DP over the remaining pairs.
    let world = gpus / 2 * 2;
    let mesh = Mesh::new(world as u64 / 2, 1, 2, world as u64);
    let blob = new_ids(group_ids::id_count(&mesh)).unwrap();
    let got: Vec<Result<Vec<f32>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (mesh, blob) = (&mesh, &blob);
                s.spawn(move || {
                    // The communicators are !Send: created here, on the rank's own thread.
                    let ctx = tessera_runtime::backend::cuda::probe::open_context(r)
                        .map_err(|e| e.to_string())?;
                    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                    let g = nccl_groups(mesh, r, stream, blob).map_err(|e| e.to_string())?;
                    workout(&g, mesh, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_same(&mesh, got);
}
