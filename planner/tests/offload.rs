//! Offload (issue 38): the memory on both tiers and the host step, as worked figures computed by
//! hand in the comments, the host-tier refusal, and the search offloading only where nothing
//! else fits.

use std::path::Path;

use tessera_planner::cost::Options;
use tessera_planner::layout::{Layout, Offload, OffloadStates, OffloadTier};
use tessera_planner::memory::{self, MemoryReport};
use tessera_planner::search::{self, Pins, SearchOptions};
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_planner::{Cluster, Model};

fn spec(dir: &str, name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../specs")
        .join(dir)
        .join(format!("{name}.toml"))
}

fn model(name: &str, framework: Option<&str>) -> Model {
    let mut m = load_model(&spec("models", name), TrainingOverrides::default()).expect("spec");
    m.training.framework = framework.map(str::to_string);
    m
}

fn cluster(name: &str) -> Cluster {
    load_cluster(&spec("clusters", name), ClusterOverrides::default()).expect("spec")
}

/// Llama 3 8B's parameters: 8,030,261,248 (untied embedding and head, vocabulary 128256, which
/// needs no padding at TP 1). 8 ranks of DP shard it into 1,003,782,656 each, exactly.
const P: f64 = 8_030_261_248.0;
const SHARD: f64 = P / 8.0;

fn dp8(zero: u8, states: OffloadStates, to: OffloadTier) -> Layout {
    let mut l = Layout::without_pipeline(8, 1, zero, 1);
    l.recompute = tessera_planner::Recompute::Full;
    l.offload = Offload {
        states,
        to,
        activations: false,
    };
    l
}

fn term(m: &MemoryReport, name: &str) -> Option<u64> {
    m.per_stage[0]
        .terms
        .iter()
        .find(|t| t.name == name)
        .map(|t| t.bytes)
}

fn host_term(m: &MemoryReport, name: &str) -> Option<(String, u64)> {
    m.host.as_ref()?.per_stage[0]
        .terms
        .iter()
        .find(|t| t.name == name)
        .map(|t| (t.kind.clone(), t.bytes))
}

/// ZeRO-2 with the optimizer offloaded (ZeRO-Offload), the default 20 B/param policy:
/// - device: the bf16 weights whole, 2 × P = 16,060,522,496 B, and the gradient bucket
///   (DeepSpeed's reduce_bucket_size, 5e8 elements × 2 B = 1,000,000,000 B) in place of the
///   bf16 gradient; no fp32 accumulator, master or moments;
/// - host, per rank: fp32 gradient, master, m and v of the shard, 4 × 1,003,782,656 =
///   4,015,130,624 B each, 16 B/param; per node 8 ranks × 16 × SHARD = 16 × P =
///   128,484,179,968 B.
#[test]
fn optimizer_offload_moves_the_fp32_states_to_the_host() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let mem = memory::estimate(&m, &c, &dp8(2, OffloadStates::Optimizer, OffloadTier::Cpu));
    assert_eq!(term(&mem, "weights_bf16"), Some(16_060_522_496));
    assert_eq!(term(&mem, "offload_grad_bucket"), Some(1_000_000_000));
    assert_eq!(term(&mem, "grads_bf16"), None);
    for gone in ["grads_fp32", "master_fp32", "adam_m_fp32", "adam_v_fp32"] {
        assert_eq!(term(&mem, gone), None, "{gone} must not be on the device");
        assert_eq!(
            host_term(&mem, gone),
            Some(("host".to_string(), 4_015_130_624)),
            "{gone}"
        );
    }
    let h = mem.host.as_ref().expect("offloads");
    assert_eq!(h.host_bytes_per_node, 128_484_179_968);
    assert_eq!(h.nvme_bytes_per_node, 0);
    assert_eq!(h.host_capacity_bytes, 2048 * (1 << 30));
    assert!(h.fits());
}

