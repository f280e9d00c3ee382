//! Cluster-wide effects that one test of this binary must have to itself while it looks at
//! them, though the tests run at the same time on one cluster.
//!
//! A test that also reserves the node's CPU ([`poolpilot_e2e::TestNamespace::reserve_cpu`])
//! does so before it takes a lock of this module: one order, so no two tests wait on each other.

use tokio::sync::Mutex;

/// The rules aggregated into the built-in `view`, `edit` and `admin` ClusterRoles: the chart
/// installs its own aggregated roles (`<release>-view`, `<release>-edit`) with the same rules as
/// `manifests/operator/rbac-aggregate.yaml`, so while a release lives, a check that the manifests'
/// roles give namespace users the policies would pass thanks to the chart's. The chart test holds
/// this from install to uninstall, the manifests' aggregation test for its whole check.
pub(crate) static BUILT_IN_ROLE_AGGREGATION: Mutex<()> = Mutex::const_new(());
