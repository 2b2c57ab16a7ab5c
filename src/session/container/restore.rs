//! `criuz runc restore`: the images written into a private work directory
//! for `runc restore --image-path`, lazily by default (criuz as the
//! lazy-pages daemon of runc's CRIU, held at its pre-resume hook until
//! the container's shared memory is registered) or eagerly, every page
//! written first; the container's memory limit and cgroup made as its
//! dump recorded them (see the parent module).

use super::{images_dir, work_dir, Runc};
use crate::archive::{BlockSource, OpenOptions, Options};
use crate::criu::images::DumpedMemoryLimit;
use crate::criu::{uffd, Criu};
use crate::error::Result;
use crate::io::Location;
use crate::proc::guard::Victim;
use crate::proc::memory::{self, ChargedTo};
use crate::session::criu_hook::{ActionHook, At};
use crate::session::criu_run::{cannot_run, criu_failure, cuda_plan, run_restoring_criu, ToldAgain};
use crate::session::lazy::{Fill, LazyRestore, Release};
use crate::session::memory_room::{check_container_memory_room, SharedPages};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct RuncRestore {
    pub id: String,
    pub input: Location,
    pub bundle: Option<PathBuf>,
    pub detach: bool,
    pub pid_file: Option<PathBuf>,
    pub memory: Memory,
    /// A lazy restore proves every stored byte before runc starts instead
    /// of behind the running container (see `session::lazy`).
    pub verify_first: bool,
    /// More `runc restore` options (e.g. `--tcp-established`).
    pub extra: Vec<String>,
    /// GPUs to restore CUDA state onto in place of those it was dumped
    /// from (old UUID, new UUID).
    pub gpu_map: Vec<(String, String)>,
}

/// How a restored container's memory comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Lazily where this kernel allows it
    /// ([`uffd::lazy_restore_available`]), else eagerly.
    Auto,
    /// The container runs before its memory is in: criuz serves its pages
    /// (`session::lazy`) and returns once every page is in place.
    Lazy,
    /// Every page written for CRIU before it starts.
    Eager,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ContainerRestoreReport {
    /// Until runc returned and (lazily) every page was in place.
    pub seconds: f64,
    /// CUDA restore and unlock of the container's processes, after runc.
    pub cuda_resume_seconds: Option<f64>,
    /// Why a restore that would have been lazy (asked, or the default) was
    /// eager: the kernel gives no userfaultfd, or the container uses CUDA.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_lazy: Option<&'static str>,
    /// In JSON, an `eager` or a `lazy` object beside `seconds`.
    #[serde(flatten)]
    pub how: RestoredHow,
    /// Without --detach, runc waits for the container and exits as its
    /// init does: that status (128 + a signal that killed it), once the
    /// container was restored (runc wrote its pid file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<i32>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RestoredHow {
    /// Every image written first (`images_dir`), then `runc restore`.
    Eager {
        /// Until the images were written.
        unpack_seconds: f64,
        /// Bytes written for CRIU to read.
        bytes: u64,
        /// Zero pages CRIU was spared.
        zero_pages_skipped: u64,
    },
    Lazy(Box<crate::session::lazy::LazyReport>),
}

