//! Unit tests of the slice bookkeeping and of opening what is not a checkpoint. The save,
//! resume, resharding and damaged-file tests run the executor: runtime/tests/checkpoint.rs.

#![allow(clippy::single_range_in_vec_init)] // lists of flat ranges

use super::*;
use crate::params::{Init, ParamLayout, ParamSpec, Shard};

fn layout(tp_rank: usize) -> ParamLayout {
    let mut l = ParamLayout::new();
    let spec = |name: &str, shape: &[usize], shard| ParamSpec {
        name: name.into(),
        global_shape: shape.to_vec(),
        shard,
        decay: true,
        init: Init::Normal { std: 1.0 },
    };
    let split = |dim| Shard::Split {
        dim,
        rank: tp_rank,
        parts: 2,
    };
    l.add(spec("norm", &[6], Shard::Replicated)).unwrap();
    l.add(spec("col", &[4, 6], split(0))).unwrap();
    l.add(spec("row", &[3, 8], split(1))).unwrap();
    l
}

#[test]
fn zero_shards_of_tp_shards_rebuild_the_global_tensors() {
    // Two TP ranks, each cut into three ZeRO shards that cross tensor boundaries.
    let mut want = std::collections::BTreeMap::<String, Vec<f32>>::new();
    let mut got = std::collections::BTreeMap::<String, Vec<f32>>::new();
    for tp_rank in 0..2 {
        let l = layout(tp_rank);
        let flat = l.init(5);
        for e in l.entries() {
            let g = want
                .entry(e.name.clone())
                .or_insert_with(|| vec![0.0; e.global_shape.iter().product()]);
            e.copy_shard_to_global(e.param_ref().of(&flat), g);
        }
        let cuts = [0..7, 7..20, 20..l.len()];
        for (sub, meta) in owned_pieces(&l, &cuts, tp_rank, None) {
            assert_eq!(meta.elements.len(), sub.len());
            let g = got
                .entry(meta.name.clone())
                .or_insert_with(|| vec![f32::NAN; meta.global_shape.iter().product()]);
            for (s, at, n) in meta.runs() {
                g[at..at + n].copy_from_slice(&flat[sub.start + s..sub.start + s + n]);
            }
        }
    }
    let bits = |m: &std::collections::BTreeMap<String, Vec<f32>>| {
        m.iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn replicas_and_the_skipped_range_are_not_saved() {
    let l = layout(1);
    let names = |skip: Option<&Range<usize>>| {
        owned_pieces(&l, &[0..l.len()], 1, skip)
            .into_iter()
            .map(|(_, m)| m.name)
            .collect::<Vec<_>>()
    };
    // TP rank 1 leaves the replicated norm to TP rank 0.
    assert_eq!(names(None), ["col", "row"]);
    let col = l.get("col").unwrap().param_ref().range();
    assert_eq!(names(Some(&col)), ["row"]);
    let whole = owned_pieces(&l, &[0..l.len()], 0, None);
    assert_eq!(
        whole[1].1.stored_shape(),
        vec![2, 6],
        "a whole box keeps its shape"
    );
    let part = owned_pieces(&l, &[8..10], 0, None);
    assert_eq!(part[0].1.stored_shape(), vec![2], "part of a box is flat");
}

#[test]
fn what_is_not_a_checkpoint_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("tessera-ckpt-unit-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        e.contains("not a checkpoint") && e.contains(&dir.display().to_string()),
        "{e}"
    );
    std::fs::write(dir.join(LATEST), "../elsewhere\n").unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(e.contains("latest") && e.contains("not a step-N"), "{e}");
    std::fs::write(dir.join(LATEST), "step-7\n").unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(e.contains("step-7") && e.contains("does not exist"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
