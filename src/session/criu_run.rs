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
use crate::format::{BlockHeader, FileKind};
use crate::io::Location;
use crate::proc::{holder, memory, restored, tree};
use crate::progress::Meter;
use crate::session::workdir::{criu_output, SavedLog};
use std::collections::HashMap;
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
    Error::CriuIo { what: format!("cannot run {program}"), err }
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

/// How a restore brings back pages the tree's processes shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SharedPages {
    /// CRIU restores them (streamed): shared copy-on-write, as they were.
    KeptShared,
    /// criuz copies them in with userfaultfd (placed or lazy), one address
    /// space at a time: each process gets a copy of its own.
    CopiedToEach,
}

/// Refuses the restore of a tree whose memory cannot fit where it would
/// run: in what the machine has available (free, droppable cache and free
/// swap), and in the room each memory cgroup its processes are charged to
/// leaves, criuz's own (which CRIU's tree inherits) or those CRIU restores
/// them into, the cgroups they were dumped in (`charged_to`). Past one, the
/// OOM killer ends the tree as its pages come in, or criuz (exit 137 and not
/// a word), or another process of the group (a restore from outside a pod's
/// group into it killed the tree's root, said "restored", and a second kill
/// took a process of the pod the tree was to rejoin). A tree whose
/// processes share pages is let through where CRIU keeps them shared (it
/// needs less than its processes hold apiece); placed or lazily, every
/// process's pages count (a forked tree of 301 processes, 300 MiB each,
/// restored lazily on 24 GiB: the OOM killer ended criuz 2 minutes in).
/// Memory taken while the tree comes back is not foreseen: a process
/// OOM-killed as its pages come in fails the restore (`session::pager`).
pub(crate) fn check_memory_room(source: &dyn BlockSource, shared: SharedPages, o: &RestoreOptions) -> Result<()> {
    if crate::session::placement::shares_pages(source) && shared == SharedPages::KeptShared {
        return Ok(());
    }
    let (charged, made) = charged_to(source, &o.extra)?;
    let charge = |pid| charged.get(&pid).cloned().unwrap_or(memory::ChargedTo::Own);
    let tree = tree_memory(source, o.keep_zero_pages)?;
    check_huge_page_room(source.label(), &tree.huge)?;
    let made_with = "the limit it was dumped with, as CRIU makes it anew";
    let keeps_shared = "an eager restore streamed through CRIU (the default for such a tree, or `--fill stream`)";
    first_short(source, &tree.by_pid, charge, &made).map_or(Ok(()), |s| Err(s.refusal(made_with, keeps_shared)))
}

/// The same check for a container runc restores: every process is charged
/// to the container's memory cgroup (`to`, which runc makes with the limit
/// `made` gives, from the bundle's `config`) and the groups above it.
/// Without it, a container past its limit failed with a CRIU log that
/// never said why (a lazy one), or "killed by signal 9" (an eager one).
/// `spooled`: the pages are first written for CRIU to files in memory
/// (tmpfs), charged to the machine and criuz's groups until the restore
/// ends; a tree whose pages CRIU keeps shared is then counted by that copy
/// alone.
pub(crate) fn check_container_memory_room(
    source: &dyn BlockSource,
    shared: SharedPages,
    to: memory::ChargedTo,
    made: &[images::DumpedMemoryLimit],
    config: &Path,
    spooled: bool,
) -> Result<()> {
    let kept_shared = crate::session::placement::shares_pages(source) && shared == SharedPages::KeptShared;
    let tree = tree_memory(source, false)?;
    check_huge_page_room(source.label(), &tree.huge)?;
    let copy: u64 = tree.by_pid.iter().map(|(_, b)| b).sum::<u64>() + tree.huge_bytes;
    let mut needs = if kept_shared { Vec::new() } else { tree.by_pid };
    if spooled {
        needs.push((SPOOL, copy));
    }
    let charge = |pid| if pid == SPOOL { memory::ChargedTo::Own } else { to.clone() };
    let made_with = format!("the limit {} gives it", config.display());
    let keeps_shared = "an eager restore (the default for such a container, or `--eager`)";
    let short = first_short(source, &needs, charge, made);
    short.map_or(Ok(()), |s| Err(s.refusal(&made_with, keeps_shared)))
}

/// The pid [`check_container_memory_room`] charges the spooled copy of the
/// pages to: no process's.
const SPOOL: u32 = u32::MAX;

/// Where a tree's memory does not fit: the room there and what it needs;
/// `group` is None for the machine's memory.
struct Short {
    label: String,
    room: u64,
    need: Need,
    group: Option<PathBuf>,
    shares: bool,
}

