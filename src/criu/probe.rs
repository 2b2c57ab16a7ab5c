//! What CRIU says of this kernel (`criu check`): whether it can dump and
//! restore here, and where it keeps what it probed of the kernel.
//!
//! CRIU probes the kernel at every start (`kerndat`: dozens of probes,
//! forks and ptrace among them) unless it finds the result saved. It saves
//! it only on a tmpfs, in a directory fixed when it was built (`/run`, or
//! `/run/criu` from `scripts/setup.sh` on a machine whose `/run` is not a
//! tmpfs), so asking CRIU is the one answer that holds for any build or
//! wrapper: the second of two runs logs the file it loaded (the first one
//! writes it, where CRIU can).

use std::path::{Path, PathBuf};
use std::process::Stdio;

/// What `criu check` found.
pub struct KernelCheck {
    /// It exited 0: CRIU's own checks of this kernel hold.
    pub passed: bool,
    /// Its errors, from its log, where it failed.
    pub errors: Vec<String>,
    /// The file CRIU loaded its kernel cache from, where it keeps one.
    pub kernel_cache: Option<PathBuf>,
}

/// Runs `criu check` (as root: CRIU's checks need it), logging to `log`,
/// which the caller removes; a second time where the first one may have
/// written the kernel cache. An error: the CRIU at `criu` could not run.
pub fn check_kernel(criu: &Path, log: &Path) -> std::io::Result<KernelCheck> {
    let mut found = KernelCheck { passed: false, errors: Vec::new(), kernel_cache: None };
    for _ in 0..2 {
        let status = crate::spawn::command(criu)
            .args(["check", "-v4", "-o"])
            .arg(log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        let text = std::fs::read_to_string(log).unwrap_or_default();
        found.passed = status.success();
        found.errors = if found.passed { Vec::new() } else { super::log_errors(log, 3) };
        found.kernel_cache = loaded_cache(&text);
        if found.kernel_cache.is_some() || !found.passed {
            break;
        }
    }
    Ok(found)
}

/// The kernel cache a CRIU log says it loaded.
fn loaded_cache(log: &str) -> Option<PathBuf> {
    log.lines().find_map(|l| l.split_once("Loaded kdat cache from ")).map(|(_, f)| PathBuf::from(f.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_cache_is_the_file_criu_says_it_loaded() {
        let log = "(00.000012) Version: 4.2.1 (gitid 0)\n\
                   (00.000180) Loaded kdat cache from /run/criu/criu.kdat\n\
                   (00.004001) Looks good.\n";
        assert_eq!(loaded_cache(log), Some(PathBuf::from("/run/criu/criu.kdat")));
        assert_eq!(loaded_cache("(00.000180) Writing kdat cache to /run/criu.kdat.tmp\n"), None);
    }
}
