//! Containers under runc: `criuz runc checkpoint|restore` (podman:
//! `session::podman`). runc and podman drive CRIU through its RPC mode,
//! which cannot stream images (CRIU aborts with `stream` in `runc.conf`), so
//! criuz goes in beside them:
//!
//! - runc checkpoint either has CRIU write into a private work directory
//!   (tmpfs when `/dev/shm` is one) and follows its page images as they
//!   grow (`follow`; a guard kills runc's CRIU should criuz die meanwhile,
//!   so the container runs on rather than ending in a checkpoint nobody
//!   packs), or gives CRIU criuz's page server (`receive`): pages are
//!   compressed as they arrive and only the metadata lands in the work
//!   directory. The page server is the default: in `criuz-bench
//!   --containers` it was as fast as following at 32 MiB and faster from
//!   128 MiB up (1.08 s against 1.70 s at 1 GiB), it needs no tmpfs room for
//!   the pages, and CRIU keeps the container frozen until the archive has
//!   every page (a failed archive leaves it running).
//!   Either way runc's own files (`descriptors.json`) join the archive.
//! - runc restore writes the images into a private work directory and runs
//!   `runc restore --image-path` on it. By default (where the kernel gives
//!   the userfaultfd CRIU needs) lazily: only what CRIU restores itself is
//!   written, and criuz serves the rest as CRIU's lazy-pages daemon (`lazy`)
//!   until every page is in, killing the container's cgroup should one fail
//!   to arrive. runc's CRIU holds the container at its pre-resume hook
//!   (`criu_hook`, through a wrapper runc runs as its CRIU) until criuz has
//!   registered its shared memory in every process. Runc
//!   cannot stream, so eagerly all of the pages are written to tmpfs before
//!   CRIU starts reading them (`images_dir`, every check first): lazily that
//!   copy overlaps CRIU's restore instead of preceding it, so the lazy
//!   restore has every page in place sooner than the eager one has started
//!   the container (`criuz-bench --containers`, docs/BENCHMARKS.md).
//!   `Memory::Eager` keeps the container from running until all of its
//!   memory is in place.
//! - podman's checkpoint is a tar stream; `session::podman` packs it.
//!
//! runc is told which CRIU to use (`runc --criu`), the one criuz found. A
//! failed runc leaves its CRIU log in `workdir::log_dir`, named in the
//! error; the work directory is removed unless it holds images that are the
//! only copy of a checkpoint.

use crate::archive::{Options, Packer};
use crate::criu::Criu;
use crate::cuda::{self, CudaDumpReport, CudaRecord};
use crate::error::{Error, IoContext, Result};
use crate::io::Output;
use crate::proc::guard::{wait_guarded, Guard};
use crate::proc::{claim, outside};
use crate::session::criu_run::{cannot_run, criu_failure, ids_by_default};
use crate::session::follow::follow_pages;
use crate::session::receive::{self, PageServer};
use crate::session::workdir::WorkDir;
use crate::tree::Before;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

mod restore;

pub use restore::{runc_restore, ContainerRestoreReport, Memory, RestoredHow, RuncRestore};

/// How to run runc.
#[derive(Clone, Debug)]
pub struct Runc {
    pub binary: PathBuf,
    /// runc's state root (`runc --root`), when not its default.
    pub root: Option<PathBuf>,
}

impl Runc {
    fn command(&self, criu: &Criu) -> Command {
        self.command_running(&criu.path)
    }

    /// runc told to run `criu` as its CRIU.
    fn command_running(&self, criu: &Path) -> Command {
        let mut c = crate::spawn::command(&self.binary);
        if let Some(root) = &self.root {
            c.arg("--root").arg(root);
        }
        c.arg("--criu").arg(criu);
        c
    }

