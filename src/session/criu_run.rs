//! Running CRIU, the parts every command that runs it shares: the options
//! and command line of a `criu restore` (streamed or lazy), the restored pid
//! handed to the user, what a CRIU that failed or could not be run is
//! reported as, and the check that a checkpointed tree's pids are free
//! before a restore.

use crate::archive::{BlockSource, ParentSearch};
use crate::criu::options::{self, CriuOptions};
use crate::criu::{self, images, Criu};
use crate::cuda;
use crate::error::{Error, IoContext, Result};
use crate::io::Location;
use crate::proc::{holder, memory, restored, tree};
use crate::progress::Meter;
use crate::session::place::HugePages;
use crate::session::workdir::{criu_output, SavedLog};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// A restore from an archive, streamed (`checkpoint::restore_opened`) or lazy
/// (`lazy::restore_lazy`).
#[derive(Clone, Debug)]
pub struct RestoreOptions {
    /// Where the archive is.
    pub input: Location,
    /// Return once the tree runs; without, the caller waits for the tree
    /// (`proc::foreground`), whose root CRIU makes criuz's child.
    pub detach: bool,
    pub shell_job: bool,
    pub extra: Vec<String>,
    /// Cap on the archive bytes spooled to a temporary file when it comes from a pipe.
    pub pipe_buffer: u64,
    /// Send CRIU every zero page instead of leaving them out where that is safe.
    pub keep_zero_pages: bool,
    /// Whether a placed restore writes private memory where the process may
    /// have had transparent huge pages so that it gets them again
    /// (`proc::huge_pages`), and when it gives up on them.
    pub huge_pages: HugePages,
    /// Where to look for the parents of an incremental archive.
    pub parents: ParentSearch,
    /// Written with the restored pid once the tree runs.
    pub pidfile: Option<PathBuf>,
    /// Counts the page bytes served, for a progress line.
    pub meter: Option<Arc<Meter>>,
    /// A lazy restore proves every stored byte before CRIU starts instead
    /// of behind the running tree (see `session::lazy`).
    pub verify_first: bool,
    /// GPUs to restore CUDA state onto in place of those it was dumped
    /// from (old UUID, new UUID).
    pub gpu_map: Vec<(String, String)>,
}

/// Why a pid a process group or session still names is not free.
fn still_named(n: &holder::Naming) -> String {
    let zombie = if n.holder.zombie { ", a zombie not reaped yet" } else { "" };
    format!(
        "pid {} of the checkpointed tree is still the {} of process {} ({}{zombie}), which outlived the process \
         that had the pid (a child it forked?): the pid is not free until that process ends; end it and restore \
         again",
        n.pid, n.as_what, n.by, n.holder.comm
    )
}

/// CRIU (or runc, podman: `what`) exited with `status`; its log is kept as
/// `log`, and its last errors go into the message.
pub(crate) fn criu_failure(what: &str, status: std::process::ExitStatus, log: &SavedLog) -> Error {
    let Some(path) = log.path() else { return Error::Criu(format!("{what} failed ({status}); {log}")) };
    let errs = criu::log_errors(path, 3).join(" | ");
    let errs = if errs.is_empty() { errs } else { format!("; {errs}") };
    // A pid CRIU could not have: named by the process keeping it, where a
    // session keeps it that the check before CRIU could not see.
    let kept = criu::log_pid_taken(path).and_then(|pid| holder::namer_among(&[pid]));
    // A process CRIU could not stop that has ended since (or is ending)
    // was not traced by another: it exited while CRIU seized the tree.
    let ended =
        criu::log_uninterrupted(path).filter(|&pid| holder::holder_of(pid).is_none_or(|h| h.exiting || h.zombie));
    let hint = match (kept, ended) {
        (Some(n), _) => format!(" ({})", still_named(&n)),
        (None, Some(pid)) => format!(
            " (process {pid} of the tree ended while CRIU was stopping it: nothing was dumped; dump again if the \
             tree still runs)"
        ),
        (None, None) => oom_hint(&errs, memory::oom_kills_since_noted())
            .or_else(|| criu::log_hint(path).map(str::to_string))
            .map(|h| format!(" ({h})"))
            .unwrap_or_default(),
    };
    let log = match log {
        SavedLog::Kept(path) => format!("log: {}", path.display()),
        not_kept => not_kept.to_string(),
    };
    Error::Criu(format!("{what} failed ({status}); {log}{errs}{hint}"))
}

