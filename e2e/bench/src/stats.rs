//! Percentiles, medians and the number formats of the report.

/// The `q`-th percentile (0–100) of `values` (sorted in place), nearest rank; NaN when empty.
pub fn percentile(values: &mut [u64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_unstable();
    // The epsilon keeps 99.9% of 1000 at rank 999 despite binary floating point.
    let rank = ((q / 100.0) * values.len() as f64 - 1e-9).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1] as f64
}

/// The median of `values` (NaN when empty; NaNs are ignored).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Microseconds as milliseconds with 3 decimals (or "–").
pub fn ms(us: f64) -> String {
    if us.is_nan() {
        "–".into()
    } else {
        format!("{:.3}", us / 1000.0)
    }
}

/// A signed difference in µs as milliseconds.
pub fn ms_signed(us: f64) -> String {
    if us.is_nan() {
        "–".into()
    } else {
        format!("{:+.3}", us / 1000.0)
    }
}

/// A ratio `a / b` with 2 decimals (or "–").
pub fn ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() || b == 0.0 {
        "–".into()
    } else {
        format!("{:.2}", a / b)
    }
}

/// A float with `digits` decimals (or "–").
pub fn num(x: f64, digits: usize) -> String {
    if x.is_nan() {
        "–".into()
    } else {
        format!("{x:.digits$}")
    }
}

/// A share as a percentage with 1 decimal (or "–").
pub fn pct(share: f64) -> String {
    if share.is_nan() {
        "–".into()
    } else {
        format!("{:.1}%", share * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let mut v: Vec<u64> = (1..=1000).rev().collect();
        assert_eq!(percentile(&mut v, 50.0), 500.0);
        assert_eq!(percentile(&mut v, 99.0), 990.0);
        assert_eq!(percentile(&mut v, 99.9), 999.0);
        assert_eq!(percentile(&mut v, 100.0), 1000.0);
        assert!(percentile(&mut [], 50.0).is_nan());
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(ratio(3.0, 2.0), "1.50");
        assert_eq!(ms(1500.0), "1.500");
        assert_eq!(pct(0.9912), "99.1%");
        assert_eq!(pct(f64::NAN), "–");
    }
}
