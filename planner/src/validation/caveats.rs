//! Where a prediction leaves the ground the validation covers (docs/validation.md). Each caveat
//! is attached to the plan (`predicted.caveats`) and printed with it, so a reader weighs the
//! number accordingly. The limits here are facts about the published runs the cost model was
//! checked against, not tuning knobs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::spec::Cluster;

/// The largest ZeRO-3 (FSDP) data-parallel degree among the scored runs: MosaicML's
/// mpt-70b on 64 A100s, predicted within 5% (docs/validation.md).
pub const ZERO3_VALIDATED_DP: u64 = 64;

/// One known limit of a prediction. `id` is stable for tools; `text` is for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Caveat {
    /// `zero3_at_scale`, `uncalibrated_cluster` or `tight_memory`.
    pub id: String,
    pub text: String,
}

/// Below this share of the device free at the peak, the caching allocator's slack, which the
/// memory model does not charge a framework that reports its allocated bytes, decides whether
/// the layout runs (the presets charged an assumed 5% before issue 39). A warning, not a
/// margin: the layout stays feasible and keeps its rank.
pub const TIGHT_MEMORY: f64 = 0.05;

/// The caveats of `layout` on `cluster`, in a fixed order; `peak` and `capacity` are the
/// predicted peak and the device's memory in bytes.
pub fn caveats(cluster: &Cluster, layout: &Layout, peak: u64, capacity: u64) -> Vec<Caveat> {
    let mut out = Vec::new();
    let free = capacity.saturating_sub(peak) as f64;
    if cluster.device.kind == crate::spec::DeviceKind::Gpu
        && peak <= capacity
        && free < TIGHT_MEMORY * capacity as f64
    {
        out.push(Caveat {
            id: "tight_memory".into(),
            text: format!(
                "the peak leaves {:.1} GiB of {:.0} GiB free ({:.1}%): the caching allocator's \
                 slack, which the memory model does not charge (tessera explain, uncertain:), \
                 could exceed it; the presets assumed 5% before. Compare with the next layout of \
                 the ranking, or pin a smaller --micro-batch or more recompute",
                free / crate::spec::GIB,
                capacity as f64 / crate::spec::GIB,
                100.0 * free / capacity as f64
            ),
        });
    }
    if layout.sharding.zero_stage == 3 && layout.dp > ZERO3_VALIDATED_DP {
        out.push(Caveat {
            id: "zero3_at_scale".into(),
            text: format!(
                "ZeRO-3 over DP {}: the cost model overlaps ZeRO-3's parameter gathers with compute \
                 as FSDP does, which matches MosaicML's FSDP runs up to DP {ZERO3_VALIDATED_DP}; \
                 Megatron-LM SC'21 Table 2's ZeRO-3 runs at DP 384-2240 measured 1.4-4.4x slower \
                 than it predicts (docs/validation.md, not scored). Treat this step time as \
                 optimistic, or compare with a pinned --zero 2 layout",
                layout.dp
            ),
        });
    }
    if !cluster.calibrated {
        out.push(Caveat {
            id: "uncalibrated_cluster".into(),
            text: format!(
                "cluster `{}` has no [calibration] table: the cost model uses default \
                 efficiencies (the A100 preset's), not ones fitted to this hardware \
                 (docs/calibration.md shows how the presets' were fitted), so read step times as \
                 rough",
                cluster.name
            ),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{load_cluster, ClusterOverrides};
    use std::path::Path;

    fn cluster(name: &str) -> Cluster {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        load_cluster(
            &root.join(format!("specs/clusters/{name}.toml")),
            ClusterOverrides::default(),
        )
        .expect("preset loads")
    }

    fn layout(dp: u64, zero_stage: u8) -> Layout {
        Layout::without_pipeline(dp, 1, zero_stage, 1)
    }

    #[test]
    fn zero3_beyond_the_validated_dp_is_flagged() {
        let a100 = cluster("dgx-a100-80g");
        assert!(caveats(&a100, &layout(64, 3), 0, 1).is_empty());
        assert!(caveats(&a100, &layout(256, 2), 0, 1).is_empty());
        let c = caveats(&a100, &layout(256, 3), 0, 1);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].id, "zero3_at_scale");
        assert!(c[0].text.contains("DP 256"), "{}", c[0].text);
    }

    #[test]
    fn a_cluster_without_calibration_is_flagged() {
        let ids: Vec<String> = caveats(&cluster("cpu-8"), &layout(8, 0), 0, 1)
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(ids, ["uncalibrated_cluster"]);
        assert!(caveats(&cluster("dgx-h100-80g"), &layout(8, 0), 0, 1).is_empty());
    }

    /// 76 of 80 GiB used leaves exactly 5% free: no caveat; a byte more and it warns. Over the
    /// capacity it is infeasible, which the plan says itself.
    #[test]
    fn a_peak_within_five_percent_of_the_device_is_flagged() {
        let h100 = cluster("dgx-h100-80g");
        let gib = crate::spec::GIB as u64;
        let cap = 80 * gib;
        assert!(caveats(&h100, &layout(8, 0), 76 * gib, cap).is_empty());
        let c = caveats(&h100, &layout(8, 0), 76 * gib + 1, cap);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].id, "tight_memory");
        assert!(
            c[0].text.contains("4.0 GiB of 80 GiB free"),
            "{}",
            c[0].text
        );
        assert!(caveats(&h100, &layout(8, 0), 81 * gib, cap).is_empty());
        assert!(caveats(&cluster("cpu-8"), &layout(8, 0), 76 * gib + 1, cap)
            .iter()
            .all(|c| c.id != "tight_memory"));
    }
}