/// Why a process of the tree was "killed by signal 9" (CRIU's words for a
/// restored process that died under it), where the machine counted OOM
/// kills since criuz started: memory taken by others meanwhile, or a tree
/// larger than the check before CRIU counted.
fn oom_hint(errs: &str, kills_since_start: Option<u64>) -> Option<String> {
    let kills = kills_since_start.filter(|&n| n > 0 && errs.contains("killed by signal 9"))?;
    Some(format!(
        "the kernel's OOM killer ended {kills} process{} meanwhile: the tree needed more memory than its memory \
         cgroup or the machine had left; free some, or raise the limit, and restore again",
        if kills == 1 { "" } else { "es" }
    ))
}

/// How a CRIU run on a thread of its own ended (the thread joined).
pub(crate) type CriuThread = std::thread::JoinHandle<std::io::Result<std::process::ExitStatus>>;

/// Joins `run`, a thread that ran CRIU: CRIU's exit status.
pub(crate) fn join_criu_thread(run: CriuThread) -> std::io::Result<std::process::ExitStatus> {
    run.join().unwrap_or_else(|_| Err(std::io::Error::other("the thread running CRIU panicked")))
}

/// `program` (CRIU, runc, podman) could not be run.
pub(crate) fn cannot_run(program: impl std::fmt::Display, err: std::io::Error) -> Error {
    // CRIU ran, and was ended for waiting for good: its failure, not a
    // CRIU that could not run.
    if let Some(stuck) = err.get_ref().and_then(|e| e.downcast_ref::<CriuStuck>()) {
        return Error::Criu(stuck.to_string());
    }
    Error::CriuIo { what: format!("cannot run {program}"), err }
}

/// A restoring CRIU ended by criuz because it waited for good on a thread
/// of the tree that a SIGCONT had stopped in a ptrace trap
/// (`proc::stuck`): returned by [`run_restoring_criu`] inside the
/// `io::Error` of a CRIU run, and said by [`cannot_run`].
#[derive(Debug, thiserror::Error)]
#[error(
    "CRIU waited for good: thread {tid} of the restored tree was continued (SIGCONT) while CRIU held it in its last \
     restore stage, which stops it in a ptrace trap that CRIU does not answer; criuz ended CRIU and the \
     half-restored tree after {waited} s without progress: restore again, with nothing sending the tree signals \
     meanwhile",
    waited = crate::proc::stuck::Watch::FOR.as_secs()
)]
pub(crate) struct CriuStuck {
    tid: i32,
}

/// How long a restore waits for a killed process on one of its pids to
/// finish exiting (the kernel freeing a large process's memory).
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a dump stores page ids (and so dedups within the archive)
/// without being asked: for a tree of several processes that share at
/// least a quarter of their anonymous memory (`shared` of `anon` bytes, as
/// [`tree::shared_anon_bytes`] counts them): forked children that still
/// share most of their memory with their parent, which CRIU writes for each
/// of them (measured in docs/BENCHMARKS.md, `forked`). Hashing every page
/// costs CPU: a single process, or a tree that shares little (a shell
/// wrapper and the program it started), is left without (512 MiB mixed on
/// 2 cores: durable dump 0.42 s with against 0.34 s without).
pub fn dedups_within(processes: usize, shared: u64, anon: u64) -> bool {
    processes > 1 && shared > 0 && shared.saturating_mul(4) >= anon
}

