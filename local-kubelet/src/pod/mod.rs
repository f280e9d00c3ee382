//! One pod on the local node: the worker loop (`worker`) that runs it from binding to deletion,
//! the per-container state it keeps (`state`), how a container becomes a process (`spec`) and
//! the status it reports (`status`). Dependencies go one way: `worker` uses the other three,
//! `status` uses `state`.

mod spec;
mod state;
mod status;
mod worker;

pub use spec::NOFILE_ANNOTATION;
pub(crate) use worker::run_pod;
