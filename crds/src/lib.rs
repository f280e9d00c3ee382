//! poolpilot's public API types, with no IO: the limits document that the operator renders and
//! every gateway pod applies ([`limits::GatewayLimits`]), the duration type both share
//! ([`duration::Duration`]), and, behind the `kube` feature, the `ConnectionPolicy` custom resource.

pub mod duration;
pub mod limits;

pub use duration::Duration;
pub use limits::GatewayLimits;
