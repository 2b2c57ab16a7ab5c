//! A streamed restore: CRIU reads every image, pages included, from criuz's
//! serve socket (`session::serve`), each block checked as it is served;
//! the archive opened from its index and proven behind, its last page of
//! each image waiting for that proof, so a failed check aborts CRIU's
//! restore before the process runs. A guard kills the half-restored tree
//! should criuz die meanwhile.

use crate::archive::{Archive, BlockSource, Options};
use crate::archive::{OpenOptions, Parents, Proof};
use crate::criu::streamer::{self, Listener};
use crate::criu::Criu;
use crate::error::{Error, Result};
use crate::proc::guard::Guard;
use crate::proc::restored;
use crate::session::criu_run::{
    cannot_run, check_pids_free, criu_failure, cuda_plan, publish_pidfile, restore_command, resume_cuda,
    run_restoring_criu, RestoreOptions, PIDFILE_FAILED,
};
use crate::session::memory_room::{check_memory_room, SharedPages};
use crate::session::serve::{self, ServeOptions};
use crate::session::workdir::WorkDir;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct RestoreReport {
    pub pid: Option<i32>,
    pub seconds: f64,
    pub served_bytes: u64,
    pub zero_pages_skipped: u64,
    pub files: usize,
    pub criu_exit: i32,
    /// CUDA restore and unlock of the restored processes, after CRIU.
    pub cuda_resume_seconds: Option<f64>,
    /// Why a default restore streamed where it would otherwise place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_placed: Option<&'static str>,
}

/// Opens a restore's archive. Missing or foreign parents are found here,
/// before CRIU starts; the parents are walked while CRIU starts and reads
/// its metadata images (ten parents of a 1 GiB process: 0.03-0.05 s, a
/// tenth of the restore), and the first page that needs them waits for that
/// walk. The archive itself is opened from its index and block table
/// (checked as a walk would check them) and walked behind, as its blocks
/// are read: from a cold page cache the walk reads the whole file (0.15 s
/// of 1 GiB mixed memory on this project's VM), which then no longer delays
/// CRIU. No process runs before that walk has proven the archive: a
/// streamed restore's last page of each image, and the release of a placed
/// or lazy restore's tree (CRIU leaves it stopped), wait for it
/// (`BlockSource::proven`).
pub fn open_for_restore(o: &RestoreOptions) -> Result<Arc<Archive>> {
    let how = OpenOptions {
        search: o.parents.clone(),
        spool_cap: o.pipe_buffer,
        proof: Proof::Behind,
        parents: Parents::Behind,
        // What a restore reads before its pages (the images CRIU's start
        // needs, the placement's plan) comes first. Each path lets the
        // read-ahead run once its pages are read: a streamed restore as it
        // starts serving (`restore_opened`), a placed one as its fill starts,
        // a lazy one once its tree runs.
        read_ahead_at_once: false,
    };
    crate::archive::open(&o.input, &how)
}