    /// `runc delete -f` of a container whose restore failed. A runc whose
    /// restore was cut short can leave the container's root file system
    /// bind-mounted in its state directory (`criu-root`, made for CRIU),
    /// and `runc delete` removes that directory recursively: through the
    /// mount, it would delete the container's files. So what is mounted
    /// there is detached first.
    /// The host pid of container `id`'s init (`runc state`).
    fn init_pid(&self, criu: &Criu, id: &str) -> Result<i32> {
        let out = self.command(criu).args(["state", id]).stdin(Stdio::null()).output();
        let out = out.map_err(|e| cannot_run(self.binary.display(), e))?;
        let state: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        match state["pid"].as_i64() {
            Some(pid) if out.status.success() && pid > 0 => Ok(pid as i32),
            _ => Err(Error::Criu(format!(
                "runc state {id}: no running container ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
        }
    }

    fn delete_failed(&self, criu: &Criu, id: &str) {
        let root = self.root.clone().unwrap_or_else(|| PathBuf::from("/run/runc"));
        crate::io::leftover::detach_mounts_below(&root.join(id));
        let _ = self.command(criu).args(["delete", "-f", id]).stdin(Stdio::null()).output();
    }
}

/// How the pages get from CRIU into the archive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// CRIU writes into a private tmpfs directory; its page images are
    /// followed and compressed as they grow (`follow`).
    Follow,
    /// CRIU sends its pages to criuz's page server (`receive`): nothing of
    /// them is written locally.
    PageServer,
}

#[derive(Clone, Debug)]
pub struct RuncCheckpoint {
    pub id: String,
    pub output: PathBuf,
    pub force: bool,
    pub leave_running: bool,
    pub via: Via,
    /// More `runc checkpoint` options (e.g. `--tcp-established`).
    pub extra: Vec<String>,
    /// Leave the container's CUDA processes as they are (see `cuda`).
    pub no_gpu: bool,
    /// Store page ids where the container's processes share much of their
    /// memory or hold CUDA state (as `criuz dump` does:
    /// `criu_run::ids_by_default`); off with `--no-ids`.
    pub auto_ids: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckpointReport {
    pub output: PathBuf,
    pub via: Via,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub ratio: f64,
    pub seconds: f64,
    pub files: u64,
    pub zero_pages: u64,
    /// The container's CUDA processes: suspended before runc froze it.
    pub cuda: Option<CudaDumpReport>,
}

/// A private work directory, on tmpfs when `/dev/shm` is one: a
/// container's images never touch a disk this way.
pub(crate) fn work_dir(prefix: &str) -> Result<WorkDir> {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(w) = WorkDir::new_in(shm, prefix) {
            return Ok(w);
        }
    }
    WorkDir::new(prefix)
}

pub(super) fn images_dir(work: &WorkDir) -> Result<PathBuf> {
    let d = work.path().join("images");
    std::fs::DirBuilder::new().mode(0o700).create(&d).at(&d)?;
    Ok(d)
}

/// `runc checkpoint` of container `o.id` into one archive. Complete only
/// when runc exits 0 and the images hold `inventory.img`; otherwise nothing
/// is published.
///
/// The container is not lost to a failure after CRIU (a full disk, a dead
/// object store, a killed criuz): runc has no `--leave-stopped`, so criuz
/// pauses the container (its freezer), has runc checkpoint it with
/// `--leave-running` (CRIU leaves a frozen container frozen), and ends it
/// (`runc delete -f`) only once the archive is committed; any failure
/// resumes it, and a guard runs `runc resume` should criuz die meanwhile.
/// Where runc cannot pause it, the checkpoint ends the container as runc
/// does, and images the work directory holds when the archive then fails
/// are kept and named.
///
/// The container's CUDA processes are suspended before it is paused (a
/// frozen process cannot let the driver move its GPU state), recorded in
/// the archive, and resumed after a `--leave-running` checkpoint or any
/// failure (after the container is resumed).
pub fn runc_checkpoint(runc: &Runc, o: &RuncCheckpoint, opts: &Options, criu: &Criu) -> Result<CheckpointReport> {
    let started = Instant::now();
    // A container runc cannot report fails in runc checkpoint, saying why.
    let init = runc.init_pid(criu, &o.id);
    // One checkpoint of its processes at a time, as for `criuz dump`.
    let _claim = init.as_ref().ok().map(|&pid| claim::claim_tree(pid)).transpose()?;
    if let Ok(pid) = init {
        outside::refuse_while_arriving(pid)?;
    }
    let suspended = match (o.no_gpu, &init) {
        (false, Ok(pid)) => cuda::suspend_tree(*pid)?,
        _ => None,
    };
    let opts = &Options {
        ids: opts.ids || (o.auto_ids && init.is_ok_and(|pid| ids_by_default(pid, suspended.is_some()))),
        ..opts.clone()
    };
    let held = if o.leave_running { None } else { Held::pause(runc, criu, &o.id) };
    let record = suspended.as_ref().map(|s| s.record());
    let written = checkpoint_into(runc, o, opts, criu, held.as_ref().map(|h| &h.guard), record);
    let report = match (written, held) {
        (Ok(report), Some(held)) => {
            held.end();
            report
        }
        (Ok(report), None) => report,
        (Err(e), Some(held)) => {
            held.resume();
            // `suspended`, dropped on the way out, resumes CUDA.
            return Err(e.context(format!("no checkpoint written; container {} was resumed", o.id)));
        }
        (Err(e), None) => return Err(e),
    };
    let cuda = suspended.map(|s| s.conclude(o.leave_running)).transpose()?;
    Ok(CheckpointReport { seconds: started.elapsed().as_secs_f64(), cuda, ..report })
}

/// A container criuz paused for its checkpoint, and the guard that resumes
/// it should criuz die.
struct Held<'a> {
    runc: &'a Runc,
    criu: &'a Criu,
    id: &'a str,
    guard: Guard,
}

impl<'a> Held<'a> {
    /// Pauses the container, or None where that cannot be done (no guard,
    /// no freezer, runc refuses): the checkpoint then goes as runc's own.
    fn pause(runc: &'a Runc, criu: &'a Criu, id: &'a str) -> Option<Held<'a>> {
        let binary = if runc.binary.components().count() > 1 {
            runc.binary.clone()
        } else {
            crate::criu::on_path(&runc.binary.to_string_lossy())?
        };
        let mut argv: Vec<std::ffi::OsString> = vec![binary.into()];
        if let Some(root) = &runc.root {
            argv.extend(["--root".into(), root.clone().into()]);
        }
        argv.extend(["resume".into(), id.into()]);
        let refs: Vec<&std::ffi::OsStr> = argv.iter().map(|a| a.as_os_str()).collect();
        // The guard first: a criuz that dies right after the pause must not
        // leave the container frozen.
        let guard = Guard::running(&refs).ok()?;
        let mut pause = runc.command(criu);
        pause.args(["pause", id]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // Told to the guard: a pause still under way when criuz dies would
        // freeze the container after the guard resumed it.
        let paused = pause.spawn().and_then(|mut c| {
            let told = guard.wait_for(c.id());
            let st = c.wait()?;
            told.map_err(|e| std::io::Error::other(e.to_string()))?;
            Ok(st)
        });
        if !paused.is_ok_and(|st| st.success()) {
            guard.release();
            return None;
        }
        Some(Held { runc, criu, id, guard })
    }

    /// The archive is committed: the container ends, as after runc's own
    /// checkpoint.
    fn end(self) {
        let _ = self.runc.command(self.criu).args(["delete", "-f", self.id]).stdin(Stdio::null()).output();
        self.guard.release();
    }

    fn resume(self) {
        let _ = self.runc.command(self.criu).args(["resume", self.id]).stdin(Stdio::null()).output();
        self.guard.release();
    }
}

/// The checkpoint itself: runc (with CRIU) and the archive, committed.
/// `held`: the container is paused and stays so (`--leave-running`); its
/// guard waits for the runc checkpointing it.
fn checkpoint_into(
    runc: &Runc,
    o: &RuncCheckpoint,
    opts: &Options,
    criu: &Criu,
    held: Option<&Guard>,
    cuda: Option<&CudaRecord>,
) -> Result<CheckpointReport> {
    let opts = Options { tree: true, ..opts.clone() };
    let out = Output::open(&o.output, o.force)?;
    let work = work_dir("criuz-runc-")?;
    let images = images_dir(&work)?;
    if let Some(record) = cuda {
        // Packed with CRIU's images; CRIU ignores a file it does not know.
        let at = images.join(crate::cuda::RECORD_FILE);
        std::fs::write(&at, serde_json::to_vec_pretty(record).unwrap_or_default()).at(&at)?;
    }
    let mut cmd = runc.command(criu);
    cmd.arg("checkpoint").arg("--image-path").arg(&images).arg("--work-path").arg(work.path());
    if o.leave_running || held.is_some() {
        cmd.arg("--leave-running");
    }
    cmd.args(&o.extra);
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let what = format!("runc checkpoint {}", o.id);
    let packer = Packer::start(out.writer()?, &opts, None)?;
    let stats = match o.via {
        Via::PageServer => {
            let server = PageServer::bind("127.0.0.1:0")?;
            cmd.arg("--page-server").arg(server.local_addr()?.to_string()).arg(&o.id);
            receive::run_dump(&server, cmd, &what, &images, &Before::default(), packer, held)
                .map(|(stats, _)| stats)
                .map_err(|e| e.context(format!("no checkpoint written ({})", work.save_log("dump.log"))))?
        }
        Via::Follow => {
            cmd.arg(&o.id);
            if !o.leave_running && held.is_none() {
                // runc's CRIU may end the container and leave its images
                // here as the only copy, even if criuz is interrupted.
                work.keep_on_interrupt();
            }
            let done = AtomicBool::new(false);
            let (status, followed) = std::thread::scope(|s| {
                let f = s.spawn(|| follow_pages(&images, &packer, &done));
                // Not once an interruption has begun (`criu_run::run_criu_told`).
                let status = crate::io::unfinished::uninterrupted(|| cmd.spawn()).and_then(|mut c| {
                    if let Some(g) = held {
                        g.wait_for(c.id()).map_err(|e| std::io::Error::other(e.to_string()))?;
                    }
                    wait_guarded(&mut c)
                });
                done.store(true, Ordering::Release);
                (status, f.join().unwrap_or(Err(Error::Cancelled)))
            });
            match status {
                Ok(st) if st.success() => {}
                Ok(st) => {
                    let e = criu_failure(&what, st, &work.save_log("dump.log"));
                    return Err(packer.abort().unwrap_or(e));
                }
                Err(e) => {
                    let e = cannot_run(runc.binary.display(), e);
                    return Err(packer.abort().unwrap_or(e));
                }
            }
            let written = match followed {
                Ok(names) => {
                    let not_followed = |e: &crate::tree::Entry| Ok(!names.contains(&e.path));
                    receive::finish_with_images(packer, &images, &Before::default(), &not_followed)
                        .map(|(stats, _)| stats)
                }
                Err(e) => Err(packer.abort().unwrap_or(e)),
            };
            match written {
                Ok(stats) => stats,
                Err(e) if o.leave_running || held.is_some() => return Err(e),
                Err(e) => {
                    let kept = work.keep();
                    return Err(e.context(format!(
                        "{what} succeeded but the archive could not be written; the images are kept in {}",
                        kept.join("images").display()
                    )));
                }
            }
        }
    };
    out.commit()?;
    Ok(CheckpointReport {
        output: o.output.clone(),
        via: o.via,
        raw_bytes: stats.raw_bytes,
        archive_bytes: stats.archive_bytes,
        ratio: stats.ratio(),
        seconds: 0.0,
        files: stats.files,
        zero_pages: stats.zero_pages,
        cuda: None,
    })
}
