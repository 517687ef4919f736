//! Divisors of counts up to 2^64, from their prime factorisation, never by scanning `1..=n`.
//!
//! The factorisation is num-prime's `factorize64` (trial division by a table of small primes,
//! then Pollard's rho and SQUFOF on what is left): sub-linear in n, where scanning `1..=n`
//! is linear and never ends for n near 2^63 (docs/reliability.md times `plan` on such counts). A number's divisors
//! are then all products of its prime powers, and their count is `Π (e_i + 1)`.

use num_prime::nt_funcs::factorize64;

/// A number's prime factorisation: `(prime, exponent)`, smallest prime first.
pub type Factors = Vec<(u64, u32)>;

/// The prime factorisation of `n` (empty for 0 and 1).
pub fn factorize(n: u64) -> Factors {
    if n < 2 {
        return Vec::new();
    }
    factorize64(n)
        .into_iter()
        .map(|(p, e)| (p, e as u32))
        .collect()
}

/// The factorisation of `d` when `d` divides the number factorised as `of` (found by dividing
/// `d` by its primes, no factorising); `None` otherwise.
pub fn factorize_divisor(of: &[(u64, u32)], d: u64) -> Option<Factors> {
    if d == 0 {
        return None;
    }
    let mut rest = d;
    let mut out = Vec::new();
    for &(p, max) in of {
        let mut e = 0;
        while e < max && rest.is_multiple_of(p) {
            rest /= p;
            e += 1;
        }
        if e > 0 {
            out.push((p, e));
        }
    }
    (rest == 1).then_some(out)
}

/// How many divisors the number factorised as `f` has, saturating (never above 103,680 for a
/// u64).
pub fn count(f: &[(u64, u32)]) -> u64 {
    f.iter()
        .fold(1u64, |n, &(_, e)| n.saturating_mul(u64::from(e) + 1))
}

/// The divisors of the number factorised as `f` that are at most `bound`, ascending. Work
/// and memory are proportional to how many there are (every partial product is one of them).
pub fn up_to(f: &[(u64, u32)], bound: u64) -> Vec<u64> {
    if bound == 0 {
        return Vec::new();
    }
    let mut out = vec![1u64];
    for &(p, e) in f {
        let len = out.len();
        for i in 0..len {
            let mut d = out[i];
            for _ in 0..e {
                match d.checked_mul(p).filter(|x| *x <= bound) {
                    Some(x) => {
                        d = x;
                        out.push(x);
                    }
                    None => break,
                }
            }
        }
    }
    out.sort_unstable();
    out
}

/// Every divisor of `n`, ascending (none for 0).
pub fn divisors(n: u64) -> Vec<u64> {
    if n == 0 {
        return Vec::new();
    }
    up_to(&factorize(n), n)
}

/// The divisors of `n` for an error message: all of them when there are few, else the first
/// and last few around an ellipsis (a count of 10^12 has thousands).
pub fn listed(n: u64) -> String {
    let d = divisors(n);
    let show = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    if d.len() <= 24 {
        show(&d)
    } else {
        format!(
            "{}, … ({} in all), {}",
            show(&d[..12]),
            d.len(),
            show(&d[d.len() - 4..])
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(n: u64) -> Vec<u64> {
        (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
    }

    #[test]
    fn listed_shortens_long_lists() {
        assert_eq!(listed(12), "1, 2, 3, 4, 6, 12");
        let long = listed(1_000_000_000_000);
        assert!(long.starts_with("1, 2, 4, 5, 8, 10,"), "{long}");
        assert!(long.contains("(169 in all)"), "{long}");
        assert!(long.ends_with("1000000000000"), "{long}");
    }

    #[test]
    fn divisors_equal_scanning_for_small_numbers() {
        for n in 0..3000u64 {
            assert_eq!(divisors(n), scan(n), "{n}");
            assert_eq!(count(&factorize(n)), scan(n).len().max(1) as u64, "{n}");
        }
        // Perfect powers of primes past the trial-division table.
        for (n, p, e) in [(257u64.pow(5) * 3, 257u64, 5), (65537u64.pow(3), 65537, 3)] {
            let d = divisors(n);
            assert!(d.contains(&p.pow(e)) && d.iter().all(|x| n.is_multiple_of(*x)));
        }
    }

    #[test]
    fn divisors_of_huge_numbers_come_from_the_factorisation() {
        // 2^63 − 1 = 7² · 73 · 127 · 337 · 92737 · 649657: 3 · 2^5 = 96 divisors.
        let n = i64::MAX as u64;
        assert_eq!(
            factorize(n),
            vec![(7, 2), (73, 1), (127, 1), (337, 1), (92737, 1), (649657, 1)]
        );
        let d = divisors(n);
        assert_eq!(d.len(), 96);
        assert_eq!(&d[..6], &[1, 7, 49, 73, 127, 337]);
        assert_eq!(d[95], n);
        assert!(d.windows(2).all(|w| w[0] < w[1]));
        assert!(d.iter().all(|x| n.is_multiple_of(*x)));
        // The largest prime below 2^63.
        let p = 9_223_372_036_854_775_783;
        assert_eq!(divisors(p), vec![1, p]);
        assert_eq!(divisors(u64::MAX).len(), 128);
        // 10^12 nodes of 8: 2^15 · 5^12.
        let n = 8_000_000_000_000;
        assert_eq!(factorize(n), vec![(2, 15), (5, 12)]);
        assert_eq!(divisors(n).len(), 16 * 13);
        assert_eq!(
            up_to(&factorize(n), 100),
            vec![1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 80, 100]
        );
        assert_eq!(
            factorize_divisor(&factorize(n), 640),
            Some(vec![(2, 7), (5, 1)])
        );
        assert_eq!(factorize_divisor(&factorize(n), 3), None);
        assert_eq!(factorize_divisor(&factorize(n), 1 << 16), None);
    }
}
