//! A bare tree's restore through the pager, lazy or placed: `criu restore
//! --lazy-pages --leave-stopped`, the tree named by its pids, its CUDA
//! state resumed and its pidfile published once it runs.

use super::{Fill, LazyReport, LazyRestore, Release};
use crate::archive::{Archive, BlockSource};
use crate::criu::images;
use crate::criu::Criu;
use crate::error::Result;
use crate::proc::guard::Victim;
use crate::session::criu_run::{
    check_pids_free, criu_failure, cuda_plan, publish_pidfile, restore_command, resume_cuda, RestoreOptions,
    PIDFILE_FAILED,
};
use crate::session::memory_room::{check_memory_room, SharedPages};
use crate::session::placement::Placement;
use crate::session::serve::pages_images_named_once;
use crate::session::shmem;
use crate::session::workdir::WorkDir;
use std::sync::Arc;
use std::time::Instant;

/// Restores `archive` lazily (see the module documentation), opened as
/// every restore opens it (`checkpoint::open_for_restore`: from its index,
/// the archive and its parents walked behind). CRIU restores the tree
/// stopped while the walks run, and the tree runs once they have proven the
/// index its images and pages came from: an archive whose records disagree
/// with its index (reordered entries with every check recomputed pass each
/// block's own checks) stops the restore while nothing runs. The proof of
/// the stored bytes runs behind the tree (first with `verify_first`).
pub fn restore_lazy(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    threads: usize,
) -> Result<LazyReport> {
    let walked = archive.clone();
    parents_say_why(&walked, restore_through_pager(o, archive, started, criu, Fill::Lazy, threads))
}

/// Restores eagerly, criuz placing the memory: CRIU restores the tree with
/// lazy pages and leaves it stopped; criuz copies every page in on `threads`
/// threads (never through CRIU's pipe), each page from a block checked as it
/// is decoded, and only then lets the tree run. No process runs with a page
/// missing or unproven; a failure kills the tree before it ran. `archive`
/// opened as a streamed restore opens it (`checkpoint::open_for_restore`:
/// parents walked behind, an arriving object proven behind): the tree runs
/// only once both are done. `planned`: the archive's `plan_placement`, where
/// the caller worked it out already.
pub(crate) fn restore_placed(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    threads: usize,
    planned: Option<Placement>,
) -> Result<LazyReport> {
    let walked = archive.clone();
    parents_say_why(
        &walked,
        restore_through_pager(
            o,
            archive,
            started,
            criu,
            Fill::Held { planned, keep_zero_pages: o.keep_zero_pages, huge_pages: o.huge_pages },
            threads,
        ),
    )
}

/// The processes of the archive's tree (`pids`) that were stopped when it
/// was dumped (a job a shell had stopped, a process paused with SIGSTOP),
/// with the signal that had stopped each, from their core images. CRIU
/// restores those stopped; a tree CRIU leaves stopped for criuz
/// (`--leave-stopped`) must be let run without them, or they would come
/// back running.
fn stopped_at_dump(source: &dyn BlockSource, pids: &[i32]) -> Result<Vec<(i32, i32)>> {
    let mut stopped = Vec::new();
    for &pid in pids {
        let Some(entry) = source.find(&format!("core-{pid}.img")) else { continue };
        if let Some(sig) = images::core_stopped_by(&source.read_file(entry)?) {
            stopped.push((pid, sig));
        }
    }
    Ok(stopped)
}

/// What a restore through the pager ended with. Its archive's parents are
/// walked behind (`checkpoint::open_for_restore`): pages that needed them
/// fail as cancelled, and the walk says why.
fn parents_say_why(archive: &Archive, restored: Result<LazyReport>) -> Result<LazyReport> {
    restored.map_err(|e| match archive.parents_walked() {
        Err(why) => why,
        Ok(()) => e,
    })
}

fn restore_through_pager(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    fill: Fill,
    threads: usize,
) -> Result<LazyReport> {
    let pids = check_pids_free(&*archive)?;
    // Shared memory's zero pages count: those criuz leaves holes
    // (`session::shmem`) are pages of memory again once the tree reads
    // them, as they were when it was dumped.
    check_memory_room(&*archive, SharedPages::CopiedToEach, o)?;
    // The shared memory criuz places itself: a held tree's, planned once.
    let mut fill = fill;
    let shared = match &mut fill {
        Fill::Held { keep_zero_pages: true, .. } | Fill::Lazy => Vec::new(),
        Fill::Held { planned: Some(p), .. } => std::mem::take(&mut p.shared),
        Fill::Held { planned: None, .. } => shmem::plan(&*archive, &pages_images_named_once(&*archive)?)?,
    };
    let cuda = cuda_plan(&*archive, &o.gpu_map, true)?;
    crate::proc::restored::become_subreaper();
    let source: Arc<dyn BlockSource> = archive;
    let work = WorkDir::new("criuz-lazy-")?;
    let pidfile = work.path().join("restored.pid");
    let mut cmd = restore_command(criu, o, &*source, "--lazy-pages", work.path(), &pidfile);
    // Held until every page is in (placed), or until the walks behind have
    // proven the archive (lazy).
    cmd.arg("--leave-stopped");
    let dumped_stopped = stopped_at_dump(&*source, &pids)?;
    let victim = Victim::Tree(pids);
    let lazy = LazyRestore {
        source,
        input: &o.input,
        images: work.path(),
        work: work.path(),
        victim: &victim,
        verify_first: o.verify_first,
        fill,
        shared,
        release: Release::Continued,
        threads,
        meter: o.meter.clone(),
        // With or without -d (`restore_command`).
        detached: true,
        dumped_stopped: &dumped_stopped,
    };
    let cuda_resumed = std::cell::Cell::new(None);
    let (status, mut report) = lazy.run(cmd, started, || {
        // The tree runs (its CUDA calls wait for the unlock) while its
        // pages still arrive; a held tree runs once every page is in.
        let resumed = resume_cuda(cuda.as_ref(), &pidfile).map_err(|e| {
            victim.kill();
            e.context("CUDA resume failed, restored tree killed")
        })?;
        cuda_resumed.set(resumed);
        publish_pidfile(&pidfile, o.pidfile.as_deref()).map_err(|e| e.context(PIDFILE_FAILED))
    })?;
    report.cuda_resume_seconds = cuda_resumed.get();
    if !status.success() {
        return Err(criu_failure("criu restore", status, &work.save_log("restore.log")));
    }
    report.pid = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
    Ok(report)
}
