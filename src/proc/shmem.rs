//! The shared memory objects a tree maps whose content CRIU dumps whole:
//! anonymous shared memory (`/dev/zero (deleted)` in /proc/PID/maps),
//! System V segments (`/SYSV…`) and memfds (`/memfd:…`). CRIU writes every
//! page such an object holds, but a process's resident set counts only the
//! pages that process has touched: PostgreSQL's shared buffers, filled by
//! backends that have since exited, were 556 MiB of a dump whose tree's
//! `VmRSS` added up to about 120 MiB.
//!
//! Each object is counted once (by device and inode, however many
//! processes map it), by what it has allocated (`st_blocks` of its
//! `/proc/PID/map_files` link, which needs the root a dump runs with; an
//! object that cannot be read counts nothing, as before). Pages of it that
//! a process also maps are counted in that process's resident set too: an
//! estimate that errs high, which costs only a larger reservation from
//! the machine's share (`budget`), where one that errs low compresses
//! pages in haste and then again. Objects held only as descriptors, and
//! System V segments no process attaches, are not found.
//!
//! Which objects only the tree reaches ([`Candidates`]): a dump may hold
//! their pages by reference, as it holds the tree's private pages
//! (`archive::held`), when no process outside the tree maps one or holds
//! a descriptor of it, so that nothing can write it while the tree is
//! stopped. Found in the walk of every other process (`outside`), which
//! then also asks for its shared mappings (of the kernel, `PROCMAP_QUERY`),
//! only for a tree that has such objects: beside 5,000 idle processes
//! that, and the walk again before the commit, make a 64 MiB dump durable
//! 0.2-0.25 s later on 2 cores, for the memory and frozen time it saves
//! (docs/BENCHMARKS.md, sessions 69 and 70).
//! System V memory is never one: any process of its IPC namespace may
//! attach a segment; and CRIU names a segment's pages by its IPC id, which
//! another object's inode number may equal, so such an object is not one
//! either. The walk races with processes that gain a mapping after it; the
//! dump walks again before it commits. Outside its view nothing is seen: a
//! process in a pid namespace above criuz's, or a descriptor of a thread
//! that keeps a table of its own (`clone` without `CLONE_FILES`).

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;

