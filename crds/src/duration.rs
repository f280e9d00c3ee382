//! The duration type of the API: a Go-style string (`300ms`, `30s`, `1m30s`) on the wire, so that
//! CRD CEL rules can use `duration(self)` on it, and a `std::time::Duration` in code.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A non-negative span of time written the way Kubernetes and Go write it: a sequence of decimal
/// numbers with a unit each (`ns`, `us`, `ms`, `s`, `m`, `h`), such as `300ms`, `30s` or `1h30m`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(std::time::Duration);

/// The regular expression that the CRD schema puts on every duration field.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// Why a duration string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid duration {input:?}: expected a number with a unit (ns, us, ms, s, m, h), like \"300ms\" or \"1m30s\""
)]
pub struct ParseDurationError {
    input: String,
}

impl Duration {
    /// The zero duration.
    pub const ZERO: Self = Self(std::time::Duration::ZERO);

    /// A duration of `ms` milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Self(std::time::Duration::from_millis(ms))
    }

    /// A duration of `secs` seconds.
    pub const fn from_secs(secs: u64) -> Self {
        Self(std::time::Duration::from_secs(secs))
    }

    /// The standard-library duration.
    pub const fn get(self) -> std::time::Duration {
        self.0
    }

    /// Whether this is zero.
    pub const fn is_zero(self) -> bool {
        self.0.is_zero()
    }
}

impl From<std::time::Duration> for Duration {
    fn from(d: std::time::Duration) -> Self {
        Self(d)
    }
}

impl From<Duration> for std::time::Duration {
    fn from(d: Duration) -> Self {
        d.0
    }
}

impl FromStr for Duration {
    type Err = ParseDurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = || ParseDurationError {
            input: input.to_owned(),
        };
        let s = input.trim();
        if s.is_empty() {
            return Err(err());
        }
        let mut total = std::time::Duration::ZERO;
        let mut rest = s;
        while !rest.is_empty() {
            let num_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(err)?;
            let (num, tail) = rest.split_at(num_len);
            let unit_len = tail
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_len);
            let scale_ns: f64 = match unit {
                "ns" => 1.0,
                "us" | "µs" => 1e3,
                "ms" => 1e6,
                "s" => 1e9,
                "m" => 60e9,
                "h" => 3600e9,
                _ => return Err(err()),
            };
            let value: f64 = num.parse().map_err(|_| err())?;
            if !value.is_finite() || num.is_empty() {
                return Err(err());
            }
            let nanos = value * scale_ns;
            if nanos > u64::MAX as f64 {
                return Err(err());
            }
            total = total
                .checked_add(std::time::Duration::from_nanos(nanos.round() as u64))
                .ok_or_else(err)?;
            rest = tail;
        }
        Ok(Self(total))
    }
}

impl fmt::Display for Duration {
    /// Writes the shortest Go-style form: `0s`, `250ms`, `1.5s`, `2m`, `1h30m`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            return f.write_str("0s");
        }
        let nanos = d.as_nanos();
        // Sub-second precision: the largest unit that divides it exactly.
        if !nanos.is_multiple_of(1_000_000_000) {
            return match nanos {
                n if n.is_multiple_of(1_000_000) => write!(f, "{}ms", n / 1_000_000),
                n if n.is_multiple_of(1_000) => write!(f, "{}us", n / 1_000),
                n => write!(f, "{n}ns"),
            };
        }
        let secs = d.as_secs();
        let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
        if h > 0 {
            write!(f, "{h}h")?;
        }
        if m > 0 {
            write!(f, "{m}m")?;
        }
        if s > 0 {
            write!(f, "{s}s")?;
        }
        Ok(())
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(feature = "kube")]
impl schemars::JsonSchema for Duration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_go_style_durations() {
        let ms = |n| Duration::from_millis(n);
        assert_eq!("300ms".parse::<Duration>(), Ok(ms(300)));
        assert_eq!("30s".parse::<Duration>(), Ok(ms(30_000)));
        assert_eq!("1m30s".parse::<Duration>(), Ok(ms(90_000)));
        assert_eq!("1.5s".parse::<Duration>(), Ok(ms(1_500)));
        assert_eq!("2h".parse::<Duration>(), Ok(ms(7_200_000)));
        assert_eq!("0s".parse::<Duration>(), Ok(Duration::ZERO));
    }

    #[test]
    fn refuses_garbage() {
        for bad in ["", "5", "ms", "5 minutes", "-1s", "1d", "1.2.3s", "s5"] {
            assert!(
                bad.parse::<Duration>().is_err(),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn displays_shortest_form() {
        assert_eq!(Duration::from_millis(250).to_string(), "250ms");
        assert_eq!(Duration::from_millis(1_500).to_string(), "1500ms");
        assert_eq!(Duration::from_secs(30).to_string(), "30s");
        assert_eq!(Duration::from_secs(5_400).to_string(), "1h30m");
        assert_eq!(Duration::ZERO.to_string(), "0s");
    }

    proptest! {
        #[test]
        fn display_round_trips(nanos in 0u64..10_000_000_000_000) {
            let d = Duration::from(std::time::Duration::from_nanos(nanos));
            let back: Duration = d.to_string().parse().unwrap();
            prop_assert_eq!(back, d);
        }

        #[test]
        fn display_matches_the_crd_pattern(nanos in 1u64..10_000_000_000_000) {
            let s = Duration::from(std::time::Duration::from_nanos(nanos)).to_string();
            let unit_ok = s.chars().all(|c| c.is_ascii_digit() || "nsumh".contains(c));
            prop_assert!(unit_ok, "{}", s);
        }
    }
}