/// Bytes one place must hold: the tree's, and the copy of its pages
/// written to memory for CRIU ([`SPOOL`]'s).
#[derive(Clone, Copy, Default)]
struct Need {
    tree: u64,
    spool: u64,
}

impl Need {
    fn add(&mut self, pid: u32, bytes: u64) {
        if pid == SPOOL {
            self.spool += bytes;
        } else {
            self.tree += bytes;
        }
    }
}

/// The first place the tree's pages (`needs`, bytes by pid, from
/// [`tree_memory`]) do not fit: the machine's memory, then every
/// memory cgroup a process is charged to (`charge`), counting each
/// process's pages once in every group above it.
fn first_short(
    source: &dyn BlockSource,
    needs: &[(u32, u64)],
    charge: impl Fn(u32) -> memory::ChargedTo,
    made: &[images::DumpedMemoryLimit],
) -> Option<Short> {
    // Each group's directory, room, and need: the tree's, the spool's.
    let mut groups: Vec<(PathBuf, u64, Need)> = Vec::new();
    let mut rooms: HashMap<memory::ChargedTo, Vec<(PathBuf, u64)>> = HashMap::new();
    let mut machine = Need::default();
    for &(pid, bytes) in needs {
        machine.add(pid, bytes);
        let for_pid = rooms.entry(charge(pid)).or_insert_with_key(|to| memory::rooms_for(to, made));
        for (dir, room) in for_pid.iter() {
            let at = groups.iter().position(|(d, ..)| d == dir).unwrap_or_else(|| {
                groups.push((dir.clone(), *room, Need::default()));
                groups.len() - 1
            });
            groups[at].2.add(pid, bytes);
        }
    }
    let in_groups = groups.into_iter().map(|(dir, room, need)| (room, need, Some(dir)));
    let (room, need, group) = std::iter::once((memory::machine_room(), machine, None))
        .chain(in_groups)
        .find(|(room, need, _)| need.tree + need.spool > *room)?;
    let shares = crate::session::placement::shares_pages(source);
    Some(Short { label: source.label().to_string(), room, need, group, shares })
}

impl Short {
    /// The one-line refusal; `made_with` says where the limit of a group
    /// not yet there comes from, `keeps_shared` what restore keeps shared
    /// pages shared.
    fn refusal(self, made_with: &str, keeps_shared: &str) -> Error {
        let label = &self.label;
        let (needs, room) = ((self.need.tree + self.need.spool) >> 20, self.room >> 20);
        let what = match &self.group {
            None => "this machine has available (memory and swap)".to_string(),
            Some(dir) => format!("memory cgroup {} has room for", dir.display()),
        };
        let room = match &self.group {
            Some(dir) if !dir.exists() => format!("{room} MiB, {made_with}"),
            _ => format!("{room} MiB"),
        };
        let copy = "the copy of its pages written to memory (tmpfs) for CRIU";
        let needing = match self.need {
            Need { tree: 0, .. } => format!("{copy} needs {needs} MiB"),
            Need { spool: 0, .. } => format!("its tree needs {needs} MiB of memory"),
            _ => format!("its tree needs {needs} MiB of memory, counting {copy}"),
        };
        Error::Criu(if self.shares && self.need.spool == 0 {
            format!(
                "cannot restore {label} through userfaultfd (placed or lazily): its processes would hold {needs} MiB of \
                 memory, each a copy of its own of the pages they shared, more than {what} ({room}): it \
                 would be OOM-killed as it came back; {keeps_shared} keeps them shared"
            )
        } else {
            format!(
                "cannot restore {label}: {needing}, more than {what} ({room}): \
                 the OOM killer would end it, or another process, as it came back"
            )
        })
    }
}

/// The memory a restored tree will hold.
struct TreeMemory {
    /// The bytes of memory each process will hold (its pages image's
    /// pages, less its zero pages unless they are kept, less its huge-page
    /// memory), by pid. Pages no process's pagemap names (shared
    /// memory's) count to the root's.
    by_pid: Vec<(u32, u64)>,
    /// Huge pages its huge-page memory (`MAP_HUGETLB`) fills, as (page
    /// size, count): those come from the system's pool of huge pages,
    /// which no cgroup's memory limit or `MemAvailable` counts.
    huge: Vec<(u64, u64)>,
    /// The bytes of the pages images that huge-page memory holds.
    huge_bytes: u64,
}

/// Which process each pages image is of, and what of them is huge-page
/// memory, from a tree's images.
struct HugeImages {
    /// Pages image name -> the pid whose pagemap names it.
    owner: HashMap<String, u32>,
    /// Pages image name -> its pages in huge-page memory: these ranges of
    /// it (in page order, apart), or (None) all of it.
    in_huge: HashMap<String, Option<Vec<(u64, u64)>>>,
    /// Huge pages they fill, as (page size, count).
    huge: Vec<(u64, u64)>,
}

