//! The rules every resolved [`Model`] and [`Cluster`] obeys, wherever it was read from.
//!
//! The spec parsers check each key as they read it (with its span); these checks run on the
//! resolved value at the end of every reader: the TOML specs, the Hugging Face configs, and the
//! `job` section of plan.json, whose model and cluster are deserialized directly and would
//! otherwise skip the parsers' rules. Cross-field rules (a learned position table at least
//! `seq_len` long, `devices` within `nodes × gpus_per_node`) live only here.

use super::problem::Problem;
use super::Cluster;
use crate::model::{Model, Position, RopeScaling};

/// The largest count any spec may hold: `i64::MAX`, what TOML can write.
const MAX_COUNT: u64 = i64::MAX as u64;

fn count(field: &str, v: u64) -> Result<(), Problem> {
    if v == 0 || v > MAX_COUNT {
        return Err(Problem::new(
            field,
            format!("must be a positive integer, found {v}"),
            format!("set `{field}` to a value of at least 1"),
        ));
    }
    Ok(())
}

/// A number of bytes expressed in GiB: finite, in range, and representable in 64-bit bytes.
fn gib(field: &str, v: f64, zero_ok: bool) -> Result<(), Problem> {
    let limit = u64::MAX as f64 / crate::spec::GIB;
    let bad = !v.is_finite() || v < 0.0 || (!zero_ok && v == 0.0) || v >= limit;
    if bad {
        let want = if zero_ok { "zero or more" } else { "above 0" };
        return Err(Problem::new(
            field,
            format!("must be a number of GiB {want} and below {limit:.0} (2^64 bytes), found {v}"),
            format!("set `{field}` to the size in GiB"),
        ));
    }
    Ok(())
}

fn positive(field: &str, v: f64) -> Result<(), Problem> {
    if !v.is_finite() || v <= 0.0 {
        return Err(Problem::new(
            field,
            format!("must be a positive number, found {v}"),
            format!("set `{field}` to a positive number"),
        ));
    }
    Ok(())
}

fn non_negative(field: &str, v: f64) -> Result<(), Problem> {
    if !v.is_finite() || v < 0.0 {
        return Err(Problem::new(
            field,
            format!("must be a zero or more number, found {v}"),
            format!("set `{field}` to zero or a positive number"),
        ));
    }
    Ok(())
}

fn fraction(field: &str, v: f64) -> Result<(), Problem> {
    if !(v > 0.0 && v <= 1.0) {
        return Err(Problem::new(
            field,
            format!("must be a fraction in (0, 1], found {v}"),
            format!("set `{field}` to a fraction of the peak, such as 0.8"),
        ));
    }
    Ok(())
}

/// The characters a name may hold: it becomes a job name, a file name and a comment in every
/// export, so no character of a shell, YAML or TOML is allowed (the exports quote anyway).
pub const NAME_CHARS: &str = "letters, digits, spaces and . , _ + - ( )";

/// The longest name.
pub const NAME_MAX: usize = 128;

