//! Lazy restore: the process runs at once, its memory arrives on demand.
//!
//! `criu restore --lazy-pages` registers the restored tree's private
//! anonymous memory with userfaultfd and hands each process's userfaultfd to
//! a lazy-pages daemon; criuz is that daemon (`session::pager`), copying
//! pages in from the archive's checked blocks on first touch and filling
//! every other page in the background. CRIU cannot stream a lazy restore,
//! so the images go to a private work directory (0700), as
//! `session::placement` writes them: each process's pages image holds only
//! the pages CRIU restores itself. Shared memory no descriptor opens gets an
//! empty pagemap: CRIU makes and maps it, and criuz serves its pages as the
//! tree runs, through every process's mappings of it (`shmem::plan_lazy`).
//! The fill brings first what earlier lazy restores saw faulted
//! (`session::working_set`).
//!
//! The tree runs only once CRIU has handed all of it over and criuz has
//! registered its shared memory in every process ([`Release`]): CRIU leaves
//! a bare tree stopped, and holds a container's (which runc cannot leave
//! stopped) at its pre-resume hook (`session::criu_hook`).
//!
//! Two proofs. The walk of the archive and its parents (do their records
//! make the index the images and pages came from?) runs beside CRIU, and
//! the tree runs only once it is done: a reordered index stops the restore
//! before the tree ran, and the tree does not wait for a walk before CRIU
//! even starts (a container's archive is walked first, as its eager
//! restore needs). The proof of the stored bytes: every stored byte of the
//! archive and its parents is read against its check
//! (`BlockSource::prove_stored`). By default it runs behind the process, so
//! the tree runs as soon as CRIU has restored it, whatever the archive's
//! size; damage it finds kills the tree,
//! as a block that fails mid-fill does (every page copied in comes from a
//! block checked as it is decoded anyway). With `verify_first` it runs
//! before CRIU starts, beside the writing of the images, so damage at rest
//! stops the restore while nothing runs. What the proof cannot see (a
//! compressed payload crafted to match its payload check, a file changed
//! after, an I/O error) is found as the block is decoded.
//!
//! No silent zeros: a page not yet copied reads as zero once every copy of
//! the tree's userfaultfds is closed. A failure criuz finds once the tree
//! runs kills the tree before criuz lets go of them, and a guard process
//! (`proc::guard`) holds copies too and kills the tree if criuz dies.
//!
//! [`LazyRestore`] is the part both callers share: `criuz restore --lazy`
//! runs `criu restore --lazy-pages` and names the tree by its pids;
//! `criuz runc restore` (lazy by default) runs `runc restore
//! --lazy-pages`, whose tree lives in a pid namespace of its own, and names
//! the container's cgroup.

use crate::archive::BlockSource;
use crate::criu::uffd;
use crate::error::{Error, IoContext, Result};
use crate::io::Location;
use crate::proc::guard::{Guard, Victim};
use crate::progress::Meter;
use crate::session::blocks::Blocks;
use crate::session::criu_hook::ActionHook;
use crate::session::criu_run::cannot_run;
use crate::session::pager::{Abort, Gate, Pager};
use crate::session::place::{HeldFill, HugePages, SlowHugePages};
use crate::session::placement::{Materialized, Placement};
use crate::session::shmem::SharedObject;
use crate::session::working_set::record_new_faults;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

mod bare;
mod prepare;

pub use bare::restore_lazy;
pub(crate) use bare::restore_placed;
use prepare::Prepared;