/// Whether a dump of the tree of `root` stores page ids without being
/// asked: where [`dedups_within`] says so of the tree as it is now, or
/// where the dump suspended CUDA state in it (`holds_cuda`). The driver's
/// checkpoint brings the process's device memory into its host memory,
/// and GPU allocators (PyTorch's caching allocator) keep freed blocks with
/// their bytes: a temporary a tensor was filled or converted from is a
/// second copy of it (3.2 GB of the 21.7 GB image of `criuz-bench --gpu`'s
/// app look like one). The hashing costs CPU where nothing repeats: on 2
/// cores, 1 GiB of bf16 dumped in 1.23 s instead of 0.95 s with LZ4
/// (docs/BENCHMARKS.md, session 28), a cost paid on a machine's spare
/// cores where it has them.
pub(crate) fn ids_by_default(root: i32, holds_cuda: bool) -> bool {
    if holds_cuda {
        return true;
    }
    let pids = tree::tree_pids(&[root]);
    // smaps_rollup walks the page tables (about 10 ms a GiB): one process
    // is decided without it.
    let (shared, anon) = if pids.len() > 1 { tree::shared_anon_bytes(&pids) } else { (0, 0) };
    dedups_within(pids.len(), shared, anon)
}

/// Why criuz neither dumps nor restores a tree that is a pid namespace of
/// its own (its root is pid 1 in it). CRIU restores such a tree in a new
/// namespace, where the archive's pids are numbered; criuz keeps, ends and
/// resumes a restored tree by its pids here, which it would learn only
/// once CRIU had forked it: a criuz that died before would leave the tree
/// half restored for good, and the archive's pids, taken as pids here,
/// would name other processes.
pub(crate) const PID_NAMESPACE_REFUSED: &str =
    "criuz restores a tree by its pids in this namespace, so it takes no pid namespaces (containers go through runc \
     or podman)";

/// CRIU restores every process and thread under its old id; one still in use
/// (often the dumped process itself, not yet reaped by its parent), or still
/// named as a session or process group by a process that outlived its
/// holder, would make CRIU fail with "Can't fork for PID: File exists".
/// Returns the tree's pids, once it has moved the pid counter past them
/// (`holder::allocate_new_pids_above`: no task started while CRIU restores
/// takes one); an archive that holds no process tree is refused before
/// CRIU runs.
pub(crate) fn check_pids_free(source: &dyn BlockSource) -> Result<Vec<i32>> {
    let Some(entry) = source.find("pstree.img") else {
        return Err(Error::Usage(format!(
            "{}: not a process checkpoint (it holds no pstree.img); criuz unpack writes out the files it holds",
            source.label()
        )));
    };
    let Some(pids) = images::pstree_pids(&source.read_file(entry)?).filter(|p| !p.is_empty()) else {
        return Err(Error::Mismatch(format!("{}: pstree.img holds no CRIU process tree", source.label())));
    };
    let pids: Vec<i32> = pids.into_iter().map(|p| p as i32).collect();
    if pids.first() == Some(&1) {
        return Err(Error::Criu(format!(
            "cannot restore {}: its tree was the init of its own pid namespace (pid 1): {PID_NAMESPACE_REFUSED}; \
             restore it with criuz unpack ARCHIVE -d DIR, then criu restore -D DIR",
            source.label()
        )));
    }
    // A tree dumped just before is killed but may still be on its way out.
    holder::wait_exits(&pids, EXIT_WAIT);
    for &pid in &pids {
        if let Some(holder::Holder { comm, zombie, exiting, parent, .. }) = holder::holder_of(pid) {
            let why = if zombie {
                let by = holder::holder_of(parent).map_or(String::new(), |p| format!(", {}", p.comm));
                format!("a zombie its parent (pid {parent}{by}) has not reaped yet")
            } else if exiting {
                "killed, still exiting".to_string()
            } else {
                "running".to_string()
            };
            return Err(Error::Criu(format!(
                "cannot restore: pid {pid} of the checkpointed tree is in use by {comm} ({why}); \
                 a dumped process keeps its pid until its parent reaps it"
            )));
        }
    }
    holder::wait_unnamed(&pids, EXIT_WAIT);
    if let Some(n) = holder::named_elsewhere(&pids) {
        return Err(Error::Criu(format!("cannot restore: {}", still_named(&n))));
    }
    holder::allocate_new_pids_above(&pids);
    Ok(pids)
}

