//! What every end-to-end scenario shares beyond the stack: one scenario at a time on this machine
//! (a file lock in the cluster directory, held across test processes, since several scenarios
//! measure reaction times and error rates that a second scenario's load would distort), and the
//! `figure` lines in which they report what they measured.

use std::fmt::Display;
use std::fs::File;

use anyhow::Context as _;
use nix::fcntl::{Flock, FlockArg};

use crate::paths::cluster_dir;

/// Held for a scenario's whole run; dropping it lets the next scenario start.
#[derive(Debug)]
pub struct Serial {
    _lock: Flock<File>,
}

/// Waits until no other scenario runs on this machine (in any process), then holds that until
/// the guard drops.
pub async fn serial() -> anyhow::Result<Serial> {
    let dir = cluster_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("scenario.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let lock = tokio::task::spawn_blocking(move || {
        Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| e)
    })
    .await?
    .with_context(|| format!("locking {}", path.display()))?;
    Ok(Serial { _lock: lock })
}

/// Prints one measured figure of a scenario as `figure <scenario> <name> = <value>`
/// (`cargo test -p poolpilot-e2e --test scenarios -- --nocapture | grep ^figure`).
pub fn figure(scenario: &str, name: &str, value: impl Display) {
    println!("figure {scenario} {name} = {value}");
}
