//! One-command dump and restore: runs stock CRIU in stream mode against our
//! capture or serve endpoint in a private temporary images directory.
//!
//! Dump: the archive is committed only if CRIU exits 0 and the stream held
//! `inventory.img` (CRIU writes it last); otherwise the packer is aborted and
//! nothing is published (no file under the output name; on stdout, an archive
//! without its trailer, which every reader rejects). CRIU's `stats-dump`
//! (written locally, not streamed; `criu::stats`) is added to the archive and reported.
//! Restore, streamed (`streamed`): every block is checked as it is served,
//! and no process runs before the archive is proven whole; a failed check
//! aborts CRIU's restore before the process runs.
//!
//! The work directory is always removed. When CRIU fails, its log is kept in
//! [`log_dir`](crate::session::workdir::log_dir) (the newest few only, so failures do not pile up) and named in
//! the error.

use crate::archive::dedup::DedupIndex;
use crate::archive::OpenOptions;
use crate::archive::{Options, PackStats, Packer};
use crate::criu::options::{self, CriuOptions};
use crate::criu::stats::{parse_stats, CriuDumpStats};
use crate::criu::streamer::{self, Listener};
use crate::criu::Criu;
use crate::cuda::{self, CudaDumpReport};
use crate::engine;
use crate::error::{Error, Result};
use crate::io::{Location, Output};
use crate::proc::guard::Guard;
use crate::proc::outside::{self, Ask};
use crate::proc::pipes::OutsideEnd;
use crate::proc::{arriving, budget, claim, holder, signal_safe, tree};
use crate::progress::Meter;
use crate::session::capture;
use crate::session::criu_hook::{self, ActionHook, At};
use crate::session::criu_run::{
    cannot_run, criu_failure, ids_by_default, join_criu_thread, run_criu_told, CriuThread, PID_NAMESPACE_REFUSED,
};
use crate::session::workdir::{criu_output, WorkDir};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

mod streamed;

pub use streamed::{open_for_restore, restore_opened, RestoreReport};

#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    pub pid: i32,
    pub output: PathBuf,
    pub force: bool,
    pub leave_running: bool,
    pub shell_job: bool,
    pub extra: Vec<String>,
    /// Write an incremental archive against this parent.
    pub parent: Option<PathBuf>,
    /// Counts what is taken in and written, for a progress line.
    pub meter: Option<Arc<Meter>>,
    /// Leave the tree's CUDA processes as they are (`--no-gpu`): suspended
    /// by the user or by CRIU's CUDA plugin, or not to be dumped.
    pub no_gpu: bool,
    /// Store page ids, and so each page that occurs more than once only
    /// once, where the tree is likely to hold such pages: processes sharing
    /// much of their memory, or CUDA state (see
    /// [`criu_run::ids_by_default`](crate::session::criu_run::ids_by_default));
    /// off with `--no-ids`.
    pub auto_ids: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DumpReport {
    pub output: PathBuf,
    pub criu: PathBuf,
    pub criu_version: String,
    pub criu_source: String,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub ratio: f64,
    pub seconds: f64,
    pub raw_bytes_per_second: f64,
    pub files: u64,
    pub zero_pages: u64,
    /// Blocks compressed with the hurried codec because the absorb budget
    /// was nearly spent while CRIU wrote (see `CodecConfig::hurried`), and
    /// that the codec asked for may store smaller; a raw block of bytes no
    /// codec shrinks is not counted.
    pub hurried_blocks: u64,
    /// Blocks of the tree's pages held by reference until compressed
    /// instead of copied in (`archive::held`): all of its own pages, and
    /// those of the shared memory only the tree reaches, unless descriptors
    /// ran short or the dump leaves the tree running.
    pub held_blocks: u64,
    /// The archive was then rewritten with the codec asked for (see [`recompress`]).
    pub recompressed: bool,
    /// Why that rewrite failed; the hurried archive stands.
    pub recompress_failed: Option<String>,
    pub criu_stats: Option<CriuDumpStats>,
    /// Bytes of CRIU's pages the dump could hold uncompressed: the
    /// pipeline's own, plus what it was granted of the machine's share.
    pub absorb_budget: u64,
    /// criuz's own peak resident memory, the rewrite included (CRIU's not
    /// counted: it shows in the RSS of the dump as a whole, and where CRIU
    /// maps the tree's shared memory to dump it, hides criuz's).
    pub peak_rss_bytes: u64,
    /// The tree's CUDA processes: suspended before CRIU froze the tree.
    pub cuda: Option<CudaDumpReport>,
    #[serde(skip)]
    pub pack: PackStats,
}