/// `restore`, of an archive opened by [`open_for_restore`] at `started`.
pub fn restore_opened(
    o: &RestoreOptions,
    source: Arc<Archive>,
    started: Instant,
    archive: &Options,
    criu: &Criu,
) -> Result<RestoreReport> {
    let tree = check_pids_free(&*source)?;
    check_memory_room(&*source, SharedPages::KeptShared, o)?;
    let cuda = cuda_plan(&*source, &o.gpu_map, true)?;
    restored::become_subreaper();
    let work = WorkDir::new("criuz-restore-")?;
    let listener = Listener::bind(work.path(), streamer::SERVE_SOCKET)?;
    let pidfile = work.path().join("restored.pid");
    let stop = AtomicBool::new(false);
    let opts = ServeOptions {
        meter: o.meter.clone().unwrap_or_default(),
        threads: archive.threads,
        prefetch_bytes: serve::PREFETCH_BYTES,
        skip_zero_pages: !o.keep_zero_pages,
    };

    let mut cmd = restore_command(criu, o, &*source, "--stream", work.path(), &pidfile);

    // Should criuz die mid-restore, its CRIU dies with it (`restore_command`)
    // and the half-restored tree would wait forever for a CRIU that is gone:
    // the guard kills it, and again once that CRIU has ended (it may have
    // forked more of the tree meanwhile). Released once CRIU has exited
    // having let the tree run, or when criuz ends the tree itself. Not at
    // CRIU's pidfile: CRIU writes it before it lets the tasks out of its
    // restorer, where a criuz killed in between left them waiting, every
    // signal blocked, for good.
    let guard = Guard::start(&tree)?;
    let restored = AtomicBool::new(false);
    let (status, served) = std::thread::scope(|s| {
        let srv = s.spawn(|| {
            // Held by `open_for_restore`; CRIU reads the pages from here on.
            source.read_ahead(true);
            let served = serve::serve(&listener, source.clone(), opts, &stop);
            match source.parents_walked() {
                // Pages that needed the parents failed as cancelled (CRIU
                // aborted before the process ran): the walk says why. A
                // restore that needed nothing of them stands.
                Err(e) if served.is_err() => Err(e),
                _ => served,
            }
        });
        // At CRIU's pidfile criuz stops reaping what the tree orphans; the
        // tree is named whole (an interruption then says it runs on) only
        // once CRIU has exited having let it run (below). In between CRIU
        // still holds it in its last restore stages (CRIU 4.2.1 waits there
        // for good on a task that a SIGCONT from outside stopped in a
        // ptrace trap): an interruption leaves it to the guard, which kills
        // it, rather than calling a half-restored tree running.
        s.spawn(|| {
            while !restored.load(Ordering::Relaxed) {
                if pidfile.exists() {
                    restored::stop_being_subreaper();
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        let status = run_restoring_criu(&mut cmd, &tree, Some(&guard));
        stop.store(true, Ordering::Relaxed);
        restored.store(true, Ordering::Relaxed);
        (status, srv.join().unwrap_or(Err(Error::Cancelled)))
    });
    let failed = |e: Error| {
        // Whatever CRIU left of the tree is killed and reaped before the
        // guard goes, so no half-restored process waits forever.
        // The root CRIU named, if it got that far: criuz stopped reaping
        // at that pidfile, so the tree may have gone to init as CRIU exited.
        let root = std::fs::read_to_string(&pidfile).ok().and_then(|p| p.trim().parse().ok());
        let _ = restored::end_aborted_tree(&tree, root);
        guard.release();
        restored::end_orphans();
        e
    };
    let status = status.map_err(|e| failed(cannot_run(criu.path.display(), e)))?;
    let pid = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
    let report = match served {
        Err(e) => {
            let log = work.save_log("restore.log");
            return Err(failed(e.context(format!("restore aborted ({log})"))));
        }
        Ok(None) if !status.success() => {
            return Err(failed(criu_failure("criu restore", status, &work.save_log("restore.log"))))
        }
        Ok(None) => return Err(failed(Error::Criu("CRIU never connected to the serve socket".into()))),
        Ok(Some(report)) => report,
    };
    // CRIU returns once the tree runs (`restore_command`).
    if !status.success() {
        return Err(failed(criu_failure("criu restore", status, &work.save_log("restore.log"))));
    }
    let cuda_resume_seconds = resume_cuda(cuda.as_ref(), &pidfile)
        .map_err(|e| failed(e.context("CUDA resume failed, restored tree killed")))?;
    // The tree runs whole: let go of even where CRIU ended before the
    // watcher above saw its pidfile (an interruption from here on leaves it
    // running, or passes on to it in the foreground: `proc::interrupt`).
    restored::let_go_of_restored_tree(pid);
    // Before the guard goes: a pidfile that cannot be written fails the
    // restore, and a failed restore leaves nothing running.
    publish_pidfile(&pidfile, o.pidfile.as_deref()).map_err(|e| failed(e.context(PIDFILE_FAILED)))?;
    guard.release();
    Ok(RestoreReport {
        pid,
        seconds: started.elapsed().as_secs_f64(),
        served_bytes: report.bytes,
        zero_pages_skipped: report.zero_pages_skipped,
        files: report.served.len(),
        criu_exit: status.code().unwrap_or(-1),
        cuda_resume_seconds,
        not_placed: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::Packer;
    use crate::io::Location;

    /// A small archive (`core-1.img`, 4 MiB of `pages-1.img`) and how a
    /// restore of it is asked for.
    fn small_archive() -> (tempfile::NamedTempFile, RestoreOptions) {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let packer = Packer::start(tmp.reopen().unwrap(), &Options::default(), None).unwrap();
        for (name, bytes) in [("core-1.img", vec![1u8; 300]), ("pages-1.img", crate::archive::noise(4 << 20))] {
            let mut sink = packer.begin_file(name).unwrap();
            sink.write(&bytes).unwrap();
            sink.finish().unwrap();
        }
        packer.finish().unwrap();
        let o = RestoreOptions {
            input: Location::File(tmp.path().to_path_buf()),
            detach: true,
            shell_job: false,
            extra: Vec::new(),
            pipe_buffer: 1 << 30,
            keep_zero_pages: false,
            huge_pages: crate::session::place::HugePages::default(),
            parents: Default::default(),
            pidfile: None,
            meter: None,
            verify_first: false,
            gpu_map: Vec::new(),
        };
        (tmp, o)
    }

    /// `o`'s archive opened for a restore, its metadata image read.
    fn opened_and_metadata_read(o: &RestoreOptions) -> Arc<Archive> {
        let source = open_for_restore(o).unwrap();
        let core = source.find("core-1.img").unwrap().clone();
        assert_eq!(source.read_file(&core).unwrap(), vec![1u8; 300]);
        source
    }

    /// A restore reads its metadata images before its pages; those reads
    /// must not start the read-ahead of the whole archive, which a cold disk
    /// would then serve before them (a 214 MiB archive: CRIU started 0.1 s
    /// later, session 88). Resumed, reads move it again.
    #[test]
    fn a_restore_s_metadata_reads_leave_its_read_ahead_paused() {
        let (_tmp, o) = small_archive();
        let source = opened_and_metadata_read(&o);
        assert_eq!(source.read_ahead_wanted(), 0, "a metadata read started the read-ahead");
        source.read_ahead(true);
        let pages = source.find("pages-1.img").unwrap().clone();
        assert_eq!(source.read_file(&pages).unwrap().len(), 4 << 20);
        assert!(source.read_ahead_wanted() > 0, "resumed, reads move the read-ahead");
    }

    /// The proof's walk asks for every record's first page at once: it
    /// waits, as the read-ahead does, until the restore reads its pages,
    /// asks for it or waits for the proof (each way releases it); an
    /// archive dropped first is freed, its walk never run.
    #[test]
    fn a_restore_s_proof_walk_waits_for_its_pages_to_be_wanted() {
        let (_tmp, o) = small_archive();
        let source = opened_and_metadata_read(&o);
        assert!(source.walk_held(), "the walk started before the pages were wanted");
        source.read_ahead(true);
        assert!(!source.walk_held());
        source.proven().unwrap();

        let source = open_for_restore(&o).unwrap();
        assert!(source.walk_held());
        source.proven().unwrap();

        let source = open_for_restore(&o).unwrap();
        source.start_proof();
        assert!(!source.walk_held());
        source.proven().unwrap();

        let source = open_for_restore(&o).unwrap();
        let dropped = Arc::downgrade(&source);
        drop(source);
        assert!(dropped.upgrade().is_none(), "a held walk kept its archive");
    }
}
