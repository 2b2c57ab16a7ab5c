//! Just enough of CRIU's image files to restore without sending zero pages.
//!
//! CRIU restores a private anonymous mapping as fresh (zero) memory and then
//! reads every page its pagemap lists. A page that is all zero need not be
//! listed at all: left out, it stays zero. That holds in a process tree too:
//! for a copy-on-write mapping inherited from a parent, CRIU drops
//! (MADV_DONTNEED) every page the child's pagemap does not list, so a child's
//! zeroed page cannot come back as the parent's bytes (criu/mem.c,
//! restore_priv_vma_content). It does not hold for private file mappings (a
//! missing page shows the file) nor for shared memory (its own pagemaps), so
//! only zero pages inside private anonymous VMAs (from mm-<pid>.img) are left
//! out. The plan rewrites pagemap-<pid>.img accordingly and tells the page
//! server which pages of pages-<id>.img to skip.
//!
//! Anything unexpected (magics, fields, flags) means no plan: the images are
//! served untouched, which is always correct.

use crate::format::PageBits;
use prost::Message;
use std::collections::HashMap;

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
const MM_MAGIC: u32 = 0x5749_2820;
const MEMFD_INODE_MAGIC: u32 = 0x4845_3499;
const FILES_MAGIC: u32 = 0x5630_3138;
const FDINFO_MAGIC: u32 = 0x5621_3732;
/// `fd_types.MEMFD` (images/fdinfo.proto).
const FD_TYPE_MEMFD: i32 = 18;
const PSTREE_MAGIC: u32 = 0x5027_3030;
const CORE_MAGIC: u32 = 0x5505_3847;
const CGROUP_MAGIC: u32 = 0x5938_3330;
/// inventory.img starts with its own magic alone (no common one).
const INVENTORY_MAGIC: u32 = 0x5831_3116;
/// `core_entry.march` of x86_64 (images/core.proto).
const MARCH_X86_64: i32 = 1;

const PE_PARENT: u32 = 1 << 0;
const PE_LAZY: u32 = 1 << 1;
const PE_PRESENT: u32 = 1 << 2;

const VMA_AREA_REGULAR: u32 = 1 << 0;
/// The kernel's own mappings: vsyscall, vDSO and its data (vvar).
const VMA_KERNEL: u32 = (1 << 2) | (1 << 3) | (1 << 12);
const VMA_ANON_SHARED: u32 = 1 << 8;
const VMA_ANON_PRIVATE: u32 = 1 << 9;
const VMA_FILE_SHARED: u32 = 1 << 7;
const VMA_AREA_SYSVIPC: u32 = 1 << 10;
const VMA_AREA_MEMFD: u32 = 1 << 14;
/// Any of these makes a VMA more than plain private anonymous memory.
const VMA_SPECIAL: u32 = (1 << 2) // vsyscall
    | (1 << 3) // vdso
    | (1 << 6) // file private
    | (1 << 7) // file shared
    | (1 << 8) // anon shared
    | (1 << 10) // SysV IPC
    | (1 << 11) // socket
    | (1 << 12) // vvar
    | (1 << 13) // AIO ring
    | (1 << 14) // memfd
    | (1 << 15) // shadow stack
    | (1 << 16) // guard
    | (1 << 17) // uprobes
    | (1 << 27) // plugin
    | (1 << 31); // unsupported

#[derive(Clone, PartialEq, Message)]
struct PagemapHead {
    #[prost(uint32, required, tag = "1")]
    pages_id: u32,
}

#[derive(Clone, PartialEq, Message)]
struct PagemapEntry {
    #[prost(uint64, required, tag = "1")]
    vaddr: u64,
    #[prost(uint32, required, tag = "2")]
    nr_pages: u32,
    #[prost(bool, optional, tag = "3")]
    in_parent: Option<bool>,
    #[prost(uint32, optional, tag = "4")]
    flags: Option<u32>,
    /// Newer CRIU: 64-bit page count (field 2 then holds a compat copy).
    #[prost(uint64, optional, tag = "5")]
    nr_pages64: Option<u64>,
}

#[derive(Clone, PartialEq, Message)]
struct PstreeEntry {
    #[prost(uint32, required, tag = "1")]
    pid: u32,
    #[prost(uint32, required, tag = "2")]
    ppid: u32,
    #[prost(uint32, repeated, packed = "false", tag = "5")]
    threads: Vec<u32>,
}

/// Every process and thread id of a checkpointed tree (pstree.img);
/// `None` if the image is not as expected.
pub fn pstree_pids(img: &[u8]) -> Option<Vec<u32>> {
    let mut pids = Vec::new();
    for obj in objects(img, PSTREE_MAGIC)? {
        let e = PstreeEntry::decode(obj).ok()?;
        pids.push(e.pid);
        pids.extend(e.threads.into_iter().filter(|&t| t != e.pid));
    }
    Some(pids)
}

/// Every process of a checkpointed tree with its parent's pid (0 for the
/// root), parents first (pstree.img); `None` if the image is not as
/// expected.
pub fn pstree_parents(img: &[u8]) -> Option<Vec<(u32, u32)>> {
    objects(img, PSTREE_MAGIC)?.into_iter().map(|obj| PstreeEntry::decode(obj).ok().map(|e| (e.pid, e.ppid))).collect()
}

/// The thread ids of process `pid` (pstree.img); `None` if the image is not
/// as expected or does not hold `pid`.
pub fn pstree_threads(img: &[u8], pid: u32) -> Option<Vec<u32>> {
    for obj in objects(img, PSTREE_MAGIC)? {
        let e = PstreeEntry::decode(obj).ok()?;
        if e.pid == pid {
            return Some(if e.threads.is_empty() { vec![pid] } else { e.threads });
        }
    }
    None
}