/// What an incremental archive written to `output` dedups against: the pages
/// of `parent` and its chain, read before CRIU starts so the process is not
/// frozen meanwhile. The parent must not be the output itself.
pub fn dedup_for(parent: Option<&Path>, output: &Path) -> Result<Option<Arc<DedupIndex>>> {
    let Some(parent) = parent else { return Ok(None) };
    Location::parse(parent)?.check_input()?;
    Ok(Some(Arc::new(crate::archive::ids::dedup_index(parent, &Location::parse(output)?)?)))
}

/// The options every command's pipeline starts from: `threads` workers, and
/// memory sized to what criuz may count on ([`engine::pipeline_budget`] of
/// `proc::memory::available`: at most the default budget, less in a memory
/// cgroup with little room left).
pub fn pipeline_options(threads: usize) -> Options {
    let memory_budget = engine::pipeline_budget(crate::proc::memory::available());
    Options { threads, memory_budget, ..Options::default() }
}

/// A dump's archive options with its absorb budget: `requested` bytes
/// (`--absorb`), by default a quarter of available memory
/// ([`engine::default_absorb`]; in a memory cgroup, of what it leaves), but
/// the pipeline's own (`opts.memory_budget`, [`pipeline_options`]) for an
/// object store output, which bounds an upload's memory; never below that.
/// A budget above the default absorbs first ([`Options::absorb_first`]); at
/// most that (`--absorb 0`), CRIU and the workers share the cores
/// throughout, as in a pack.
pub fn with_absorb(opts: Options, requested: Option<usize>, output: &Path) -> Options {
    let object = Location::parse(output).is_ok_and(|at| at.is_object());
    let pipeline = opts.memory_budget;
    let default = if object { pipeline } else { engine::default_absorb(crate::proc::memory::available()) };
    let budget = requested.unwrap_or(default).max(pipeline);
    Options { memory_budget: budget, absorb_first: budget > engine::DEFAULT_MEMORY_BUDGET, ..opts }
}

/// Rewrites the archive at `path`, replacing it only once the new one is
/// complete: a dump whose absorb budget ran out wrote the blocks `hurried`
/// lists with the hurried codec (LZ4, at acceleration 8 where LZ4 was
/// asked). Only those are decoded, checked and compressed again with the
/// codec asked for, on every worker; the others are copied as they are.
/// Archives with page ids, whose blocks are written again with their ids,
/// are redone whole (`offline::recode`). The process no longer waits for
/// this. Archives with parents are left as they are (the caller).
pub fn recompress(path: &Path, opts: &Options, hurried: &crate::archive::HurriedBlocks) -> Result<PackStats> {
    let source = crate::archive::open(&Location::File(path.to_path_buf()), &OpenOptions::default())?;
    let out = Output::open(path, true)?;
    // After CRIU: nothing is frozen while this archive is written.
    out.flush_behind();
    let bounded = Options { memory_budget: engine::DEFAULT_MEMORY_BUDGET, absorb_first: false, ..opts.clone() };
    let stats = crate::offline::recode(source, out.writer()?, &bounded, &|file, block| !hurried.contains(file, block))?;
    out.commit()?;
    Ok(stats)
}

