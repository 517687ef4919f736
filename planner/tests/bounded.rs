//! Bounded work for any count (issue 16): every count up to i64::MAX (devices, global batch,
//! layers, widths, micro-batch pins) gets an answer from the search and the prediction — a
//! plan, no fit, or a clean error — without a panic, a hang or a huge allocation. These tests
//! assert the outcome; run them in release to see that each takes well under a second, and
//! in debug to see that no arithmetic overflows.

use tessera_planner::layout::{Layout, TOO_MANY_MICROBATCHES};
use tessera_planner::search::{
    self, count_layouts, predict_layout, search_checked, try_predict_layout, Pins, SearchError,
    SearchOptions, SearchResult, MAX_LAYOUTS, TOO_MANY_LAYOUTS,
};
use tessera_planner::source::Source;
use tessera_planner::spec::{
    parse_cluster_toml, parse_model_toml, ClusterOverrides, TrainingOverrides,
};
use tessera_planner::{Cluster, Model};

const BIG: u64 = i64::MAX as u64;

const TINY: &str = r#"
name = "tiny"
[architecture]
layers = 4
hidden = 64
heads = 4
kv_heads = 4
ffn_hidden = 256
vocab = 256
activation = "gelu"
norm = "layernorm"
position = "learned"
tied_embeddings = true
bias = true
max_positions = 64
[training]
seq_len = 64
global_batch = 16
precision = "default"
attention = "eager"
dropout = 0.0
"#;

const DGX: &str = r#"
name = "dgx-a100-80g"
nodes = 1
gpus_per_node = 8
[device]
name = "A100-SXM4-80GB"
kind = "gpu"
memory_gib = 80
peak_tflops = 312
memory_bandwidth_gbps = 2039
[intra_node]
bandwidth_gbps = 300
latency_us = 2.0
[inter_node]
bandwidth_gbps = 25
latency_us = 5.0
[overhead]
context_gib = 1.0
fragmentation = 0.05
"#;

fn tiny() -> Model {
    parse_model_toml(
        &Source::from_text("tiny.toml", TINY),
        TrainingOverrides::default(),
    )
    .expect("the tiny spec parses")
}

/// The DGX spec with `nodes` nodes of 8 (set on the resolved struct, so that counts the spec
/// parser refuses, such as nodes × 8 past u64, still reach the planner).
fn dgx(nodes: u64, devices: u64) -> Cluster {
    let mut c = parse_cluster_toml(
        &Source::from_text("dgx.toml", DGX),
        ClusterOverrides::default(),
    )
    .expect("the cluster spec parses");
    c.nodes = nodes;
    c.devices = devices;
    c
}

/// Searches, then predicts the chosen layout or the closest miss as `Plan::new` does: the
/// answer must be a result or a clean error, and a predicted layout a finite step time.
fn answer(model: &Model, cluster: &Cluster, pins: &Pins) -> Result<SearchResult, SearchError> {
    let r = search_checked(model, cluster, pins, SearchOptions::default())?;
    for c in r.fits.first().into_iter().chain(r.closest_miss.as_ref()) {
        let (assessed, p) = predict_layout(model, cluster, &c.layout, Default::default());
        assert!(assessed.evaluation.is_some(), "{}", c.layout.label());
        assert!(p.step_time_s > 0.0, "{}: {p:?}", c.layout.label());
    }
    Ok(r)
}

#[test]
fn bounded_tiny_model_on_10_to_the_12_nodes() {
    let nodes = 1_000_000_000_000;
    let r = answer(&tiny(), &dgx(nodes, 8 * nodes), &Pins::default()).expect("searchable");
    // TP divides 4 heads and PP at most 4 layers, so DP is at least 5·10^11: above the batch.
    assert!(r.fits.is_empty() && r.closest_miss.is_none());
    assert!(r
        .rejected
        .contains_key("DP does not divide the global batch"));
}

#[test]
fn bounded_global_batch_of_2_to_the_63() {
    let mut m = tiny();
    m.training.global_batch = BIG;
    let r = answer(&m, &dgx(1, 8), &Pins::default()).expect("searchable");
    // DP 1 (the batch is odd): micro-batches small enough to run leave too many of them to
    // simulate; those few enough are 10^13 sequences each, far beyond 80 GiB.
    assert!(r.fits.is_empty());
    let too_many = &r.rejected[TOO_MANY_MICROBATCHES];
    assert!(
        too_many.example.contains("pin a larger --micro-batch"),
        "{}",
        too_many.example
    );
    assert!(r.closest_miss.is_some());
    // Pinning a small micro-batch is rejected for its micro-batch count, not simulated.
    let l = Layout {
        pp: 2,
        ..Layout::without_pipeline(1, 4, 0, 1)
    };
    let why = try_predict_layout(&m, &dgx(1, 8), &l, Default::default()).unwrap_err();
    assert_eq!(why.rule, TOO_MANY_MICROBATCHES);
    assert!(why.detail.contains("m = 9223372036854775807"), "{why}");
    // Predicting it anyway takes the pipeline's lower bound instead of 2^63 simulated steps.
    let (_, p) = predict_layout(&m, &dgx(1, 8), &l, Default::default());
    assert!(p.step_time_s > 1e12 && p.step_time_s.is_finite());
}

