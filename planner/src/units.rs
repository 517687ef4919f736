//! Byte counts for people: in the largest binary unit that keeps the number at least 1, so a
//! small model's memory never reads "0.0 GiB".

/// Bytes in a GiB: the unit of every spec's memory sizes.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The binary units, largest first.
const UNITS: [(&str, f64); 7] = [
    ("EiB", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("PiB", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("GiB", 1024.0 * 1024.0 * 1024.0),
    ("MiB", 1024.0 * 1024.0),
    ("KiB", 1024.0),
    ("B", 1.0),
];

/// The unit (name, bytes) in which `bytes` reads as at least 1 (GiB at most for tables, whose
/// readers compare against device sizes in GiB).
pub fn unit_for(bytes: f64) -> (&'static str, f64) {
    UNITS[3..]
        .iter()
        .copied()
        .find(|(_, size)| bytes >= *size)
        .unwrap_or(("B", 1.0))
}

/// `bytes` with its unit: `1.50 MiB`, `80.00 GiB`, `512 B`, `1.20 TiB`.
pub fn bytes(bytes: f64) -> String {
    if !bytes.is_finite() {
        return format!("{bytes} B");
    }
    // Sizes saturate at the 64-bit limit rather than wrap: say so instead of a number.
    if bytes >= u64::MAX as f64 {
        return "16 EiB or more (past the 64-bit byte count)".to_string();
    }
    let (name, size) = UNITS
        .iter()
        .copied()
        .find(|(_, size)| bytes.abs() >= *size)
        .unwrap_or(("B", 1.0));
    if size == 1.0 {
        format!("{bytes:.0} B")
    } else {
        format!("{:.2} {name}", bytes / size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_unit_that_keeps_the_number_above_one() {
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(1536.0), "1.50 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0), "3.00 MiB");
        assert_eq!(bytes(80.0 * 1024.0 * 1024.0 * 1024.0), "80.00 GiB");
        assert_eq!(bytes(2.5 * 1024f64.powi(4)), "2.50 TiB");
        assert_eq!(bytes(3.0 * 1024f64.powi(5)), "3.00 PiB");
        assert!(bytes(u64::MAX as f64).contains("64-bit"));
        assert_eq!(unit_for(300_000.0).0, "KiB");
        assert_eq!(unit_for(5e12).0, "GiB");
        assert_eq!(unit_for(10.0).0, "B");
    }
}