#[derive(Clone, PartialEq, Message)]
struct CoreEntry {
    #[prost(int32, required, tag = "1")]
    mtype: i32,
    #[prost(message, optional, tag = "2")]
    thread_info: Option<ThreadInfoX86>,
    #[prost(message, optional, tag = "3")]
    tc: Option<TaskCoreEntry>,
    #[prost(message, optional, tag = "5")]
    thread_core: Option<ThreadCoreEntry>,
}

#[derive(Clone, PartialEq, Message)]
struct ThreadCoreEntry {
    #[prost(uint32, optional, tag = "16")]
    cg_set: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
struct TaskCoreEntry {
    #[prost(uint32, optional, tag = "1")]
    task_state: Option<u32>,
    #[prost(uint32, optional, tag = "9")]
    cg_set: Option<u32>,
    #[prost(uint32, optional, tag = "21")]
    stop_signo: Option<u32>,
}

/// CRIU's task state of a process dumped stopped (compel's
/// `COMPEL_TASK_STOPPED`).
const TASK_STOPPED: u32 = 3;

/// The signal that had stopped a process dumped stopped (SIGSTOP, SIGTSTP,
/// ...: CRIU stops it with the same one as it restores it), from its
/// main thread's core image; `None` for one that ran (or an image not as
/// expected).
pub fn core_stopped_by(core: &[u8]) -> Option<i32> {
    let tc = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?.tc?;
    if tc.task_state? != TASK_STOPPED {
        return None;
    }
    Some(tc.stop_signo.filter(|&s| s > 0).map_or(libc::SIGSTOP, |s| s as i32))
}

#[derive(Clone, PartialEq, Message)]
struct ThreadInfoX86 {
    #[prost(message, optional, tag = "2")]
    gpregs: Option<UserX86Regs>,
}

#[derive(Clone, PartialEq, Message)]
struct UserX86Regs {
    #[prost(uint64, optional, tag = "20")]
    sp: Option<u64>,
}

/// The cgroup set a process was dumped in (its main thread's core image:
/// per thread since CRIU 3.x, in the task's part before; 0: none of its
/// own, as a zombie's), to look up in cgroup.img.
pub fn core_cg_set(core: &[u8]) -> Option<u32> {
    let c = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?;
    let per_thread = c.thread_core.and_then(|t| t.cg_set);
    Some(per_thread.or_else(|| c.tc.and_then(|t| t.cg_set)).unwrap_or(0))
}

#[derive(Clone, PartialEq, Message)]
struct InventoryEntry {
    #[prost(uint32, optional, tag = "5")]
    root_cg_set: Option<u32>,
}

/// The cgroup set CRIU itself ran in at the dump (inventory.img): a
/// process in that set inherits its cgroups from whatever restores it.
pub fn inventory_root_cg_set(img: &[u8]) -> Option<u32> {
    if u32::from_ne_bytes(img.get(0..4)?.try_into().ok()?) != INVENTORY_MAGIC {
        return None;
    }
    let len = u32::from_ne_bytes(img.get(4..8)?.try_into().ok()?) as usize;
    InventoryEntry::decode(img.get(8..8 + len)?).ok()?.root_cg_set
}

#[derive(Clone, PartialEq, Message)]
struct CgMemberEntry {
    #[prost(string, required, tag = "1")]
    name: String,
    #[prost(string, required, tag = "2")]
    path: String,
}

#[derive(Clone, PartialEq, Message)]
struct CgSetEntry {
    #[prost(uint32, required, tag = "1")]
    id: u32,
    #[prost(message, repeated, tag = "2")]
    ctls: Vec<CgMemberEntry>,
}

#[derive(Clone, PartialEq, Message)]
struct CgroupPropEntry {
    #[prost(string, required, tag = "1")]
    name: String,
    #[prost(string, required, tag = "2")]
    value: String,
}

#[derive(Clone, PartialEq, Message)]
struct CgroupDirEntry {
    #[prost(string, required, tag = "1")]
    dir_name: String,
    #[prost(message, repeated, tag = "2")]
    children: Vec<CgroupDirEntry>,
    #[prost(message, repeated, tag = "3")]
    properties: Vec<CgroupPropEntry>,
}

#[derive(Clone, PartialEq, Message)]
struct CgControllerEntry {
    #[prost(string, repeated, tag = "1")]
    cnames: Vec<String>,
    #[prost(message, repeated, tag = "2")]
    dirs: Vec<CgroupDirEntry>,
}

#[derive(Clone, PartialEq, Message)]
struct CgroupEntry {
    #[prost(message, repeated, tag = "1")]
    sets: Vec<CgSetEntry>,
    #[prost(message, repeated, tag = "2")]
    controllers: Vec<CgControllerEntry>,
}

/// A memory cgroup's limits as dumped (cgroup.img), which CRIU gives the
/// group where it makes it anew at the restore.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DumpedMemoryLimit {
    /// Its path in the memory hierarchy (v1's, or v2's with `v2`).
    pub path: String,
    pub v2: bool,
    /// `memory.limit_in_bytes` (v1) or `memory.max` (v2).
    pub limit: u64,
    /// `memory.memsw.limit_in_bytes` (v1: memory and swap) or
    /// `memory.swap.max` (v2: swap alone), where dumped.
    pub swap: Option<u64>,
}

/// Every memory cgroup with a limit among those dumped (cgroup.img's
/// directories of the memory controller, v1's or v2's); empty where the
/// image says none or is not as expected.
pub fn cgroup_dumped_memory_limits(img: &[u8]) -> Vec<DumpedMemoryLimit> {
    let Some(entry) = objects(img, CGROUP_MAGIC).and_then(|o| CgroupEntry::decode(*o.first()?).ok()) else {
        return Vec::new();
    };
    fn walk(dirs: &[CgroupDirEntry], above: &str, v2: bool, out: &mut Vec<DumpedMemoryLimit>) {
        let (limit_name, swap_name) = if v2 {
            ("memory.max", "memory.swap.max")
        } else {
            ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        };
        for d in dirs {
            let path = format!("{above}/{}", d.dir_name.trim_matches('/'));
            // "max" (v2) or v1's near 2^63: no limit.
            let value = |name: &str| {
                d.properties.iter().find(|p| p.name == name)?.value.trim().parse::<u64>().ok().filter(|&n| n < 1 << 60)
            };
            if let Some(limit) = value(limit_name) {
                out.push(DumpedMemoryLimit { path: path.clone(), v2, limit, swap: value(swap_name) });
            }
            walk(&d.children, &path, v2, out);
        }
    }
    let mut out = Vec::new();
    for c in &entry.controllers {
        let v1 = c.cnames.iter().any(|n| n.split(',').any(|n| n == "memory"));
        let v2 = c.cnames.iter().all(|n| n.is_empty());
        if v1 || v2 {
            walk(&c.dirs, "", !v1, &mut out);
        }
    }
    out
}

