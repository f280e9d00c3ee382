//! poolpilot-operator.