/// The CUDA resume a restore of `source` needs, checked before CRIU starts
/// (`cuda::plan_resume`): None for an archive without CUDA processes.
/// `returns_running`: the restore returns while the tree runs (the resume
/// needs that; a bare restore always does, runc only with --detach).
pub(crate) fn cuda_plan(
    source: &dyn BlockSource,
    gpu_map: &[(String, String)],
    returns_running: bool,
) -> Result<Option<cuda::ResumePlan>> {
    let Some(entry) = source.find(cuda::RECORD_FILE) else {
        if let Some((old, _)) = gpu_map.first() {
            return Err(Error::Usage(format!("--gpu-map {old}: {} holds no CUDA state", source.label())));
        }
        return Ok(None);
    };
    let record: cuda::CudaRecord = serde_json::from_slice(&source.read_file(entry)?)
        .map_err(|e| Error::Mismatch(format!("{}: {}: {e}", source.label(), cuda::RECORD_FILE)))?;
    if !returns_running {
        return Err(Error::Usage(
            "an archive with CUDA state restores with -d (criuz resumes CUDA once the tree runs)".into(),
        ));
    }
    cuda::plan_resume(&record, gpu_map).map(Some)
}

/// Resumes the CUDA processes of the restored tree of `root` (read from
/// CRIU's `pidfile`) as `plan` says; the seconds it took. On failure the
/// caller kills the tree.
pub(crate) fn resume_cuda(plan: Option<&cuda::ResumePlan>, pidfile: &Path) -> Result<Option<f64>> {
    let Some(plan) = plan else { return Ok(None) };
    let root: i32 = std::fs::read_to_string(pidfile)
        .at(pidfile)?
        .trim()
        .parse()
        .map_err(|_| Error::Criu(format!("{}: CRIU wrote no pid", pidfile.display())))?;
    plan.resume(root).map(Some)
}

/// Why a restore whose `--pidfile` could not be written failed (the tree
/// is killed: a supervisor told the restore failed must not find it
/// running, nor lose track of one it has no pid for).
pub(crate) const PIDFILE_FAILED: &str = "cannot write --pidfile, restored tree killed";

/// Copies CRIU's pidfile in `work` to the user's `to`, complete or not at
/// all (written beside it, then renamed).
pub(crate) fn publish_pidfile(ours: &Path, to: Option<&Path>) -> Result<()> {
    let Some(to) = to else { return Ok(()) };
    let pid = std::fs::read_to_string(ours).at(ours)?;
    crate::io::replace_small_file(to, 0o644, format!("{}\n", pid.trim()).as_bytes())
}

/// Bytes of a CRIU image that holds no entry: its two magic numbers.
const EMPTY_IMAGE_BYTES: u64 = 8;

/// What a checkpoint holds that CRIU restores only when told so again, as
/// the dump was: file locks (entries in `filelocks.img`, written for a dump
/// given `--file-locks`) and established TCP connections (a
/// `tcp-stream-*.img` each, for `--tcp-established`). Told nothing, CRIU
/// restores the tree without its locks and without a word (found by hand:
/// an SQLite process holding its database locked came back holding no
/// lock, and another process wrote the database under it), and fails on
/// the connections. What the dump was asked for, the restore does.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ToldAgain {
    pub file_locks: bool,
    pub tcp_connections: bool,
}

impl ToldAgain {
    /// What the CRIU images of `source` hold.
    pub(crate) fn of(source: &dyn BlockSource) -> ToldAgain {
        let mut held = ToldAgain::default();
        for f in source.index().files.iter().filter(|f| f.is_criu_image()) {
            held.note(&f.name, f.raw_size);
        }
        held
    }

    /// The options that say so, the same to CRIU, runc and podman, but for
    /// those `given` says were given (`--tcp-close`, CRIU's, asks for the
    /// connections closed instead).
    pub(crate) fn options(&self, given: impl Fn(&str) -> bool) -> Vec<&'static str> {
        let closed = given("--tcp-close");
        [(self.file_locks, "--file-locks"), (self.tcp_connections && !closed, "--tcp-established")]
            .into_iter()
            .filter(|&(held, option)| held && !given(option))
            .map(|(_, option)| option)
            .collect()
    }

    /// Notes CRIU's image `name`, of `size` bytes.
    pub(crate) fn note(&mut self, name: &str, size: u64) {
        self.file_locks |= name == "filelocks.img" && size > EMPTY_IMAGE_BYTES;
        self.tcp_connections |= name.starts_with("tcp-stream-");
    }
}