#[derive(Clone, Debug, serde::Serialize)]
pub struct LazyReport {
    pub pid: Option<i32>,
    /// CUDA restore and unlock of the restored processes, once they ran.
    pub cuda_resume_seconds: Option<f64>,
    /// Until criuz started CRIU: its own part of the start (opening the
    /// archive, writing CRIU's images).
    pub criu_started_seconds: f64,
    /// Until a placed restore's fill began, CRIU having restored the tree
    /// and handed its memory over: what of `running_seconds` is CRIU's
    /// (and criuz's start); the rest is the fill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill_started_seconds: Option<f64>,
    /// A lazy tree's start, step by step (what of `running_seconds` is
    /// whose): until CRIU had handed all of it over, until the walks behind
    /// had proven the index (stamped where the release waits for them, so
    /// never before the handover), and until the restore command (CRIU, or
    /// runc for a container) returned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handed_over_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_proven_seconds: Option<f64>,
    pub criu_exited_seconds: f64,
    /// Until the tree runs (CRIU returned; a lazy tree CRIU left stopped
    /// let run; a placed one's pages all in).
    pub running_seconds: f64,
    /// Until every lazy page was in place.
    pub resident_seconds: f64,
    /// Pages restored by CRIU itself (not lazy).
    pub eager_pages: u64,
    /// Zero pages of private anonymous memory left out: they read as zero
    /// without being copied (a lazy restore keeps short runs of them, where
    /// each hole would cost a fault, and maps them: `zero_pages_mapped`).
    pub zero_pages_skipped: u64,
    /// Pages of the working set recorded beside the archive
    /// (`<archive>.touch`) by earlier lazy restores, whose blocks the fill
    /// brought first.
    pub working_set_pages: u64,
    /// Until those pages were in place.
    pub working_set_seconds: Option<f64>,
    /// Where this restore's faults were recorded (none if there were no new
    /// ones, the archive came from a pipe, or its directory is read-only).
    pub working_set_file: Option<String>,
    /// Pages criuz copied in lazily, and the page faults it served (each
    /// answered with the missing rest of the faulted page's block).
    pub lazy_pages: u64,
    /// Of those, pages of shared memory a placed restore copied in or a
    /// lazy one served (`session::shmem`; CRIU restored the rest of it).
    pub shared_pages: u64,
    /// Zero pages the pagemap kept, mapped to the kernel's zero page rather
    /// than copied (no memory of their own until the process writes them).
    pub zero_pages_mapped: u64,
    pub faults: u64,
    /// Restored processes that ended before every page of theirs was in:
    /// `resident_seconds` is then when the last of them ended or was filled.
    pub ended_unfilled: u64,
    pub criu_exit: i32,
    /// Why a lazy restore that was asked for placed the memory instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_lazy: Option<&'static str>,
    /// Private memory the tree's processes shared copy-on-write that a
    /// default restore placed anyway, as a copy in each
    /// (`restore::why_not_placed`; `--fill stream` keeps it shared).
    #[serde(skip_serializing_if = "is_zero")]
    pub copied_apart_bytes: u64,
    /// Private memory a placed restore wrote through the processes' memory
    /// where the kernel may back it with transparent huge pages, as it did
    /// before the dump (`proc::huge_pages`): bytes of those ranges.
    #[serde(skip_serializing_if = "is_zero")]
    pub huge_page_bytes: u64,
    /// Where the kernel gave huge pages too slowly to wait for them: how
    /// fast, and how much was placed in 4 KiB pages instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_huge_pages: Option<SlowHugePages>,
}

/// A lazy restore ready to run: the archive, the directory CRIU reads its
/// images from, CRIU's work directory (where its lazy-pages socket goes),
/// and what is killed should the pages be unable to all arrive. Bare trees
/// (`restore_lazy`) and containers (`container::runc_restore`) both run
/// through it.
pub(crate) struct LazyRestore<'a> {
    pub source: Arc<dyn BlockSource>,
    /// The archive as named (its working-set record goes beside it).
    pub input: &'a Location,
    pub images: &'a Path,
    pub work: &'a Path,
    pub victim: &'a Victim,
    /// Prove the stored bytes before CRIU starts, not behind the process.
    pub verify_first: bool,
    pub fill: Fill,
    /// Shared memory a held tree's fill places (`session::shmem`).
    pub shared: Vec<SharedObject>,
    /// How a lazy tree is let run.
    pub release: Release<'a>,
    /// Threads that fill a held tree, or (less one, for the tree) decode
    /// ahead of a running tree's fill.
    pub threads: usize,
    /// Counts the bytes a held tree's fill copies in, for a progress line.
    pub meter: Option<Arc<Meter>>,
    /// CRIU returns once the tree is restored (a bare restore's always,
    /// `criu_run::restore_command`; runc's with `--detach`), so a failure it
    /// reports is the restore's. Without (a runc in the foreground), it
    /// waits for the tree as long as it runs (and may be killed meanwhile).
    pub detached: bool,
    /// The processes of a tree held stopped that were stopped when dumped,
    /// with the signal that had stopped them (`stopped_at_dump`): letting
    /// the tree run leaves them stopped, as CRIU's own restore does.
    pub dumped_stopped: &'a [(i32, i32)],
}

