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
use crate::proc::holder;
use crate::proc::{claim, outside, tree};
use crate::session::criu_hook::{self, ActionHook, At};
use crate::session::criu_run::{join_criu_thread, run_criu_told};
use crate::session::receive::{self, PageServer, ReceiveReport};
use crate::session::serve::{self, ServeOptions, ServeReport};
use crate::session::workdir::WorkDir;
use crate::session::{capture, criu_run::RestoreOptions};
use crate::tree::Before;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The images directory given to criuz and CRIU alike (`-D`) must be one:
/// a failure to listen in it would name the socket, not what is wrong. One
/// that is not there, or is no directory, is a bad argument (exit 2).
fn images_dir(dir: &Path) -> Result<()> {
    crate::io::named_dir(dir).map_err(|e| e.context("-D (CRIU's images directory)"))
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
        let captured = capture::capture(&self.0, &packer, &never, &capture::Pages::Copied, None);
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
/// (with a guard, should criuz die), as `criuz dump` does. A dump only
/// CRIU can roll back whole (`--tcp-established`, `--link-remap`: its
/// connections stay locked for the restore) is held at CRIU's post-dump
/// hook as well (`session::criu_hook`), so that a failure lets CRIU roll
/// it back. Other commands end as they would alone.
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
    let _claim = held.map(|h| claim::claim_tree(h.pid)).transpose()?;
    if let Some(h) = held {
        outside::refuse_while_arriving(h.pid)?;
    }
    let opts = Options { tree: true, ..opts.clone() };
    let out = output.output(force)?;
    // Taken as the dump begins: what was there already is another run's,
    // and the archive being written (in `dir`, or replacing a file there)
    // is never packed into itself.
    let before = Before::take(dir, out.own_files())?;
    let packer = Packer::start(out.writer()?, &opts, None)?;
    let mut cmd = crate::spawn::command(program);
    cmd.args(args);
    let work = held.filter(|h| h.hooked).map(|_| WorkDir::new("criuz-page-server-")).transpose()?;
    let hook = work.as_ref().map(|w| ActionHook::bind(w.path(), At::PostDump)).transpose()?;
    let stopped_before = held.map(|h| tree::stopped_pids(&[h.pid])).unwrap_or_default();
    let guard = held.map(|h| Guard::of_dump(&[h.pid], &stopped_before, hook.is_some()).map(Arc::new)).transpose()?;
    if held.is_some() {
        cmd.arg("--leave-stopped");
    }
    let done = match &hook {
        Some(hook) => {
            cmd.arg("--action-script").arg(hook.script());
            hooked_dump(server, cmd, program, (dir, &before), packer, guard.clone(), hook, || out.commit())
        }
        None => receive::run_dump(server, cmd, program, dir, &before, packer, None).and_then(|done| {
            out.commit()?;
            Ok(done)
        }),
    };
    if let (Some(Held { pid, .. }), Some(guard)) = (held, guard) {
        if done.is_ok() {
            tree::end_dumped(pid);
        } else {
            tree::resume_dumped(pid, &stopped_before);
        }
        guard.release();
        let resumed = holder::exists(pid);
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

/// A page-server dump's tree that criuz ends (see [`page_server_dump`]).
#[derive(Clone, Copy)]
struct Held {
    pid: i32,
    /// Held at CRIU's post-dump hook too.
    hooked: bool,
}

/// The tree a page-server dump command leaves to criuz to end: that of a
/// `criu dump` that would end it.
fn held_tree(program: &str, args: &[String]) -> Option<Held> {
    if Path::new(program).file_name()? != "criu" {
        return None;
    }
    let ("dump", options) = options::action(args)? else { return None };
    let given = CriuOptions::read(&options);
    let ends_it = ["leave-running", "leave-stopped", "lazy-pages"].iter().all(|name| !given.is_set(name));
    let pid = given.value("tree")?.parse().ok()?;
    ends_it.then_some(Held { pid, hooked: criu_hook::needed(&given) })
}

/// [`receive::run_dump`] held at CRIU's post-dump hook: when CRIU asks, it
/// has sent every page and written every image; the archive is finished
/// and committed then (`commit`), and CRIU told whether it was, to end the
/// tree or to roll it back. Returns once CRIU has ended.
#[allow(clippy::too_many_arguments)]
fn hooked_dump(
    server: &PageServer,
    mut cmd: Command,
    what: &str,
    (dir, before): (&Path, &Before),
    packer: Packer,
    guard: Option<Arc<Guard>>,
    hook: &ActionHook,
    commit: impl FnOnce() -> Result<()>,
) -> Result<(PackStats, ReceiveReport)> {
    let criu_ended = Arc::new(AtomicBool::new(false));
    let ended = criu_ended.clone();
    // Its own thread, not the scope's: CRIU waits at its hook while the
    // archive below is written, after the scope.
    let criu = std::thread::spawn(move || {
        let status = run_criu_told(&mut cmd, &[], guard.as_deref());
        ended.store(true, Ordering::Relaxed);
        status
    });
    let stop = AtomicBool::new(false);
    let (asked, received) = std::thread::scope(|s| {
        let rx = s.spawn(|| receive::receive(server, &packer, &stop));
        let asked = hook.wait_asked(&criu_ended);
        // CRIU is done with the page server by its hook, or has ended: a
        // receiver still waiting for it to connect waits no more.
        stop.store(true, Ordering::Relaxed);
        (asked, rx.join().unwrap_or(Err(Error::Cancelled)))
    });
    match asked {
        Ok(Some(asked)) => {
            let written = match received {
                Ok(Some(report)) => receive::complete(packer, dir, before, report).and_then(|done| {
                    commit()?;
                    Ok(done)
                }),
                Ok(None) => Err(packer
                    .abort()
                    .unwrap_or_else(|| Error::Criu(format!("{what} finished without connecting to the page server")))),
                Err(e) => Err(packer.abort().unwrap_or(e)),
            };
            asked.answer(written.is_ok());
            let _ = join_criu_thread(criu);
            written
        }
        // CRIU ended without asking: it failed, and rolled back itself.
        Ok(None) => {
            let status = join_criu_thread(criu);
            Err(packer.abort().unwrap_or_else(|| receive::failure(status, received, what)))
        }
        // Its hook, not answered, fails: CRIU rolls back.
        Err(e) => {
            let _ = join_criu_thread(criu);
            Err(packer.abort().unwrap_or(e))
        }
    }
}
