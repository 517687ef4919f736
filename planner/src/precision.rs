//! Precision and optimizer policies: the bytes each parameter costs, named term by term.
//!
//! A policy is data: a list of per-parameter states, each with its size and the sharding class
//! that ZeRO acts on. The memory model multiplies these by parameter counts; nothing here knows
//! about layouts.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::model::Model;

mod device;

pub use device::for_device;

/// Which ZeRO stage first shards a state over the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StateClass {
    /// Weights used by forward and backward: sharded by ZeRO-3.
    Param,
    /// Gradients: sharded by ZeRO-2 and up.
    Grad,
    /// Optimizer states and master weights: sharded by ZeRO-1 and up.
    Optim,
}

impl StateClass {
    /// The lowest ZeRO stage that shards this class.
    pub fn sharded_from_stage(self) -> u8 {
        match self {
            StateClass::Optim => 1,
            StateClass::Grad => 2,
            StateClass::Param => 3,
        }
    }
}

/// One per-parameter state of a policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, JsonSchema)]
pub struct State {
    pub name: &'static str,
    pub bytes: u32,
    pub class: StateClass,
    /// Why the state exists, for `tessera explain`.
    pub why: &'static str,
}

/// A named precision/optimizer policy.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct Policy {
    pub name: &'static str,
    pub summary: &'static str,
    pub states: &'static [State],
    /// Bytes per element of the activations a layer keeps for its backward (2: 16-bit
    /// training; 4: the CPU backend's f32).
    pub activation_bytes: u32,
}

const BF16_WEIGHT: State = State {
    name: "weights_bf16",
    bytes: 2,
    class: StateClass::Param,
    why: "16-bit copy of the weights that forward and backward read",
};
const BF16_GRAD: State = State {
    name: "grads_bf16",
    bytes: 2,
    class: StateClass::Grad,
    why: "16-bit gradient the backward writes before it is accumulated",
};
const FP32_GRAD: State = State {
    name: "grads_fp32",
    bytes: 4,
    class: StateClass::Grad,
    why: "fp32 gradient accumulator across micro-batches (and the buffer reduced over DP)",
};
const MASTER: State = State {
    name: "master_fp32",
    bytes: 4,
    class: StateClass::Optim,
    why: "fp32 master weights that the optimizer updates",
};
const ADAM_M: State = State {
    name: "adam_m_fp32",
    bytes: 4,
    class: StateClass::Optim,
    why: "Adam first moment (fp32)",
};
const ADAM_V: State = State {
    name: "adam_v_fp32",
    bytes: 4,
    class: StateClass::Optim,
    why: "Adam second moment (fp32)",
};

const F32_WEIGHT: State = State {
    name: "weights_fp32",
    bytes: 4,
    class: StateClass::Param,
    why: "fp32 weights that forward and backward read and the optimizer updates (no separate master copy)",
};
const F32_GRAD: State = State {
    name: "grads_fp32",
    bytes: 4,
    class: StateClass::Grad,
    why: "fp32 gradient, accumulated across micro-batches (and the buffer reduced over DP)",
};

const ADAM_M_BF16: State = State {
    name: "adam_m_bf16",
    bytes: 2,
    class: StateClass::Optim,
    why: "Adam first moment, in the weights' bf16 (torch.optim.AdamW keeps its states in the parameter's dtype)",
};
const ADAM_V_BF16: State = State {
    name: "adam_v_bf16",
    bytes: 2,
    class: StateClass::Optim,
    why: "Adam second moment, in the weights' bf16",
};

const POLICIES: &[Policy] = &[
    Policy {
        name: "default",
        summary: "mixed-precision Adam, 20 B/param: bf16 weight 2 + bf16 grad 2 + fp32 grad accumulator 4 + fp32 master 4 + Adam m, v 8 (the count of DeepSpeed's ZeRO estimators; the seeds' \"2+4+4+8\" omits the bf16 gradient)",
        states: &[BF16_WEIGHT, BF16_GRAD, FP32_GRAD, MASTER, ADAM_M, ADAM_V],
        activation_bytes: 2,
    },
    Policy {
        name: "megatron",
        summary: "Megatron-LM, 18 B/param: bf16 weight 2 + fp32 main grad 4 + fp32 master 4 + Adam m, v 8 (no separate bf16 grad); with its distributed optimizer (ZeRO-1) 6 + 12/DP",
        states: &[BF16_WEIGHT, FP32_GRAD, MASTER, ADAM_M, ADAM_V],
        activation_bytes: 2,
    },
    Policy {
        name: "mixed16",
        summary: "16 B/param: 16-bit weight 2 + 16-bit grad 2 + fp32 master, m, v 12 (the ZeRO paper's K = 12 accounting, and llm.c's)",
        states: &[BF16_WEIGHT, BF16_GRAD, MASTER, ADAM_M, ADAM_V],
        activation_bytes: 2,
    },
    Policy {
        name: "fp32",
        summary: "full fp32 Adam, 16 B/param: fp32 weight 4 + fp32 grad 4 + Adam m, v 8, and fp32 activations (the CPU backend's policy: tessera's CPU runtime computes and stores everything in f32)",
        states: &[F32_WEIGHT, F32_GRAD, ADAM_M, ADAM_V],
        activation_bytes: 4,
    },
    Policy {
        name: "bf16",
        summary: "pure bf16 AdamW, 8 B/param: bf16 weight 2 + bf16 grad 2 + Adam m, v in bf16 4, no fp32 master copy (torchtune's recipes' dtype = bf16, litgpt's bf16-true)",
        states: &[BF16_WEIGHT, BF16_GRAD, ADAM_M_BF16, ADAM_V_BF16],
        activation_bytes: 2,
    },
];

