//! poolpilot-gateway.
