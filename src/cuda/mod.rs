//! CUDA processes in a checkpoint. CRIU cannot dump a process's GPU state,
//! but the driver can move it into the process's host memory
//! ([`driver`]): a dump of a tree finds the processes that use CUDA, locks
//! them (their CUDA calls block; work already submitted gets CRIU's usual
//! 10 s to finish) and checkpoints them before CRIU freezes the tree, and
//! records in the archive what it did ([`CudaRecord`], file
//! [`RECORD_FILE`]). A restore checks before CRIU starts that the recorded
//! GPUs (or those `--gpu-map` names) are here and of the same kind, and
//! once CRIU has the tree running, restores and unlocks each process: the
//! tree's host code runs meanwhile, its CUDA calls wait for the unlock.
//!
//! Nothing is left suspended: a dump that fails after the suspend, or one
//! that leaves the tree running, resumes what it suspended; a criuz killed
//! meanwhile leaves a guard that runs `criuz gpu resume` on those pids; a
//! restore whose resume fails kills the restored tree (a process whose GPU
//! memory did not come back must not run on as if it had). Every driver
//! call's result is checked; none is only logged.
//!
//! Not supported, by the driver: UVM (managed) memory, IPC memory, MIG, MPS
//! and NCCL. A process the user already checkpointed (`cuda-checkpoint`) is
//! recorded and resumed on restore, but not resumed after the dump.

pub mod driver;

use crate::error::{Error, Result};
use crate::proc::guard::Guard;
use crate::proc::tree;
use driver::{Driver, Gpu, LoadError, ProcessState};
use std::time::Instant;

/// The archive file that records a dump's CUDA processes.
pub const RECORD_FILE: &str = "criuz-cuda.json";

/// What a dump did to the CUDA processes of its tree.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CudaRecord {
    /// The driver's CUDA version at the dump (e.g. 12080).
    pub driver_version: i32,
    /// The processes whose CUDA state is in their host memory.
    pub pids: Vec<i32>,
    /// The GPUs they held.
    pub gpus: Vec<Gpu>,
}

/// What a dump did with CUDA.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CudaDumpReport {
    #[serde(flatten)]
    pub record: CudaRecord,
    /// Lock and checkpoint (device memory into host memory), all processes.
    pub suspend_seconds: f64,
    /// Restore and unlock after a `--leave-running` dump.
    pub resume_seconds: Option<f64>,
}

/// How long a lock waits for work a process already submitted: CRIU's own
/// default timeout, as its CUDA plugin uses.
pub const LOCK_TIMEOUT_MS: u32 = 10_000;

/// The CUDA processes of a tree, suspended for its dump. Dropped without
/// [`finish`](Self::finish), it resumes them: every failure after the
/// suspend gives them back their GPU state.
pub struct Suspended {
    driver: Driver,
    /// Suspended by this dump (resumed on failure).
    ours: Vec<i32>,
    record: CudaRecord,
    guard: Guard,
    pub seconds: f64,
}

impl std::fmt::Debug for Suspended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Suspended").field("ours", &self.ours).field("record", &self.record).finish()
    }
}