#[test]
fn bounded_micro_batch_pin_of_2_to_the_63() {
    let pins = Pins {
        micro_batch: Some(BIG),
        ..Pins::default()
    };
    let r = answer(&tiny(), &dgx(1, 8), &pins).expect("searchable");
    assert!(r.fits.is_empty() && r.closest_miss.is_none());
    assert!(r
        .rejected
        .contains_key("micro-batch does not divide the per-replica batch"));
}

#[test]
fn bounded_layers_of_2_to_the_63() {
    let mut m = tiny();
    m.architecture.layers = BIG;
    let r = answer(&m, &dgx(1, 8), &Pins::default()).expect("searchable");
    assert!(r.fits.is_empty());
    let miss = r.closest_miss.expect("buildable, too large");
    assert!(miss.peak_bytes > 1 << 60, "{}", miss.peak_bytes);
    assert!(m.architecture.checked_param_count().is_none());
    assert_eq!(m.architecture.param_count(), u64::MAX);
}

#[test]
fn bounded_vocab_and_hidden_of_2_to_the_63_do_not_fit() {
    for hidden in [64, BIG] {
        let mut m = tiny();
        m.architecture.vocab = BIG;
        m.architecture.hidden = hidden;
        assert_eq!(m.architecture.checked_param_count(), None);
        let r = answer(&m, &dgx(1, 8), &Pins::default()).expect("searchable");
        assert!(r.fits.is_empty(), "hidden {hidden}");
        // The overflowed parameter count reads as infinitely many bytes: saturated, not wrapped.
        let miss = r.closest_miss.expect("buildable, too large");
        assert_eq!(miss.peak_bytes, u64::MAX, "hidden {hidden}");
    }
}

#[test]
fn bounded_every_width_of_2_to_the_63() {
    type Set = fn(&mut Model);
    let sets: [Set; 5] = [
        |m| m.architecture.heads = BIG,
        |m| m.architecture.ffn_hidden = BIG,
        |m| m.training.seq_len = BIG,
        |m| m.architecture.max_positions = BIG,
        |m| m.architecture.head_dim = BIG,
    ];
    for (i, set) in sets.into_iter().enumerate() {
        let mut m = tiny();
        set(&mut m);
        let r = answer(&m, &dgx(1, 8), &Pins::default()).expect("searchable");
        assert!(r.fits.is_empty(), "case {i}: {:?}", r.fits.first());
    }
}

#[test]
fn bounded_nodes_of_2_to_the_63() {
    // nodes × 8 overflows u64, which the spec parser refuses; as resolved structs, the first
    // 2^63 − 1 or 2^64 − 1 devices of such a cluster.
    for devices in [BIG, u64::MAX] {
        let r = answer(&tiny(), &dgx(BIG, devices), &Pins::default()).expect("searchable");
        assert!(r.fits.is_empty() && r.closest_miss.is_none(), "{devices}");
    }
}

#[test]
fn bounded_too_many_layouts_is_an_error_naming_the_pins() {
    // 2^63 devices and a 2^62-sequence batch over 2^62 layers: millions of layouts.
    let mut m = tiny();
    m.architecture.layers = 1 << 62;
    m.training.global_batch = 1 << 62;
    let c = dgx(1 << 60, 1 << 63);
    let size = count_layouts(&m, &c, &Pins::default());
    assert!(size.layouts > MAX_LAYOUTS);
    let err = search_checked(&m, &c, &Pins::default(), SearchOptions::default()).unwrap_err();
    let text = err.to_string();
    for flag in ["--tp", "--pp", "--micro-batch"] {
        assert!(text.contains(flag), "{text}");
    }
    assert!(
        text.contains("layouts of 9223372036854775808 devices"),
        "{text}"
    );
    // `search` keeps its signature: no layout, the error as the only rejection.
    let r = search::search(&m, &c, &Pins::default());
    assert!(r.fits.is_empty() && r.evaluated == 0);
    assert_eq!(r.rejected[TOO_MANY_LAYOUTS].example, text);
    // Pinning TP, PP and the micro-batch narrows it to a search that runs.
    let pins = Pins {
        tp: Some(4),
        pp: Some(4),
        micro_batch: Some(8),
        ..Pins::default()
    };
    let r = answer(&m, &c, &pins).expect("narrowed");
    assert!(r.fits.is_empty());
}

