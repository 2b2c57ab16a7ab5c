//! `criuz podman checkpoint|restore`: podman's checkpoint is a tar stream
//! (`podman container checkpoint --export`), which criuz packs as a tree of
//! files, page-aware, and unpacks back to a private tar file for
//! `podman container restore --import`. podman finds CRIU on `PATH`, so the
//! CRIU criuz found goes first there. Trade-off: the export lands whole on
//! tmpfs before it is packed (podman writes it to a file), so that an
//! export podman ended the container for is kept, and named, should the
//! packing fail.

use crate::archive::{OpenOptions, Options, PackStats};
use crate::criu::Criu;
use crate::error::{Error, IoContext, Result};
use crate::io::{Location, Output};
use crate::offline::{self, Reading};
use crate::progress::Progress;
use crate::session::container::work_dir;
use crate::session::criu_run::{cannot_run, ids_by_default, run_podman_restore, CriuStuck, ToldAgain};
use crate::session::workdir::WorkDir;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// podman finds CRIU on `PATH` (and hands that `PATH` to conmon and runc):
/// a private directory holding `criu`, a link to the CRIU criuz found, goes
/// first ([`criu_dir`]).
fn podman_command(podman: &Path, criu: &Criu, work: &WorkDir) -> Result<Command> {
    let bin = criu_dir(work);
    // Made once per work directory (private to this command).
    if !bin.is_dir() {
        std::fs::DirBuilder::new().mode(0o700).create(&bin).at(&bin)?;
        std::os::unix::fs::symlink(&criu.path, bin.join("criu")).at(&bin)?;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin];
    dirs.extend(std::env::split_paths(&path));
    let mut c = crate::spawn::command(podman);
    c.env("PATH", std::env::join_paths(dirs).map_err(|e| Error::Usage(format!("PATH: {e}")))?);
    Ok(c)
}

/// The directory first on podman's `PATH`, private to this criuz: what
/// runs with it there is this command's (`run_podman_restore` finds
/// podman's CRIU by it).
fn criu_dir(work: &WorkDir) -> PathBuf {
    work.path().join("bin")
}

/// What `criuz podman checkpoint` was asked.
pub struct PodmanCheckpoint<'a> {
    /// The container's name or id.
    pub id: &'a str,
    pub output: &'a Path,
    pub force: bool,
    /// More `podman container checkpoint` options.
    pub extra: &'a [String],
    /// Store page ids where the container's processes share much of their
    /// memory (`criu_run::ids_by_default`, asked before podman checkpoints
    /// it); off with `--no-ids`.
    pub auto_ids: bool,
}

