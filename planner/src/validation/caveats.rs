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
    /// `zero3_at_scale` or `uncalibrated_cluster`.
    pub id: String,
    pub text: String,
}

/// The caveats of `layout` on `cluster`, in a fixed order.
pub fn caveats(cluster: &Cluster, layout: &Layout) -> Vec<Caveat> {
    let mut out = Vec::new();
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
        assert!(caveats(&a100, &layout(64, 3)).is_empty());
        assert!(caveats(&a100, &layout(256, 2)).is_empty());
        let c = caveats(&a100, &layout(256, 3));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].id, "zero3_at_scale");
        assert!(c[0].text.contains("DP 256"), "{}", c[0].text);
    }

    #[test]
    fn a_cluster_without_calibration_is_flagged() {
        let ids: Vec<String> = caveats(&cluster("cpu-8"), &layout(8, 0))
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(ids, ["uncalibrated_cluster"]);
        assert!(caveats(&cluster("dgx-h100-80g"), &layout(8, 0)).is_empty());
    }
}