/// Bytes the shared memory objects mapped by `pids` hold (each once).
pub(crate) fn dumped_shared_bytes(pids: &[i32]) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for pid in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        for object in maps.lines().filter_map(SharedObject::parse) {
            if seen.contains(&(object.device, object.inode)) {
                continue;
            }
            // Counted where it can be read: a process that exited meanwhile
            // leaves the object to the next one that maps it.
            let link = format!("/proc/{pid}/map_files/{:x}-{:x}", object.start, object.end);
            if let Ok(meta) = std::fs::metadata(link) {
                seen.insert((object.device, object.inode));
                total = total.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// One line of /proc/PID/maps that maps a shared memory object CRIU dumps.
#[derive(Debug, PartialEq)]
struct SharedObject {
    start: u64,
    end: u64,
    /// Major and minor number.
    device: (u32, u32),
    inode: u64,
    /// A System V segment (`/SYSV…`).
    system_v: bool,
}

/// A shared memory object: its device (major, minor) and inode.
pub(crate) type Object = ((u32, u32), u64);

/// The shared memory objects of a tree whose pages CRIU dumps and that a
/// dump may hold by reference while the tree is stopped, if no process
/// outside the tree maps one or holds a descriptor of it (the walk of
/// those processes, `outside`, tells). Never a System V segment, nor an
/// object whose inode number a segment's id in the tree's IPC namespace
/// equals (CRIU names a segment's pagemap by its id, and the others'
/// `pagemap-shmem-<inode>.img`).
pub(crate) struct Candidates(HashSet<Object>);

impl Candidates {
    /// Those of the tree `pids`; `None` where there are none, or a process
    /// of the tree, or its IPC namespace's segments, cannot be read.
    pub(crate) fn of(pids: &[i32]) -> Option<Candidates> {
        let objects = tree_objects(pids)?;
        if objects.is_empty() {
            return None;
        }
        let segments = system_v_ids(pids)?;
        let candidates: HashSet<Object> = objects.into_iter().filter(|o| !segments.contains(&o.1)).collect();
        (!candidates.is_empty()).then_some(Candidates(candidates))
    }

    /// Those that `pid`, outside the tree, maps or holds (its descriptors
    /// read `links`); `None` where it cannot be read.
    pub(crate) fn reached_by(&self, pid: i32, links: &std::io::Result<super::Links>) -> Option<Vec<Object>> {
        Some(outsider_reaches(pid, links)?.into_iter().filter(|o| self.0.contains(o)).collect())
    }

    /// Those none of `reached` is, by inode (as CRIU names their pagemaps):
    /// what a dump may hold by reference.
    pub(crate) fn unreached(self, reached: impl IntoIterator<Item = Object>) -> HashSet<u64> {
        let reached: HashSet<u64> = reached.into_iter().map(|object| object.1).collect();
        self.0.into_iter().map(|object| object.1).filter(|inode| !reached.contains(inode)).collect()
    }
}

/// Every shared memory object but System V segments that `pids` map or
/// hold a descriptor of; `None` where a process of the tree cannot be read.
fn tree_objects(pids: &[i32]) -> Option<HashSet<Object>> {
    let mut objects = HashSet::new();
    for &pid in pids {
        objects.extend(tree_reaches(pid)?.into_iter().filter(|(_, system_v)| !system_v).map(|(o, _)| o));
    }
    Some(objects)
}

/// The ids of the System V segments of every IPC namespace of `pids`
/// (`/proc/sysvipc/shm`, read in each namespace: it lists the reader's);
/// `None` where one cannot be read.
fn system_v_ids(pids: &[i32]) -> Option<HashSet<u64>> {
    let own = std::fs::read_link("/proc/self/ns/ipc").ok()?;
    let mut spaces: HashMap<std::path::PathBuf, i32> = HashMap::new();
    for &pid in pids {
        match std::fs::read_link(format!("/proc/{pid}/ns/ipc")) {
            Ok(space) => {
                spaces.entry(space).or_insert(pid);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => return None,
        }
    }
    let mut ids = HashSet::new();
    for (space, pid) in spaces {
        ids.extend(if space == own { segment_ids()? } else { in_ipc_namespace_of(pid, segment_ids)?? });
    }
    Some(ids)
}

/// The ids `/proc/sysvipc/shm` lists (its second column): the segments of
/// the reading thread's IPC namespace. None in a kernel without System V
/// IPC.
fn segment_ids() -> Option<HashSet<u64>> {
    match std::fs::read_to_string("/proc/sysvipc/shm") {
        Ok(table) => table.lines().skip(1).map(|l| l.split_whitespace().nth(1)?.parse().ok()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(HashSet::new()),
        Err(_) => None,
    }
}

/// `read` run on a thread of its own that has joined the IPC namespace of
/// process `pid` (an IPC namespace is a thread's own: the rest of criuz
/// stays where it is); `None` where it could not join.
fn in_ipc_namespace_of<T: Send>(pid: i32, read: impl FnOnce() -> T + Send) -> Option<T> {
    let space = std::fs::File::open(format!("/proc/{pid}/ns/ipc")).ok()?;
    std::thread::scope(|s| {
        s.spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns(2) on a namespace descriptor we hold open; it
            // changes only this thread's IPC namespace, and the thread ends
            // with the scope.
            (unsafe { libc::setns(space.as_raw_fd(), libc::CLONE_NEWIPC) } == 0).then(read)
        })
        .join()
        .ok()
        .flatten()
    })
}

/// Gone, or exiting (its maps then read ESRCH).
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// The shared memory objects CRIU would dump that `pid`, a process of the
/// tree, maps (read as text: it names System V segments) or holds a
/// descriptor of, each with whether it is a System V segment; nothing for
/// a process gone meanwhile, `None` for one that cannot be read.
fn tree_reaches(pid: i32) -> Option<Vec<(Object, bool)>> {
    let mut objects: Vec<(Object, bool)> = match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        Ok(maps) => {
            maps.lines().filter_map(SharedObject::parse_reachable).map(|o| ((o.device, o.inode), o.system_v)).collect()
        }
        Err(e) if gone(&e) => return Some(Vec::new()),
        Err(_) => return None,
    };
    match super::fd_links(pid) {
        Ok(links) => objects.extend(descriptor_objects(pid, &links)),
        Err(e) if gone(&e) => {}
        Err(_) => return None,
    }
    Some(objects)
}

/// The shared memory objects that `pid`, a process outside the tree whose
/// descriptors read `links`, maps or holds a descriptor of; nothing for a
/// process gone meanwhile, `None` for one that cannot be read. A process
/// whose maps even root may not read (one holding capabilities criuz
/// lacks: a sandbox's own init here) is known by its descriptors alone:
/// such a process could as well write the tree's private memory, which a
/// dump holds by reference in any case.
pub(crate) fn outsider_reaches(pid: i32, links: &std::io::Result<super::Links>) -> Option<Vec<Object>> {
    let denied = |e: &std::io::Error| e.kind() == std::io::ErrorKind::PermissionDenied;
    let mut objects: Vec<Object> = match shared_mappings(pid) {
        Ok(objects) => objects,
        Err(e) if gone(&e) => return Some(Vec::new()),
        Err(e) if denied(&e) => Vec::new(),
        // A kernel without `PROCMAP_QUERY`: the text.
        Err(_) => match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            Ok(maps) => maps.lines().filter_map(SharedObject::parse_reachable).map(|o| (o.device, o.inode)).collect(),
            Err(e) if gone(&e) => return Some(Vec::new()),
            Err(e) if denied(&e) => Vec::new(),
            Err(_) => return None,
        },
    };
    match links {
        Ok(links) => objects.extend(descriptor_objects(pid, links).into_iter().map(|(o, _)| o)),
        Err(e) if gone(e) => {}
        Err(_) => return None,
    }
    Some(objects)
}