/// The memory cgroup of each cgroup set (cgroup.img): set id -> (its path
/// in the memory hierarchy, whether that is cgroup v2's). A set without
/// one is left out; `None` if the image is not as expected.
pub fn cgroup_memory_paths(img: &[u8]) -> Option<Vec<(u32, String, bool)>> {
    let entry = CgroupEntry::decode(*objects(img, CGROUP_MAGIC)?.first()?).ok()?;
    let memory_of = |set: &CgSetEntry| {
        let v1 = set.ctls.iter().find(|c| c.name.split(',').any(|n| n == "memory"));
        // v2's one hierarchy has no controller name.
        v1.map(|c| (c.path.clone(), false))
            .or_else(|| set.ctls.iter().find(|c| c.name.is_empty()).map(|c| (c.path.clone(), true)))
    };
    Some(entry.sets.iter().filter_map(|set| memory_of(set).map(|(path, v2)| (set.id, path, v2))).collect())
}

/// The stack pointer a thread was dumped with (core-<tid>.img); x86_64
/// only, `None` otherwise or if the image is not as expected.
pub fn core_stack_pointer(core: &[u8]) -> Option<u64> {
    let c = CoreEntry::decode(*objects(core, CORE_MAGIC)?.first()?).ok()?;
    if c.mtype != MARCH_X86_64 {
        return None;
    }
    c.thread_info?.gpregs?.sp
}

#[derive(Clone, PartialEq, Message)]
struct VmaEntry {
    #[prost(uint64, required, tag = "1")]
    start: u64,
    #[prost(uint64, required, tag = "2")]
    end: u64,
    /// Where in its file or shared memory object the mapping starts (bytes).
    #[prost(uint64, required, tag = "3")]
    pgoff: u64,
    #[prost(uint64, required, tag = "4")]
    shmid: u64,
    #[prost(uint32, required, tag = "5")]
    prot: u32,
    #[prost(uint32, required, tag = "6")]
    flags: u32,
    #[prost(uint32, required, tag = "7")]
    status: u32,
}

/// CRIU's `memfd_inode_entry` (images/memfd.proto), the fields read here.
#[derive(Clone, PartialEq, Message)]
struct MemfdInodeEntry {
    #[prost(uint64, optional, tag = "4")]
    size: Option<u64>,
    #[prost(uint32, required, tag = "5")]
    shmid: u32,
    #[prost(uint32, optional, tag = "6")]
    seals: Option<u32>,
    #[prost(uint64, optional, tag = "7")]
    inode_id: Option<u64>,
    #[prost(uint32, optional, tag = "8")]
    hugetlb_flag: Option<u32>,
}

/// CRIU's `file_entry` (images/fdinfo.proto), the fields read here.
#[derive(Clone, PartialEq, Message)]
struct FileEntry {
    #[prost(int32, required, tag = "1")]
    r#type: i32,
    #[prost(uint32, required, tag = "2")]
    id: u32,
    #[prost(message, optional, tag = "20")]
    memfd: Option<MemfdFileEntry>,
}

/// CRIU's `fdinfo_entry` (images/fdinfo.proto), the field read here.
#[derive(Clone, PartialEq, Message)]
struct FdinfoEntry {
    #[prost(uint32, required, tag = "1")]
    id: u32,
}

/// The file ids (files.img) a process's descriptors open
/// (`fdinfo-<id>.img`); `None` if the image is not as expected.
pub fn fd_file_ids(fdinfo: &[u8]) -> Option<Vec<u64>> {
    objects(fdinfo, FDINFO_MAGIC)?.into_iter().map(|o| Some(u64::from(FdinfoEntry::decode(o).ok()?.id))).collect()
}

/// CRIU's `memfd_file_entry` (images/memfd.proto), the field read here.
#[derive(Clone, PartialEq, Message)]
struct MemfdFileEntry {
    #[prost(uint32, required, tag = "5")]
    inode_id: u32,
}

#[derive(Clone, PartialEq, Message)]
struct MmEntry {
    #[prost(message, repeated, tag = "14")]
    vmas: Vec<VmaEntry>,
}

/// Splits an image into its protobuf objects after checking its magics.
fn objects(img: &[u8], magic: u32) -> Option<Vec<&[u8]>> {
    if img.len() < 8 || u32::from_ne_bytes(img[0..4].try_into().ok()?) != IMG_COMMON_MAGIC {
        return None;
    }
    if u32::from_ne_bytes(img[4..8].try_into().ok()?) != magic {
        return None;
    }
    let mut out = Vec::new();
    let mut pos = 8;
    while pos < img.len() {
        let len = u32::from_ne_bytes(img.get(pos..pos + 4)?.try_into().ok()?) as usize;
        out.push(img.get(pos + 4..pos + 4 + len)?);
        pos += 4 + len;
    }
    Some(out)
}

/// A run of pages a pagemap lists: `nr` pages from `vaddr`, stored from
/// page `first` of its pages image; `lazy` if CRIU may fetch them on demand
/// (`PE_LAZY`: private anonymous memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    pub vaddr: u64,
    pub nr: u64,
    pub first: u64,
    pub lazy: bool,
}

