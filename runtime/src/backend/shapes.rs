//! The plain values the kernels take, shared by the kernel interface (`ops`) and the backends
//! that implement it (`cpu`, `cuda`): kept apart so a backend reads them without importing the
//! interface, whose CPU side calls back into the CPU backend.

/// `C (m×n) = op(A) (m×k) · op(B) (k×n)`, all row-major and dense. `A` is stored `m×k`, or
/// `k×m` when `trans_a`; `B` is stored `k×n`, or `n×k` when `trans_b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowMajorGemm {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
}

/// What a buffer is stored as on a backend; selects the tolerance of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Activations and weights (bf16 on a GPU, f32 on the CPU).
    Bf16,
    /// Statistics, gradient accumulators, master weights, optimizer state.
    F32,
}

/// One AdamW update of a run of tensors with the same weight decay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// The step number after this update (1 for the first), for the bias corrections.
    pub t: u64,
    /// Gradient multiplier (the clip factor).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// `(1 − β1ᵗ, 1 − β2ᵗ)`, computed exactly as `optim::AdamW::step` does.
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = self.t as i32;
        (
            (1.0 - f64::from(self.beta1).powi(t)) as f32,
            (1.0 - f64::from(self.beta2).powi(t)) as f32,
        )
    }
}

/// Where RoPE applies: rows of `width` values, the first `heads` heads of size `hd` rotated,
/// row `n` at position `n % t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    pub t: usize,
    pub width: usize,
    pub heads: usize,
    pub hd: usize,
}