/// `criu restore` in `mode` (`--stream`, `--lazy-pages`) from `dir`, with
/// the user's options, and what `source` holds that CRIU must be told again
/// ([`ToldAgain`]); the restored pid goes to `pidfile`. CRIU returns
/// once the tree runs, with or without -d: without, the root is made
/// criuz's own child (`--restore-sibling`), for criuz to wait for
/// (`proc::foreground`). CRIU gets criuz's standard streams where the tree
/// takes them (a `--shell-job` tree its terminal, `--inherit-fd`), with or
/// without -d.
pub(crate) fn restore_command(
    criu: &Criu,
    o: &RestoreOptions,
    source: &dyn BlockSource,
    mode: &str,
    dir: &Path,
    pidfile: &Path,
) -> Command {
    let mut cmd = crate::spawn::command(&criu.path);
    cmd.args(["restore", mode, "-o", "restore.log", "--pidfile"]).arg(pidfile).arg("-D").arg(dir);
    let given = CriuOptions::read(&o.extra);
    cmd.args(ToldAgain::of(source).options(|option| given.is_set(option.trim_start_matches("--"))));
    // Where the log goes, whatever CRIU's config files say.
    cmd.arg("-W").arg(dir);
    cmd.arg("--restore-detached");
    if !o.detach {
        cmd.arg("--restore-sibling");
    }
    // CRIU's own output goes to its log. criuz's standard streams are given
    // to it only for the tree to take: a `--shell-job` tree's terminal, or
    // what `--inherit-fd` names. Otherwise every helper CRIU forks holds
    // copies of them, and one left stopped by a criuz killed during CRIU's
    // start (its kernel probe, stopped under its ptrace, until the next
    // criuz sweeps it) kept a pipe out of criuz open: whoever read criuz's
    // output never saw its end.
    // With -d too: a detached `--shell-job` restore failed "Don't have tty
    // to inherit session from", and `--inherit-fd fd[1]:...` gave the tree
    // CRIU's output file.
    let tree_takes_streams = o.shell_job || given.is_set("shell-job") || given.value("inherit-fd").is_some();
    if !tree_takes_streams {
        let (stdout, stderr) = criu_output(dir);
        cmd.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    }
    if o.shell_job {
        cmd.arg("--shell-job");
    }
    cmd.args(options::anchored(&o.extra));
    // Unless the user injects a fault of their own.
    if let (Some(fault), None) = (criu.no_breakpoints_fault(), std::env::var_os("CRIU_FAULT")) {
        cmd.env("CRIU_FAULT", fault);
    }
    die_with_criuz(&mut cmd);
    cmd
}

/// Runs CRIU (or runc, which runs CRIU) to its end, ending meanwhile and
/// after what CRIU forked and left behind (`restored::end_criu_strays`): a
/// probe left stopped by a killed CRIU holds copies of its sockets, so the
/// runc above it, or criuz's own image socket, would wait for it forever.
/// `keep` (a restored tree's pids) is spared. `guard` is told to wait for
/// the process before it acts (a paused container is resumed only once
/// the runc checkpointing it ends).
pub(crate) fn run_criu_told(
    cmd: &mut Command,
    keep: &[i32],
    guard: Option<&crate::proc::guard::Guard>,
) -> std::io::Result<std::process::ExitStatus> {
    run_criu_watched(cmd, keep, guard, false)
}

/// [`run_criu_told`] for a restore (`criu restore`, or `runc restore`): a
/// CRIU that waits for good on a thread of the tree it traces
/// (`proc::stuck`: CRIU 4.2.1 after a SIGCONT from outside in its last
/// stages) is killed with the threads it traces, and the run's error,
/// once the process criuz started has ended, is a [`CriuStuck`]; what is
/// left of the tree is the caller's to end, as after any failed CRIU. Not
/// for a dump, whose CRIU traces a frozen tree and must not be killed
/// while its parasite runs there.
pub(crate) fn run_restoring_criu(
    cmd: &mut Command,
    keep: &[i32],
    guard: Option<&crate::proc::guard::Guard>,
) -> std::io::Result<std::process::ExitStatus> {
    run_criu_watched(cmd, keep, guard, true)
}

