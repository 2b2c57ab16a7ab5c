//! What must hold after a fault, and what must not be left after the next
//! run. A process is judged by asking it (its own checksum of its memory);
//! an archive by `criuz verify`; a leftover by looking where criuz puts
//! things (its temporary directory, beside its outputs, `/dev/shm`, its
//! runtime directory's memory grants and dumps' claims, the process
//! table, the S3 bucket's multipart uploads).

use crate::error::{Error, Result};
use crate::proc;
use serde::Serialize;
use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One broken promise.
#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub path: &'static str,
    pub fault: &'static str,
    pub trial: usize,
    /// lost-process, partial-archive, wrong-memory, stuck-process,
    /// next-run-failed, leftover, hung.
    pub kind: &'static str,
    pub detail: String,
}

/// How a process of the checkpointed tree is found after a fault.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    Gone,
    Running,
    /// Still stopped (or traced) when the wait ran out.
    Stopped,
}

/// Waits (at most `limit`) until `pid` is gone or runs, reaping what is ours.
pub fn settle(pid: i32, limit: Duration) -> Settled {
    let t = Instant::now();
    loop {
        proc::reap_zombies();
        match proc::state(pid) {
            None | Some('Z') | Some('X') => return Settled::Gone,
            Some('T') | Some('t') => {}
            Some(_) if traced(pid) || proc::exiting_or_ended(pid) => {}
            Some(_) => return Settled::Running,
        }
        if t.elapsed() > limit {
            return Settled::Stopped;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn traced(pid: i32) -> bool {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().any(|l| l.starts_with("TracerPid:") && l.split_whitespace().nth(1).is_some_and(|p| p != "0"))
}

/// `criuz verify` of an archive (a file or an `s3://` URL) passes, opened
/// with `identity` if it is encrypted.
pub fn complete(criuz: &Path, archive: &str, identity: Option<&Path>) -> bool {
    verify(criuz, archive, identity).is_ok()
}

/// `criuz verify` of an archive; its complaint when it fails.
pub fn verify(criuz: &Path, archive: &str, identity: Option<&Path>) -> std::result::Result<(), String> {
    let mut c = Command::new(criuz);
    c.args(["verify", archive]).stdin(Stdio::null());
    if let Some(key) = identity {
        c.arg("--identity").arg(key);
    }
    match c.output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().lines().last().unwrap_or("").to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Where leftovers are looked for.
pub struct Places {
    /// criuz's `TMPDIR` in the campaign (work directories, logs).
    pub tmp: PathBuf,
    /// Directories criuz writes outputs into.
    pub outputs: Vec<PathBuf>,
    /// What `/dev/shm` held before the campaign (not ours to judge).
    pub shm_before: BTreeSet<String>,
}

impl Places {
    pub fn new(tmp: PathBuf, outputs: Vec<PathBuf>) -> Places {
        Places { tmp, outputs, shm_before: names(Path::new("/dev/shm")) }
    }
}

fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter_map(|e| e.file_name().to_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// Everything criuz left behind that nobody holds: each a line naming it.
/// `spared` are processes of the campaign's own (the S3 server, a
/// workload, a container) that may be running.
pub fn leftovers(places: &Places, spared: &[i32], uploads: impl FnOnce() -> Result<Vec<String>>) -> Vec<String> {
    let mut out = left_files(places);
    let me = std::process::id() as i32;
    let spared: BTreeSet<i32> = spared.iter().flat_map(|&p| proc::tree(p)).collect();
    for pid in proc::tree(me).into_iter().skip(1).filter(|p| !spared.contains(p)) {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        match proc::state(pid) {
            None | Some('Z') | Some('X') => {}
            Some(s) => out.push(format!("process {pid} ({}, state {s})", comm.trim())),
        }
    }
    match uploads() {
        Ok(u) => out.extend(u.into_iter().map(|k| format!("incomplete multipart upload of {k}"))),
        Err(e) => out.push(format!("cannot list multipart uploads: {e}")),
    }
    out
}

/// True if nobody holds a lock on `f` (taken and let go at once).
fn unheld(f: &std::fs::File) -> bool {
    // SAFETY: flock on a descriptor we own; released when `f` closes.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) == 0 }
}

/// The S3 bucket's incomplete multipart uploads (their keys).
pub fn multipart_uploads(bucket: &str) -> Result<Vec<String>> {
    const LIST: &str = r#"
import sys, boto3
r = boto3.client("s3").list_multipart_uploads(Bucket=sys.argv[1])
for u in r.get("Uploads", []):
    print(u["Key"])
"#;
    let out = Command::new("python3").args(["-c", LIST, bucket]).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(Error::Invalid(String::from_utf8_lossy(&out.stderr).trim().lines().last().unwrap_or("").into()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect())
}

/// The files and directories criuz left behind (in its `TMPDIR`, beside
/// its outputs, on `/dev/shm`): each a line naming it.
pub fn left_files(places: &Places) -> Vec<String> {
    let mut out = Vec::new();
    for n in names(&places.tmp) {
        if n != "criuz-logs" {
            out.push(format!("{} in criuz's TMPDIR", places.tmp.join(n).display()));
        }
    }
    for dir in &places.outputs {
        for n in names(dir).into_iter().filter(|n| n.contains(".criuz-")) {
            out.push(format!("temporary {}", dir.join(n).display()));
        }
    }
    for n in names(Path::new("/dev/shm")).difference(&places.shm_before) {
        if n.starts_with("criuz") {
            out.push(format!("/dev/shm/{n}"));
        }
    }
    // Memory grants, and dumps' claims on their trees.
    for n in names(Path::new("/run/criuz")).into_iter().filter(|n| n.starts_with("grant-") || n.starts_with("dump-")) {
        let p = Path::new("/run/criuz").join(&n);
        if std::fs::File::open(&p).is_ok_and(|f| unheld(&f)) {
            out.push(format!("abandoned {}", p.display()));
        }
    }
    out
}
