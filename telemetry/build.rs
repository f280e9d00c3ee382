//! Stamps the binaries with the source revision: `POOLPILOT_REVISION` when the build sets it (image
//! builds without a `.git`), else `git rev-parse --short=12 HEAD`, else `unknown`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=POOLPILOT_REVISION");
    let revision = std::env::var("POOLPILOT_REVISION")
        .ok()
        .filter(|r| !r.trim().is_empty())
        .or_else(git_revision)
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=POOLPILOT_REVISION={}", revision.trim());
    // A new commit moves HEAD (or the ref it names): rebuild so the stamp follows.
    // `--git-path` resolves both inside a worktree (HEAD is per worktree, branches are shared).
    let mut watched = vec!["HEAD".to_owned()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]).map(|r| r.trim().to_owned()));
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", &name]) {
            println!("cargo:rerun-if-changed={}", path.trim());
        }
    }
}

fn git_revision() -> Option<String> {
    git(&["rev-parse", "--short=12", "HEAD"])
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
