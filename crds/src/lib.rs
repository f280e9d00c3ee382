//! poolpilot's public API types, with no IO: the limits document that the operator renders and
//! every gateway pod applies ([`limits::GatewayLimits`]), the duration type both share
//! ([`duration::Duration`]), and, behind the `kube` feature, the `ConnectionPolicy` custom resource.

pub mod duration;
pub mod limits;
#[cfg(feature = "kube")]
pub mod policy;

pub use duration::Duration;
pub use limits::GatewayLimits;
#[cfg(feature = "kube")]
pub use policy::{ConnectionPolicy, ConnectionPolicySpec, ConnectionPolicyStatus, crd, crd_yaml};
