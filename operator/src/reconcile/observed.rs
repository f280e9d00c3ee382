//! What observe saw of a namespace: the planner's input, which pods each policy selects and
//! where their admin ports are. A module of its own so that what keeps it (the namespace passes,
//! which the context holds) need not import the observing, which reads the context.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::plan::FleetInput;

/// What observe saw.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The namespace.
    pub namespace: String,
    /// The planner's input for the namespace.
    pub input: FleetInput,
    /// Which pods each policy of `input` selects (names, sorted), in the policies' order.
    pub selected: Vec<Vec<String>>,
    /// Admin address per pod name (pods with an IP).
    pub admin: BTreeMap<String, SocketAddr>,
}