/// ZeRO-3 with the parameters offloaded: the host holds 18 B/param of the shard (bf16 weights
/// 2, fp32 gradient 4, master 4, m 4, v 4 — DeepSpeed's estimator's 18); the bf16 gradient has
/// no place (reduce-scattered layer by layer, then copied down). Per node 18 × P =
/// 144,544,702,464 B. On the device no weight or gradient term is left but the gathered layers.
#[test]
fn params_offload_leaves_only_the_gathered_layers_on_the_device() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let mem = memory::estimate(&m, &c, &dp8(3, OffloadStates::Params, OffloadTier::Cpu));
    for gone in [
        "weights_bf16",
        "grads_bf16",
        "grads_fp32",
        "master_fp32",
        "adam_m_fp32",
        "adam_v_fp32",
    ] {
        assert_eq!(term(&mem, gone), None, "{gone} must not be on the device");
    }
    assert!(term(&mem, "zero3_gathered_layers").is_some());
    assert_eq!(
        host_term(&mem, "weights_bf16"),
        Some(("host".to_string(), 2_007_565_312))
    );
    assert_eq!(host_term(&mem, "grads_bf16"), None);
    let h = mem.host.as_ref().expect("offloads");
    assert_eq!(h.host_bytes_per_node, 144_544_702_464);
}

/// The same to NVMe (ZeRO-Infinity): the bf16 weights, master, m and v, 14 × P =
/// 112,423,657,472 B per node, go to NVMe; the host keeps the fp32 gradient, 4 × P =
/// 32,121,044,992 B, and per rank DeepSpeed's pinned swap buffers: parameters 5 × 1e8 × 2 B =
/// 1e9 B, optimizer 4 × min(1e9, 1,003,782,656) × 4 B = 1.6e10 B; per node
/// 32,121,044,992 + 8 × 1.7e10 = 168,121,044,992 B.
#[test]
fn nvme_offload_puts_the_weights_and_optimizer_on_the_drives() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let mem = memory::estimate(&m, &c, &dp8(3, OffloadStates::Params, OffloadTier::Nvme));
    assert_eq!(
        host_term(&mem, "master_fp32").map(|t| t.0),
        Some("nvme".into())
    );
    assert_eq!(
        host_term(&mem, "grads_fp32").map(|t| t.0),
        Some("host".into())
    );
    let h = mem.host.as_ref().expect("offloads");
    assert_eq!(h.nvme_bytes_per_node, 112_423_657_472);
    assert_eq!(h.host_bytes_per_node, 168_121_044_992);
    assert_eq!(h.nvme_capacity_bytes, 28610 * (1 << 30));
}

/// Megatron's 18 B/param policy has one gradient, the fp32 main grad the backward writes: it
/// stays on the device (4 × P = 32,121,044,992 B at ZeRO-1) and the host adds a copy of the
/// shard for the step (4 × SHARD), beside master, m and v: 16 B/param of the shard.
#[test]
fn a_single_gradient_policy_keeps_it_and_copies_the_shard() {
    let mut m = model("llama3-8b", None);
    m.training.precision = "megatron".into();
    let c = cluster("dgx-h100-80g");
    let mem = memory::estimate(&m, &c, &dp8(1, OffloadStates::Optimizer, OffloadTier::Cpu));
    assert_eq!(term(&mem, "grads_fp32"), Some(32_121_044_992));
    assert_eq!(
        host_term(&mem, "host_grad_buffer"),
        Some(("host".to_string(), 4_015_130_624))
    );
    assert_eq!(
        mem.host.as_ref().expect("offloads").host_bytes_per_node,
        (16.0 * P) as u64
    );
}

/// The host step of ZeRO-2 + optimizer offload under the megatron-core profile (PyTorch's CPU
/// AdamW, 0.147 of the cluster's 1.5 Gparams/s): each rank updates its 1,003,782,656-parameter
/// shard, the node's 8 ranks share the CPUs: 8 × SHARD / (1.5e9 × 0.147) = 36.419 s; then the
/// updated bf16 shard goes up, 2 × SHARD / 35.2e9 = 0.0570 s.
#[test]
fn the_host_step_is_the_node_s_adamw_over_its_ranks_shards() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let options = Options::for_model(&m, &c);
    let (_, p) = search::predict_layout(
        &m,
        &c,
        &dp8(2, OffloadStates::Optimizer, OffloadTier::Cpu),
        options,
    );
    let host = p
        .breakdown
        .iter()
        .find(|t| t.name == "host_optimizer")
        .expect("a host step term");
    let want = 8.0 * SHARD / (1.5e9 * 0.147) + 2.0 * SHARD / 35.2e9;
    assert!(
        (host.seconds - want).abs() < 1e-6 * want,
        "{} vs {want}",
        host.seconds
    );
    assert!(p.breakdown.iter().all(|t| t.name != "optimizer"));
}