/// The shared memory objects among the descriptors of `pid` (`links`),
/// each with whether it is a System V segment.
fn descriptor_objects(pid: i32, links: &super::Links) -> Vec<(Object, bool)> {
    let mut objects = Vec::new();
    for (fd, target) in links {
        let Some(target) = target.to_str() else { continue };
        if !SharedObject::is_shared_memory(target) {
            continue;
        }
        // Closed meanwhile: it holds nothing.
        if let Ok(meta) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
            let device = (libc::major(meta.dev()), libc::minor(meta.dev()));
            objects.push(((device, meta.ino()), target.starts_with("/SYSV")));
        }
    }
    objects
}

/// `struct procmap_query` of linux/fs.h (Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `PROCMAP_QUERY`: `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16) | ((b'f' as libc::c_ulong) << 8) | 17;
/// The next shared, file-backed mapping at or after the address asked.
const SHARED_FILE_MAPPING_FROM: u64 = 0x08 | 0x10 | 0x20;

/// The objects of every shared mapping of `pid` that is backed by a file
/// (shared memory objects among them), asked of the kernel one mapping at
/// a time (`PROCMAP_QUERY`, Linux 6.11) rather than read as text: on this
/// VM, 5,000 idle processes took 0.10 s that way against 0.37 s for
/// their maps read whole (one core, a one-off script). A private mapping
/// of a memfd is left out: what it writes stays its own. Fails (to fall
/// back on the text) where the kernel does not know the request.
fn shared_mappings(pid: i32) -> std::io::Result<Vec<Object>> {
    use std::os::fd::AsRawFd;
    let maps = std::fs::File::open(format!("/proc/{pid}/maps"))?;
    let mut objects = Vec::new();
    let mut from = 0;
    loop {
        let mut query = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: SHARED_FILE_MAPPING_FROM,
            query_addr: from,
            ..Default::default()
        };
        // SAFETY: the request's argument is a `struct procmap_query` of
        // ours, whose size it carries; no name or build id is asked for.
        if unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut query) } != 0 {
            let e = std::io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENOENT) { Ok(objects) } else { Err(e) };
        }
        objects.push(((query.dev_major, query.dev_minor), query.inode));
        if query.vma_end <= from {
            return Ok(objects);
        }
        from = query.vma_end;
    }
}

impl SharedObject {
    /// `start-end perms offset device inode path`; `None` for any other
    /// mapping (private anonymous memory is in the resident set already,
    /// file contents stay in their files).
    fn parse(line: &str) -> Option<SharedObject> {
        SharedObject::parse_with(line, false)
    }

    /// [`parse`](Self::parse), and shared huge-page memory too (CRIU dumps
    /// it as it dumps a memfd; its pages count in the resident set's
    /// `HugetlbPages` already, so not in [`dumped_shared_bytes`]).
    fn parse_reachable(line: &str) -> Option<SharedObject> {
        SharedObject::parse_with(line, true)
    }