/// The pages image id and the runs of a process's pagemap, in its order;
/// `None` if anything is not as expected (entries in a parent, unknown flags).
pub fn pagemap_runs(pagemap: &[u8]) -> Option<(u32, Vec<PageRun>)> {
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = PagemapHead::decode(*objs.first()?).ok()?;
    let mut runs = Vec::new();
    let mut first = 0u64;
    let mut after = 0u64;
    for obj in &objs[1..] {
        let e = PagemapEntry::decode(*obj).ok()?;
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        let flags = entry_flags(&e);
        if flags & !(PE_PRESENT | PE_LAZY) != 0 || flags & PE_PRESENT == 0 {
            return None;
        }
        after = ascending(after, e.vaddr, nr)?;
        runs.push(PageRun { vaddr: e.vaddr, nr, first, lazy: flags & PE_LAZY != 0 });
        first = first.checked_add(nr)?;
        // Every page's byte offset in the pages image must fit too: readers
        // compute it as page * 4096.
        first.checked_mul(4096)?;
    }
    Some((head.pages_id, runs))
}

/// An entry's flags as CRIU reads them (`init_compat_pagemap_entry`,
/// criu/pagemap.c, v4.2): `in_parent` adds `PE_PARENT` whatever the flags
/// say, and an entry without flags is present.
fn entry_flags(e: &PagemapEntry) -> u32 {
    let flags = e.flags.unwrap_or(if e.in_parent == Some(true) { 0 } else { PE_PRESENT });
    if e.in_parent == Some(true) {
        flags | PE_PARENT
    } else {
        flags
    }
}

/// The end of an entry of `nr` pages at `vaddr` that starts at or after
/// `after`, the previous entry's end; `None` if it starts before it or ends
/// past the address space. CRIU writes a pagemap in address order, one entry
/// per run. Out of order or overlapping (an archive crafted with every check
/// recomputed), its meaning would be whatever each reader made of it: CRIU
/// restores the last copy of a page written twice, where a copy by
/// userfaultfd keeps the first, and skipping a zero copy would unmask an
/// earlier one. Such a pagemap is left to CRIU's own reading, never placed
/// nor rewritten.
fn ascending(after: u64, vaddr: u64, nr: u64) -> Option<u64> {
    (vaddr >= after).then_some(())?;
    vaddr.checked_add(nr.checked_mul(4096)?)
}

/// The pages image a pagemap refers to.
pub fn pagemap_pages_id(pagemap: &[u8]) -> Option<u32> {
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    PagemapHead::decode(*objs.first()?).ok().map(|h| h.pages_id)
}

/// `pagemap-<pid>.img` -> pid (process pagemaps only, not shmem ones).
///
/// Only the name CRIU gives the file (`pagemap-%d.img`): `pagemap-07.img`
/// is a file CRIU never opens, whatever it holds.
pub fn process_pagemap_pid(name: &str) -> Option<&str> {
    let pid = name.strip_prefix("pagemap-")?.strip_suffix(".img")?;
    canonical_number(pid).then_some(pid)
}

/// Whether CRIU opens a pagemap of this name: a process's
/// (`pagemap-%lu.img`) or shared memory's (`pagemap-shmem-%lu.img`).
pub fn pagemap_criu_opens(name: &str) -> bool {
    process_pagemap_pid(name).is_some()
        || name.strip_prefix("pagemap-shmem-").and_then(|n| n.strip_suffix(".img")).is_some_and(canonical_number)
}

/// `pages-<id>.img` -> id; only the name CRIU opens (`pages-%u.img`): an
/// archive crafted to hold `pages-01.img` beside `pages-1.img` must not
/// have criuz take the pages of one for the other.
pub fn pages_image_id(name: &str) -> Option<u32> {
    let id = name.strip_prefix("pages-")?.strip_suffix(".img")?;
    canonical_number(id).then(|| id.parse().ok()).flatten()
}

/// Whether `s` is a decimal number as printf's `%d` writes one: digits, no
/// leading zero but for 0 itself.
fn canonical_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
}

/// Which pages of one pages image CRIU will not be sent.
#[derive(Clone, Debug)]
pub struct ZeroPlan {
    pub pages_id: u32,
    /// The rewritten pagemap image.
    pub pagemap: Vec<u8>,
    /// The pages of the pages image left out.
    skipped: PageBits,
    pub skipped_pages: u64,
}

impl ZeroPlan {
    pub fn is_skipped(&self, page: u64) -> bool {
        self.skipped.contains(page as usize)
    }
}

/// Plans the rewrite; `zero` holds the pages of the pages image that are
/// all zero. `None` when anything is not as expected.
pub fn plan(mm: &[u8], pagemap: &[u8], zero: &PageBits) -> Option<ZeroPlan> {
    plan_runs(mm, pagemap, zero, 1)
}