/// Suspends the CUDA processes of the tree of `root`; None when it has none
/// (or the machine has no CUDA driver).
pub fn suspend_tree(root: i32) -> Result<Option<Suspended>> {
    let driver = match Driver::load() {
        Ok(d) => d,
        Err(LoadError::Absent(..)) => return Ok(None),
        Err(e @ LoadError::TooOld(..)) => {
            let pids = tree::tree_pids(&[root]);
            return match pids.iter().find(|&&p| maps_libcuda(p)) {
                Some(p) => Err(Error::Criu(format!("process {p} uses CUDA, but {e}"))),
                None => Ok(None),
            };
        }
    };
    let mut found = Vec::new();
    for pid in tree::tree_pids(&[root]) {
        match driver.state(pid) {
            Ok(ProcessState::Locked) => {
                return Err(Error::Criu(format!(
                    "process {pid}'s CUDA state is locked by someone else (another checkpoint under way?)"
                )))
            }
            Ok(ProcessState::Failed) => {
                return Err(Error::Criu(format!("process {pid}'s CUDA state is failed (the driver says so)")))
            }
            Ok(s) => found.push((pid, s)),
            Err(_) => {} // not a CUDA process
        }
    }
    if found.is_empty() {
        return Ok(None);
    }
    let started = Instant::now();
    driver.init().map_err(cuda_err)?;
    let driver_version = driver.version().map_err(cuda_err)?;
    let pids: Vec<i32> = found.iter().map(|(p, _)| *p).collect();
    let gpus = gpus_of(&pids, &driver.gpus().map_err(cuda_err)?);
    let ours: Vec<i32> = found.iter().filter(|(_, s)| *s == ProcessState::Running).map(|(p, _)| *p).collect();
    let guard = resume_guard(&ours)?;
    let mut s =
        Suspended { driver, ours: Vec::new(), record: CudaRecord { driver_version, pids, gpus }, guard, seconds: 0.0 };
    for &pid in &ours {
        // Counted as ours from the lock on: a failure from here resumes it.
        s.ours.push(pid);
        s.driver.lock(pid, LOCK_TIMEOUT_MS).map_err(|e| cuda_err(e).context(format!("suspending CUDA of {pid}")))?;
    }
    for &pid in &ours {
        s.driver.checkpoint(pid).map_err(|e| cuda_err(e).context(format!("suspending CUDA of {pid}")))?;
    }
    s.seconds = started.elapsed().as_secs_f64();
    Ok(Some(s))
}

impl Suspended {
    pub fn record(&self) -> &CudaRecord {
        &self.record
    }

    /// The dump is written: resumes what it suspended if the tree runs on
    /// (`leave_running`), else lets it go (the tree was ended); what it did.
    pub fn conclude(self, leave_running: bool) -> Result<CudaDumpReport> {
        let (record, suspend_seconds) = (self.record.clone(), self.seconds);
        let resume_seconds = if leave_running {
            Some(self.resume().map_err(|e| e.context("the checkpoint is written, but CUDA did not resume"))?)
        } else {
            self.finish();
            None
        };
        Ok(CudaDumpReport { record, suspend_seconds, resume_seconds })
    }

    /// Resumes what this dump suspended (a dump that leaves the tree
    /// running); returns the seconds it took.
    pub fn resume(mut self) -> Result<f64> {
        let started = Instant::now();
        let ours = std::mem::take(&mut self.ours);
        resume_pids(&self.driver, &ours, &[])?;
        self.guard.release();
        Ok(started.elapsed().as_secs_f64())
    }

    /// The tree was dumped and ended: nothing is left to resume.
    pub fn finish(mut self) {
        self.ours.clear();
        self.guard.release();
    }
}

impl Drop for Suspended {
    fn drop(&mut self) {
        if !self.ours.is_empty() {
            // A dump failed after the suspend. CRIU may still hold the tree
            // (its restore thread must run): wait until it lets go.
            tree::wait_untraced(&self.ours, 60_000);
            match resume_pids(&self.driver, &self.ours, &[]) {
                Ok(()) => self.guard.release(),
                // Said on stderr: a drop has no caller to tell.
                Err(e) => crate::say!("criuz: {e}; retry with: criuz gpu resume {}", pid_list(&self.ours)),
            }
        }
    }
}

/// Restores and unlocks each of `pids` as far as its state needs: a
/// checkpointed process is restored (onto `pairs` when given), a locked one
/// unlocked; a running one is left alone. Stops at the first failure.
pub fn resume_pids(driver: &Driver, pids: &[i32], pairs: &[(String, String)]) -> Result<()> {
    for &pid in pids {
        let what = || format!("resuming CUDA of {pid}");
        if driver.state(pid).map_err(|e| cuda_err(e).context(what()))? == ProcessState::Checkpointed {
            driver.restore(pid, pairs).map_err(|e| cuda_err(e).context(what()))?;
        }
        if driver.state(pid).map_err(|e| cuda_err(e).context(what()))? == ProcessState::Locked {
            driver.unlock(pid).map_err(|e| cuda_err(e).context(what()))?;
        }
    }
    Ok(())
}

