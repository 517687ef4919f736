//! The memory model against published numbers (../shared/groundtruth/README.md §4, §5).
//!
//! Expected values are copied from the sources, never computed by the code under test.

use tessera_planner::layout::Layout;
use tessera_planner::memory::{self, per_param};
use tessera_planner::model::{Architecture, AttentionImpl, Model, Training};
use tessera_planner::precision::Policy;
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{Cluster, Device, DeviceKind, Link, Overhead};

fn cluster(devices: u64, memory_gib: f64) -> Cluster {
    Cluster {
        name: "test".into(),
        nodes: devices.div_ceil(8),
        gpus_per_node: 8,
        devices,
        device: Device {
            name: "test".into(),
            kind: DeviceKind::Gpu,
            memory_gib,
            peak_tflops: 100.0,
            peak_tflops_fp8: None,
            memory_bandwidth_gbps: 1000.0,
            sms: 0,
            kernel_launch_us: 0.0,
            transcendental_gops: None,
            shared_cores: None,
            precision: None,
            l2_cache_kib: None,
        },
        intra_node: Link {
            bandwidth_gbps: 100.0,
            latency_us: 1.0,
        },
        inter_node: Link {
            bandwidth_gbps: 10.0,
            latency_us: 1.0,
        },
        overhead: Overhead {
            context_gib: 0.0,
            fragmentation: 0.0,
            ..Overhead::default()
        },
        calibration: Default::default(),
        calibrated: false,
        // No host tier: nothing offloads here.
        host: Default::default(),
        cost: None,
        reliability: None,
        storage: None,
    }
}

fn gpt2(layers: u64, hidden: u64, heads: u64, vocab: u64, precision: &str) -> Model {
    Model {
        name: "gpt2".into(),
        architecture: Architecture::gpt(layers, hidden, heads, vocab, 1024),
        training: Training {
            seq_len: 1024,
            global_batch: 128,
            tokens: None,
            precision: precision.into(),
            attention: AttentionImpl::Flash,
            flash_kernel: Default::default(),
            dropout: 0.0,
            framework: None,
            method: Default::default(),
            optimizer_states: Default::default(),
            fp8: Default::default(),
            tp_comm_overlap: false,
        },
        optimizer: Default::default(),
        schedule: Default::default(),
        lora: None,
    }
}

fn layout(dp: u64, tp: u64, zero_stage: u8, micro_batch: u64) -> Layout {
    Layout::without_pipeline(dp, tp, zero_stage, micro_batch)
}

/// llm.c GPT-2 1558M (d48, padded vocab 50304) on 8 GPUs with ZeRO-1 prints:
/// parameters 2971 MiB, gradients 2971 MiB, AdamW m, v and master weights 742 MiB each.
#[test]
fn llm_c_gpt2_1558m_memory_lines() {
    let model = gpt2(48, 1600, 25, 50304, "mixed16");
    assert_eq!(model.architecture.param_count(), 1_557_686_400);
    let c = cluster(8, 80.0);
    let report = memory::estimate(&model, &c, &layout(8, 1, 1, 16));
    let mib = |name: &str| {
        let t = report.per_stage[0]
            .terms
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no term {name}"));
        t.bytes / (1024 * 1024)
    };
    assert_eq!(mib("weights_bf16"), 2971);
    assert_eq!(mib("grads_bf16"), 2971);
    assert_eq!(mib("master_fp32"), 742);
    assert_eq!(mib("adam_m_fp32"), 742);
    assert_eq!(mib("adam_v_fp32"), 742);
}

/// ZeRO (Rajbhandari et al. SC'20) Table 2, "max theoretical" columns: the largest model (in
/// billions) whose model states fit in a 32 GB V100 with N_d = 64 and MP = 1..16, under the
/// K = 12 accounting (our `mixed16` policy): baseline, P_os, P_os+g, P_os+g+p.
#[test]
fn zero_paper_table_2_theoretical_entries() {
    let rows: [(u64, [f64; 4]); 5] = [
        (1, [2.0, 7.6, 14.4, 128.0]),
        (2, [4.0, 15.2, 28.8, 256.0]),
        (4, [8.0, 30.4, 57.6, 500.0]),
        (8, [16.0, 60.8, 115.2, 1000.0]),
        (16, [32.0, 121.6, 230.4, 2000.0]),
    ];
    let policy = Policy::by_name("mixed16").unwrap();
    for (mp, expected) in rows {
        for (zero, want) in expected.iter().enumerate() {
            let bytes: f64 = policy
                .states
                .iter()
                .map(|s| per_param(s, zero as u8, 64))
                .sum();
            let max_b = mp as f64 * 32e9 / bytes / 1e9;
            // The paper rounds the MP = 1 entry to one decimal and scales it by MP (30.4 = 4 × 7.6,
            // where 4 × 32 / 4.1875 = 30.57), and prints 0.5T/1T/2T for 512/1024/2048.
            let per_mp = (max_b - want) / mp as f64;
            let tolerance = if zero == 3 {
                0.03 * want / mp as f64
            } else {
                0.05 + 1e-9
            };
            assert!(
                per_mp.abs() <= tolerance,
                "MP {mp} ZeRO {zero}: {max_b:.2}B vs paper {want}B"
            );
        }
    }
}

/// The per-parameter accounting above is the one the memory report uses, term by term.
#[test]
fn report_model_states_follow_the_policy_and_tp() {
    let model = gpt2(8, 1024, 16, 50304, "mixed16");
    for (tp, zero) in [(1u64, 0u8), (2, 1), (4, 2), (2, 3)] {
        let dp = 16 / tp;
        let c = cluster(16, 80.0);
        let r = memory::estimate(&model, &c, &layout(dp, tp, zero, 1));
        let s = &r.per_stage[0];
        let policy = Policy::by_name("mixed16").unwrap();
        for st in policy.states {
            let term = s.terms.iter().find(|t| t.name == st.name).unwrap();
            let want = s.params_per_rank as f64 * per_param(st, zero, dp);
            assert!(
                (term.bytes as f64 - want).abs() <= 1.0,
                "{} tp{tp} zero{zero}",
                st.name
            );
        }
    }
}

/// The memory model's closed-form in-flight counts equal the schedules' own op lists.
#[test]
fn in_flight_matches_the_schedules() {
    for kind in ScheduleKind::ALL {
        for pp in 1..=6u64 {
            for m in 1..=12u64 {
                for v in 1..=3u64 {
                    let Ok(s) =
                        tessera_planner::schedule::build(kind, pp as usize, m as usize, v as usize)
                    else {
                        continue;
                    };
                    for stage in 0..pp {
                        assert_eq!(
                            memory::in_flight(kind, pp, m, v, stage),
                            s.peak_in_flight(stage as usize) as u64,
                            "{kind:?} pp{pp} m{m} v{v} stage{stage}"
                        );
                    }
                }
            }
        }
    }
}

/// Megatron's distributed optimizer: 6 + 12/DP bytes per parameter (theoretical_memory_usage.py).
#[test]
fn megatron_distributed_optimizer_bytes() {
    let policy = Policy::by_name("megatron").unwrap();
    for dp in [1u64, 2, 8, 64] {
        let bytes: f64 = policy.states.iter().map(|s| per_param(s, 1, dp)).sum();
        assert!((bytes - (6.0 + 12.0 / dp as f64)).abs() < 1e-12);
    }
}
