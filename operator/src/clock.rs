//! The wall clock: the one place the operator's runtime reads the time. The planning core never
//! does; it gets `now` passed in, and tests pass a fixed one.

use crate::plan::Timestamp;

/// The current time.
pub fn now() -> Timestamp {
    // The only wall-clock read of the runtime; everything downstream takes `now` as an argument.
    #[allow(clippy::disallowed_methods)]
    Timestamp::now()
}