/// `podman container checkpoint --export` of container `o.id` into an
/// archive. The export goes to a private tar file on tmpfs first, then is
/// packed: podman ends the container as it exports (unless told
/// `--leave-running`), so should packing fail, the export is kept and named
/// instead of lost.
pub fn podman_checkpoint(podman: &Path, criu: &Criu, o: &PodmanCheckpoint, opts: &Options) -> Result<PackStats> {
    let out = Output::open(o.output, o.force)?;
    let work = work_dir("criuz-podman-")?;
    // Whether its processes share pages is asked of the running container;
    // one podman cannot report is left to podman's checkpoint to refuse.
    let shares = || podman_init_pid(podman, criu, &work, o.id).is_some_and(|pid| ids_by_default(pid, false));
    let opts = &Options { ids: opts.ids || (o.auto_ids && shares()), ..opts.clone() };
    let tar = work.path().join("export.tar");
    // podman may end the container and leave its export here as the only
    // copy, even if criuz is interrupted meanwhile.
    work.keep_on_interrupt();
    // Uncompressed: criuz compresses it, page-aware.
    let status = podman_command(podman, criu, &work)?
        .args(["container", "checkpoint", "--compress", "none", "--export"])
        .arg(&tar)
        .args(o.extra)
        .arg(o.id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .map_err(|e| cannot_run(podman.display(), e))?;
    let id = o.id;
    if !status.success() {
        return Err(Error::Criu(format!("podman container checkpoint {id} failed ({status}); nothing written")));
    }
    let packed = std::fs::File::open(&tar).at(&tar).and_then(|f| {
        let label = tar.display().to_string();
        offline::pack_tar(Box::new(f), &label, out.writer()?, opts, &mut Progress::hidden())
    });
    match packed.and_then(|stats| out.commit().map(|_| stats)) {
        Ok(stats) => Ok(stats),
        Err(e) => {
            let kept = work.keep();
            Err(e.context(format!(
                "podman checkpointed {id} but the archive could not be written; its export is kept as {}",
                kept.join("export.tar").display()
            )))
        }
    }
}

/// The host pid of container `id`'s init, as podman reports it (None where
/// it cannot: no such container, not running).
fn podman_init_pid(podman: &Path, criu: &Criu, work: &WorkDir, id: &str) -> Option<i32> {
    let out = podman_command(podman, criu, work)
        .ok()?
        .args(["container", "inspect", "--format", "{{.State.Pid}}", id])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    (out.status.success() && pid > 0).then_some(pid)
}

/// `podman container restore --import` from an archive of a podman export:
/// unpacked to a private tar file first (podman reads an import as a file).
pub fn podman_restore(podman: &Path, criu: &Criu, input: &Location, extra: &[String], opts: &Options) -> Result<()> {
    let work = work_dir("criuz-podman-")?;
    let tar = work.path().join("checkpoint.tar");
    let out = Output::open(&tar, false)?;
    let inp = Reading::for_tar(input, &OpenOptions::default())?;
    let mut held = ToldAgain::default();
    let mut note = |name: &str, size: u64| {
        if let Some(image) = name.strip_prefix("checkpoint/").filter(|n| !n.contains('/')) {
            held.note(image, size);
        }
    };
    offline::unpack_tar_noting(inp, out.writer()?, opts, &mut note)?;
    out.commit()?;
    let mut cmd = podman_command(podman, criu, &work)?;
    cmd.args(["container", "restore", "--import"]).arg(&tar);
    cmd.args(held.options(|option| extra.iter().any(|a| a == option)));
    cmd.args(extra).stdin(Stdio::null());
    // A process group of its own: a Ctrl-C at the terminal reaches only
    // criuz, which lets podman end first. podman interrupted mid-restore
    // exits at once while conmon's runc finishes the restore, leaving a
    // running container podman records as "created" (and `podman rm` then
    // drops the record, not the processes).
    cmd.process_group(0);
    let made = container_made(&tar, extra);
    let started = SystemTime::now();
    let failed = |what: String| {
        let removed =
            made.as_deref().map(|c| remove_failed_import(podman, criu, &work, c, started)).unwrap_or_default();
        Err(Error::Criu(format!("{what}{removed}")))
    };
    match run_podman_restore(&mut cmd, criu_dir(&work)) {
        Ok(status) if status.success() => {}
        Ok(status) => return failed(format!("podman container restore --import failed ({status})")),
        Err(e) => match e.get_ref().and_then(|e| e.downcast_ref::<CriuStuck>()) {
            Some(stuck) => return failed(stuck.to_string()),
            None => return Err(cannot_run(podman.display(), e)),
        },
    }
    Ok(())
}

/// The container `podman container restore --import` makes of the export
/// `tar`: the name `extra` gives it (`--name`, `-n`), else the export's own
/// id (config.dump's), which the import keeps.
fn container_made(tar: &Path, extra: &[String]) -> Option<String> {
    let mut args = extra.iter();
    while let Some(arg) = args.next() {
        if arg == "--name" || arg == "-n" {
            return args.next().cloned();
        }
        if let Some(name) = arg.strip_prefix("--name=").or_else(|| arg.strip_prefix("-n=")) {
            return Some(name.to_string());
        }
    }
    let config = crate::tree::tar::member(tar, "config.dump", 1 << 20)?;
    let config: serde_json::Value = serde_json::from_slice(&config).ok()?;
    config["id"].as_str().filter(|id| !id.is_empty()).map(String::from)
}

/// After a failed import: podman keeps the container it made, "created",
/// and an import of the same export then fails on its id ("that ID is
/// already in use"), so the restore could not be run again. criuz removes
/// it if it was made since `started` (not one of the same name or id that
/// was there before, on which the import failed) and does not run, first
/// detaching the cgroup yard a CRIU killed mid-restore leaves mounted in
/// the container's directory (podman cannot remove the files below it).
/// What it did, for the error's message.
fn remove_failed_import(podman: &Path, criu: &Criu, work: &WorkDir, container: &str, started: SystemTime) -> String {
    let inspect = podman_command(podman, criu, work).ok().and_then(|mut c| {
        c.args(["container", "inspect", "--format", "{{.Created.UnixNano}} {{.State.Status}} {{.StaticDir}}"])
            .arg(container)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
    });
    let Some(inspect) = inspect.filter(|o| o.status.success()) else { return String::new() };
    let inspect = String::from_utf8_lossy(&inspect.stdout);
    let mut fields = inspect.trim().splitn(3, ' ');
    let created = fields.next().and_then(|ns| ns.parse::<u64>().ok()).map(|ns| UNIX_EPOCH + Duration::from_nanos(ns));
    let (state, dir) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
    if created.is_none_or(|c| c < started) || state == "running" {
        return String::new();
    }
    if !dir.is_empty() {
        crate::io::leftover::detach_cgroup_yards(Path::new(dir));
    }
    let removed = podman_command(podman, criu, work).ok().and_then(|mut c| {
        c.args(["container", "rm", "-f", container]).stdin(Stdio::null()).stdout(Stdio::null()).status().ok()
    });
    let short = container.get(..12).filter(|_| container.len() == 64).unwrap_or(container);
    match removed {
        Some(s) if s.success() => format!("; criuz removed the container podman had made for it ({short})"),
        _ => format!("; podman keeps the container it made for it: `podman rm -f {short}` before restoring again"),
    }
}
