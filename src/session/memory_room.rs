//! Whether a restore's memory fits before CRIU starts: in what the machine
//! has available, in the huge-page pool, and in the room each memory cgroup
//! its processes are charged to leaves (criuz's own, or the groups CRIU
//! restores them into, with the limits they were dumped with). A tree
//! past one is refused with the room and the need named, rather than left
//! to the OOM killer as its pages come in. Trade-offs: memory the tree
//! takes while it comes back is not foreseen, and a tree whose processes
//! share pages that CRIU keeps shared copy-on-write is let through
//! unchecked (it needs less than its processes hold apiece).

use crate::archive::BlockSource;
use crate::criu::images;
use crate::criu::options::CriuOptions;
use crate::error::{Error, Result};
use crate::format::{BlockHeader, FileKind};
use crate::proc::memory;
use crate::session::criu_run::RestoreOptions;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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