fn search(m: &Model, c: &Cluster, pins: Pins) -> search::SearchResult {
    let options = SearchOptions {
        top: 3,
        cost: Options::for_model(m, c),
    };
    search::search_checked(m, c, &pins, options).expect("searches")
}

/// Llama 3 70B's full training states (20 B/param × 70.55B = 1.41 TB) exceed one DGX H100's
/// 640 GB of device memory whatever the layout: the search offloads. Llama 3 8B fits without.
#[test]
fn the_search_offloads_only_where_nothing_fits_without() {
    let c = cluster("dgx-h100-80g");
    let big = search(&model("llama3-70b", None), &c, Pins::default());
    let chosen = big
        .fits
        .first()
        .expect("70B plans on one node with offload");
    assert!(
        chosen.layout.offload.optimizer(),
        "{}",
        chosen.layout.label()
    );
    assert!(big.fits.iter().all(|f| f.layout.offload.optimizer()));
    let small = search(&model("llama3-8b", None), &c, Pins::default());
    let chosen = small.fits.first().expect("8B fits");
    assert!(!chosen.layout.offload.any(), "{}", chosen.layout.label());
    assert!(small.fits.iter().all(|f| !f.layout.offload.any()));
}

/// A DGX H100 given only 256 GiB of host memory cannot hold 70B's offloaded optimizer
/// (16 B/param of every shard, 16 × 70.55B = 1.13 TB per node): every layout that fits on the
/// device only by offloading is refused under the host tier's name.
#[test]
fn a_layout_that_overflows_host_memory_is_refused_naming_the_tier() {
    let m = model("llama3-70b", None);
    let mut c = cluster("dgx-h100-80g");
    c.host.memory_gib = 256.0;
    let r = search(&m, &c, Pins::default());
    assert!(r.fits.is_empty());
    let g = r
        .rejected
        .get("does not fit in host memory")
        .expect("refused under the host tier");
    assert!(
        g.example
            .contains("of host memory per node, has 256.00 GiB"),
        "{}",
        g.example
    );
}

/// ZeRO-1 with the optimizer offloaded: the device accumulates every micro-batch's gradients
/// as without offload — bf16 2 × P = 16,060,522,496 B and the fp32 accumulator 4 × P =
/// 32,121,044,992 B, unsharded — and the reduced shard goes down once per step into a host
/// buffer, 4 × SHARD = 4,015,130,624 B, beside master, m and v: 16 × P per node.
#[test]
fn zero1_keeps_the_gradients_on_the_device_and_copies_the_shard() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let mem = memory::estimate(&m, &c, &dp8(1, OffloadStates::Optimizer, OffloadTier::Cpu));
    assert_eq!(term(&mem, "grads_bf16"), Some(16_060_522_496));
    assert_eq!(term(&mem, "grads_fp32"), Some(32_121_044_992));
    assert_eq!(term(&mem, "master_fp32"), None);
    assert_eq!(
        host_term(&mem, "host_grad_buffer"),
        Some(("host".to_string(), 4_015_130_624))
    );
    assert_eq!(host_term(&mem, "grads_fp32"), None);
    assert_eq!(
        mem.host.as_ref().expect("offloads").host_bytes_per_node,
        128_484_179_968
    );
}

/// The gradient copies of ZeRO-2 + optimizer offload under a profile that does not overlap
/// them (megatron-core's): each micro-batch, each of the 32 layers sends its bf16 gradient
/// shard down, 218,112,000 / 8 = 27,264,000 parameters × 2 B = 54,528,000 B over 35.2 GB/s =
/// 1.5491 ms; m = global batch / 8 micro-batches of one sequence.
#[test]
fn unoverlapped_gradient_copies_show_whole() {
    let (m, c) = (model("llama3-8b", None), cluster("dgx-h100-80g"));
    let options = Options::for_model(&m, &c);
    assert!(
        !options.offload_overlap,
        "megatron-core's copies follow the step"
    );
    let (_, p) = search::predict_layout(
        &m,
        &c,
        &dp8(2, OffloadStates::Optimizer, OffloadTier::Cpu),
        options,
    );
    let copies = p
        .breakdown
        .iter()
        .find(|t| t.name == "offload_copies")
        .expect("named")
        .seconds;
    let micro = (m.training.global_batch / 8) as f64;
    let want = micro * 32.0 * 54_528_000.0 / 35.2e9;
    assert!(
        (copies - want).abs() < 1e-9 * want.max(1.0),
        "{copies} vs {want}"
    );
}