    fn parse_with(line: &str, huge: bool) -> Option<SharedObject> {
        let m = super::MapsLine::parse(line)?;
        let path = m.path;
        let shared_anonymous =
            m.perms.ends_with('s') && (path == "/dev/zero (deleted)" || (huge && path.starts_with("/anon_hugepage")));
        let dumped_whole = path.starts_with("/SYSV") || path.starts_with("/memfd:");
        if !(shared_anonymous || dumped_whole) {
            return None;
        }
        let (major, minor) = m.device.split_once(':')?;
        Some(SharedObject {
            start: m.start,
            end: m.end,
            device: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
            inode: m.inode.parse().ok()?,
            system_v: path.starts_with("/SYSV"),
        })
    }

    /// Whether a descriptor's link (or a mapping's path) names a shared
    /// memory object CRIU dumps: what a process holds of one through a
    /// descriptor (a memfd, or /proc/PID/map_files opened).
    fn is_shared_memory(target: &str) -> bool {
        ["/memfd:", "/dev/zero (deleted)", "/SYSV", "/anon_hugepage"].iter().any(|p| target.starts_with(p))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn shared_objects_criu_dumps_are_found_in_maps_lines() {
        let object = |line| SharedObject::parse(line).map(|o| (o.start, o.end, o.device, o.inode));
        assert_eq!(
            object("7fc002a2f000-7fc02bc00000 rw-s 00000000 00:01 4                          /dev/zero (deleted)"),
            Some((0x7fc0_02a2_f000, 0x7fc0_2bc0_0000, (0, 1), 4))
        );
        assert_eq!(
            object("7f00aa000000-7f00aa001000 rw-s 00000000 00:01 9                          /SYSV00994149 (deleted)"),
            Some((0x7f00_aa00_0000, 0x7f00_aa00_1000, (0, 1), 9))
        );
        assert_eq!(
            object("00400000-00452000 r--p 00000000 00:1a 1031                       /memfd:weights (deleted)"),
            Some((0x40_0000, 0x45_2000, (0, 0x1a), 1031))
        );
        // Private anonymous memory, a private /dev/zero mapping, a file and a
        // POSIX shared memory file (its content stays in /dev/shm).
        for line in [
            "7ffd1c3e0000-7ffd1c401000 rw-p 00000000 00:00 0                          [stack]",
            "7f5a00000000-7f5a00021000 rw-p 00000000 00:00 0 ",
            "7f5a10000000-7f5a10021000 rw-p 00000000 00:05 6                          /dev/zero",
            "55d0c0a00000-55d0c0a28000 r--p 00000000 08:01 1311                       /usr/bin/cat",
            "7f5a20000000-7f5a20400000 rw-s 00000000 00:19 27                         /dev/shm/cache",
            "garbage",
        ] {
            assert_eq!(object(line), None, "{line}");
        }
    }

    /// The kernel's answer (`PROCMAP_QUERY`) names the shared mappings the
    /// text names, and leaves out a memfd mapped privately.
    #[test]
    fn shared_mappings_asked_of_the_kernel_are_those_the_text_names() {
        let len = 1 << 20;
        let map = shared_anonymous(len);
        let inode = inode_mapped_at(map, len);
        // SAFETY: a name of our own; the descriptor and mapping go below.
        let (memfd, private) = unsafe {
            let fd = libc::memfd_create(c"criuz-private".as_ptr(), 0);
            assert!(fd >= 0 && libc::ftruncate(fd, len as libc::off_t) == 0);
            let private =
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, 0);
            assert_ne!(private, libc::MAP_FAILED);
            (fd, private)
        };
        let private_inode = inode_mapped_at(private, len);
        let me = std::process::id() as i32;
        let asked = shared_mappings(me);
        let text: HashSet<Object> = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(SharedObject::parse_reachable)
            .filter(|o| !o.system_v)
            .map(|o| (o.device, o.inode))
            .collect();
        // SAFETY: undoing what this test made.
        unsafe {
            libc::munmap(map, len);
            libc::munmap(private, len);
            libc::close(memfd);
        }
        let asked: HashSet<Object> = asked.expect("PROCMAP_QUERY (Linux 6.11)").into_iter().collect();
        assert!(!asked.iter().any(|o| o.1 == private_inode), "a private mapping: {asked:?}");
        // (Other tests of this process map and unmap meanwhile: only this
        // test's own objects are compared.)
        assert!(text.iter().any(|o| o.1 == private_inode), "the text names it: {text:?}");
        let shared = text.iter().find(|o| o.1 == inode).expect("the text names the shared mapping");
        assert!(asked.contains(shared), "{shared:?} not asked: {asked:?}");
    }