/// `runc restore` of container `o.id` from an archive. Eagerly, the
/// archive is proven whole (every check) before runc starts; lazily, it is
/// walked first and its stored bytes are proven behind the running
/// container (before runc starts with `verify_first`), every page still comes from a checked
/// block, and a block or proof that fails once the container runs (or a
/// criuz that dies) kills the container's cgroup (`proc::guard::Victim`).
pub fn runc_restore(runc: &Runc, o: &RuncRestore, opts: &Options, criu: &Criu) -> Result<ContainerRestoreReport> {
    let started = Instant::now();
    // Refused before the archive is written out for CRIU: runc would fail
    // on it only then, naming no CRIU log.
    if let Some(b) = &o.bundle {
        crate::io::named_dir(b).map_err(|e| e.context("--bundle"))?;
    }
    // Removed before runc runs (runc writes it anew): an archive there, the
    // one being restored, was deleted.
    if let Some(p) = &o.pid_file {
        if let Some(what) = crate::session::restore::not_a_pid_file(p) {
            return Err(crate::session::restore::refused_pid_file("--pid-file", p, what));
        }
    }
    let work = work_dir("criuz-runc-")?;
    let images = images_dir(&work)?;
    // The read-ahead held until the pages are read, as a restore's
    // (`OpenOptions::read_ahead_at_once`).
    let how = OpenOptions { read_ahead_at_once: false, ..OpenOptions::default() };
    let archive = crate::archive::open(&o.input, &how)?;
    let held = ToldAgain::of(&*archive);
    let cuda = cuda_plan(&*archive, &o.gpu_map, o.detach)?;
    let (lazy, not_lazy) = match o.memory {
        Memory::Eager => (false, None),
        // As `restore --lazy` of a CUDA archive places its memory first
        // (`session::restore`): the driver's resume reads all of it at once.
        _ if cuda.is_some() => (false, Some(CUDA_NOT_LAZY)),
        Memory::Lazy => (true, None),
        // As a default eager restore of such a tree streams (`session::restore`).
        Memory::Auto if crate::session::placement::shares_pages(&*archive) => (false, Some(SHARED_NOT_LAZY)),
        Memory::Auto if uffd::lazy_restore_available() => (true, None),
        Memory::Auto => (false, Some(NO_USERFAULTFD)),
    };
    if let Some((to, made, config)) = container_memory(o.bundle.as_deref(), &o.id) {
        let shared = if lazy { SharedPages::CopiedToEach } else { SharedPages::KeptShared };
        let spooled = !lazy && crate::tree::dir::in_memory(&images);
        check_container_memory_room(&*archive, shared, to, &made, &config, spooled)?;
    }
    // Once runc has the container running: its CUDA processes resumed, or
    // the container killed.
    let resume = || -> Result<Option<f64>> {
        let Some(plan) = &cuda else { return Ok(None) };
        let resumed = runc.init_pid(criu, &o.id).and_then(|pid| plan.resume(pid));
        resumed.map(Some).map_err(|e| {
            runc.delete_failed(criu, &o.id);
            e.context(format!("CUDA resume failed, container {} killed", o.id))
        })
    };
    // Written by runc once the container runs: without --detach, it tells
    // runc's status as the container's end from a failed restore.
    let pid_file = o.pid_file.clone().unwrap_or_else(|| work.path().join("init.pid"));
    let _ = std::fs::remove_file(&pid_file);
    let ended = |status: std::process::ExitStatus| -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        (!o.detach && pid_file.exists()).then(|| status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
    };
    let restore = |criu: &Path| {
        let mut cmd = runc.command_running(criu);
        cmd.arg("restore").arg("--image-path").arg(&images).arg("--work-path").arg(work.path());
        cmd
    };
    if lazy {
        // runc's CRIU waits at its pre-resume hook with the container
        // stopped, until criuz has registered its shared memory in every
        // process and the walks have proven the archive (`session::lazy`).
        let hook = ActionHook::bind(work.path(), At::PreResume)?;
        let mut cmd = restore(&hook.criu_wrapper(&criu.path)?);
        cmd.arg("--lazy-pages");
        runc_restore_args(&mut cmd, o, &pid_file, held);
        let victim = Victim::Cgroup(OnceLock::new());
        let lazy = LazyRestore {
            source: archive,
            input: &o.input,
            images: &images,
            work: work.path(),
            victim: &victim,
            verify_first: o.verify_first,
            fill: Fill::Lazy,
            shared: Vec::new(),
            release: Release::AtPreResume(&hook),
            threads: crate::engine::default_threads(),
            meter: None,
            detached: o.detach,
            // runc's CRIU restores a stopped process stopped itself: a
            // container is never held.
            dumped_stopped: &[],
        };
        let cuda_resumed = std::cell::Cell::new(None);
        let (status, report) = lazy.run(cmd, started, || resume().map(|t| cuda_resumed.set(t))).inspect_err(|_| {
            if matches!(&victim, Victim::Cgroup(c) if c.get().is_some()) {
                // Ours (CRIU connected for it), killed: no stopped container
                // is left behind under its name.
                runc.delete_failed(criu, &o.id);
            }
        })?;
        let exit_status = ended(status);
        if !status.success() && exit_status.is_none() {
            return Err(criu_failure(&format!("runc restore {}", o.id), status, &work.save_log("restore.log")));
        }
        return Ok(ContainerRestoreReport {
            seconds: started.elapsed().as_secs_f64(),
            cuda_resume_seconds: cuda_resumed.get(),
            not_lazy,
            how: RestoredHow::Lazy(Box::new(report)),
            exit_status,
        });
    }
    // The images, pages too, are read front to back from here.
    archive.read_ahead(true);
    let (st, zero_pages_skipped) = crate::session::images_dir::write_images(archive, &images, opts)?;
    let unpack_seconds = started.elapsed().as_secs_f64();
    let mut cmd = restore(&criu.path);
    runc_restore_args(&mut cmd, o, &pid_file, held);
    let exit_status = run_restoring_criu(&mut cmd, &[], None)
        .map_err(|e| cannot_run(runc.binary.display(), e))
        .and_then(|status| {
            let exit_status = ended(status);
            if !status.success() && exit_status.is_none() {
                return Err(criu_failure(&format!("runc restore {}", o.id), status, &work.save_log("restore.log")));
            }
            Ok(exit_status)
        })
        // A failed restore, a CRIU ended for waiting for good included,
        // leaves what it forked: none of it outlives the failure.
        .inspect_err(|_| crate::proc::restored::end_orphans())?;
    let cuda_resume_seconds = resume()?;
    Ok(ContainerRestoreReport {
        seconds: started.elapsed().as_secs_f64(),
        cuda_resume_seconds,
        not_lazy,
        how: RestoredHow::Eager { unpack_seconds, bytes: st.bytes, zero_pages_skipped },
        exit_status,
    })
}