/// The options a dump runs with, and what it was granted: its absorb memory
/// beyond the pipeline's own comes from the machine's share
/// (`proc::budget`), no more than the tree holds, so concurrent dumps stay
/// within the share together; what is not granted is compressed as it
/// comes (as with `--absorb 0`).
fn granted(opts: &Options, pid: i32) -> (Options, budget::Grant) {
    if !opts.absorb_first {
        return (opts.clone(), budget::Grant::none());
    }
    // A budget counts each block's input and output, and held workers start
    // at three quarters of it: three times what the tree holds absorbs all
    // of it. What it can hold of CRIU's pages is half its budget, and that
    // is what the machine's share gives.
    let wanted = opts.memory_budget.saturating_sub(engine::DEFAULT_MEMORY_BUDGET);
    let wanted = wanted.min(tree::resident_bytes(pid).saturating_mul(3));
    let grant = budget::reserve(wanted / 2);
    let memory_budget = engine::DEFAULT_MEMORY_BUDGET + 2 * grant.bytes;
    (Options { memory_budget, absorb_first: grant.bytes > 0, ..opts.clone() }, grant)
}

/// The end of the CRIU a dump runs on a thread of its own (`criu_run`,
/// taken: joined once).
fn join_criu(criu_run: &mut Option<CriuThread>) -> std::io::Result<std::process::ExitStatus> {
    join_criu_thread(criu_run.take().ok_or_else(|| std::io::Error::other("CRIU was waited for twice"))?)
}

/// A process that CRIU could dump: one that exists, is a process (CRIU
/// given a thread's id aborts on an assertion), has not exited, is no
/// kernel thread, and has no criuz in its tree.
fn check_dumpable(pid: i32) -> Result<()> {
    match tree::thread_group(pid) {
        None => Err(Error::Usage(format!("process {pid} does not exist"))),
        Some(leader) if leader != pid => {
            Err(Error::Usage(format!("{pid} is a thread of process {leader}: dump the process (-t {leader})")))
        }
        _ if holder::holder_of(pid).is_some_and(|h| h.zombie) => {
            Err(Error::Usage(format!("process {pid} has exited (a zombie its parent has not reaped): nothing to dump")))
        }
        _ if let Some(h) = holder::holder_of(pid).filter(|h| h.kernel_thread) => Err(Error::Usage(format!(
            "process {pid} ({}) is a kernel thread: CRIU checkpoints user processes only",
            h.comm
        ))),
        // CRIU refuses to seize itself, and its log reads as a tracing
        // failure: the shell that runs criuz (`-t $$`) is the usual case.
        _ if holder::descends_from(std::process::id(), pid as u32) => Err(Error::Usage(format!(
            "process {pid} is criuz or an ancestor of it (the shell criuz runs in?), so its tree holds criuz and CRIU: \
             dump it from a process outside that tree"
        ))),
        _ if tree::pid_namespace_init(pid) => Err(Error::Criu(format!(
            "process {pid} is the init of its own pid namespace (pid 1 in it): {PID_NAMESPACE_REFUSED}; \
             checkpoint it with criu dump -D DIR and criuz pack DIR, restore it with criuz unpack and criu restore -D"
        ))),
        _ if tree::too_large(&[pid]) => Err(Error::Criu(format!(
            "the tree of process {pid} has more than {} processes, more than criuz can end or resume after a dump",
            signal_safe::MAX_TREE - 1
        ))),
        _ => Ok(()),
    }
}

/// Says which pipes of the tree lead to processes outside it (see
/// `proc::pipes`): the checkpoint is made all the same, as CRIU makes it.
fn warn_of_outside_pipes(ends: &[OutsideEnd]) {
    const SAID: usize = 4;
    for end in ends.iter().take(SAID) {
        crate::say!("criuz: warning: {end}");
    }
    if ends.len() > SAID {
        crate::say!("criuz: warning: and {} more such pipes", ends.len() - SAID);
    }
}