/// A guard that resumes `pids` if criuz dies: `criuz gpu resume PID...`.
fn resume_guard(pids: &[i32]) -> Result<Guard> {
    let exe = std::env::current_exe()?;
    let mut argv: Vec<std::ffi::OsString> = vec![exe.into(), "gpu".into(), "resume".into()];
    argv.extend(pids.iter().map(|p| p.to_string().into()));
    let refs: Vec<&std::ffi::OsStr> = argv.iter().map(|a| a.as_os_str()).collect();
    Guard::running(&refs)
}

/// `criuz gpu resume`: resumes processes left suspended (by a criuz that
/// died, or by hand), once no tracer holds them.
pub fn resume_command(pids: &[i32]) -> Result<()> {
    let driver = Driver::load().map_err(|e| Error::Criu(e.to_string()))?;
    driver.init().map_err(cuda_err)?;
    tree::wait_untraced(pids, 60_000);
    tree::signal_tree(pids, libc::SIGCONT);
    resume_pids(&driver, pids, &[])
}

/// `criuz gpu state`: each process's checkpoint state, or why there is none.
pub fn states(pids: &[i32]) -> Result<Vec<(i32, std::result::Result<ProcessState, String>)>> {
    let driver = Driver::load().map_err(|e| Error::Criu(e.to_string()))?;
    Ok(pids.iter().map(|&p| (p, driver.state(p).map_err(|e| e.to_string()))).collect())
}

/// What a restore of CUDA processes needs: the driver, and the GPU pairs
/// for the driver's restore (empty: the same GPUs).
pub struct ResumePlan {
    driver: Driver,
    pub pids: Vec<i32>,
    pairs: Vec<(String, String)>,
}

impl std::fmt::Debug for ResumePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResumePlan").field("pids", &self.pids).field("pairs", &self.pairs).finish()
    }
}

/// Checks, before CRIU starts, that the GPUs `record` names (or those `map`
/// sends them to, `OLD=NEW` by UUID) are on this machine and of the same
/// kind; a missing driver, a missing GPU or another model is an error.
pub fn plan_resume(record: &CudaRecord, map: &[(String, String)]) -> Result<ResumePlan> {
    let pids = record.pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ");
    let driver = Driver::load()
        .map_err(|e| Error::Criu(format!("the archive holds the CUDA state of process {pids}, but {e}")))?;
    driver.init().map_err(cuda_err)?;
    let here = driver.gpus().map_err(cuda_err)?;
    let same = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    for (old, _) in map {
        if !record.gpus.iter().any(|g| same(&g.uuid, old)) {
            let had: Vec<&str> = record.gpus.iter().map(|g| g.uuid.as_str()).collect();
            return Err(Error::Usage(format!(
                "--gpu-map {old}: the archive's processes held no such GPU (they held {})",
                had.join(", ")
            )));
        }
    }
    let mut pairs = Vec::new();
    for g in &record.gpus {
        let target = map.iter().find(|(old, _)| same(old, &g.uuid)).map_or(g.uuid.as_str(), |(_, new)| new.as_str());
        let listed: Vec<String> = here.iter().map(|h| format!("{} ({})", h.uuid, h.name)).collect();
        let Some(found) = here.iter().find(|h| same(&h.uuid, target)) else {
            return Err(Error::Criu(format!(
                "the archive's CUDA state was on {} ({}), and this machine has no GPU {target} (it has: {}); name one of the same kind with --gpu-map {}=NEW",
                g.uuid,
                g.name,
                if listed.is_empty() { "none".into() } else { listed.join(", ") },
                g.uuid
            )));
        };
        if found.name != g.name {
            return Err(Error::Criu(format!(
                "the archive's CUDA state was on a {} ({}); {} is a {}: CUDA restores onto a GPU of the same kind only",
                g.name, g.uuid, found.uuid, found.name
            )));
        }
        pairs.push((g.uuid.clone(), found.uuid.clone()));
    }
    if map.is_empty() {
        pairs.clear();
    }
    Ok(ResumePlan { driver, pids: record.pids.clone(), pairs })
}