/// How a lazy tree CRIU restored stopped is let run.
pub(crate) enum Release<'a> {
    /// CRIU leaves it stopped (`--leave-stopped`) and exits; criuz
    /// continues it (a bare tree).
    Continued,
    /// CRIU waits at its pre-resume hook with the tree stopped and resumes
    /// it once criuz answers (a container: runc cannot leave a tree
    /// stopped).
    AtPreResume(&'a ActionHook),
}

/// When the restored tree runs, against when its memory is in.
pub(crate) enum Fill {
    /// At once: its pages arrive on demand, the rest in the background.
    /// CRIU restores the tree stopped (see [`Release`]), and it runs once
    /// CRIU has handed all of it over, criuz has registered its shared
    /// memory in every process, and the walks of the archive and its
    /// parents, which ran beside CRIU's restore, have proven them; what
    /// they find stops the restore before the tree ran.
    Lazy,
    /// Held stopped (CRIU's `--leave-stopped`) until every page is in, then
    /// let run: an eager restore whose memory criuz places itself, on
    /// `threads` threads (`session::place`). A bare tree only. `planned`:
    /// its pagemaps, where already worked out (`plan_placement`, which
    /// leaves zero pages out). `keep_zero_pages`: every zero page placed
    /// too, as a page of memory (as CRIU's own restore writes them).
    /// `huge_pages`: whether memory that may be transparent huge pages is
    /// written so that it is (`proc::huge_pages`).
    Held { planned: Option<Placement>, keep_zero_pages: bool, huge_pages: HugePages },
}

