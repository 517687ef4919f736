use super::*;
use crate::layout::{Recompute, Sharding};
use crate::schedule::ScheduleKind;
use crate::spec::DeviceKind;

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
        "torchtitan-compile",
        "tessera",
    ] {
        assert!(by_name(n).is_some(), "the issue's profile {n} is built in");
    }
}

/// `--compile`'s mapping: the eager PyTorch profiles to their compiled variants, a compiled
/// one to itself; every `compiled` key names a built-in profile that is its own variant; a
/// profile without one is refused, naming it, its file and the pairs that exist.
#[test]
fn compiled_variants_map_eager_pytorch_profiles_and_refuse_the_rest() {
    let name = |n: &str| compiled(by_name(n).unwrap()).map(|p| p.name.as_str());
    assert_eq!(name("pytorch-eager"), Ok("pytorch-compile"));
    assert_eq!(name("torchtitan"), Ok("torchtitan-compile"));
    assert_eq!(name("pytorch-compile"), Ok("pytorch-compile"));
    assert_eq!(name("torchtitan-compile"), Ok("torchtitan-compile"));
    for p in all() {
        if let Ok(c) = compiled(p) {
            assert_eq!(compiled(c).unwrap().name, c.name, "{} → {}", p.name, c.name);
            assert!(c.memory.fused_elementwise, "{} is compiled", c.name);
        }
    }
    for n in [
        "megatron-core",
        "deepspeed",
        "llm.c",
        "tessera",
        "llm-foundry",
    ] {
        let e = compiled(by_name(n).unwrap()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("\"{n}\" has no compiled variant")),
            "{msg}"
        );
        assert!(msg.contains(&format!("specs/frameworks/{n}.toml")), "{msg}");
        assert!(msg.contains("pytorch-eager → pytorch-compile"), "{msg}");
        assert!(msg.contains("torchtitan → torchtitan-compile"), "{msg}");
    }
}

/// FSDP1's SHARD_GRAD_OP is ZeRO-2 (torch/distributed/fsdp/api.py), and _HYBRID_SHARD_ZERO2
/// its hybrid form: the PyTorch profiles run both; torchtitan runs it as
/// `fsdp_reshard_after_forward = "never"`; Megatron-LM of 2021 has no ZeRO and refuses it,
/// naming the stages it runs.
#[test]
fn fsdp_shard_grad_op_is_zero_2_and_runs_where_the_framework_has_it() {
    let z2 = |hybrid| Layout {
        sharding: Sharding {
            zero_stage: 2,
            hybrid,
        },
        ..layout()
    };
    for n in [
        "pytorch-eager",
        "pytorch-compile",
        "torchtitan",
        "torchtitan-compile",
        "llm-foundry",
    ] {
        let p = by_name(n).unwrap();
        assert!(admits(p, &z2(false)).is_ok(), "{n}: ZeRO-2");
        assert!(admits(p, &z2(true)).is_ok(), "{n}: hybrid ZeRO-2");
    }
    let e = admits(by_name("megatron-legacy").unwrap(), &z2(false)).unwrap_err();
    assert_eq!(e.rule, CANNOT_RUN);
    assert!(
        e.detail.contains("megatron-legacy cannot run ZeRO-2"),
        "{e}"
    );
    assert_eq!(e.fix.as_deref(), Some("use --zero 0"), "{e:?}");
}

