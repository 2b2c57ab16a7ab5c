//! `criuz check`: whether this machine can dump and restore, and which of
//! criuz's ways it can take, asked before the first checkpoint rather than
//! learnt from a failed one.
//!
//! Each finding probes what a dump or restore would use, the way they use
//! it: the CRIU they would run (found as they find it) and its own `criu
//! check`; criuz's capabilities; the userfaultfd that placed and lazy
//! restores copy memory in through; the descriptors a dump holds pages by
//! reference with; the cores and memory a dump takes; CRIU's kernel cache;
//! the CUDA driver, loaded as a dump of a GPU process loads it; runc and
//! podman for the container commands.
//! A finding that stops every dump or restore fails the check; one that
//! takes a way away (lazy restores, TCP, GPU processes) warns; the rest
//! are notes. Nothing is changed on the machine but CRIU's kernel cache,
//! which `criu check` writes where CRIU keeps one.

use crate::criu::{self, probe, Criu};
use crate::error::{Error, Result};
use crate::proc::capabilities;
use crate::session::workdir::WorkDir;
use std::path::{Path, PathBuf};

/// How a finding bears on dumps and restores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// What criuz needs or uses is there.
    Ok,
    /// Something to know that takes nothing away.
    Note,
    /// A way criuz would take is closed here (it says which), or is slower.
    Warn,
    /// No dump or restore can run here.
    Fail,
}

impl Verdict {
    /// Its word, as a report line and the JSON (serde's name) give it.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Note => "note",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// One thing checked.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Finding {
    /// What was checked, one word or two.
    pub topic: &'static str,
    pub verdict: Verdict,
    /// What was found and what it means, one line.
    pub text: String,
}

impl Finding {
    fn new(topic: &'static str, verdict: Verdict, text: impl Into<String>) -> Finding {
        Finding { topic, verdict, text: text.into() }
    }
}

/// What `criuz check` looks at.
#[derive(Default)]
pub struct CheckOptions {
    /// The CRIU to check, as `--criu` names it for a dump; by default the
    /// one a dump would find.
    pub criu: Option<PathBuf>,
}

/// Checks this machine; the findings in the order they are reported. An
/// error: `criu` names no file (a wrong name, as for a dump).
pub fn check_machine(o: &CheckOptions) -> Result<Vec<Finding>> {
    let mut found = Vec::new();
    let root = privileges(&mut found);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string();
    if let Some(criu) = find_criu(o, &kernel, &mut found)? {
        if root {
            criu_check(&criu, &kernel, &mut found);
        } else {
            found.push(Finding::new("criu check", Verdict::Fail, "not run: CRIU's checks need root"));
        }
    }
    found.push(userfaultfd());
    found.push(descriptors());
    found.push(cores_and_memory());
    found.push(gpu());
    found.push(containers());
    Ok(found)
}

/// Root, and the capabilities CRIU uses; whether criuz runs as root.
fn privileges(found: &mut Vec<Finding>) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        found.push(Finding::new(
            "privileges",
            Verdict::Fail,
            "not root: criuz runs CRIU, which dumps and restores as root",
        ));
        return false;
    }
    let Some(set) = capabilities::effective() else {
        found.push(Finding::new("privileges", Verdict::Warn, "root; its capabilities could not be read"));
        return true;
    };
    let lacking: Vec<&capabilities::Capability> = capabilities::missing(set).collect();
    if lacking.is_empty() {
        found.push(Finding::new("privileges", Verdict::Ok, "root, with every capability CRIU uses"));
    }
    for c in lacking {
        let verdict = if c.required { Verdict::Fail } else { Verdict::Warn };
        found.push(Finding::new("privileges", verdict, format!("root without {}: {}", c.name, c.without)));
    }
    true
}

/// The CRIU a dump would run, found as it finds it.
fn find_criu(o: &CheckOptions, kernel: &str, found: &mut Vec<Finding>) -> Result<Option<Criu>> {
    match criu::locate(o.criu.as_deref()) {
        Ok((c, rejected)) => {
            for r in rejected {
                found.push(Finding::new(
                    "CRIU",
                    Verdict::Note,
                    format!("skipped {} (from {}): {}", r.path.display(), r.source, r.why),
                ));
            }
            let (verdict, tail) = if c.release().is_some_and(|v| v < (4, 2))
                && criu::release_of(kernel) >= Some((6, 16))
            {
                (Verdict::Warn, format!(": on Linux {kernel} it cannot dump TCP sockets (4.2 is the first that can)"))
            } else {
                (Verdict::Ok, String::new())
            };
            found.push(Finding::new(
                "CRIU",
                verdict,
                format!("{} at {} (from {}){tail}", c.version, c.path.display(), c.source),
            ));
            Ok(Some(c))
        }
        Err(e @ Error::Usage(_)) => Err(e),
        Err(e) => {
            found.push(Finding::new("CRIU", Verdict::Fail, e.to_string()));
            Ok(None)
        }
    }
}