fn name(field: &str, v: &str) -> Result<(), Problem> {
    if v.trim().is_empty() {
        return Err(Problem::new(
            field,
            "must not be empty",
            format!("set `{field}` to a name"),
        ));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || " .,_+-()".contains(c);
    if let Some(bad) = v.chars().find(|&c| !allowed(c)) {
        return Err(Problem::new(
            field,
            format!(
                "{:?} holds {:?}, which a name may not: names become job names and comments in exported scripts",
                v, bad
            ),
            format!("use only {NAME_CHARS} in `{field}`"),
        ));
    }
    if v.len() > NAME_MAX || v.trim() != v {
        return Err(Problem::new(
            field,
            format!(
                "{:?} is {} characters long or starts or ends with a space",
                v,
                v.len()
            ),
            format!(
                "use at most {NAME_MAX} characters in `{field}`, with no leading or trailing space"
            ),
        ));
    }
    Ok(())
}

impl Cluster {
    /// Checks every field of a resolved cluster.
    pub fn check(&self) -> Result<(), Problem> {
        name("name", &self.name)?;
        name("device.name", &self.device.name)?;
        count("nodes", self.nodes)?;
        count("gpus_per_node", self.gpus_per_node)?;
        count("devices", self.devices)?;
        let Some(total) = self.nodes.checked_mul(self.gpus_per_node) else {
            return Err(Problem::new(
                "nodes",
                format!(
                    "nodes {} × gpus_per_node {} devices is more than a 64-bit count holds",
                    self.nodes, self.gpus_per_node
                ),
                "use fewer nodes (--nodes N or --devices N)",
            ));
        };
        if self.devices > total || self.devices <= (self.nodes - 1) * self.gpus_per_node {
            return Err(Problem::new(
                "devices",
                format!(
                    "{} devices do not fill {} nodes of {} (between {} and {} would)",
                    self.devices,
                    self.nodes,
                    self.gpus_per_node,
                    (self.nodes - 1) * self.gpus_per_node + 1,
                    total
                ),
                "make `devices` agree with `nodes` × `gpus_per_node`",
            ));
        }
        let d = &self.device;
        name("device.name", &d.name)?;
        gib("device.memory_gib", d.memory_gib, false)?;
        positive("device.peak_tflops", d.peak_tflops)?;
        positive("device.memory_bandwidth_gbps", d.memory_bandwidth_gbps)?;
        non_negative("device.kernel_launch_us", d.kernel_launch_us)?;
        if let Some(g) = d.transcendental_gops {
            positive("device.transcendental_gops", g)?;
        }
        if d.kernel_launch_us > 1e6 || d.sms > 1 << 20 {
            return Err(Problem::new(
                if d.sms > 1 << 20 {
                    "device.sms"
                } else {
                    "device.kernel_launch_us"
                },
                format!(
                    "sms {} / kernel_launch_us {} is out of range",
                    d.sms, d.kernel_launch_us
                ),
                "give the device's SM count (108 for an A100) and a launch cost of a few µs",
            ));
        }
        for (t, l) in [
            ("intra_node", &self.intra_node),
            ("inter_node", &self.inter_node),
        ] {
            positive(&format!("{t}.bandwidth_gbps"), l.bandwidth_gbps)?;
            non_negative(&format!("{t}.latency_us"), l.latency_us)?;
        }
        gib("overhead.context_gib", self.overhead.context_gib, true)?;
        non_negative("overhead.fragmentation", self.overhead.fragmentation)?;
        for (field, mib) in [
            ("overhead.cuda_context_mib", self.overhead.cuda_context_mib),
            (
                "overhead.cublas_workspace_mib",
                self.overhead.cublas_workspace_mib,
            ),
            (
                "overhead.nccl_mib_per_communicator",
                self.overhead.nccl_mib_per_communicator,
            ),
        ] {
            gib(field, mib / 1024.0, true)?;
        }
        let c = &self.calibration;
        fraction("calibration.memory_efficiency", c.memory_efficiency)?;
        if let Some(e) = c.gemm_efficiency {
            fraction("calibration.gemm_efficiency", e)?;
        }
        fraction(
            "calibration.flash_attention_efficiency",
            c.flash_attention_efficiency,
        )?;
        if let Some(e) = c.cudnn_attention_efficiency {
            fraction("calibration.cudnn_attention_efficiency", e)?;
        }
        fraction("calibration.intra_node_efficiency", c.intra_node_efficiency)?;
        fraction("calibration.inter_node_efficiency", c.inter_node_efficiency)?;
        if c.host_op_us.is_some_and(|x| !(x.is_finite() && x <= 1e6))
            || c.nccl_ctas.is_some_and(|x| !(x.is_finite() && x <= 1e6))
        {
            return Err(Problem::new(
                "calibration.host_op_us",
                "host_op_us and nccl_ctas must be finite and at most 1e6",
                "give the host's microseconds per eager op (scripts/host_op_cost.py measures it) and NCCL's CTAs per collective (a few to 32)",
            ));
        }
        for (field, v) in [
            ("calibration.host_dispatch_us", c.host_dispatch_us),
            ("calibration.host_launch_us", c.host_launch_us),
        ] {
            if v.is_some_and(|x| !(x.is_finite() && x <= 1e6)) {
                return Err(Problem::new(
                    field,
                    "must be finite and at most 1e6 microseconds",
                    "give the host's microseconds per dispatcher call and per kernel launch (scripts/host_op_cost.py --device cuda measures both on a GPU host)",
                ));
            }
        }
        let points = &c.matmul_efficiency;
        let increasing = points.windows(2).all(|w| w[0][0] < w[1][0]);
        let valid = points
            .iter()
            .all(|[d, e]| d.is_finite() && *d >= 1.0 && *e > 0.0 && *e <= 1.0);
        if points.is_empty() || !increasing || !valid {
            return Err(Problem::new(
                "calibration.matmul_efficiency",
                "must be a non-empty list of [dimension, fraction] pairs with dimensions of at least 1 in increasing order and fractions in (0, 1]",
                "write it as `matmul_efficiency = [[256, 0.5], [1024, 0.6], [4096, 0.7]]`",
            ));
        }
        Ok(())
    }
}

/// A `rope_scaling` as transformers' `_validate_llama3_parameters` wants it: `factor` at least 1,
/// `high_freq_factor` above `low_freq_factor` (the interpolation divides by their difference).
pub(crate) fn rope_scaling(r: &RopeScaling) -> Result<(), Problem> {
    const F: &str = "architecture.rope_scaling";
    if r.rope_type != crate::model::RopeType::Llama3 {
        return Err(Problem::new(
            &format!("{F}.rope_type"),
            "unknown RoPE scaling type: only \"llama3\" is computed",
            "set rope_type = \"llama3\", or remove rope_scaling",
        ));
    }
    for (key, v) in [
        ("factor", r.factor),
        ("low_freq_factor", r.low_freq_factor),
        ("high_freq_factor", r.high_freq_factor),
    ] {
        positive(&format!("{F}.{key}"), v)?;
    }
    count(
        &format!("{F}.original_max_positions"),
        r.original_max_positions,
    )?;
    if r.factor < 1.0 {
        return Err(Problem::new(
            &format!("{F}.factor"),
            format!(
                "must be at least 1 (it divides the low frequencies), found {}",
                r.factor
            ),
            "set factor to 1 or more (Llama 3.1 uses 8)",
        ));
    }
    if r.high_freq_factor <= r.low_freq_factor {
        return Err(Problem::new(
            &format!("{F}.high_freq_factor"),
            format!(
                "high_freq_factor ({}) must be above low_freq_factor ({})",
                r.high_freq_factor, r.low_freq_factor
            ),
            "set high_freq_factor above low_freq_factor (Llama 3.1 uses 4 and 1)",
        ));
    }
    Ok(())
}

impl Model {
    /// Checks every field of a resolved model, including what the runtime needs of it.
    pub fn check(&self) -> Result<(), Problem> {
        name("name", &self.name)?;
        let a = &self.architecture;
        for (field, v) in [
            ("architecture.layers", a.layers),
            ("architecture.hidden", a.hidden),
            ("architecture.heads", a.heads),
            ("architecture.kv_heads", a.kv_heads),
            ("architecture.head_dim", a.head_dim),
            ("architecture.ffn_hidden", a.ffn_hidden),
            ("architecture.vocab", a.vocab),
            (
                "architecture.make_vocab_size_divisible_by",
                a.vocab_divisible_by,
            ),
        ] {
            count(field, v)?;
        }
        // Mixture of experts and MLA first: MLA's rules name its own keys (spec/moe.rs).
        super::moe_check::check_architecture(a)?;
        if !a.heads.is_multiple_of(a.kv_heads) {
            return Err(Problem::new(
                "architecture.kv_heads",
                format!(
                    "heads ({}) is not divisible by kv_heads ({}); each KV head must serve a whole group of query heads",
                    a.heads, a.kv_heads
                ),
                "set kv_heads to a divisor of heads",
            ));
        }
        if a.position == Position::Rope && !a.head_dim.is_multiple_of(2) {
            return Err(Problem::new(
                "architecture.head_dim",
                format!(
                    "RoPE rotates pairs of channels, and the head size {} is odd",
                    a.head_dim
                ),
                "use an even head size (hidden / heads, or head_dim), or position = \"learned\"",
            ));
        }
        positive("architecture.rope_theta", a.rope_theta)?;
        positive("architecture.norm_eps", a.norm_eps)?;
        if let Some(r) = &a.rope_scaling {
            if a.position != Position::Rope {
                return Err(Problem::new(
                    "architecture.rope_scaling",
                    "rope_scaling scales rotary embeddings, but position is \"learned\"",
                    "remove rope_scaling, or set position = \"rope\"",
                ));
            }
            rope_scaling(r)?;
        }
        if let Some(w) = a.sliding_window {
            count("architecture.sliding_window", w)?;
        }
        let t = &self.training;
        count("training.seq_len", t.seq_len)?;
        count("training.global_batch", t.global_batch)?;
        if t.global_batch
            .checked_mul(t.seq_len)
            .is_none_or(|n| n > MAX_COUNT)
        {
            let field = if t.seq_len > t.global_batch {
                "training.seq_len"
            } else {
                "training.global_batch"
            };
            return Err(Problem::new(
                field,
                format!(
                    "global_batch {} × seq_len {} tokens per step is more than a 64-bit count holds",
                    t.global_batch, t.seq_len
                ),
                "use a smaller global batch or sequence length",
            ));
        }
        if a.position == Position::Learned && a.max_positions < t.seq_len {
            return Err(Problem::new(
                "architecture.max_positions",
                format!(
                    "the learned position table has {} rows, fewer than seq_len {}: positions {}..{} would have no embedding",
                    a.max_positions, t.seq_len, a.max_positions, t.seq_len
                ),
                format!(
                    "set max_positions to at least {} (or remove it: it defaults to seq_len), or train with a seq_len of at most {}",
                    t.seq_len, a.max_positions
                ),
            ));
        }
        if let Some(w) = a.sliding_window.filter(|w| *w < t.seq_len) {
            return Err(Problem::new(
                "architecture.sliding_window",
                format!(
                    "sliding-window attention over {w} positions is narrower than seq_len {}: Tessera's runtime has full causal attention only, which is the same computation only when the window covers the whole sequence",
                    t.seq_len
                ),
                format!(
                    "train with a sequence length of at most {w} (--seq-len {w}), where the window changes nothing; sliding-window attention itself is not implemented"
                ),
            ));
        }
        if crate::precision::Policy::by_name(&t.precision).is_none() {
            return Err(Problem::new(
                "training.precision",
                format!("unknown precision policy \"{}\"", t.precision),
                format!(
                    "use one of: {}",
                    crate::precision::Policy::names().join(" | ")
                ),
            ));
        }
        if !(0.0..1.0).contains(&t.dropout) {
            return Err(Problem::new(
                "training.dropout",
                format!(
                    "a dropout probability must be at least 0 and below 1, found {}",
                    t.dropout
                ),
                "set dropout between 0.0 and 0.9",
            ));
        }
        crate::optimizer::check(&self.optimizer, &self.schedule)?;
        crate::finetune::check(a, t.method, self.lora.as_ref())?;
        Ok(())
    }
}