#[test]
fn bounded_unbuildable_layouts_are_predicted_without_allocating() {
    let m = tiny();
    let c = dgx(1 << 40, 1 << 43);
    // 2^40 pipeline stages: nothing sized by PP is built.
    let l = Layout {
        pp: 1 << 40,
        ..Layout::without_pipeline(8, 1, 0, 1)
    };
    let (a, p) = predict_layout(&m, &c, &l, Default::default());
    assert!(!a.fits && a.split.is_empty() && p.step_time_s.is_infinite());
    assert!(try_predict_layout(&m, &c, &l, Default::default()).is_err());
    // DP × PP × TP past u64.
    let l = Layout::without_pipeline(u64::MAX, u64::MAX, 0, 1);
    let (a, _) = predict_layout(&m, &c, &l, Default::default());
    assert_eq!(a.peak_bytes, u64::MAX);
    assert!(l.check(&m, &c).is_err());
}

/// Every count alone at 10^12, 2^62, 2^63 − 1 and 2^64 − 1 on the tiny model and a GPT-3-sized
/// one, and every pair of them on the tiny model, pins included: an answer each time.
#[test]
fn bounded_sweep_of_huge_counts() {
    type Set = fn(&mut Model, &mut Cluster, &mut Pins, u64);
    let sets: [(&str, Set); 17] = [
        ("devices", |_, c, _, v| c.devices = v),
        ("nodes", |_, c, _, v| (c.nodes, c.devices) = (v, v)),
        ("gpus_per_node", |_, c, _, v| {
            (c.gpus_per_node, c.devices) = (v, v)
        }),
        ("global_batch", |m, _, _, v| m.training.global_batch = v),
        ("layers", |m, _, _, v| m.architecture.layers = v),
        ("hidden", |m, _, _, v| m.architecture.hidden = v),
        ("heads", |m, _, _, v| m.architecture.heads = v),
        ("kv_heads", |m, _, _, v| m.architecture.kv_heads = v),
        ("ffn_hidden", |m, _, _, v| m.architecture.ffn_hidden = v),
        ("vocab", |m, _, _, v| m.architecture.vocab = v),
        ("seq_len", |m, _, _, v| m.training.seq_len = v),
        ("--micro-batch", |_, _, p, v| p.micro_batch = Some(v)),
        ("--pp", |_, _, p, v| p.pp = Some(v)),
        ("--virtual-stages", |_, _, p, v| p.virtual_stages = Some(v)),
        ("--tp", |_, _, p, v| p.tp = Some(v)),
        ("--dp", |_, _, p, v| p.dp = Some(v)),
        ("hidden, head_dim", |m, _, _, v| {
            m.architecture.hidden = v;
            m.architecture.head_dim = v / m.architecture.heads;
        }),
    ];
    let mut gpt = tiny();
    gpt.architecture.layers = 96;
    gpt.architecture.hidden = 12288;
    gpt.architecture.heads = 96;
    gpt.architecture.kv_heads = 96;
    gpt.architecture.head_dim = 128;
    gpt.architecture.ffn_hidden = 4 * 12288;
    gpt.architecture.vocab = 51200;
    gpt.training.global_batch = 1536;
    let mut answered = 0;
    let mut ask = |base: &Model, first: Set, second: Set, v: u64| {
        let (mut m, mut c, mut p) = (base.clone(), dgx(16, 128), Pins::default());
        first(&mut m, &mut c, &mut p, v);
        second(&mut m, &mut c, &mut p, v);
        let _ = answer(&m, &c, &p);
        answered += 1;
    };
    // Every pair on the tiny model (whose small layers fit in many layouts).
    for (i, (_, first)) in sets.iter().enumerate() {
        for (_, second) in &sets[i..] {
            for v in [1_000_000_000_000, BIG] {
                ask(&tiny(), *first, *second, v);
            }
        }
    }
    // Every count alone at four sizes on both models.
    for base in [tiny(), gpt] {
        for (_, set) in &sets {
            for v in [1_000_000_000_000, 1 << 62, BIG, u64::MAX] {
                ask(&base, *set, |_, _, _, _| {}, v);
            }
        }
    }
    assert_eq!(answered, 153 * 2 + 2 * 17 * 4);
}

/// The u64 below 2^63 with the most divisors (103,680) as the device count, with a prime-rich
/// or a highly composite batch: the count stops within its budget and asks for pins.
#[test]
fn bounded_device_count_with_the_most_divisors() {
    let n = 897_612_484_786_617_600; // 2^8·3^4·5^2·7^2·11·13·17·19·23·29·31·37
    assert_eq!(search::divisors::divisors(n).len(), 103_680);
    for batch in [16, BIG, n] {
        let mut m = tiny();
        m.training.global_batch = batch;
        let err = search_checked(
            &m,
            &dgx(n / 8, n),
            &Pins::default(),
            SearchOptions::default(),
        )
        .expect_err("millions of layouts");
        let text = err.to_string();
        assert!(
            text.contains("layouts of 897612484786617600 devices"),
            "{text}"
        );
        assert!(text.contains("--tp (103680 values)"), "{text}");
        // TP and PP pinned: a search that runs.
        let pins = Pins {
            tp: Some(4),
            pp: Some(4),
            ..Pins::default()
        };
        answer(&m, &dgx(n / 8, n), &pins).expect("narrowed");
    }
}