fn run_criu_watched(
    cmd: &mut Command,
    keep: &[i32],
    guard: Option<&crate::proc::guard::Guard>,
    watch_stuck: bool,
) -> std::io::Result<std::process::ExitStatus> {
    restored::become_subreaper();
    // Not once an interruption has begun: it ends the CRIU (or runc) it
    // finds, and one started after that would outlive criuz.
    let mut child = crate::io::unfinished::uninterrupted(|| cmd.spawn())?;
    if let Some(g) = guard {
        if let Err(e) = g.wait_for(child.id()) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(e.to_string()));
        }
    }
    let mut spared = keep.to_vec();
    spared.push(child.id() as i32);
    let watch = watch_stuck.then(|| crate::proc::stuck::Watch::new(child.id() as i32));
    let status = wait_watched(&mut child, watch, || restored::end_criu_strays(&spared));
    restored::end_criu_strays(keep);
    status
}

/// `podman container restore` run to its end, the CRIU it runs watched as
/// [`run_restoring_criu`] watches runc's. That CRIU runs below conmon,
/// outside criuz's tree (so criuz is not made its subreaper: conmon would
/// come to it), and is found by `path_dir`, which criuz put first on the
/// `PATH` it gave podman.
pub(crate) fn run_podman_restore(
    cmd: &mut Command,
    path_dir: std::path::PathBuf,
) -> std::io::Result<std::process::ExitStatus> {
    let mut child = cmd.spawn()?;
    wait_watched(&mut child, Some(crate::proc::stuck::Watch::path_first(path_dir)), || {})
}

/// Waits for `child` to end, calling `meanwhile` between looks. A CRIU that
/// `watch` finds waiting for good is killed with the threads it traces;
/// the result is then a [`CriuStuck`], once `child` has ended (as it does
/// when its CRIU dies).
fn wait_watched(
    child: &mut std::process::Child,
    mut watch: Option<crate::proc::stuck::Watch>,
    mut meanwhile: impl FnMut(),
) -> std::io::Result<std::process::ExitStatus> {
    let exited = ExitWatch::open(child.id());
    let mut between = ExitWatch::FIRST_CHECKS;
    let mut ended_stuck = None;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        meanwhile();
        if let Some(stuck) = watch.as_mut().and_then(|w| w.look()) {
            // The tree first, while CRIU still holds it: let go by a dead
            // CRIU, its threads would run on in CRIU's restorer.
            for &tid in &stuck.traced {
                // SAFETY: a thread of the tree this CRIU restores (it traces
                // it): the whole process goes.
                unsafe { libc::kill(tid, libc::SIGKILL) };
            }
            // SAFETY: the CRIU this restore runs (criuz's child, or runc's
            // below it, or podman's), found waiting for good. Killing the
            // tree alone does not wake it.
            unsafe { libc::kill(stuck.criu, libc::SIGKILL) };
            ended_stuck = Some(CriuStuck { tid: stuck.trapped });
            // A runc above it fails on its own as its CRIU dies.
            watch = None;
        }
        exited.wait(between);
        between = exited.next(between);
    };
    match ended_stuck {
        Some(stuck) => Err(std::io::Error::other(stuck)),
        None => Ok(status),
    }
}

/// Waits for a child to exit, at most a given time: through a pidfd where
/// the kernel has them (the wait ends as the child exits), by sleeping
/// otherwise. With a 10 ms sleep between checks, CRIU's exit went unseen for
/// up to 10 ms, which a lazy restore's pidfile and a dump's archive waited
/// out.
struct ExitWatch(Option<std::os::fd::OwnedFd>);

impl ExitWatch {
    /// Between the first checks for strays: CRIU's probes come as it starts.
    const FIRST_CHECKS: std::time::Duration = std::time::Duration::from_millis(10);
    /// At most between later checks. A runc in the foreground (and criuz
    /// with it) waits as long as the restored container runs: checked
    /// every 10 ms, that was a hundred wakeups a second meanwhile.
    const LATER_CHECKS: std::time::Duration = std::time::Duration::from_secs(1);