impl LazyRestore<'_> {
    /// Writes the images, then runs `cmd` (a restore told `--lazy-pages`,
    /// with `work` as its work directory) while serving its pages;
    /// `on_running` runs once `cmd` succeeded, as the pages still arrive.
    /// Returns once every page is in place (or the restore failed), with
    /// `cmd`'s status; an error if the pages could not all be served (the
    /// victim is then dead), `cmd` could not run, or `on_running` failed.
    pub(crate) fn run(
        mut self,
        mut cmd: Command,
        started: Instant,
        on_running: impl FnOnce() -> Result<()>,
    ) -> Result<(ExitStatus, LazyReport)> {
        // `gated`: a lazy tree CRIU restores stopped, let run by the walks.
        // The plan is taken (the images consume it); the fill stays as asked.
        let (hold, gated, planned, keep_zeros, huge_pages) = match &mut self.fill {
            Fill::Held { planned, keep_zero_pages, huge_pages } => {
                (true, false, planned.take().filter(|_| !*keep_zero_pages), *keep_zero_pages, *huge_pages)
            }
            Fill::Lazy => (false, true, None, false, HugePages::Off),
        };
        let blocks = Blocks::new(self.source.clone());
        let Prepared { touch, recorded, served_shared, materialized } =
            self.prepare(&blocks, hold, gated, planned, keep_zeros)?;
        let Materialized { processes, eager_pages, zero_pages } = materialized;

        let listener = uffd::listen(self.work).at(self.work.join(uffd::LAZY_SOCKET))?;
        let guard = Guard::start_for(self.victim)?;
        let (stop_tx, stop_rx) = UnixStream::pair()?;
        let abort = Abort::new()?;
        let victim = self.victim;
        let held_fill = hold.then(|| HeldFill { threads: self.threads, meter: self.meter.clone(), huge_pages });
        // A running tree is filled in steps on every core (`Pager::fill_step`),
        // each thread decoding the blocks it copies; on one core, by the
        // pager's thread a block at a time, decoded ahead.
        let fill_threads = if hold { 0 } else { self.threads };
        // Opened once CRIU has exited having restored a held tree: its
        // memory that may be huge pages is written only then.
        let criu_restored = Gate::new()?;
        let mut pager = Pager::new(&blocks, &processes, &guard, victim, &recorded, held_fill, fill_threads)
            .placing_shared(&self.shared)
            .serving_shared(&served_shared)
            .writing_huge_pages_after(&criu_restored);
        // The proof behind a running tree. A held tree needs none: it runs
        // only once every page is in, each from a block checked as it was
        // decoded, which is what a streamed restore promises too.
        let prove_behind = !self.verify_first && !hold;
        let resumed: OnceLock<Instant> = OnceLock::new();
        let fill_gate = if gated { Some(Gate::new()?) } else { None };
        let (finished_tx, finished) = std::sync::mpsc::channel::<()>();
        // Whether CRIU exited having restored the tree: a held tree, or a
        // lazy one CRIU left stopped, is let run only then. CRIU says the
        // restore finished (and a held fill starts) before it lets the
        // tasks out of its restorer: a CRIU that died in between (killed,
        // or with a criuz killed once the guard was told the tree is whole)
        // left them waiting there for good, every signal blocked, where a
        // SIGCONT could not reach them.
        let (criu_ended_tx, criu_ended) = std::sync::mpsc::channel::<bool>();
        let (mut gate_waits, held_waits) = if gated { (Some(criu_ended), None) } else { (None, Some(criu_ended)) };
        // Set once the command has returned: a pre-resume hook CRIU has not
        // run by then it never runs.
        let command_ended = AtomicBool::new(false);
        let decoders = if hold { 0 } else { self.decoders(fill_threads) };
        let mut criu_started = 0.0;
        let mut criu_exited = 0.0;
        let steps = ReleaseSteps::default();
        let (paged, proof, status, running, published, ran) = std::thread::scope(|s| {
            for _ in 0..decoders {
                s.spawn(|| blocks.decode_ahead());
            }
            // Started once the tree runs, so as not to hold CRIU's reads
            // back either.
            let prove = || {
                s.spawn(|| {
                    let proving = std::panic::AssertUnwindSafe(|| self.source.prove_stored());
                    let proven = std::panic::catch_unwind(proving).unwrap_or(Err(Error::Cancelled));
                    if let Err(e) = &proven {
                        // The pager fails with it, killing the tree.
                        abort.fail(e.duplicate());
                    }
                    proven
                })
            };
            let mut proving = None;
            // A lazy tree runs once CRIU has handed over its memory (and the
            // pager has registered its shared memory in every process) and
            // the walks behind have proven the index its images and pages
            // came from, which a reordered index with every check
            // recomputed would not be: what the walks find fails the pager,
            // which kills the tree before it ran. The pager serves faults
            // meanwhile but fills nothing in (`Gate`).
            let releasing = fill_gate.as_ref().map(|gate| {
                let (this, resumed, abort, command_ended, steps) = (&self, &resumed, &abort, &command_ended, &steps);
                let criu_ended = gate_waits.take();
                s.spawn(move || {
                    let released = this.release_once_proven(finished, criu_ended, abort, command_ended, steps);
                    if released {
                        let _ = resumed.set(Instant::now());
                        gate.open();
                    }
                    released
                })
            });
            let gated = fill_gate.as_ref().map(|g| (g, finished_tx));
            let paging = s.spawn(|| {
                let criu_ended = held_waits;
                let mut r = pager.run(&listener, &stop_rx, &abort, gated);
                if hold && r.is_ok() && pager.all_in() {
                    // Letting a held tree run is the point of no return: an
                    // archive opened while it still arrived must be proven
                    // whole first (as a streamed restore's last page waits),
                    // and every process must still be there.
                    r = self.source.proven().and_then(|()| pager.killed_while_held());
                }
                blocks.finish();
                // A held tree is told whole, and let run, only once CRIU has
                // exited having restored it (above).
                let restored_by_criu = || !hold || criu_ended.as_ref().is_some_and(|e| e.recv().unwrap_or(false));
                if r.is_err() {
                    // Before the pager's copies of the userfaultfds close.
                    victim.kill();
                } else if pager.all_in() && restored_by_criu() {
                    r = pager.ran_while_held();
                    if r.is_err() {
                        victim.kill();
                    } else {
                        self.let_go_whole(&mut pager, &guard, hold, &resumed);
                    }
                }
                let whole = r.is_ok() && pager.all_in();
                (r, whole)
            });
            let keep: &[i32] = match victim {
                Victim::Tree(pids) => pids,
                Victim::Cgroup(_) => &[],
            };
            // CRIU forks the tree. Should criuz die meanwhile, the guard
            // notices before CRIU does (criuz's descriptors close before its
            // children are told it died), kills the tree, and CRIU may fork
            // more of it: the guard kills again once CRIU has ended. (A
            // container's cgroup kill takes what joins it later anyway.)
            let told = matches!(victim, Victim::Tree(_)).then_some(&guard);
            criu_started = started.elapsed().as_secs_f64();
            let status = crate::session::criu_run::run_restoring_criu(&mut cmd, keep, told);
            criu_exited = started.elapsed().as_secs_f64();
            command_ended.store(true, std::sync::atomic::Ordering::Relaxed);
            if status.as_ref().is_ok_and(|s| s.success()) {
                criu_restored.open();
            }
            let _ = criu_ended_tx.send(status.as_ref().is_ok_and(|s| s.success()));
            let mut running = criu_exited;
            let mut published = Ok(());
            let mut paging = Some(paging);
            let mut paged = None;
            let join = |p: Option<std::thread::ScopedJoinHandle<'_, (Result<()>, bool)>>| {
                p.map_or((Err(Error::Cancelled), false), |p| p.join().unwrap_or((Err(Error::Cancelled), false)))
            };
            let ran = if status.as_ref().is_ok_and(|s| s.success()) {
                if hold {
                    // Restored, held stopped: it runs once the pager is done.
                    paged = Some(join(paging.take()).0);
                    resumed.get().is_some()
                } else {
                    // The tree runs (once released, where CRIU left it
                    // stopped) while its pages still arrive.
                    releasing.is_none_or(|r| r.join().unwrap_or(false))
                }
            } else {
                // The restore failed, or, under a runc in the foreground,
                // CRIU failed or was killed while the tree ran (by an
                // interrupted criuz among others): nothing more will fault.
                let _ = stop_tx.shutdown(std::net::Shutdown::Both);
                let (r, whole) = join(paging.take());
                paged = Some(r);
                // A tree let run with every page in is whole: how CRIU ended
                // after that is no failed restore, and the tree (and what it
                // forked) is not criuz's to kill. Behind a lazy tree the
                // proof still runs, as after a CRIU that succeeded.
                whole && resumed.get().is_some() && !self.detached
            };
            if ran {
                running = resumed.get().map_or(running, |t| (*t - started).as_secs_f64());
                // Said first: on 2 cores, the proof's and the read-ahead's
                // threads, started before it, delayed the pidfile of a
                // tree that already ran.
                published = on_running();
                // A held tree's fill resumed the read-ahead already, and it
                // has no proof behind.
                self.source.read_ahead(true);
                proving = prove_behind.then(prove);
            }
            let proof = proving.map_or(Ok(()), |p| p.join().unwrap_or(Err(Error::Cancelled)));
            let paged = paged.unwrap_or_else(|| join(paging).0);
            (paged, proof, status, running, published, ran)
        });
        let mut ended = String::new();
        if paged.is_err() || proof.is_err() || published.is_err() {
            // Again, now that the restore has returned: the tree may not have
            // existed at the first kill, and it must be dead before the pager's
            // and the guard's copies of its userfaultfds close.
            victim.kill();
            ended = victim.wait_gone();
            if ended.is_empty() && !ran && steps.handed_over.get().is_some() {
                // Killed while CRIU, its parent still, was finishing: CRIU
                // reaped it, so criuz has no status of it to tell, but the
                // tree CRIU handed over was killed all the same (before it
                // ran: not "restored tree killed", which says it ran).
                ended = "the tree killed (reaped by CRIU)".into();
            }
        }
        let report = pager.into_report();
        guard.release();
        let whole = ran && paged.is_ok() && proof.is_ok();
        if let (true, Victim::Tree(pids)) = (whole, victim) {
            // Whole and unguarded: a lazy tree's proof behind is done, and
            // from here an interruption leaves the tree running, or passes
            // on to it in the foreground (`proc::interrupt`).
            crate::proc::restored::let_go_of_restored_tree(pids.first().copied());
        }
        if !whole && (paged.is_err() || proof.is_err() || !status.as_ref().is_ok_and(|s| s.success())) {
            // What CRIU abandoned, whether criuz learned of it or not.
            crate::proc::restored::end_orphans();
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        let status = status.map_err(|e| cannot_run(&program, e))?;
        let resident = report.resident.map_or(started.elapsed(), |t| t - started).as_secs_f64();
        let failed = if ran {
            "lazy restore failed, restored tree killed"
        } else {
            "restore failed before the restored tree ran"
        };
        let failed = if ended.is_empty() { failed.to_string() } else { format!("{failed}: {ended}") };
        paged.and(proof).map_err(|e| e.context(failed))?;
        // Its error says the tree was killed (`PIDFILE_FAILED`, or the CUDA
        // resume's).
        published?;
        let working_set_file = record_new_faults(touch.as_deref(), &recorded, &report.touched);
        Ok((
            status,
            LazyReport {
                pid: None,
                cuda_resume_seconds: None,
                criu_started_seconds: criu_started,
                fill_started_seconds: report.held_fill_started.map(|t| (t - started).as_secs_f64()),
                handed_over_seconds: steps.handed_over.get().map(|t| (*t - started).as_secs_f64()),
                index_proven_seconds: steps.index_proven.get().map(|t| (*t - started).as_secs_f64()),
                criu_exited_seconds: criu_exited,
                running_seconds: running,
                resident_seconds: resident,
                eager_pages,
                zero_pages_skipped: zero_pages,
                working_set_pages: recorded.len() as u64,
                working_set_seconds: report.working_set_in.map(|t| (t - started).as_secs_f64()),
                working_set_file,
                lazy_pages: report.pages,
                shared_pages: report.shared_pages,
                zero_pages_mapped: report.zero_pages,
                faults: report.faults,
                ended_unfilled: report.ended_unfilled,
                criu_exit: status.code().unwrap_or(-1),
                not_lazy: None,
                copied_apart_bytes: 0,
                huge_page_bytes: report.huge_page_bytes,
                slow_huge_pages: report.slow_huge_pages,
            },
        ))
    }
}