/// Refuses a tree one of whose threads another process traces (a debugger,
/// strace): CRIU must trace every thread itself, and fails otherwise with
/// "Unable to interrupt task", which does not say why.
fn refuse_traced(pid: i32) -> Result<()> {
    let Some((tid, tracer)) = tree::traced_thread(&[pid]) else { return Ok(()) };
    let name = std::fs::read_to_string(format!("/proc/{tracer}/comm")).unwrap_or_default();
    Err(Error::Criu(format!(
        "process {tid} is traced by process {tracer} ({}), and CRIU must trace it itself: detach the tracer and \
         dump again",
        name.trim()
    )))
}

/// The `criu dump` of a streamed dump, its log and statistics in `work`,
/// stopping at `hook` where one waits for the archive to be durable.
fn dump_command(criu: &Criu, o: &DumpOptions, work: &Path, hook: Option<&ActionHook>) -> Command {
    let (stdout, stderr) = criu_output(work);
    let mut cmd = crate::spawn::command(&criu.path);
    cmd.args(["dump", "--stream", "-o", "dump.log", "-t", &o.pid.to_string(), "-D"])
        .arg(work)
        // Where the log and statistics go, whatever CRIU's config files say.
        .arg("-W")
        .arg(work)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    // CRIU may finish before the archive does (it writes into the absorb
    // budget): a tree that is to end is left stopped, and ended only once
    // the archive is complete, so a failure after CRIU (a full disk, a
    // refused upload) resumes the process instead of losing it with its
    // checkpoint.
    cmd.arg(if o.leave_running { "--leave-running" } else { "--leave-stopped" });
    if o.shell_job {
        cmd.arg("--shell-job");
    }
    if let Some(h) = hook {
        cmd.arg("--action-script").arg(h.script());
    }
    cmd.args(options::anchored(&o.extra));
    cmd
}

/// Once the process is done with and the archive durable: redoes the
/// blocks compressed in haste, where rewriting the archive is cheap (a
/// local file with no parent). The archive's size after, whether it was
/// rewritten, and why not where that failed (the archive written first
/// stands).
fn redo_hurried(o: &DumpOptions, archive: &Options, pack: &PackStats) -> (u64, bool, Option<String>) {
    let rewrite = !pack.hurried.is_empty()
        && o.parent.is_none()
        && Location::parse(&o.output).is_ok_and(|at| at.path().is_some());
    match rewrite.then(|| recompress(&o.output, archive, &pack.hurried)) {
        None => (pack.archive_bytes, false, None),
        Some(Ok(rewritten)) => (rewritten.archive_bytes, true, None),
        Some(Err(e)) => (pack.archive_bytes, false, Some(e.to_string())),
    }
}

