//! poolpilot's public API types, with no IO: the limits document that the operator renders and
//! every gateway pod applies ([`limits::GatewayLimits`]), the duration type both share
//! ([`duration::Duration`]), and, behind the `kube` feature, the `ConnectionPolicy` custom resource
//! with its conditions and Events ([`policy::conditions`]) and its reference doc
//! ([`policy::reference`]).

pub mod admin;
pub mod duration;
pub mod limits;
#[cfg(feature = "kube")]
pub mod policy;

pub use duration::Duration;
pub use limits::GatewayLimits;
#[cfg(feature = "kube")]
pub use policy::{
    ConnectionPolicy, ConnectionPolicySpec, ConnectionPolicyStatus, crd, crd_yaml,
    reference_markdown,
};
