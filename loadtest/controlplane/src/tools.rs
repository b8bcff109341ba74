//! The build scripts that put Go binaries into the cache outside the repo, run once per
//! process: the control plane's, the gateway's, and the command-line tools the tests use.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Result, anyhow};

/// What a build script printed, or why it failed; kept once per process.
pub(crate) type Built = std::sync::OnceLock<std::result::Result<PathBuf, String>>;

/// Runs `script` (relative to this crate) with `args` the first time `cell` is asked, its
/// progress shown on stderr, and returns the path it printed on stdout.
pub(crate) fn built_once(cell: &Built, script: &str, args: &[&str], what: &str) -> Result<PathBuf> {
    cell.get_or_init(|| run_build_script(script, args, what)).clone().map_err(|e| anyhow!(e))
}

fn run_build_script(script: &str, args: &[&str], what: &str) -> std::result::Result<PathBuf, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{what}: cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!("{what}: the build failed (see the error above)"));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// helm, built from its Go module on first use (`loadtest/tools/build.sh helm`).
pub fn helm() -> Result<PathBuf> {
    static HELM: Built = Built::new();
    built_once(&HELM, "../tools/build.sh", &["helm"], "helm")
}

/// kube-state-metrics, built from its Go module on first use.
pub fn kube_state_metrics() -> Result<PathBuf> {
    static KSM: Built = Built::new();
    built_once(&KSM, "../tools/build.sh", &["kube-state-metrics"], "kube-state-metrics")
}