    /// The wait after one of `last`: doubled up to [`Self::LATER_CHECKS`]
    /// where the pidfd ends the wait as CRIU exits, else as before.
    fn next(&self, last: std::time::Duration) -> std::time::Duration {
        match self.0 {
            Some(_) => (last * 2).min(Self::LATER_CHECKS),
            None => last,
        }
    }

    fn open(pid: u32) -> Self {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor (or -1), which the OwnedFd then owns.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: a descriptor pidfd_open just returned, owned by nothing else.
        ExitWatch((fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }))
    }

    fn wait(&self, most: std::time::Duration) {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.0 else {
            std::thread::sleep(most);
            return;
        };
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd on our stack; a pidfd reads ready once the process exits.
        unsafe { libc::poll(&mut p, 1, most.as_millis() as libc::c_int) };
    }
}

/// A restoring CRIU dies with criuz: left alone it can wait forever for
/// the lazy-pages daemon or image streamer that criuz was, holding the work
/// directory. The tree it was restoring would wait in CRIU's restorer for
/// good: criuz's guard kills it, until CRIU has exited having let it run.
/// Not for a dump: a dumping CRIU whose stream
/// breaks cures the tree of its parasite and lets go of it, where a killed
/// one could leave the process with the parasite inside. Every CRIU is
/// waited for by the thread that started it, so the parent-death signal
/// (sent when that thread exits) comes only when criuz dies.
fn die_with_criuz(cmd: &mut Command) {
    // SAFETY: getpid is async-signal-safe.
    let parent = unsafe { libc::getpid() };
    // SAFETY: prctl, getppid and _exit are async-signal-safe; nothing else
    // runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // criuz died before the signal was asked for.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_killed_under_criu_is_said_oom_killed_only_when_the_machine_counted_one() {
        let killed = "Error (criu/cr-restore.c:1269): 31114 killed by signal 9: Killed";
        assert!(oom_hint(killed, Some(1)).is_some_and(|h| h.contains("OOM killer ended 1 process meanwhile")));
        assert!(oom_hint(killed, Some(3)).is_some_and(|h| h.contains("ended 3 processes")));
        // No kill counted, none noted, or another failure.
        assert_eq!(oom_hint(killed, Some(0)), None);
        assert_eq!(oom_hint(killed, None), None);
        assert_eq!(oom_hint("Error (criu/files-reg.c:2175): File x has bad size", Some(2)), None);
        // This kernel counts them (memory cgroups' kills too).
        memory::note_oom_kills();
        assert!(memory::oom_kills_since_noted().is_some(), "/proc/vmstat has no oom_kill");
    }

    #[test]
    fn what_a_checkpoint_holds_is_told_again_unless_given() {
        let mut held = ToldAgain::default();
        held.note("filelocks.img", 8);
        held.note("tcp-stream-7.img", 40);
        assert_eq!(held.options(|_| false), vec!["--tcp-established"], "an empty filelocks.img holds no lock");
        held.note("filelocks.img", 30);
        assert_eq!(held.options(|_| false), vec!["--file-locks", "--tcp-established"]);
        assert_eq!(held.options(|o| o == "--file-locks"), vec!["--tcp-established"]);
        assert_eq!(held.options(|o| o == "--tcp-close"), vec!["--file-locks"], "closed instead");
    }

    #[test]
    fn only_a_tree_that_shares_much_of_its_memory_dedups() {
        const MIB: u64 = 1 << 20;
        assert!(dedups_within(4, 900 * MIB, 1024 * MIB), "forked children sharing most of it");
        assert!(dedups_within(2, 256 * MIB, 1024 * MIB), "a quarter shared");
        assert!(!dedups_within(2, 255 * MIB, 1024 * MIB), "less than a quarter");
        assert!(!dedups_within(2, 0, 0), "nothing to share");
        assert!(!dedups_within(1, 1024 * MIB, 1024 * MIB), "one process shares with none of the tree");
    }
}
