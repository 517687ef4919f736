//! Offload: model states kept in host memory (or on node-local NVMe) instead of the device, as
//! DeepSpeed's ZeRO-Offload and ZeRO-Infinity, FSDP's `CPUOffload` and Megatron-Core's
//! `--optimizer-cpu-offload` do. A layout knob like the ZeRO stage: what it moves is the memory
//! model's question (`memory::offload`), what it costs the cost model's (`cost::offload`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Which model states leave the device.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OffloadStates {
    /// Everything on the device.
    #[default]
    None,
    /// The fp32 master weights, the Adam moments and the fp32 gradient the step reads live on
    /// the host, and the optimizer step runs there; gradients stream down during the backward
    /// and the updated 16-bit weights go back up after the step (ZeRO-Offload, Ren et al. 2021).
    Optimizer,
    /// The sharded 16-bit weights too: each layer's shard is copied up before its forward and
    /// its backward and all-gathered as ZeRO-3 does (ZeRO-Infinity, FSDP `CPUOffload`).
    Params,
}

/// Where offloaded states live.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OffloadTier {
    /// Pinned host memory.
    #[default]
    Cpu,
    /// Node-local NVMe, through pinned host buffers (ZeRO-Infinity's `nvme_path`).
    Nvme,
}

/// The offload knobs of a layout.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
)]
pub struct Offload {
    pub states: OffloadStates,
    /// Ignored (and `cpu`) where `states` is `none`.
    pub to: OffloadTier,
    /// Saved activations go to host memory during the forward and come back for the backward
    /// (torchtune's `enable_activation_offloading`, DeepSpeed's `cpu_checkpointing`).
    pub activations: bool,
}

impl OffloadStates {
    pub const ALL: [OffloadStates; 3] = [
        OffloadStates::None,
        OffloadStates::Optimizer,
        OffloadStates::Params,
    ];
    pub fn name(self) -> &'static str {
        match self {
            OffloadStates::None => "none",
            OffloadStates::Optimizer => "optimizer",
            OffloadStates::Params => "params",
        }
    }
}

impl std::str::FromStr for OffloadStates {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OffloadStates::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| format!("unknown offload \"{s}\"; use none | optimizer | params"))
    }
}

impl OffloadTier {
    pub const ALL: [OffloadTier; 2] = [OffloadTier::Cpu, OffloadTier::Nvme];
    pub fn name(self) -> &'static str {
        match self {
            OffloadTier::Cpu => "cpu",
            OffloadTier::Nvme => "nvme",
        }
    }
}

impl std::str::FromStr for OffloadTier {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OffloadTier::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| format!("unknown offload target \"{s}\"; use cpu | nvme"))
    }
}

impl Offload {
    /// Nothing offloaded.
    pub const NONE: Offload = Offload {
        states: OffloadStates::None,
        to: OffloadTier::Cpu,
        activations: false,
    };

    /// Whether anything leaves the device.
    pub fn any(&self) -> bool {
        self.states != OffloadStates::None || self.activations
    }

    /// Whether the optimizer step runs on the host.
    pub fn optimizer(&self) -> bool {
        self.states != OffloadStates::None
    }

    /// Whether the weights live off the device between uses.
    pub fn params(&self) -> bool {
        self.states == OffloadStates::Params
    }

    /// Whether the offloaded states sit on NVMe.
    pub fn nvme(&self) -> bool {
        self.optimizer() && self.to == OffloadTier::Nvme
    }

    /// The label's part: ` off-opt`, ` off-params-nvme`, ` off-act`.
    pub fn label(&self) -> String {
        let mut s = String::new();
        match self.states {
            OffloadStates::None => {}
            OffloadStates::Optimizer => s += " off-opt",
            OffloadStates::Params => s += " off-params",
        }
        if self.nvme() {
            s += "-nvme";
        }
        if self.activations {
            s += " off-act";
        }
        s
    }
}
