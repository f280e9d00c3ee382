//! Step 2, validate (pure): whether the reconciled policy is in force — its spec passes every rule
//! the schema may not have enforced, and no older policy on the same pods defines one of its
//! backends. A rejected policy is reported in status and not rolled out.

use crate::plan::validate;

/// Why a policy is not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The spec breaks rules.
    #[error("invalid: {}", .0.join("; "))]
    Invalid(Vec<String>),
    /// An older policy wins a conflict.
    #[error("conflicted: {0}")]
    Conflicted(String),
    /// The policy is not part of what was observed (it is being deleted).
    #[error("the policy is not in the observed fleet")]
    Absent,
}

/// The verdict on the reconciled policy, as its namespace pass judged it (`None`: the pass
/// does not hold it).
pub fn check(verdict: Option<&validate::Acceptance>) -> Result<(), Rejected> {
    match verdict.ok_or(Rejected::Absent)? {
        validate::Acceptance::Accepted => Ok(()),
        validate::Acceptance::Invalid(e) => Err(Rejected::Invalid(e.clone())),
        validate::Acceptance::Conflicted(why) => Err(Rejected::Conflicted(why.clone())),
    }
}