/// As `plan`, leaving out only runs of at least `min_run` zero pages: a lazy
/// restore fetches each gap-free range in requests of its own, so scattered
/// holes would multiply the requests. Where an entry lies in one VMA, the
/// runs long enough are found 64 pages at a time (`PageBits::next_run`):
/// page by page, a plan of 1 GiB took 4-6 ms, most of a lazy restore's own
/// start.
pub fn plan_runs(mm: &[u8], pagemap: &[u8], zero: &PageBits, min_run: u64) -> Option<ZeroPlan> {
    let anon = anon_vmas(mm, 0)?;
    let in_anon = |addr: u64| in_ranges(&anon, addr);

    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = decode_exact::<PagemapHead>(objs.first()?)?;
    let mut out = pagemap[..8].to_vec();
    push_object(&mut out, &head.encode_to_vec());
    let mut skipped = PageBits::new();
    let mut skipped_pages = 0u64;
    let mut page = 0u64; // next page of the pages image
    let mut after = 0u64;
    for obj in &objs[1..] {
        let e = decode_exact::<PagemapEntry>(obj)?;
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        // Pages in a parent image (a pre-dump chain packed as it was): where
        // CRIU's reading of the pages image goes on after them is its own
        // business (it moves on when it skips them, not when it reads them).
        let flags = entry_flags(&e);
        if flags & !(PE_PRESENT | PE_LAZY) != 0 {
            return None;
        }
        after = ascending(after, e.vaddr, nr)?;
        // CRIU marks anonymous pages PE_LAZY as well as PE_PRESENT; only a
        // lazy-pages restore acts on it, and a page left out is zero there too.
        if flags & PE_PRESENT == 0 {
            push_object(&mut out, obj);
            continue;
        }
        let end_addr = e.vaddr.checked_add(nr.checked_mul(4096)?)?;
        let first = usize::try_from(page).ok()?;
        let pages = usize::try_from(nr).ok()?;
        first.checked_add(pages)?;
        // Which pages may be left out: zero ones of private anonymous memory.
        let vma = anon.get(anon.partition_point(|&(s, _)| s <= e.vaddr).wrapping_sub(1));
        let whole = vma.is_some_and(|&(s, end)| s <= e.vaddr && end_addr <= end);
        let none = !whole && !anon.iter().any(|&(s, end)| s < end_addr && e.vaddr < end);
        // The first page from `i` that may be left out (`want`) or not, else nr.
        let next = |i: usize, want: bool| -> usize {
            if whole {
                zero.next(first + i, first + pages, want) - first
            } else if none {
                if want {
                    pages
                } else {
                    i
                }
            } else {
                (i..pages)
                    .find(|&k| (zero.contains(first + k) && in_anon(e.vaddr + k as u64 * 4096)) == want)
                    .unwrap_or(pages)
            }
        };
        // Kept runs, merged across zero runs too short to leave out.
        let min_run = usize::try_from(min_run).unwrap_or(usize::MAX);
        let mut kept_from = 0;
        let mut i = 0;
        while i < pages {
            // Inside one VMA, straight to the next run long enough.
            let z = if whole { zero.next_run(first + i, first + pages, min_run) - first } else { next(i, true) };
            if z >= pages {
                break;
            }
            let after = next(z, false);
            if after - z >= min_run {
                if z > kept_from {
                    push_entry(&mut out, &e, e.vaddr + kept_from as u64 * 4096, (z - kept_from) as u64);
                }
                skipped.insert_range(first + z, first + after);
                skipped_pages += (after - z) as u64;
                kept_from = after;
            }
            i = after;
        }
        if pages > kept_from {
            push_entry(&mut out, &e, e.vaddr + kept_from as u64 * 4096, (pages - kept_from) as u64);
        }
        page += nr;
    }
    Some(ZeroPlan { pages_id: head.pages_id, pagemap: out, skipped, skipped_pages })
}

/// The VMAs of plain private anonymous memory (mm-<pid>.img), sorted, none
/// of whose flags has any of the bits in `not`.
fn anon_vmas(mm: &[u8], not: u32) -> Option<Vec<(u64, u64)>> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut anon: Vec<(u64, u64)> = mm
        .vmas
        .iter()
        .filter(|v| {
            v.status & VMA_AREA_REGULAR != 0
                && v.status & VMA_ANON_PRIVATE != 0
                && v.status & VMA_SPECIAL == 0
                && v.flags & (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32
                    == (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32
                && v.flags & (libc::MAP_SHARED as u32 | not) == 0
        })
        .map(|v| (v.start, v.end))
        .collect();
    anon.sort_unstable();
    Some(anon)
}

/// The VMAs (mm-<pid>.img) a lazy restore's CRIU registers with
/// userfaultfd, sorted: private anonymous memory neither locked nor huge,
/// other than the vDSO, its data and vsyscall (`vma_entry_can_be_lazy` in
/// criu/include/vma.h, v4.2).
/// `None` too where the VMAs overlap or are out of address order, which
/// CRIU never writes: which of two mappings a page lands in would then be
/// a matter of the order they are mapped in.
fn registered_vmas(mm: &[u8]) -> Option<Vec<(u64, u64)>> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut after = 0;
    for v in &mm.vmas {
        (v.start >= after && v.end > v.start).then_some(())?;
        after = v.end;
    }
    let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32;
    let pinned = (libc::MAP_LOCKED | libc::MAP_HUGETLB) as u32;
    let mut vmas: Vec<(u64, u64)> = mm
        .vmas
        .iter()
        .filter(|v| v.flags & anon == anon && v.flags & pinned == 0 && v.status & VMA_KERNEL == 0)
        .map(|v| (v.start, v.end))
        .collect();
    vmas.sort_unstable();
    Some(vmas)
}

/// Whether every run of `runs` flagged lazy lies in memory a lazy restore's
/// CRIU registers with userfaultfd (`registered_vmas` of mm-<pid>.img);
/// false if the image is not as expected. CRIU leaves each page flagged
/// lazy to the page server, whatever memory it is in: one where no
/// userfaultfd is registered would be copied by nobody (a copy there
/// fails), and the process would read the file's bytes or zeros where the
/// archive holds others. CRIU flags no such page; an archive crafted so is
/// not placed.
pub fn lazy_runs_registered(mm: &[u8], runs: &[PageRun]) -> bool {
    let Some(vmas) = registered_vmas(mm) else { return false };
    runs.iter().filter(|r| r.lazy).all(|r| {
        // A run may go on across adjacent VMAs (CRIU merges the pages of
        // neighbours into one entry).
        let (mut at, end) = (r.vaddr, r.vaddr.saturating_add(r.nr.saturating_mul(4096)));
        while at < end {
            match vmas.partition_point(|&(s, _)| s <= at).checked_sub(1).map(|i| vmas[i]) {
                Some((_, vma_end)) if at < vma_end => at = vma_end,
                _ => return false,
            }
        }
        true
    })
}

/// Which shared memory object a mapping shows: anonymous shared memory by
/// its id (that of its `pagemap-shmem-<id>.img`), or a memfd by the id of
/// its file (files.img, then memfd.img: [`memfds`]). CRIU 4.2 dumps
/// anonymous shared memory as a memfd too, where the kernel allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SharedId {
    Anon(u64),
    MemfdFile(u64),
}