    /// PostgreSQL's shape: a System V segment beside anonymous shared
    /// memory. The segment is never the tree's alone (any process of its
    /// IPC namespace may attach it); the other memory still is. A tree in
    /// an IPC namespace of its own has its own segments read there.
    #[test]
    fn system_v_memory_is_never_the_tree_s_alone_and_leaves_the_rest_so() {
        let len = 1 << 20;
        // SAFETY: a private segment of our own, removed below.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, len, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: attaching that segment; detached below.
        let attached = unsafe { libc::shmat(id, std::ptr::null(), 0) };
        let map = shared_anonymous(len);
        let inode = |addr| inode_mapped_at(addr, len);
        let (segment_inode, map_inode) = (inode(attached), inode(map));
        let me = std::process::id() as i32;
        let only_mine = Candidates::of(&[me]).map_or_else(HashSet::new, |c| c.unreached([]));
        let ours = system_v_ids(&[me]);
        let mut other = std::process::Command::new("unshare").args(["--ipc", "sleep", "30"]).spawn().unwrap();
        let other_pid = other.id() as i32;
        let own_space = std::fs::read_link("/proc/self/ns/ipc").unwrap();
        let mut theirs = None;
        for _ in 0..500 {
            if std::fs::read_link(format!("/proc/{other_pid}/ns/ipc")).is_ok_and(|space| space != own_space) {
                theirs = system_v_ids(&[other_pid]);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = other.kill();
        let _ = other.wait();
        // SAFETY: undoing what this test made.
        unsafe {
            libc::shmdt(attached);
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
            libc::munmap(map, len);
        }
        assert_eq!(segment_inode, id as u64, "a segment's inode number is its id");
        assert!(!only_mine.contains(&segment_inode), "{only_mine:?}");
        assert!(only_mine.contains(&map_inode), "{only_mine:?}");
        assert!(ours.is_some_and(|ids| ids.contains(&(id as u64))));
        let theirs = theirs.expect("the segments of a new IPC namespace");
        assert!(!theirs.contains(&(id as u64)), "read in our namespace, not theirs: {theirs:?}");
    }

    /// A fresh shared anonymous mapping of `len` bytes; the caller unmaps it.
    pub(crate) fn shared_anonymous(len: usize) -> *mut libc::c_void {
        // SAFETY: a new mapping that nothing else refers to.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        map
    }

    /// The inode of the object this process maps at `map` (`len` bytes).
    pub(crate) fn inode_mapped_at(map: *mut libc::c_void, len: usize) -> u64 {
        let link = format!("/proc/self/map_files/{:x}-{:x}", map as usize, map as usize + len);
        std::fs::metadata(link).unwrap().ino()
    }

    /// This thread's name, which a process it forks starts with.
    pub(crate) fn current_comm() -> String {
        std::fs::read_to_string("/proc/thread-self/comm").unwrap().trim().to_string()
    }

    /// A shared anonymous mapping written only by a child that then exited:
    /// its parent's resident set holds none of it, the object all of it.
    #[test]
    fn shared_memory_written_by_an_exited_child_is_counted_once() {
        let len = 8 << 20;
        let map = shared_anonymous(len);
        assert_ne!(map, libc::MAP_FAILED);
        // SAFETY: the child only writes the mapping and exits without
        // running anything of the parent's (no allocation, no locks).
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: the mapping is `len` bytes long and writable.
            unsafe {
                std::ptr::write_bytes(map as *mut u8, 0x5a, len);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        let me = std::process::id() as i32;
        let (once, twice) = (dumped_shared_bytes(&[me]), dumped_shared_bytes(&[me, me]));
        // SAFETY: the mapping made above, used no more.
        unsafe { libc::munmap(map, len) };
        assert!(once >= len as u64, "{once} bytes counted, {len} written");
        assert_eq!(once, twice, "an object mapped by two processes counts once");
    }
}