/// Checkpoints process tree `pid` into an archive through CRIU's stream mode.
pub fn dump(o: &DumpOptions, archive: &Options, criu: &Criu) -> Result<DumpReport> {
    archive.validate()?;
    options::check_extra(&o.extra, options::Action::Dump)?;
    check_dumpable(o.pid)?;
    let _claim = claim::claim_tree(o.pid)?;
    // After the claim: a tree another criuz dumps is said to be that.
    refuse_traced(o.pid)?;
    // Before the walk below, which a busy host makes long: an output that
    // cannot be written (a read-only directory, a refused object store) is
    // said at once.
    let out = Output::open(&o.output, o.force)?;
    let held_shared = survey_around(o)?;
    let (archive, _grant) = &granted(archive, o.pid);
    let started = Instant::now();
    let work = WorkDir::new("criuz-dump-")?;
    let listener = Listener::bind(work.path(), streamer::CAPTURE_SOCKET)?;
    let dedup = dedup_for(o.parent.as_deref(), &o.output)?;
    // Before CRIU freezes the tree: a frozen process cannot let the driver
    // move its GPU state. Dropped on any failure below, it resumes them.
    let suspended = if o.no_gpu { None } else { cuda::suspend_tree(o.pid)? };
    let ids = archive.ids || (o.auto_ids && ids_by_default(o.pid, suspended.is_some()));
    let archive = &Options { ids, ..archive.clone() };
    let meter = o.meter.clone().unwrap_or_default();
    let packer = Packer::start_metered(out.writer()?, archive, dedup, meter)?;
    let stop = AtomicBool::new(false);

    // A dump only CRIU can roll back whole (its connections locked for the
    // restore) waits at CRIU's post-dump hook until the archive is durable
    // (`session::criu_hook`).
    let hook = (!o.leave_running && criu_hook::needed(&CriuOptions::read(&o.extra)))
        .then(|| ActionHook::bind(work.path(), At::PostDump))
        .transpose()?;
    let mut cmd = dump_command(criu, o, work.path(), hook.as_ref());

    let pages =
        if o.leave_running { capture::Pages::Copied } else { capture::Pages::HeldWhileStopped { shared: held_shared } };
    let pages = &pages;
    // Resumes the tree should criuz die while CRIU leaves it stopped; not
    // the processes stopped before, which CRIU's own failure leaves so too.
    // At a post-dump hook CRIU decides: the guard waits for it to end, and
    // ends a tree CRIU left stopped (`Guard::resuming_unless_dumped`).
    let stopped_before = tree::stopped_pids(&[o.pid]);
    let mut guard = (!o.leave_running)
        .then(|| Guard::of_dump(&[o.pid], &stopped_before, hook.is_some()).map(Arc::new))
        .transpose()?;
    let told = guard.clone().filter(|_| hook.is_some());
    let capture_ends = OnceLock::new();
    let criu_ended = Arc::new(AtomicBool::new(false));
    let ended = criu_ended.clone();
    let mut criu_run = Some(std::thread::spawn(move || {
        let status = run_criu_told(&mut cmd, &[], told.as_deref());
        ended.store(true, Ordering::Relaxed);
        status
    }));
    let (status, asked, captured) = std::thread::scope(|s| {
        let (listener, packer, stop) = (&listener, &packer, &stop);
        let ends = hook.as_ref().map(|_| &capture_ends);
        let cap = s.spawn(move || capture::capture(listener, packer, stop, pages, ends));
        let asked = hook.as_ref().map_or(Ok(None), |h| h.wait_asked(&criu_ended)).unwrap_or(None);
        let status = if asked.is_some() {
            // Every image is written: the capture ends here, not with CRIU,
            // and CRIU writes no more.
            if let Some(conn) = capture_ends.get() {
                let _ = conn.shutdown(std::net::Shutdown::Read);
            }
            out.flush_behind();
            None
        } else {
            let status = join_criu(&mut criu_run);
            // The tree is frozen no more: what is written may be flushed.
            out.flush_behind();
            stop.store(true, Ordering::Relaxed);
            Some(status)
        };
        (status, asked, cap.join().unwrap_or(Err(Error::Cancelled)))
    });
    let commit = Commit { o, work: &work, suspended: suspended.as_ref(), out };
    let resume = || tree::resume_dumped(o.pid, &stopped_before);
    let (written, stats_bytes) = match (asked, status) {
        (Some(asked), _) => {
            // CRIU waits at its post-dump hook with the tree frozen (held
            // by CRIU: nothing can run it meanwhile). It rolls back if the
            // archive could not be written (the tree resumed as it was, its
            // connections unlocked), and leaves the tree stopped otherwise.
            let written = commit.write(packer, captured, RunCheck::NotNeeded, None);
            asked.answer(written.is_ok());
            // How CRIU ended matters no more: with the archive durable the
            // tree is ended below (a CRIU killed after the answer left it
            // stopped, its connections still held for the restore).
            let _ = join_criu(&mut criu_run);
            if written.is_err() {
                // Resumed by CRIU's rollback, or left stopped by a CRIU
                // killed meanwhile.
                resume();
            }
            // Written by CRIU after its hook: for the report only.
            (written, std::fs::read(work.path().join("stats-dump")).ok())
        }
        (None, status) => {
            let status = status.expect("joined above").map_err(|e| {
                // How CRIU ended is not known (it ran: its wait failed); a
                // tree it left stopped must not stay so.
                resume();
                cannot_run(criu.path.display(), e)
            })?;
            if !status.success() {
                // A CRIU that failed on its own lets the tree go running; one
                // that was killed (the OOM killer, an operator) leaves it
                // stopped, released from ptrace but never continued. Once no
                // tracer holds it, it is resumed.
                resume();
                // CRIU stopped because the archive could not be written (a
                // full disk, a dead object store): that is the cause to
                // report.
                if let Some(e) = packer.abort() {
                    let log = work.save_log("dump.log");
                    return Err(e.context(format!("criu dump stopped: the archive could not be written ({log})")));
                }
                return Err(criu_failure("criu dump", status, &work.save_log("dump.log")));
            }
            let run_check = RunCheck::once_criu_is_done(o.pid, pages.holds());
            let stats = std::fs::read(work.path().join("stats-dump")).ok();
            let written = commit.write(packer, captured, run_check, stats.clone());
            if written.is_err() && !o.leave_running {
                resume();
            }
            (written, stats)
        }
    };
    let pack = match written {
        Ok(pack) => {
            if !o.leave_running {
                tree::end_dumped(o.pid);
            }
            if let Some(g) = guard.take() {
                g.release();
            }
            pack
        }
        Err(e) if o.leave_running => return Err(e),
        Err(e) => return Err(e.context(format!("no checkpoint written; process {} was resumed", o.pid))),
    };
    let cuda = suspended.map(|s| s.conclude(o.leave_running)).transpose()?;
    let stats = stats_bytes.as_deref().and_then(parse_stats);
    Ok(DumpReport::of(o, criu, archive, pack, stats, cuda, started))
}

