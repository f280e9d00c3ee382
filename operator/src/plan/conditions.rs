//! Status conditions: typed condition kinds and statuses, and the merge that keeps a condition's
//! `lastTransitionTime` unless its status flipped (Stackable's `compute_conditions`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::time::Timestamp;

/// The conditions a ConnectionPolicy reports, in the order they are listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// The spec is valid and free of conflicts.
    Accepted,
    /// Prometheus answers with usable samples for every backend.
    MetricsAvailable,
    /// The rendered pools fit the pods' file-descriptor budget.
    FdBudget,
    /// Every ready selected pod acknowledged the current revision.
    RolledOut,
    /// Some backend wants more connections than it can safely get.
    Saturated,
    /// Accepted and rolled out.
    Ready,
}

impl Kind {
    /// Every condition, in the order they are listed.
    pub const ALL: [Kind; 6] = [
        Self::Accepted,
        Self::MetricsAvailable,
        Self::FdBudget,
        Self::RolledOut,
        Self::Saturated,
        Self::Ready,
    ];

    /// The condition `type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "Accepted",
            Self::MetricsAvailable => "MetricsAvailable",
            Self::FdBudget => "FdBudget",
            Self::RolledOut => "RolledOut",
            Self::Saturated => "Saturated",
            Self::Ready => "Ready",
        }
    }
}

/// A condition's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// `True`.
    True,
    /// `False`.
    False,
    /// `Unknown`.
    Unknown,
}

impl Status {
    /// The condition `status` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }

    /// `True` or `False`.
    pub fn from_bool(b: bool) -> Self {
        if b { Self::True } else { Self::False }
    }
}

/// A freshly computed condition, before it is merged with the stored ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Computed {
    /// Which condition.
    pub kind: Kind,
    /// Its status.
    pub status: Status,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable detail, with numbers.
    pub message: String,
}

impl Computed {
    /// A condition.
    pub fn new(
        kind: Kind,
        status: Status,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            status,
            reason,
            message: message.into(),
        }
    }
}

/// The new condition list: `computed` in [`Kind`] order, each keeping the `lastTransitionTime` of
/// the stored condition of the same type when its status did not change, else `now`.
pub fn merge(
    old: &[Condition],
    mut computed: Vec<Computed>,
    generation: i64,
    now: Timestamp,
) -> Vec<Condition> {
    computed.sort_by_key(|c| c.kind);
    computed
        .into_iter()
        .map(|c| {
            let kept = old
                .iter()
                .find(|o| o.type_ == c.kind.as_str() && o.status == c.status.as_str())
                .map(|o| o.last_transition_time.clone());
            Condition {
                type_: c.kind.as_str().to_owned(),
                status: c.status.as_str().to_owned(),
                reason: c.reason.to_owned(),
                message: c.message,
                observed_generation: Some(generation),
                last_transition_time: kept.unwrap_or(Time(now)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let first = merge(
            &[],
            vec![Computed::new(
                Kind::Ready,
                Status::False,
                "RollingOut",
                "0/3",
            )],
            1,
            at(0),
        );
        assert_eq!(first[0].last_transition_time, Time(at(0)));

        let same = merge(
            &first,
            vec![Computed::new(
                Kind::Ready,
                Status::False,
                "RollingOut",
                "1/3",
            )],
            2,
            at(30),
        );
        assert_eq!(
            same[0].last_transition_time,
            Time(at(0)),
            "message change is not a transition"
        );
        assert_eq!(same[0].message, "1/3");
        assert_eq!(same[0].observed_generation, Some(2));

        let flipped = merge(
            &same,
            vec![Computed::new(Kind::Ready, Status::True, "Ready", "3/3")],
            2,
            at(60),
        );
        assert_eq!(flipped[0].last_transition_time, Time(at(60)));
    }

    #[test]
    fn conditions_come_out_in_a_stable_order() {
        let got = merge(
            &[],
            vec![
                Computed::new(Kind::Ready, Status::True, "Ready", ""),
                Computed::new(Kind::Accepted, Status::True, "Accepted", ""),
                Computed::new(Kind::FdBudget, Status::Unknown, "FdLimitUnknown", ""),
            ],
            1,
            at(0),
        );
        let types: Vec<&str> = got.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Accepted", "FdBudget", "Ready"]);
    }

    // === the API's condition catalog (poolpilot_api::policy::conditions) ===

    use poolpilot_api::policy::conditions::{CONDITIONS, is_documented};

    #[test]
    fn the_kinds_are_the_documented_condition_types_in_their_order() {
        let kinds: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        let documented: Vec<&str> = CONDITIONS.iter().map(|c| c.type_).collect();
        assert_eq!(kinds, documented);
    }

    /// Every `Computed::new(Kind::K, Status::S, "Reason", ..)` in `status.rs`, as (K, S, reason);
    /// a reason that is not a literal counts as `None`.
    fn reported() -> Vec<(String, String, Option<String>)> {
        let source = include_str!("status.rs");
        let code = source.split("#[cfg(test)]").next().unwrap_or_default();
        let code = code.split_whitespace().collect::<Vec<_>>().join(" ");
        code.split("Computed::new(")
            .skip(1)
            .map(|call| {
                let args: Vec<&str> = call.splitn(4, ',').map(str::trim).collect();
                let kind = args[0].strip_prefix("Kind::").expect("Kind:: first");
                let status = args[1].strip_prefix("Status::").expect("Status:: second");
                let reason = args[2]
                    .strip_prefix('"')
                    .and_then(|r| r.strip_suffix('"'))
                    .map(str::to_owned);
                (kind.to_owned(), status.to_owned(), reason)
            })
            .collect()
    }

    #[test]
    fn every_reported_condition_reason_is_documented_and_every_documented_one_is_reported() {
        let reported = reported();
        assert!(
            reported.len() >= 20,
            "status.rs changed shape; found only {reported:?}"
        );
        let mut literal = std::collections::BTreeSet::new();
        for (kind, status, reason) in &reported {
            match reason {
                Some(reason) => {
                    assert!(
                        is_documented(kind, status, reason),
                        "{kind}={status} reason {reason} is not documented in \
                         crds/src/policy/conditions.rs (then run `make crds`)"
                    );
                    literal.insert((kind.as_str(), status.as_str(), reason.as_str()));
                }
                // `Ready=False` takes the reason of `RolledOut=False`.
                None => assert_eq!((kind.as_str(), status.as_str()), ("Ready", "False")),
            }
        }
        for c in CONDITIONS {
            for r in c.reasons {
                let derived = c.type_ == "Ready" && r.status == "False";
                let source = if derived { "RolledOut" } else { c.type_ };
                assert!(
                    literal.contains(&(source, r.status, r.reason)),
                    "{}={} reason {} is documented but the operator never reports it",
                    c.type_,
                    r.status,
                    r.reason
                );
            }
        }
    }
}
