//! What the benchmark binaries share (`poolpilot-bench` here and `poolpilot-loop-bench` in
//! poolpilot-e2e): how a run describes the machine it ran on.

pub mod machine;
