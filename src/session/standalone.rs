//! criuz on one side of a CRIU the user runs: `capture` and `serve` answer
//! a `criu dump/restore --stream` started by hand, and the page server
//! receives the pages of a dump command the user gives. Each is bound
//! first (so the caller can say where CRIU should connect), then run as one
//! call; the rules of a complete dump are those of `capture::settle` and
//! `receive::run_dump`.

use crate::archive::{Archive, OpenOptions, Options, PackStats, Packer};
use crate::criu::options::{self, CriuOptions};
use crate::criu::streamer::{self, Listener};
use crate::error::{Error, Result};
use crate::io::Location;
use crate::proc::guard::Guard;
use crate::proc::{claim, tree};
use crate::session::post_dump;
use crate::session::receive::{self, PageServer, ReceiveReport};
use crate::session::serve::{self, ServeOptions, ServeReport};
use crate::session::{capture, criu_run::RestoreOptions};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The images directory given to criuz and CRIU alike (`-D`) must be one:
/// a failure to listen in it would name the socket, not what is wrong.
fn images_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::Usage(format!("{}: not a directory (-D names CRIU's images directory)", dir.display()))),
        Err(e) => Err(Error::file(dir, e)),
    }
}

/// Waits for `criu dump --stream -D DIR` and writes what it sends.
pub struct Capture(Listener);

impl Capture {
    pub fn bind(dir: &Path) -> Result<Capture> {
        images_dir(dir)?;
        Listener::bind(dir, streamer::CAPTURE_SOCKET).map(Capture)
    }

    /// Writes the dump CRIU streams into a new archive at `output`,
    /// published only if the stream was complete.
    pub fn run(self, output: &Location, force: bool, opts: &Options) -> Result<PackStats> {
        let out = output.output(force)?;
        let packer = Packer::start(out.writer()?, opts, None)?;
        let never = AtomicBool::new(false);
        let captured = capture::capture(&self.0, &packer, &never, capture::Pages::Copied, None);
        let (packer, _) = capture::settle(packer, captured).map_err(|e| e.context(format!("{output} not written")))?;
        let (stats, _) = packer.finish()?;
        out.commit()?;
        Ok(stats)
    }
}

/// Waits for `criu restore --stream -D DIR` and answers it from an archive.
pub struct Serve {
    listener: Listener,
    source: Arc<Archive>,
}

impl Serve {
    /// Opens and proves the archive `o.input`, with its parents, then
    /// listens in `dir`.
    pub fn bind(dir: &Path, o: &RestoreOptions) -> Result<Serve> {
        images_dir(dir)?;
        let how = OpenOptions { search: o.parents.clone(), spool_cap: o.pipe_buffer, ..OpenOptions::default() };
        let source = crate::archive::open(&o.input, &how)?;
        Ok(Serve { listener: Listener::bind(dir, streamer::SERVE_SOCKET)?, source })
    }

    /// Serves the archive to the CRIU that connects, as `o` asks.
    pub fn run(self, o: &RestoreOptions, threads: usize) -> Result<ServeReport> {
        let never = AtomicBool::new(false);
        let sopts = ServeOptions {
            meter: o.meter.clone().unwrap_or_default(),
            threads,
            prefetch_bytes: serve::PREFETCH_BYTES,
            skip_zero_pages: !o.keep_zero_pages,
        };
        Ok(serve::serve(&self.listener, self.source, sopts, &never)?.expect("serve waits for CRIU"))
    }
}

/// Runs `command` (a program and its arguments), a dump told to send its
/// pages to `server` and its other images to `dir`, into a new tree archive
/// at `output`, published only if the dump was complete.
///
/// A plain `criu dump` ends its tree once criuz has every page, before the
/// images it writes after that are in the archive: a failure then would
/// lose the process with its checkpoint. So a `criu dump` that would end
/// its tree is told to leave it stopped (`--leave-stopped`), and criuz
/// ends it once the archive is committed, or resumes it on any failure
/// (with a guard, should criuz die), as `criuz dump` does. Not a dump CRIU
/// alone can roll back whole (`--tcp-established`, `--link-remap`: its
/// connections stay locked for the restore), which ends as CRIU ends it.
pub fn page_server_dump(
    server: &PageServer,
    command: &[String],
    dir: &Path,
    output: &Location,
    force: bool,
    opts: &Options,
) -> Result<(PackStats, ReceiveReport)> {
    let (program, args) = command.split_first().ok_or_else(|| Error::Usage("no dump command given".into()))?;
    if !program.contains('/') && crate::criu::on_path(program).is_none() {
        let ours = crate::criu::locate(None).ok().map(|(c, _)| format!(" (criuz's own CRIU is {})", c.path.display()));
        return Err(Error::Usage(format!(
            "{program}: not found on PATH; give the dump command's full path{}",
            ours.unwrap_or_default()
        )));
    }
    images_dir(dir)?;
    let held = held_tree(program, args);
    let _claim = held.map(claim::claim_tree).transpose()?;
    let opts = Options { tree: true, ..opts.clone() };
    let out = output.output(force)?;
    let packer = Packer::start(out.writer()?, &opts, None)?;
    let mut cmd = Command::new(program);
    cmd.args(args);
    let stopped_before = held.map(|pid| tree::stopped_pids(&[pid])).unwrap_or_default();
    let guard = held.map(|pid| Guard::resuming(&[pid], &stopped_before)).transpose()?;
    if held.is_some() {
        cmd.arg("--leave-stopped");
    }
    let done = receive::run_dump(server, cmd, program, dir, packer, None).and_then(|done| {
        out.commit()?;
        Ok(done)
    });
    if let (Some(pid), Some(guard)) = (held, guard) {
        if done.is_ok() {
            tree::end_dumped(pid);
        } else {
            tree::resume_dumped(pid, &stopped_before);
        }
        guard.release();
        let resumed = tree::exists(pid);
        return done.map_err(|e| {
            if resumed {
                // The command may have failed before it stopped anything.
                let now = if stopped_before.contains(&pid) { "is left stopped, as it was" } else { "runs on" };
                e.context(format!("no checkpoint written; process {pid} {now}"))
            } else {
                e
            }
        });
    }
    done
}

/// The tree a page-server dump command leaves to criuz to end (see
/// [`page_server_dump`]): that of a `criu dump` that would end it.
fn held_tree(program: &str, args: &[String]) -> Option<i32> {
    if Path::new(program).file_name()? != "criu" {
        return None;
    }
    let ("dump", options) = options::action(args)? else { return None };
    let given = CriuOptions::read(&options);
    let ends_it = ["leave-running", "leave-stopped", "lazy-pages"].iter().all(|name| !given.is_set(name))
        && !post_dump::needed(&given);
    ends_it.then(|| given.value("tree")?.parse().ok()).flatten()
}
