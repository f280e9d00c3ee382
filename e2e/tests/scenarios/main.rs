//! The end-to-end scenarios: the whole product (operator, gateways, modelsim
//! backends, Prometheus) deployed from `manifests/overlays/local` into a test namespace
//! ([`poolpilot_e2e::stack`]), driven through kubectl, the Kubernetes API and real HTTP load
//! only. One file per scenario; they run one at a time ([`poolpilot_e2e::scenario::serial`]).
//!
//! Each scenario prints its measured figures as `figure <scenario> <name> = <value>` lines
//! (`cargo test -p poolpilot-e2e --test scenarios -- --nocapture | grep ^figure`), which
//! `e2e/README.md` records.

mod backend_keepalive;
mod bad_input;
mod canary_rollback;
mod client_protection;
mod fd_budget;
mod flash_crowd;
mod happy_path;
mod hostile_clients;
mod long_calls_knee;
mod operator_down;
mod partial_scrape;
mod policy_edit;
mod priority_classes;
mod prometheus_down;
mod provider_cooldown;
mod saturated;
mod scale_gateways;
mod shadow_mode;
mod skewed_load;
mod square_wave;
mod token_budgets;