/// A shared mapping (mm-<pid>.img): `[start, end)` shows `object` from
/// byte `pgoff` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMapping {
    pub start: u64,
    pub end: u64,
    pub pgoff: u64,
    pub object: SharedId,
    /// Mapped writable. A read-only mapping may come from a descriptor
    /// opened read-only, which the kernel lets take no copy (no
    /// `VM_MAYWRITE`); a writable one is one CRIU made from a writable
    /// descriptor.
    pub writable: bool,
}

impl SharedMapping {
    /// The address that shows byte `offset` of the object, if this mapping
    /// shows it, and how many bytes on from there it shows.
    pub fn address_of(&self, offset: u64) -> Option<(u64, u64)> {
        let into = offset.checked_sub(self.pgoff)?;
        let addr = self.start.checked_add(into)?;
        (addr < self.end).then_some((addr, self.end - addr))
    }
}

/// The plain shared mappings of shared memory in a process (`MAP_SHARED`,
/// not of huge pages, of anonymous shared memory or a memfd; read-only
/// ones too, marked so), and the objects it maps some other way (System V segments, huge pages, a memfd
/// mapped privately, a status criuz does not know): whoever fills an object
/// through its mappings must leave those to CRIU. `None` if the image is
/// not as expected, a mapping is not whole pages, or mappings overlap or
/// are out of address order, which CRIU never writes (a page copied
/// through the first would land in whatever the later one maps there).
pub fn shared_mappings(mm: &[u8]) -> Option<(Vec<SharedMapping>, Vec<SharedId>)> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let (mut plain, mut other) = (Vec::new(), Vec::new());
    let page = |v: u64| v % 4096 == 0;
    let mut after = 0;
    for v in &mm.vmas {
        (v.start >= after && v.end > v.start).then_some(())?;
        after = v.end;
    }
    for v in &mm.vmas {
        let memfd = v.status & VMA_AREA_MEMFD != 0;
        if !memfd && v.status & (VMA_ANON_SHARED | VMA_AREA_SYSVIPC) == 0 {
            continue;
        }
        let object = if memfd { SharedId::MemfdFile(v.shmid) } else { SharedId::Anon(v.shmid) };
        // What else a plain mapping of the kind may have.
        let kind = if memfd { VMA_AREA_MEMFD | VMA_FILE_SHARED } else { VMA_ANON_SHARED };
        let special = v.status & VMA_SPECIAL & !kind != 0;
        let huge = v.flags & libc::MAP_HUGETLB as u32 != 0;
        let shared = v.flags & libc::MAP_SHARED as u32 != 0 && v.flags & libc::MAP_PRIVATE as u32 == 0;
        if v.status & VMA_AREA_REGULAR == 0 || v.status & kind != kind || special || huge || !shared {
            other.push(object);
            continue;
        }
        (v.start < v.end && page(v.start) && page(v.end) && page(v.pgoff)).then_some(())?;
        v.pgoff.checked_add(v.end - v.start)?;
        let writable = v.prot & libc::PROT_WRITE as u32 != 0;
        plain.push(SharedMapping { start: v.start, end: v.end, pgoff: v.pgoff, object, writable });
    }
    Some((plain, other))
}

/// A memfd as CRIU restores it (memfd.img): its pages are
/// `pagemap-shmem-<shmid>.img`'s, and CRIU reads them into its first
/// `size` bytes (rounded up to a page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memfd {
    pub shmid: u64,
    pub size: u64,
    /// Neither of huge pages nor sealed against writes: its mappings can
    /// take copies.
    pub writable: bool,
}

/// Each memfd file of files.img (by file id) and its memfd (memfd.img);
/// `None` if either image is not as expected.
pub fn memfds(files: &[u8], memfd: &[u8]) -> Option<HashMap<u64, Memfd>> {
    // F_SEAL_WRITE, F_SEAL_FUTURE_WRITE.
    const SEALED_AGAINST_WRITES: u32 = 0x08 | 0x10;
    let mut inodes = HashMap::new();
    for obj in objects(memfd, MEMFD_INODE_MAGIC)? {
        let e = MemfdInodeEntry::decode(obj).ok()?;
        let writable = e.hugetlb_flag.unwrap_or(0) == 0 && e.seals.unwrap_or(0) & SEALED_AGAINST_WRITES == 0;
        let m = Memfd { shmid: u64::from(e.shmid), size: e.size.unwrap_or(0), writable };
        inodes.insert(e.inode_id.unwrap_or(0), m);
    }
    let mut out = HashMap::new();
    for obj in objects(files, FILES_MAGIC)? {
        let e = FileEntry::decode(obj).ok()?;
        let Some(mfe) = e.memfd.filter(|_| e.r#type == FD_TYPE_MEMFD) else { continue };
        out.insert(u64::from(e.id), *inodes.get(&u64::from(mfe.inode_id))?);
    }
    Some(out)
}

/// `pagemap-shmem-<id>.img` -> id; only the name CRIU opens.
pub fn shmem_pagemap_id(name: &str) -> Option<u64> {
    let id = name.strip_prefix("pagemap-shmem-")?.strip_suffix(".img")?;
    canonical_number(id).then(|| id.parse().ok()).flatten()
}

/// Whether a process (mm-<pid>.img) has private memory of huge pages
/// (`MAP_HUGETLB` without `MAP_SHARED`). CRIU restores such memory in its
/// restorer, reading the pages image at random (`preadv`), which its image
/// stream cannot do: a streamed restore of it fails "Can't read pages data
/// (-29)" (criu/pie/restorer.c, v4.2). `None` if the image is not as
/// expected.
pub fn private_huge_pages(mm: &[u8]) -> Option<bool> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    Some(mm.vmas.iter().any(|v| is_huge(v) && v.flags & libc::MAP_SHARED as u32 == 0))
}

