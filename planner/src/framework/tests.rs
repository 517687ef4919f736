use super::*;
use crate::layout::{Recompute, Sharding};
use crate::schedule::ScheduleKind;

#[test]
fn every_profile_parses_and_names_itself() {
    assert_eq!(all().len(), FILES.len());
    for p in all() {
        assert!(!p.sources.is_empty(), "{} names no source", p.name);
        assert!(!p.can_run.zero_stages.is_empty(), "{}", p.name);
        assert!(!p.can_run.recompute.is_empty(), "{}", p.name);
    }
    for n in [
        "megatron-core",
        "megatron-legacy",
        "deepspeed",
        "torchtitan",
        "pytorch-eager",
        "pytorch-compile",
        "tessera",
    ] {
        assert!(by_name(n).is_some(), "the issue's profile {n} is built in");
    }
}

fn layout() -> Layout {
    let mut l = Layout::without_pipeline(8, 1, 0, 1);
    l.recompute = Recompute::None;
    l
}

#[test]
fn a_profile_refuses_what_its_framework_cannot_run_naming_the_knob() {
    let eager = by_name("pytorch-eager").unwrap();
    assert!(admits(eager, &layout()).is_ok());
    let mut tp = layout();
    tp.tp = 2;
    tp.dp = 4;
    let e = admits(eager, &tp).unwrap_err();
    assert_eq!(e.rule, CANNOT_RUN);
    assert!(e.detail.contains("pytorch-eager cannot run TP 2"), "{e}");

    let legacy = by_name("megatron-legacy").unwrap();
    let mut sel = layout();
    sel.recompute = Recompute::Selective;
    let e = admits(legacy, &sel).unwrap_err();
    assert!(e.detail.contains("selective recompute"), "{e}");
    assert!(e.fix.as_deref().unwrap().contains("none | full"), "{e:?}");

    let titan = by_name("torchtitan").unwrap();
    let mut z1 = layout();
    z1.sharding = Sharding {
        zero_stage: 1,
        hybrid: false,
    };
    let e = admits(titan, &z1).unwrap_err();
    assert!(e.detail.contains("ZeRO-1"), "{e}");

    let ds = by_name("deepspeed").unwrap();
    let mut inter = layout();
    inter.pp = 2;
    inter.dp = 4;
    inter.schedule = ScheduleKind::Interleaved;
    inter.virtual_stages = 2;
    let e = admits(ds, &inter).unwrap_err();
    assert!(e.detail.contains("interleaved"), "{e}");
}

#[test]
fn the_default_profiles_run_every_layout_the_search_builds() {
    // The defaults keep the planner's recommending behaviour: nothing is refused.
    for n in [DEFAULT_GPU, DEFAULT_CPU] {
        let c = &by_name(n).unwrap().can_run;
        assert!(c.tensor_parallel && c.sequence_parallel && c.pipeline);
        assert!(c.context_parallel && c.expert_parallel && c.hybrid_sharding);
        assert_eq!(c.zero_stages, vec![0, 1, 2, 3]);
        assert_eq!(c.recompute.len(), 3);
        assert_eq!(c.schedules.len(), 3);
    }
}