impl ResumePlan {
    /// Restores and unlocks the suspended processes of the restored tree of
    /// `root` (found by their state: a container's pids differ from the
    /// dumped ones); returns the seconds it took. Every recorded process
    /// must be found suspended. The caller kills the tree on failure.
    pub fn resume(&self, root: i32) -> Result<f64> {
        let started = Instant::now();
        let suspended: Vec<i32> = tree::tree_pids(&[root])
            .into_iter()
            .filter(|&p| matches!(self.driver.state(p), Ok(ProcessState::Checkpointed | ProcessState::Locked)))
            .collect();
        if suspended.len() != self.pids.len() {
            return Err(Error::Criu(format!(
                "the archive suspended the CUDA state of {} process(es) ({}); the restored tree of {root} has {} to resume",
                self.pids.len(),
                pid_list(&self.pids),
                suspended.len()
            )));
        }
        resume_pids(&self.driver, &suspended, &self.pairs)?;
        Ok(started.elapsed().as_secs_f64())
    }
}

/// `OLD=NEW` of `--gpu-map`.
pub fn parse_gpu_map(s: &str) -> std::result::Result<(String, String), String> {
    let (old, new) = s.split_once('=').ok_or_else(|| format!("{s}: expected OLD=NEW (GPU UUIDs)"))?;
    for u in [old, new] {
        if driver::uuid_bytes(u).is_none() {
            return Err(format!(
                "{u}: not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L prints)"
            ));
        }
    }
    Ok((old.to_string(), new.to_string()))
}

fn pid_list(pids: &[i32]) -> String {
    pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" ")
}

fn cuda_err(e: driver::DriverError) -> Error {
    Error::Criu(format!("CUDA driver: {e}"))
}

/// Whether process `pid` has libcuda mapped.
fn maps_libcuda(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains("libcuda.so"))
}

/// The GPUs `pids` hold: the GPUs whose device files (`/dev/nvidiaN`) they
/// have open, matched by minor number in `/proc/driver/nvidia/gpus`; all
/// the driver lists where that cannot be told.
fn gpus_of(pids: &[i32], listed: &[Gpu]) -> Vec<Gpu> {
    let mut minors = Vec::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else { continue };
            let t = target.to_string_lossy();
            if let Some(n) = t.strip_prefix("/dev/nvidia").and_then(|n| n.parse::<u32>().ok()) {
                if !minors.contains(&n) {
                    minors.push(n);
                }
            }
        }
    }
    let mut held = Vec::new();
    if let Ok(dirs) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        for d in dirs.flatten() {
            let Ok(info) = std::fs::read_to_string(d.path().join("information")) else { continue };
            let field = |k: &str| info.lines().find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()));
            let minor = field("Device Minor:").and_then(|m| m.parse::<u32>().ok());
            if let (Some(m), Some(uuid)) = (minor, field("GPU UUID:")) {
                if minors.contains(&m) {
                    held.extend(listed.iter().filter(|g| g.uuid.eq_ignore_ascii_case(&uuid)).cloned());
                }
            }
        }
    }
    if held.is_empty() {
        listed.to_vec()
    } else {
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_maps_parse_and_refuse_what_is_not_a_uuid() {
        let a = "GPU-01234567-89ab-cdef-1032-547698badcfe";
        let b = "GPU-11111111-2222-3333-4444-555555555555";
        assert_eq!(parse_gpu_map(&format!("{a}={b}")), Ok((a.to_string(), b.to_string())));
        assert!(parse_gpu_map(a).is_err());
        assert!(parse_gpu_map(&format!("{a}=GPU-12")).unwrap_err().contains("not a GPU UUID"));
    }
}