/// Whether a VMA is a mapping of huge pages (`MAP_HUGETLB`).
fn is_huge(v: &VmaEntry) -> bool {
    v.status & VMA_AREA_REGULAR != 0 && v.flags & libc::MAP_HUGETLB as u32 != 0
}

/// The huge page size that mmap or memfd_create `flags` name: log2 of it
/// from [`MAP_HUGE_SHIFT`] (the same bits for both), 0 for the system's
/// `default` size. `None` for a size past 64 bits.
fn huge_page_size(flags: u32, default: u64) -> Option<u64> {
    match (flags >> MAP_HUGE_SHIFT) & 0x3f {
        0 => Some(default),
        shift => 1u64.checked_shl(shift),
    }
}

/// Where a huge-page mapping's flags hold log2 of its page size (0: the
/// system's default size), as mmap takes it (`MAP_HUGE_SHIFT`).
const MAP_HUGE_SHIFT: u32 = 26;

/// What a process's images hold of huge-page memory (`MAP_HUGETLB`). It
/// comes back from the system's pool of huge pages (vm.nr_hugepages), not
/// from the memory a cgroup limits or `MemAvailable` counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HugeMemory {
    /// The pages of the process's pages image in private huge-page
    /// mappings, as ranges [first, end) of page numbers in that image.
    pub private_pages: Vec<(u64, u64)>,
    /// Huge pages those pages fill, as (page size in bytes, count): one
    /// per aligned huge page holding a dumped page.
    pub private_huge: Vec<(u64, u64)>,
    /// The shared memory of huge pages the process maps: its id (CRIU's
    /// `pagemap-shmem-<id>.img`) and page size.
    pub shared: Vec<(u64, u64)>,
}

/// The huge-page memory of a process, from its mm-<pid>.img and
/// pagemap-<pid>.img; `default_size` is the system's huge page size, for a
/// mapping that names none. `None` if an image is not as expected.
pub fn huge_memory(mm: &[u8], pagemap: &[u8], default_size: u64) -> Option<HugeMemory> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut out = HugeMemory::default();
    let mut private: Vec<(u64, u64, u64)> = Vec::new();
    for v in mm.vmas.iter().filter(|v| is_huge(v)) {
        let size = huge_page_size(v.flags, default_size)?.max(crate::format::PAGE_SIZE as u64);
        if v.flags & libc::MAP_SHARED as u32 != 0 {
            // Shared memory of huge pages is, where the kernel has memfds
            // of huge pages, a memfd ([`huge_memfds`]); else shared memory
            // of its own.
            if v.status & VMA_ANON_SHARED != 0 && !out.shared.iter().any(|&(id, _)| id == v.shmid) {
                out.shared.push((v.shmid, size));
            }
        } else {
            private.push((v.start, v.end, size));
        }
    }
    if private.is_empty() {
        return Some(out);
    }
    private.sort_unstable();
    let (_, runs) = pagemap_runs(pagemap)?;
    // The last huge page counted, by size: runs come in address order.
    let mut counted: Vec<(u64, u64, u64)> = Vec::new();
    for r in &runs {
        let (start, end) = (r.vaddr, r.vaddr + r.nr * 4096);
        // The mappings are apart, so in order of their ends too.
        let after = private.partition_point(|&(_, e, _)| e <= start);
        for &(s, e, size) in private[after..].iter().take_while(|&&(s, ..)| s < end).filter(|&&(_, e, _)| start < e) {
            let (from, to) = (start.max(s), end.min(e));
            if from >= to {
                continue;
            }
            let first = r.first + (from - start) / 4096;
            let last = first + (to - from) / 4096;
            match out.private_pages.last_mut() {
                Some((_, at)) if *at == first => *at = last,
                _ => out.private_pages.push((first, last)),
            }
            let (lo, hi) = (from / size, (to - 1) / size);
            match counted.iter_mut().find(|(z, ..)| *z == size) {
                Some((_, seen, n)) => {
                    *n += hi - lo + 1 - u64::from(*seen == lo);
                    *seen = hi;
                }
                None => counted.push((size, hi, hi - lo + 1)),
            }
        }
    }
    out.private_huge = counted.into_iter().map(|(size, _, n)| (size, n)).collect();
    Some(out)
}

/// The memfds of huge pages in a tree's memfd.img (`memfd_inode_entry`s
/// with `MFD_HUGETLB`): the id of each one's contents (CRIU's
/// `pagemap-shmem-<id>.img`) and its page size. CRIU dumps this way every
/// shared mapping of huge pages, and every hugetlbfs file, not only
/// memfds. `None` if the image is not as expected.
pub fn huge_memfds(memfd: &[u8], default_size: u64) -> Option<Vec<(u64, u64)>> {
    const MFD_HUGETLB: u32 = 4;
    let mut out = Vec::new();
    for obj in objects(memfd, MEMFD_INODE_MAGIC)? {
        let e = MemfdInodeEntry::decode(obj).ok()?;
        let Some(flag) = e.hugetlb_flag.filter(|f| f & MFD_HUGETLB != 0) else { continue };
        out.push((u64::from(e.shmid), huge_page_size(flag, default_size)?));
    }
    Some(out)
}

/// Huge pages of `size` bytes that the pages of a shared memory's pagemap
/// (`pagemap-shmem-<id>.img`) fill: one per aligned huge page holding a
/// dumped page. `None` if the image is not as expected.
pub fn shared_huge_pages(pagemap: &[u8], size: u64) -> Option<(u32, u64)> {
    let (pages_id, runs) = pagemap_runs(pagemap)?;
    let size = size.max(crate::format::PAGE_SIZE as u64);
    let mut last = None;
    let mut n = 0;
    for r in runs.iter().filter(|r| r.nr > 0) {
        let (first, end) = (r.vaddr / size, (r.vaddr + r.nr * 4096 - 1) / size);
        n += end - first + 1 - u64::from(last == Some(first));
        last = Some(end);
    }
    Some((pages_id, n))
}