/// torchtitan's TP always shards the norms by sequence (`apply_tp`'s `SequenceParallel`): TP 2
/// without SP is refused, naming the fix; with SP it runs; megatron-core runs both.
#[test]
fn torchtitan_runs_tp_only_with_sequence_parallelism() {
    let tp2 = |sp| Layout {
        tp: 2,
        dp: 4,
        sequence_parallel: sp,
        ..layout()
    };
    for n in ["torchtitan", "torchtitan-compile"] {
        let p = by_name(n).unwrap();
        let e = admits(p, &tp2(false)).unwrap_err();
        assert!(
            e.detail
                .contains(&format!("{n} cannot run TP 2 without sequence parallelism")),
            "{e}"
        );
        assert_eq!(e.fix.as_deref(), Some("pin --sp, or use --tp 1"), "{e:?}");
        assert!(admits(p, &tp2(true)).is_ok(), "{n}");
    }
    let mcore = by_name(DEFAULT_GPU).unwrap();
    assert!(admits(mcore, &tp2(false)).is_ok() && admits(mcore, &tp2(true)).is_ok());
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
    // DeepSpeed's PipelineEngine asserts ZeRO-2 and ZeRO-3 are incompatible with PP.
    let mut piped = layout();
    piped.pp = 2;
    piped.dp = 4;
    piped.schedule = ScheduleKind::OneFOneB;
    for (stage, ok) in [(1, true), (2, false), (3, false)] {
        piped.sharding = Sharding {
            zero_stage: stage,
            hybrid: false,
        };
        match admits(ds, &piped) {
            Ok(()) => assert!(ok, "ZeRO-{stage} with PP admitted"),
            Err(e) => {
                assert!(!ok, "{e}");
                assert!(e.detail.contains(&format!("ZeRO-{stage} with PP 2")), "{e}");
            }
        }
    }
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
        for k in [
            ScheduleKind::Gpipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved,
        ] {
            assert!(c.schedules.contains(&k), "{n}: {k}");
        }
    }
}

#[test]
fn every_shipped_profile_states_what_it_builds_with_its_source() {
    // The keys are optional for a profile written before them, but every shipped file gives
    // them, under a comment saying where they come from.
    for (name, text) in FILES {
        let block = text
            .split("[can_run]")
            .nth(1)
            .and_then(|t| t.split("[runs]").next())
            .unwrap();
        for key in ["architectures =", "moe =", "gqa =", "devices ="] {
            assert!(block.contains(key), "{name}.toml does not state {key}");
        }
        assert!(
            block.contains("# What its model code builds"),
            "{name}.toml gives no source for what it builds"
        );
    }
    let c = &by_name("llm.c").unwrap().can_run;
    assert_eq!(c.architectures, vec![crate::model::Family::Gpt]);
    assert!(!c.moe && !c.gqa);
    assert_eq!(c.devices, vec![DeviceKind::Gpu]);
    assert!(by_name("tessera")
        .unwrap()
        .can_run
        .devices
        .contains(&DeviceKind::Cpu));
}