impl DumpReport {
    /// The report of a dump started at `started` whose archive was
    /// committed with `pack`, once the blocks compressed in haste were redone
    /// where that is cheap ([`redo_hurried`]).
    fn of(
        o: &DumpOptions,
        criu: &Criu,
        archive: &Options,
        pack: PackStats,
        criu_stats: Option<CriuDumpStats>,
        cuda: Option<CudaDumpReport>,
        started: Instant,
    ) -> DumpReport {
        let (archive_bytes, recompressed, recompress_failed) = redo_hurried(o, archive, &pack);
        let seconds = started.elapsed().as_secs_f64();
        DumpReport {
            output: o.output.clone(),
            criu: criu.path.clone(),
            criu_version: criu.version.clone(),
            criu_source: criu.source.to_string(),
            raw_bytes: pack.raw_bytes,
            archive_bytes,
            ratio: archive_bytes as f64 / pack.raw_bytes.max(1) as f64,
            seconds,
            raw_bytes_per_second: pack.raw_bytes as f64 / seconds.max(1e-9),
            files: pack.files,
            zero_pages: pack.zero_pages,
            hurried_blocks: pack.hurried.len(),
            held_blocks: pack.blocks_held,
            recompressed,
            recompress_failed,
            criu_stats,
            absorb_budget: archive.memory_budget as u64,
            peak_rss_bytes: crate::proc::memory::own_peak_rss(),
            cuda,
            pack,
        }
    }
}

/// One walk of every other process, before CRIU freezes the tree (it costs
/// no frozen time) and before a CUDA tree is suspended (the walk would
/// lengthen the time its GPU work stands still; a process that maps the
/// tree's shared memory after the walk is caught by the walk again before
/// the commit, [`Commit::write`]): a tree whose pages would arrive from
/// outside is refused, pipes to outside are warned of. The shared memory
/// only the tree reaches, held by reference while it stays stopped.
fn survey_around(o: &DumpOptions) -> Result<HashSet<u64>> {
    let pids = tree::tree_pids(&[o.pid]);
    let around = outside::survey(&pids, Ask { pipes: true, shared: !o.leave_running });
    arriving::refuse(around.arriving)?;
    warn_of_outside_pipes(&around.outside_pipes);
    Ok(around.held_shared)
}

