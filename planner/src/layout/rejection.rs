//! Why a layout cannot be built: the rule it breaks, the details and the fix, and the order
//! in which `Layout::check` tests its rules.

/// The rules of [`Layout::check`](super::Layout::check) in the order it tests them: a layout rejected by a later
/// rule passed the earlier ones, so its reason is the more specific (an error shows it first).
pub const CHECK_ORDER: [&str; 20] = [
    "degrees do not multiply to the device count",
    "CP does not divide the sequence",
    "EP needs a mixture-of-experts model",
    "EP does not divide the experts",
    "TP does not divide the expert FFN width",
    "EP with TP needs sequence parallelism",
    "EP does not divide DP × CP",
    "TP does not divide the heads",
    "TP does not divide the FFN width",
    "sequence parallelism needs TP > 1 dividing seq_len",
    "more pipeline chunks than layers",
    "DP does not divide the global batch",
    "micro-batch does not divide the per-replica batch",
    "recompute every N-th layer needs full recompute",
    "recompute every N-th layer needs N ≥ 1",
    "no such ZeRO stage",
    "interleaving needs PP ≥ 2 and v ≥ 2",
    "interleaving needs micro-batches divisible by PP",
    "virtual stages need the interleaved schedule",
    "the step has no micro-batch",
];

/// Greatest common divisor.
pub(crate) fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `" (1, 2, 4, 8)"`: the divisors of `n` for a fix's text, when `n` has few and is small
/// enough to list them quickly (empty otherwise).
pub(super) fn divisor_list(n: u64) -> String {
    if n == 0 || n > 1 << 40 {
        return String::new();
    }
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1u64;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    if small.len() > 16 {
        return String::new();
    }
    let list: Vec<String> = small.iter().map(u64::to_string).collect();
    format!(" ({})", list.join(", "))
}

/// Why a layout cannot be built: the rule it breaks, and the details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// A short, stable name of the rule (used to group rejections).
    pub rule: &'static str,
    pub detail: String,
    /// What to change, where the rule knows which pin and which values would pass.
    pub fix: Option<String>,
}

impl Rejection {
    pub fn new(rule: &'static str, detail: String) -> Self {
        Rejection {
            rule,
            detail,
            fix: None,
        }
    }

    /// The same rejection with the change that would pass it.
    pub fn with_fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}