/// Why a container using CUDA is restored eagerly.
const SHARED_NOT_LAZY: &str = "its processes share pages, which CRIU keeps shared: every page written before the \
                               container ran, not lazily (that would give each process a copy of its own)";

const CUDA_NOT_LAZY: &str =
    "its CUDA processes read all their memory as they resume: every page written before the container ran, not lazily";
/// Why a lazy-by-default restore was eager.
const NO_USERFAULTFD: &str = "this kernel gives no userfaultfd for a lazy restore: restored eagerly";

/// The memory cgroup runc restores a container into and the limit it
/// gives it, from the bundle's `config.json` (`linux.cgroupsPath`, else
/// the container's id; `linux.resources.memory`), with the file's path.
/// None where the file cannot be read or there is no memory hierarchy: runc
/// then fails on it, or there is no group to count against.
fn container_memory(bundle: Option<&Path>, id: &str) -> Option<(ChargedTo, Vec<DumpedMemoryLimit>, PathBuf)> {
    let config = bundle.unwrap_or(Path::new(".")).join("config.json");
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).ok()?).ok()?;
    let linux = &spec["linux"];
    let path = linux["cgroupsPath"].as_str().filter(|p| !p.is_empty()).unwrap_or(id);
    let to = memory::container_group(path)?;
    let ChargedTo::Group { path, v2 } = &to else { return None };
    let memory = &linux["resources"]["memory"];
    // -1 (or nothing): no limit.
    let bytes = |v: &serde_json::Value| v.as_i64().filter(|&n| n > 0).map(|n| n as u64);
    let made = bytes(&memory["limit"]).map(|limit| {
        // runc's `swap` bounds memory and swap together, as v1's memsw
        // does; v2's swap.max is the swap alone.
        let swap = bytes(&memory["swap"]).map(|s| if *v2 { s.saturating_sub(limit) } else { s });
        DumpedMemoryLimit { path: path.clone(), v2: *v2, limit, swap }
    });
    Some((to, made.into_iter().collect(), config))
}

/// runc restore's options: the user's, and what the checkpoint holds that
/// runc's CRIU must be told again ([`ToldAgain`]).
fn runc_restore_args(cmd: &mut Command, o: &RuncRestore, pid_file: &Path, held: ToldAgain) {
    if let Some(b) = &o.bundle {
        cmd.arg("--bundle").arg(b);
    }
    cmd.args(held.options(|option| o.extra.iter().any(|a| a == option)));
    if o.detach {
        cmd.arg("--detach");
    }
    cmd.arg("--pid-file").arg(pid_file);
    cmd.args(&o.extra).arg(&o.id);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_containers_memory_limit_is_read_from_its_bundle() {
        let dir = tempfile::tempdir().unwrap();
        assert!(container_memory(Some(dir.path()), "box").is_none(), "no config.json");
        let write = |linux: serde_json::Value| {
            let spec = serde_json::json!({ "ociVersion": "1.0.2", "linux": linux });
            std::fs::write(dir.path().join("config.json"), spec.to_string()).unwrap();
        };
        write(serde_json::json!({ "resources": { "memory": { "limit": -1 } } }));
        let Some((to, made, config)) = container_memory(Some(dir.path()), "box") else {
            return eprintln!("SKIP: no memory cgroup hierarchy here");
        };
        let ChargedTo::Group { path, v2 } = to else { panic!("{to:?}") };
        assert!(
            path.ends_with("/box") && made.is_empty() && config == dir.path().join("config.json"),
            "{path} {made:?}"
        );
        write(
            serde_json::json!({ "cgroupsPath": "/pods/web", "resources": { "memory": { "limit": 64 << 20, "swap": 96 << 20 } } }),
        );
        let (to, made, _) = container_memory(Some(dir.path()), "box").unwrap();
        assert_eq!(to, ChargedTo::Group { path: "/pods/web".into(), v2 });
        // runc's swap is memory and swap together; v2's swap.max is swap alone.
        let swap = if v2 { 32 << 20 } else { 96 << 20 };
        assert_eq!(made, [DumpedMemoryLimit { path: "/pods/web".into(), v2, limit: 64 << 20, swap: Some(swap) }]);
    }
}