/// One per-parameter state as the memory model counts it, in bytes that need not be whole
/// (an 8-bit moment carries its block scales).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Term {
    pub name: &'static str,
    pub bytes: f64,
    pub class: StateClass,
    pub why: &'static str,
}

/// Bytes per parameter of the gradient that DP reduces and of the weights ZeRO gathers.
pub(crate) fn dtype_bytes(model: &Model) -> (f64, f64, f64) {
    let policy = Policy::by_name(&model.training.precision)
        .expect("the precision policy is validated when the spec is resolved");
    let grad = policy
        .states
        .iter()
        .filter(|s| s.class == StateClass::Grad)
        .map(|s| s.bytes)
        .max()
        .unwrap_or(2) as f64;
    let weight = policy.class_bytes(StateClass::Param) as f64;
    // Adam reads and writes master, m and v, reads the gradient, writes the 16-bit weight.
    let update = 2.0 * policy.class_bytes(StateClass::Optim) as f64 + grad + weight;
    (grad, weight, update)
}

impl Policy {
    pub fn by_name(name: &str) -> Option<&'static Policy> {
        POLICIES.iter().find(|p| p.name == name)
    }
    pub fn names() -> Vec<&'static str> {
        POLICIES.iter().map(|p| p.name).collect()
    }
    pub fn all() -> &'static [Policy] {
        POLICIES
    }
    /// The states a trainable parameter carries with the optimizer's moments as `states` keeps
    /// them: the policy's own, or bitsandbytes' AdamW8bit (1 B per moment plus one fp32 absmax
    /// per block of 256: `bitsandbytes/optim/optimizer.py`, `Optimizer8bit`), the master copy
    /// and gradients unchanged.
    pub fn terms(&self, states: crate::finetune::OptimizerStates) -> Vec<Term> {
        let eight = states == crate::finetune::OptimizerStates::Bit8;
        self.states
            .iter()
            .map(|s| {
                let moment = s.name.starts_with("adam_m") || s.name.starts_with("adam_v");
                if eight && moment {
                    let m = s.name.starts_with("adam_m");
                    Term {
                        name: if m { "adam_m_8bit" } else { "adam_v_8bit" },
                        bytes: 1.0 + 4.0 / crate::finetune::BNB_8BIT_BLOCK,
                        class: s.class,
                        why: if m {
                            "Adam first moment, 8-bit with an fp32 absmax per 256 (bitsandbytes AdamW8bit)"
                        } else {
                            "Adam second moment, 8-bit with an fp32 absmax per 256 (bitsandbytes AdamW8bit)"
                        },
                    }
                } else {
                    Term {
                        name: s.name,
                        bytes: f64::from(s.bytes),
                        class: s.class,
                        why: s.why,
                    }
                }
            })
            .collect()
    }

    /// Bytes per parameter with nothing sharded.
    pub fn bytes_per_param(&self) -> u32 {
        self.states.iter().map(|s| s.bytes).sum()
    }
    /// Bytes per parameter of one class.
    pub fn class_bytes(&self, class: StateClass) -> u32 {
        self.states
            .iter()
            .filter(|s| s.class == class)
            .map(|s| s.bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_bytes_per_param() {
        assert_eq!(Policy::by_name("default").unwrap().bytes_per_param(), 20);
        assert_eq!(Policy::by_name("megatron").unwrap().bytes_per_param(), 18);
        assert_eq!(Policy::by_name("mixed16").unwrap().bytes_per_param(), 16);
        // f32 weight 4 + f32 grad 4 + Adam m 4 + v 4, counted by hand.
        assert_eq!(Policy::by_name("fp32").unwrap().bytes_per_param(), 16);
        // torchtune's bf16 AdamW: weight 2 + grad 2 + m 2 + v 2.
        assert_eq!(Policy::by_name("bf16").unwrap().bytes_per_param(), 8);
    }

    #[test]
    fn adamw_8bit_moments() {
        // bitsandbytes AdamW8bit on the default policy: 2 + 2 + 4 + 4 (master) + 2 × (1 + 4/256).
        let p = Policy::by_name("default").unwrap();
        let t = p.terms(crate::finetune::OptimizerStates::Bit8);
        let total: f64 = t.iter().map(|t| t.bytes).sum();
        assert!(
            (total - (12.0 + 2.0 * (1.0 + 4.0 / 256.0))).abs() < 1e-12,
            "{total}"
        );
    }

    #[test]
    fn megatron_distributed_optimizer_is_6_plus_12_over_dp() {
        // Megatron theoretical_memory_usage.py: 6 + 12/DP bytes per parameter.
        let p = Policy::by_name("megatron").unwrap();
        let unsharded = p.class_bytes(StateClass::Param) + p.class_bytes(StateClass::Grad);
        assert_eq!(unsharded, 6);
        assert_eq!(p.class_bytes(StateClass::Optim), 12);
    }
}