/// Reads each process's pagemap and mm image, and the memfds, for
/// [`HugeImages`].
fn huge_images(source: &dyn BlockSource) -> Result<HugeImages> {
    let default_size = memory::default_huge_page_size();
    let mut found = HugeImages { owner: HashMap::new(), in_huge: HashMap::new(), huge: Vec::new() };
    let add_huge = |huge: &mut Vec<(u64, u64)>, size: u64, n: u64| match huge.iter_mut().find(|(s, _)| *s == size) {
        Some((_, count)) => *count += n,
        None => huge.push((size, n)),
    };
    let mut shared: Vec<(u64, u64)> = Vec::new();
    let pagemaps = source.index().files.iter().filter(|f| f.is_criu_image() && f.kind == FileKind::Plain);
    for f in pagemaps {
        let Some(pid) = images::process_pagemap_pid(&f.name).and_then(|p| p.parse::<u32>().ok()) else { continue };
        let pagemap = source.read_file(f)?;
        let Some(id) = images::pagemap_pages_id(&pagemap) else { continue };
        found.owner.insert(format!("pages-{id}.img"), pid);
        let mm = source.find(&format!("mm-{pid}.img")).map(|e| source.read_file(e)).transpose()?;
        let Some(h) = mm.and_then(|mm| images::huge_memory(&mm, &pagemap, default_size)) else { continue };
        if !h.private_pages.is_empty() {
            found.in_huge.insert(format!("pages-{id}.img"), Some(h.private_pages));
        }
        h.private_huge.into_iter().for_each(|(size, n)| add_huge(&mut found.huge, size, n));
        shared.extend(h.shared);
    }
    let memfd = source.find("memfd.img").map(|e| source.read_file(e)).transpose()?;
    shared.extend(memfd.and_then(|m| images::huge_memfds(&m, default_size)).unwrap_or_default());
    shared.sort_unstable();
    shared.dedup_by_key(|(id, _)| *id);
    for (shmid, size) in shared {
        let Some(e) = source.find(&format!("pagemap-shmem-{shmid}.img")) else { continue };
        if let Some((id, n)) = images::shared_huge_pages(&source.read_file(e)?, size) {
            found.in_huge.insert(format!("pages-{id}.img"), None);
            add_huge(&mut found.huge, size, n);
        }
    }
    Ok(found)
}

fn tree_memory(source: &dyn BlockSource, keep_zero_pages: bool) -> Result<TreeMemory> {
    let files = || source.index().files.iter().filter(|f| f.is_criu_image());
    let HugeImages { owner, in_huge, huge } = huge_images(source)?;
    let root = source.find("pstree.img").map(|e| source.read_file(e)).transpose()?;
    let root = root.and_then(|p| images::pstree_pids(&p)).and_then(|p| p.first().copied()).unwrap_or(0);
    let mut by_pid: Vec<(u32, u64)> = Vec::new();
    let mut huge_pages = 0u64;
    for f in files().filter(|f| f.kind == FileKind::Pages) {
        // Only a process's pages have their zero runs left out
        // (`serve::zero_plan`); shared memory's come back whole, zero pages
        // taking memory like any other. Counted without them, a 512 MiB
        // shared cache half of zeros was taken for 256 MiB, and the restore
        // was OOM-killed ("killed by signal 9") in a group with 300 MiB free.
        let keep_zero_pages = keep_zero_pages || !owner.contains_key(&f.name);
        let kept = |h: &BlockHeader, page: usize| keep_zero_pages || !h.is_zero_page(page);
        let (mut pages, mut first) = (0u64, 0u64);
        for (h, _) in (0..).map_while(|i| source.block_header(f.file_id, i)) {
            let n = h.pages() as u64;
            match in_huge.get(&f.name) {
                Some(None) => huge_pages += n,
                Some(Some(ranges))
                    if ranges[..ranges.partition_point(|&(a, _)| a < first + n)]
                        .last()
                        .is_some_and(|&(_, b)| first < b) =>
                {
                    for page in 0..n {
                        if images::in_ranges(ranges, first + page) {
                            huge_pages += 1;
                        } else if kept(h, page as usize) {
                            pages += 1;
                        }
                    }
                }
                _ => pages += if keep_zero_pages { n } else { n.saturating_sub(h.zero_pages() as u64) },
            }
            first += n;
        }
        let pid = owner.get(&f.name).copied().unwrap_or(root);
        let bytes = pages.saturating_mul(crate::format::PAGE_SIZE as u64);
        match by_pid.iter_mut().find(|(p, _)| *p == pid) {
            Some((_, b)) => *b += bytes,
            None => by_pid.push((pid, bytes)),
        }
    }
    Ok(TreeMemory { by_pid, huge, huge_bytes: huge_pages.saturating_mul(crate::format::PAGE_SIZE as u64) })
}