#[test]
fn a_profile_without_the_build_keys_builds_everything() {
    let text = FILES.iter().find(|(n, _)| *n == "llm.c").unwrap().1;
    let old: String = text
        .lines()
        .filter(|l| {
            !["architectures", "moe =", "gqa =", "devices ="]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let p: Profile = toml::from_str(&old).unwrap();
    assert_eq!(p.can_run.architectures, crate::model::Family::ALL.to_vec());
    assert!(p.can_run.moe && p.can_run.gqa);
    assert_eq!(p.can_run.devices.len(), 2);
}

#[test]
fn a_profile_refuses_a_job_it_cannot_build_naming_the_key() {
    use crate::spec::{self, ClusterOverrides, TrainingOverrides};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let model = |n: &str| {
        spec::load_model(
            &root.join(format!("specs/models/{n}.toml")),
            TrainingOverrides::default(),
        )
        .unwrap()
    };
    let cluster = |n: &str| {
        spec::load_cluster(
            &root.join(format!("specs/clusters/{n}.toml")),
            ClusterOverrides::default(),
        )
        .unwrap()
    };
    let (h100, cpu) = (cluster("dgx-h100-80g"), cluster("cpu-8"));
    let llmc = by_name("llm.c").unwrap();
    assert!(builds(llmc, &model("gpt2-124m"), &h100).is_ok());
    let e = builds(llmc, &model("llama3-8b"), &h100).unwrap_err();
    assert_eq!(e.why.key, "can_run.architectures = [\"gpt\"]");
    assert!(e.to_string().contains("specs/frameworks/llm.c.toml"), "{e}");
    assert!(
        e.why.fix.contains("torchtitan") && !e.why.fix.contains("llm.c"),
        "{e}"
    );
    let e = builds(llmc, &model("gpt2-124m"), &cpu).unwrap_err();
    assert!(e.why.key.starts_with("can_run.devices"), "{e}");
    assert!(e.why.fix.contains("--framework tessera"), "{e}");
    let e = builds(by_name("deepspeed").unwrap(), &model("tiny-moe"), &h100).unwrap_err();
    assert_eq!(e.why.key, "can_run.moe = false", "{e}");
    // The defaults build every preset on their devices, as before.
    for n in ["llama3-8b", "mixtral-8x7b", "deepseek-v3", "gpt3-175b"] {
        assert!(
            builds(by_name(DEFAULT_GPU).unwrap(), &model(n), &h100).is_ok(),
            "{n}"
        );
    }
    for n in ["tiny", "tiny-moe", "gpt2-124m"] {
        assert!(
            builds(by_name(DEFAULT_CPU).unwrap(), &model(n), &cpu).is_ok(),
            "{n}"
        );
    }
}

/// Each eager profile's dispatch and launch counts are the ones the checked-in trace summary
/// records for its layer (scripts/host_layer_trace.py --json docs/host-floor-trace.json), and
/// each summary total is the sum of its per-op counts: an edit of a count on either side fails.
#[test]
fn counted_profiles_carry_the_trace_summarys_counts() {
    let summary: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/host-floor-trace.json")).unwrap();
    let megatron = "megatron-core (TransformerLayer, local spec)";
    let nanogpt = "pytorch-eager (nanoGPT block, bf16 autocast)";
    for (profile, layer) in [
        ("megatron-core", megatron),
        ("megatron-legacy", megatron),
        ("megatron-lm-2022", megatron),
        ("deepspeed", megatron),
        ("pytorch-eager", nanogpt),
        ("llm-foundry", nanogpt),
        ("torchtitan", "torchtitan (Llama 3 TransformerBlock)"),
    ] {
        let r = &by_name(profile).unwrap().runs;
        let l = &summary["layers"][layer];
        for (key, recorded) in [
            ("dispatches_forward", r.host_dispatches_forward),
            ("dispatches_backward", r.host_dispatches_backward),
            ("launches_forward", r.host_launches_forward),
            ("launches_backward", r.host_launches_backward),
        ] {
            let ops: u64 = l["ops"][key]
                .as_object()
                .unwrap_or_else(|| panic!("{layer}: no {key} in the summary"))
                .values()
                .map(|n| n.as_u64().unwrap())
                .sum();
            assert_eq!(l["totals"][key].as_u64(), Some(ops), "{layer}: {key}");
            assert_eq!(u64::from(recorded), ops, "{profile}: host_{key}");
        }
    }
    // No eager profile is left on the CPU-timed bare-op equivalents.
    for p in all() {
        if p.runs.host_cost == HostCost::Dispatch {
            assert!(
                p.runs.host_dispatches_forward > 0,
                "{} is not counted",
                p.name
            );
        }
    }
}

/// The attention kernel a job runs: Megatron-Core (Transformer Engine, which prefers cuDNN's
/// fused attention on Hopper) takes the H100 preset's `cudnn_attention_efficiency`; torchtitan
/// (FlashAttention-class SDPA) its `flash_attention_efficiency`; on the A100, whose preset
/// measures no cuDNN kernel apart, both take the flash figure.
#[test]
fn megatron_core_takes_cudnn_attention_where_the_cluster_measures_it() {
    use crate::cost::device::Device;
    use crate::spec::{self, ClusterOverrides, TrainingOverrides};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cluster = |n: &str| {
        spec::load_cluster(
            &root.join(format!("specs/clusters/{n}.toml")),
            ClusterOverrides::default(),
        )
        .unwrap()
    };
    let model = |framework: &str| {
        let mut m = spec::load_model(
            &root.join("specs/models/llama3-8b.toml"),
            TrainingOverrides::default(),
        )
        .unwrap();
        m.training.framework = Some(framework.into());
        m
    };
    let (h100, a100) = (cluster("dgx-h100-80g"), cluster("dgx-a100-80g"));
    let eff = |m: &Model, c: &crate::spec::Cluster| {
        let kernel = crate::cost::Options::for_model(m, c).attention_kernel;
        let layout = crate::layout::Layout::without_pipeline(1, 1, 1, 1);
        Device::for_job(c, m, &layout, kernel).attention_efficiency
    };
    assert_eq!(h100.calibration.cudnn_attention_efficiency, Some(0.427));
    assert_eq!(eff(&model("megatron-core"), &h100), 0.427);
    assert_eq!(eff(&model("torchtitan"), &h100), 0.268);
    assert_eq!(a100.calibration.cudnn_attention_efficiency, None);
    assert_eq!(eff(&model("megatron-core"), &a100), 0.548);
    assert_eq!(eff(&model("torchtitan"), &a100), 0.548);
}
