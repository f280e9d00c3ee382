//! poolpilot-e2e.