/// Refuses a tree whose huge-page memory the system's pool cannot give
/// (counting only the huge pages its dumped pages fill, the least its
/// mappings take): CRIU would fail deep in its restorer, "Can't restore
/// 0x... mapping with 0xfffffffffffffff4".
fn check_huge_page_room(label: &str, huge: &[(u64, u64)]) -> Result<()> {
    for &(size, needs) in huge.iter().filter(|(_, n)| *n > 0) {
        // Pools that cannot be read are left to CRIU (which says so, with
        // a hint): never a refusal on a guess.
        let Some(room) = memory::huge_page_room(size) else { continue };
        if needs > room {
            return Err(Error::Criu(format!(
                "cannot restore {label}: its tree needs {needs} huge pages of {} KiB (MAP_HUGETLB memory), and the \
                 system has {room} free (/sys/kernel/mm/hugepages/hugepages-{}kB; raise vm.nr_hugepages)",
                size >> 10,
                size >> 10
            )));
        }
    }
    Ok(())
}

/// Where each process of a tree is charged, by pid, and the dumped memory
/// groups' limits ([`charged_to`]).
type Charged = (HashMap<u32, memory::ChargedTo>, Vec<images::DumpedMemoryLimit>);

/// The memory cgroup CRIU restores each process of the tree into, by pid,
/// as it does (criu/cgroup.c, `restore_task_cgroup`): a process in its
/// parent's cgroup set (the root: in the set CRIU itself was dumped from)
/// stays where its parent is, criuz's group for the root; one in another
/// set is moved into that set's groups, as they were at the dump. Where
/// the images do not say, or CRIU is told to put the tree elsewhere
/// (`--cgroup-root`) or nowhere (`--manage-cgroups=ignore`), in `extra` or
/// its config files, every process counts as criuz's. With the limits of
/// the dumped memory groups, which CRIU gives those it makes anew.
fn charged_to(source: &dyn BlockSource, extra: &[String]) -> Result<Charged> {
    let mut charged = HashMap::new();
    let given = CriuOptions::read(extra);
    if given.is_set("cgroup-root") || given.value("manage-cgroups") == Some("ignore") {
        return Ok((charged, Vec::new()));
    }
    let read = |name: &str| source.find(name).map(|f| source.read_file(f)).transpose();
    let (Some(inventory), Some(cgroups), Some(pstree)) =
        (read("inventory.img")?, read("cgroup.img")?, read("pstree.img")?)
    else {
        return Ok((charged, Vec::new()));
    };
    let (Some(root_set), Some(paths), Some(tree)) = (
        images::inventory_root_cg_set(&inventory),
        images::cgroup_memory_paths(&cgroups),
        images::pstree_parents(&pstree),
    ) else {
        return Ok((charged, Vec::new()));
    };
    let made = images::cgroup_dumped_memory_limits(&cgroups);
    // Each process's set as its children see it (a zombie's 0: its parent's).
    let mut set_of: HashMap<u32, u32> = HashMap::new();
    for (pid, ppid) in tree {
        let parent_set = set_of.get(&ppid).copied().unwrap_or(root_set);
        let own = read(&format!("core-{pid}.img"))?.and_then(|c| images::core_cg_set(&c)).unwrap_or(0);
        let set = if own == 0 { parent_set } else { own };
        set_of.insert(pid, set);
        let to = if set == parent_set {
            charged.get(&ppid).cloned().unwrap_or(memory::ChargedTo::Own)
        } else {
            match paths.iter().find(|(id, ..)| *id == set) {
                Some((_, path, v2)) => memory::ChargedTo::Group { path: path.clone(), v2: *v2 },
                None => memory::ChargedTo::Own,
            }
        };
        charged.insert(pid, to);
    }
    Ok((charged, made))
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
    let mut cmd = Command::new(&criu.path);
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
/// `keep` (a restored tree's pids) is spared.
pub(crate) fn run_criu(cmd: &mut Command, keep: &[i32]) -> std::io::Result<std::process::ExitStatus> {
    run_criu_told(cmd, keep, None)
}

/// [`run_criu`], telling `guard` to wait for the process before it acts
/// (a paused container is resumed only once the runc checkpointing it ends).
pub(crate) fn run_criu_told(
    cmd: &mut Command,
    keep: &[i32],
    guard: Option<&crate::proc::guard::Guard>,
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
    let exited = ExitWatch::open(child.id());
    let mut between = ExitWatch::FIRST_CHECKS;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        restored::end_criu_strays(&spared);
        exited.wait(between);
        between = exited.next(between);
    };
    restored::end_criu_strays(keep);
    Ok(status)
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