/// CRIU's own check of this kernel, and where it keeps its kernel cache.
fn criu_check(criu: &Criu, kernel: &str, found: &mut Vec<Finding>) {
    let checked = WorkDir::new("criuz-check")
        .map_err(|e| e.to_string())
        .and_then(|dir| probe::check_kernel(&criu.path, &dir.path().join("check.log")).map_err(|e| e.to_string()));
    let check = match checked {
        Ok(c) => c,
        Err(e) => {
            found.push(Finding::new("criu check", Verdict::Fail, format!("could not run: {e}")));
            return;
        }
    };
    if check.passed {
        found.push(Finding::new("criu check", Verdict::Ok, format!("passed on Linux {kernel}")));
    } else {
        let why = if check.errors.is_empty() { "no error logged".to_string() } else { check.errors.join(" / ") };
        found.push(Finding::new("criu check", Verdict::Fail, format!("failed on Linux {kernel}: {why}")));
    }
    found.push(match check.kernel_cache {
        Some(file) => Finding::new(
            "kernel cache",
            Verdict::Ok,
            format!("CRIU keeps its kernel probes in {}: no probes at each start", file.display()),
        ),
        None => Finding::new(
            "kernel cache",
            Verdict::Warn,
            "CRIU keeps no kernel cache here (it keeps one only on a tmpfs: scripts/setup.sh builds it for \
             /run/criu where /run is not one): every CRIU start probes the kernel again, tens of milliseconds \
             of each restore",
        ),
    });
}

/// The userfaultfd that placed and lazy restores copy memory in through.
fn userfaultfd() -> Finding {
    if criu::uffd::lazy_restore_available() {
        Finding::new(
            "userfaultfd",
            Verdict::Ok,
            "criuz places restored memory on every core, and restores lazily (--lazy)",
        )
    } else {
        Finding::new(
            "userfaultfd",
            Verdict::Warn,
            "this kernel gives criuz no userfaultfd with the events CRIU needs: restores stream every page through \
             CRIU's one pipe (--fill stream), and --lazy fails",
        )
    }
}

/// The descriptors a dump holds blocks by reference with (a pipe each).
fn descriptors() -> Finding {
    let limit = crate::io::open_files_limit();
    let held = crate::archive::most_held() as u64;
    let bytes = held.saturating_mul(crate::archive::DEFAULT_BLOCK_SIZE as u64);
    let text = format!(
        "{limit} open files: a dump holds up to {held} blocks ({} MiB) of a frozen process's pages by reference",
        bytes >> 20
    );
    // Fewer than the pipeline's 64 MiB: a dump copies pages while the
    // process is frozen.
    if bytes < 64 << 20 {
        Finding::new(
            "descriptors",
            Verdict::Warn,
            format!("{text}; beyond that it copies them while the process is frozen (raise `ulimit -Hn`)"),
        )
    } else {
        Finding::new("descriptors", Verdict::Ok, text)
    }
}

/// The cores and memory a dump and a restore take here by default, as
/// they reckon them.
fn cores_and_memory() -> Finding {
    use crate::engine;
    let cores = engine::default_threads();
    let available = crate::proc::memory::available();
    let absorb = engine::default_absorb(available);
    Finding::new(
        "cores",
        Verdict::Note,
        format!(
            "{cores} core(s) for criuz (as affinity and CPU quota allow): a dump compresses on {} worker(s) while \
             CRIU writes and on {cores} after it, a restore decodes on {cores}; a dump to a file takes in up to \
             {} MiB of CRIU's pages ahead of its workers (--absorb: a quarter of the {} MiB available now)",
            engine::free_while_capturing(cores),
            absorb >> 20,
            available >> 20
        ),
    )
}

/// The CUDA driver, loaded as a dump of a GPU process loads it.
fn gpu() -> Finding {
    use crate::cuda::driver::{Driver, LoadError};
    let driver = match Driver::load() {
        Ok(d) => d,
        Err(e @ LoadError::Absent(..)) => {
            return Finding::new("GPU", Verdict::Note, format!("{e}: GPU processes are not dumped here"))
        }
        Err(e @ LoadError::TooOld(..)) => {
            return Finding::new("GPU", Verdict::Warn, format!("{e}: GPU processes cannot be dumped"))
        }
    };
    let gpus = driver.init().and_then(|()| Ok((driver.version()?, driver.gpus()?)));
    match gpus {
        Ok((version, gpus)) => {
            let names: Vec<String> = gpus.iter().map(|g| format!("{} ({})", g.name, g.uuid)).collect();
            Finding::new(
                "GPU",
                Verdict::Ok,
                format!(
                    "CUDA driver {}.{} with its checkpoint calls, {} GPU(s): {}",
                    version / 1000,
                    version % 1000 / 10,
                    gpus.len(),
                    names.join(", ")
                ),
            )
        }
        Err(e) => Finding::new("GPU", Verdict::Warn, format!("the CUDA driver loads but {e}")),
    }
}

/// runc and podman, for `criuz runc` and `criuz podman`.
fn containers() -> Finding {
    let found: Vec<String> =
        ["runc", "podman"].into_iter().filter_map(|name| criu::on_path(name).map(|p| version_line(name, &p))).collect();
    if found.is_empty() {
        Finding::new(
            "containers",
            Verdict::Note,
            "neither runc nor podman on PATH: `criuz runc` and `criuz podman` need them",
        )
    } else {
        Finding::new("containers", Verdict::Note, found.join("; "))
    }
}

/// `NAME VERSION at PATH`, from its `--version`'s first line.
fn version_line(name: &str, path: &Path) -> String {
    let out = crate::spawn::command(path).arg("--version").output();
    let first = out.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string));
    // "runc version 1.1.12", "podman version 4.3.1".
    let version = first.as_deref().and_then(|l| l.split_whitespace().last()).unwrap_or("(no version)");
    format!("{name} {version} at {}", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report's word and the JSON's are one.
    #[test]
    fn a_verdict_reads_the_same_in_a_line_and_in_json() {
        for v in [Verdict::Ok, Verdict::Note, Verdict::Warn, Verdict::Fail] {
            assert_eq!(serde_json::to_value(v).unwrap(), v.word());
        }
    }
}