impl LazyRestore<'_> {
    /// Lets go of a tree whose every page is in (and, held, that CRIU
    /// restored whole): the userfaultfds, criuz's and the guard's copies, are
    /// closed now, so that pages left out as zero read as zero from now on (a
    /// runc in the foreground waits for the tree, and the tree must not wait
    /// for us), and a held tree is let run.
    fn let_go_whole(&self, pager: &mut Pager, guard: &Guard, hold: bool, resumed: &OnceLock<Instant>) {
        // Done whole, uninterrupted. A held tree's guard is told it is whole
        // first and released only once it runs, so that a criuz killed in
        // between leaves the guard to let it run (released first, it left
        // the tree stopped for good).
        crate::io::unfinished::uninterrupted(|| {
            if hold {
                // A guard that cannot be told is gone already.
                let _ = guard.whole(self.dumped_stopped);
            }
            pager.let_go();
            if !hold {
                guard.release();
            }
            // Not where a lazy tree's proof behind may still kill it by its
            // pids and criuz returns once that is done: until then they stay
            // criuz's to hold (and without -d, `proc::foreground` lets go
            // after).
            if hold || !self.detached {
                let root = match self.victim {
                    Victim::Tree(pids) => pids.first().copied(),
                    Victim::Cgroup(_) => None,
                };
                crate::proc::restored::let_go_of_restored_tree(root);
            }
            if hold {
                let _ = resumed.set(Instant::now());
                self.victim.resume(self.dumped_stopped);
                guard.release();
            }
        });
    }

    /// Lets a lazy tree CRIU restored stopped run, once CRIU has handed all
    /// of it over (`finished`) and the walks of the archive and its parents
    /// have proven the index its images and pages came from; whether it
    /// was let run. What the walks find fails the pager (`abort`), which
    /// kills the tree. `criu_ended`: whether CRIU exited having restored
    /// it; `command_ended`: set once the restore command has returned;
    /// `steps`: when each step passed.
    fn release_once_proven(
        &self,
        finished: std::sync::mpsc::Receiver<()>,
        criu_ended: Option<std::sync::mpsc::Receiver<bool>>,
        abort: &Abort,
        command_ended: &AtomicBool,
        steps: &ReleaseSteps,
    ) -> bool {
        let source = &*self.source;
        // An error from the pager (it ended before CRIU handed the tree
        // over) kills the tree itself.
        let handed_over = finished.recv().is_ok();
        if handed_over {
            let _ = steps.handed_over.set(Instant::now());
        }
        let proven = handed_over
            && match source.proven().and_then(|()| source.parents_walked()) {
                Ok(()) => {
                    let _ = steps.index_proven.set(Instant::now());
                    true
                }
                Err(e) => {
                    abort.fail(e);
                    false
                }
            };
        match &self.release {
            // Let run only once CRIU exited having restored it.
            Release::Continued => {
                let restored = proven && criu_ended.is_some_and(|e| e.recv().unwrap_or(false));
                if restored {
                    self.victim.resume(self.dumped_stopped);
                }
                restored
            }
            // CRIU waits at its hook whatever criuz found, so it is answered
            // either way; told to fail, the hook kills the tree before CRIU
            // would let it run.
            Release::AtPreResume(hook) => match hook.wait_asked(command_ended) {
                Ok(Some(asked)) => {
                    asked.answer(proven);
                    proven
                }
                Ok(None) | Err(_) => false,
            },
        }
    }
}

/// When a lazy tree's release passed its steps (for the report).
#[derive(Default)]
struct ReleaseSteps {
    handed_over: OnceLock<Instant>,
    index_proven: OnceLock<Instant>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