/// Whether the tree must be shown not to have run before the archive is
/// committed: it must where the archive holds pages of the tree's own
/// memory by reference, which it reads after CRIU is done.
#[derive(Debug, PartialEq, Eq)]
enum RunCheck {
    /// No page held, or the tree frozen by CRIU until the commit answers
    /// its post-dump hook: nothing can have changed a page meanwhile.
    NotNeeded,
    /// Pages held; what each thread of the tree had run (`(tid, run
    /// time)`) once CRIU was done, read again before the commit.
    Since(Vec<(i32, u64)>),
    /// Pages held, but the tree did not settle stopped (a thread running,
    /// or its run times unreadable): its held pages cannot be trusted.
    Unsettled,
}

impl RunCheck {
    /// Held pages are the stopped tree's own: it must not run until they
    /// have all been read, so what it has run is taken once CRIU is done
    /// and again before the archive is committed.
    fn once_criu_is_done(pid: i32, holds: bool) -> RunCheck {
        if !holds {
            return RunCheck::NotNeeded;
        }
        match tree::settled_runtimes(&[pid], 2_000) {
            Some(runtimes) => RunCheck::Since(runtimes),
            None => RunCheck::Unsettled,
        }
    }
}

/// What a dump commits its archive with, once CRIU is done.
struct Commit<'a> {
    o: &'a DumpOptions,
    work: &'a WorkDir,
    suspended: Option<&'a cuda::Suspended>,
    out: Output,
}

impl Commit<'_> {
    /// Writes the archive from what was `captured`: complete
    /// (`capture::settle`), with CRIU's `stats` where it wrote them already
    /// and the CUDA record, and commits it; where the tree's own pages were
    /// held, only if it did not run meanwhile (`run_check`) and no process
    /// outside it reached its held shared memory.
    fn write(
        self,
        packer: Packer,
        captured: Result<Option<capture::CaptureReport>>,
        run_check: RunCheck,
        stats: Option<Vec<u8>>,
    ) -> Result<PackStats> {
        let pid = self.o.pid;
        if run_check == RunCheck::Unsettled {
            packer.abort();
            return Err(Error::Criu(format!("process {pid} did not stay stopped after CRIU dumped it")));
        }
        let (packer, report) = capture::settle(packer, captured)
            .map_err(|e| e.context(format!("capture failed ({})", self.work.save_log("dump.log"))))?;
        // A writer that failed after the capture (a disk that filled once
        // every image was in) refuses these with its own error; the packer,
        // dropped, writes no index.
        if let Some(bytes) = &stats {
            let mut sink = packer.begin_file("stats-dump")?;
            sink.write(bytes)?;
            sink.finish()?;
        }
        if let Some(s) = self.suspended {
            let mut sink = packer.begin_file(cuda::RECORD_FILE)?;
            // A struct of numbers and strings: serialising cannot fail.
            sink.write(&serde_json::to_vec_pretty(s.record()).unwrap_or_default())?;
            sink.finish()?;
        }
        let (pack, _) = packer.finish()?;
        if let RunCheck::Since(before) = &run_check {
            if tree::stopped_runtimes(&[pid]).as_ref() != Some(before) {
                return Err(Error::Criu(format!(
                    "process {pid} ran while its checkpoint was written (resumed by another process?)"
                )));
            }
        }
        if let Some(who) = outside::shared_reached_from_outside(&tree::tree_pids(&[pid]), &report.held_shared) {
            return Err(Error::Criu(format!(
                "{who} outside the tree of process {pid} mapped or opened its shared memory while its checkpoint was \
                 written, and could have written pages held of it: dump again"
            )));
        }
        self.out.commit()?;
        Ok(pack)
    }
}