/// Whether `addr` lies in one of the `sorted` ranges [start, end), which do
/// not overlap.
pub(crate) fn in_ranges(sorted: &[(u64, u64)], addr: u64) -> bool {
    let i = sorted.partition_point(|&(s, _)| s <= addr);
    i > 0 && addr < sorted[i - 1].1
}

/// Marks lazy (`PE_LAZY`) the present pages CRIU should have marked.
///
/// CRIU marks lazy the pages of the memory a lazy restore registers with
/// userfaultfd (private anonymous, not locked, not huge), except the page
/// holding a thread's stack pointer. But its test for that page (`is_stack`
/// in criu/mem.c, v4.2) compares only the offset within a page, so when a
/// thread's stack pointer is page-aligned (about one dump in 256) every
/// page is "the stack", nothing is lazy, and a lazy restore has CRIU copy
/// every page before the tree runs. This gives the flag back to present
/// pages of plain private anonymous memory (`anon_vmas`, no stricter than
/// CRIU's rule), neither locked nor huge, other than the pages at and just
/// below each of `stack_pointers`. It only ever adds the flag, so a dump
/// CRIU marked right comes back unchanged. `None` if anything is not as
/// expected.
pub fn mark_lazy(mm: &[u8], pagemap: &[u8], stack_pointers: &[u64]) -> Option<Vec<u8>> {
    let vmas = anon_vmas(mm, (libc::MAP_LOCKED | libc::MAP_HUGETLB) as u32)?;
    let page = !(crate::format::PAGE_SIZE as u64 - 1);
    let near_stack =
        |vaddr: u64| stack_pointers.iter().any(|&sp| vaddr == sp & page || vaddr == (sp & page).wrapping_sub(4096));
    let may_be_lazy = |vaddr: u64| in_ranges(&vmas, vaddr) && !near_stack(vaddr);
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = decode_exact::<PagemapHead>(objs.first()?)?;
    let mut out = pagemap[..8].to_vec();
    push_object(&mut out, &head.encode_to_vec());
    for obj in &objs[1..] {
        let e = decode_exact::<PagemapEntry>(obj)?;
        if e.flags != Some(PE_PRESENT) || entry_flags(&e) != PE_PRESENT {
            push_object(&mut out, obj);
            continue;
        }
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        let at = |i: u64| e.vaddr.checked_add(i.checked_mul(4096)?);
        let mut i = 0;
        while i < nr {
            let lazy = may_be_lazy(at(i)?);
            let mut j = i + 1;
            while j < nr && may_be_lazy(at(j)?) == lazy {
                j += 1;
            }
            let flags = if lazy { PE_PRESENT | PE_LAZY } else { PE_PRESENT };
            push_entry(&mut out, &PagemapEntry { flags: Some(flags), ..e.clone() }, at(i)?, j - i);
            i = j;
        }
    }
    Some(out)
}

/// Decodes a message we rewrite, only if it holds nothing but the fields we
/// know: re-encoded, it must give back the same bytes. A field added by a
/// newer CRIU (such as the compressed size of pages CRIU compressed itself,
/// which would make "page N of the pages image" mean something else) means
/// no plan, and the images are served untouched.
fn decode_exact<M: Message + Default>(obj: &[u8]) -> Option<M> {
    let m = M::decode(obj).ok()?;
    (m.encode_to_vec() == obj).then_some(m)
}

fn push_object(out: &mut Vec<u8>, obj: &[u8]) {
    out.extend_from_slice(&(obj.len() as u32).to_ne_bytes());
    out.extend_from_slice(obj);
}

fn push_entry(out: &mut Vec<u8>, like: &PagemapEntry, vaddr: u64, nr: u64) {
    let e = PagemapEntry {
        vaddr,
        nr_pages: nr.min(u64::from(u32::MAX)) as u32,
        in_parent: like.in_parent.map(|_| false),
        flags: like.flags,
        nr_pages64: like.nr_pages64.map(|_| nr),
    };
    push_object(out, &e.encode_to_vec());
}

/// Builds a pagemap image as CRIU writes it: the image magics, the head
/// naming the pages image, then one entry per run of pages (what a page
/// server receiving a dump writes, see `criu::page_server`).
pub struct PagemapBuilder {
    out: Vec<u8>,
    last: Option<(u64, u64, u32)>,
}

impl PagemapBuilder {
    pub fn new(pages_id: u32) -> Self {
        let mut out = Vec::new();
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
        out.extend_from_slice(&PAGEMAP_MAGIC.to_ne_bytes());
        push_object(&mut out, &PagemapHead { pages_id }.encode_to_vec());
        PagemapBuilder { out, last: None }
    }

    /// Adds `nr` pages at `vaddr` with CRIU's `flags` (`PE_*`); a run that
    /// continues the previous one with the same flags is merged into it.
    pub fn push(&mut self, vaddr: u64, nr: u64, flags: u32) {
        match &mut self.last {
            Some((v, n, f)) if *f == flags && v.checked_add(*n * crate::format::PAGE_SIZE as u64) == Some(vaddr) => {
                *n += nr
            }
            _ => {
                self.flush();
                self.last = Some((vaddr, nr, flags));
            }
        }
    }

    fn flush(&mut self) {
        if let Some((vaddr, nr, flags)) = self.last.take() {
            // Both counts: CRIU >= 4.2 reads field 5, older CRIU field 2.
            let like = PagemapEntry { vaddr, nr_pages: 0, in_parent: None, flags: Some(flags), nr_pages64: Some(0) };
            push_entry(&mut self.out, &like, vaddr, nr);
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.flush();
        self.out
    }
}

/// `PE_PRESENT`, `PE_LAZY` and `PE_PARENT` of a pagemap entry's flags.
pub mod pe {
    pub const PARENT: u32 = super::PE_PARENT;
    pub const LAZY: u32 = super::PE_LAZY;
    pub const PRESENT: u32 = super::PE_PRESENT;
}

#[cfg(test)]
mod tests;
