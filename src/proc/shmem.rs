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
//! Which objects only the tree reaches ([`reached_only_by`]): a dump may
//! hold their pages by reference, as it holds the tree's private pages
//! (`archive::held`), when no process outside the tree maps one or holds
//! a descriptor of it, so that nothing can write it while the tree is
//! stopped. Found by a walk of every other process's shared mappings
//! (asked of the kernel, `PROCMAP_QUERY`) and descriptors, on every core
//! (`proc::scan_processes`), and only for a tree that has such objects:
//! beside 5,000 idle processes it makes a 64 MiB dump durable about 0.3 s
//! later on 2 cores, for the memory and frozen time it saves
//! (docs/BENCHMARKS.md, session 69). System V memory is never one: any process of its IPC
//! namespace may attach a segment; and CRIU names a segment's pages by its
//! IPC id, which another object's inode number may equal, so such an
//! object is not one either. The walk races
//! with processes that gain a mapping after it; the dump walks again
//! before it commits ([`reached_from_outside`]). Outside its view nothing
//! is seen: a process in a pid namespace above criuz's, or a descriptor
//! of a thread that keeps a table of its own (`clone` without
//! `CLONE_FILES`).

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
type Object = ((u32, u32), u64);

/// The shared memory objects of the tree `pids` whose pages CRIU dumps and
/// that no process outside the tree maps or holds a descriptor of, by
/// inode (as CRIU names their pagemaps, `pagemap-shmem-<inode>.img`):
/// those a dump may hold by reference while the tree is stopped. Never a
/// System V segment, nor an object whose inode number a segment's id in
/// the tree's IPC namespace equals (CRIU names a segment's pagemap by its
/// id); none at all where a process of the tree, or that namespace's
/// segments, cannot be read.
pub(crate) fn reached_only_by(pids: &[i32]) -> HashSet<u64> {
    let Some(objects) = tree_objects(pids) else { return HashSet::new() };
    if objects.is_empty() {
        return HashSet::new();
    }
    let Some(segments) = system_v_ids(pids) else { return HashSet::new() };
    let candidates: HashSet<Object> = objects.into_iter().filter(|o| !segments.contains(&o.1)).collect();
    let Some(reached) = outside_reaches(pids, &|object: &Object| candidates.contains(object)) else {
        return HashSet::new();
    };
    let reached: HashSet<u64> = reached.iter().map(|(object, _)| object.1).collect();
    candidates.iter().map(|object| object.1).filter(|inode| !reached.contains(inode)).collect()
}

/// A process outside the tree `pids` that maps or holds one of the shared
/// memory objects `inodes` names (whatever its device), named for the
/// user; also where a process cannot be read, since it might.
pub(crate) fn reached_from_outside(pids: &[i32], inodes: &HashSet<u64>) -> Option<String> {
    if inodes.is_empty() {
        return None;
    }
    match outside_reaches(pids, &|object: &Object| inodes.contains(&object.1)) {
        None => Some("a process whose maps or descriptors criuz cannot read".into()),
        Some(reached) => reached.first().map(|&(_, pid)| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            format!("process {pid} ({})", comm.trim())
        }),
    }
}

/// Every shared memory object but System V segments that `pids` map or
/// hold a descriptor of; `None` where a process of the tree cannot be read.
fn tree_objects(pids: &[i32]) -> Option<HashSet<Object>> {
    let mut objects = HashSet::new();
    for &pid in pids {
        objects.extend(reaches(pid, false)?.into_iter().filter(|(_, system_v)| !system_v).map(|(o, _)| o));
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

/// What the processes outside the tree `pids` (and outside criuz's own
/// tree: CRIU maps the objects to dump them) reach of the objects `wanted`
/// picks, with one such process each; `None` where a process cannot be
/// read.
fn outside_reaches(pids: &[i32], wanted: &(dyn Fn(&Object) -> bool + Sync)) -> Option<Vec<(Object, i32)>> {
    let skip: HashSet<i32> = pids.iter().copied().chain(super::tree::tree_pids(&[std::process::id() as i32])).collect();
    let seen = super::scan_processes(
        |pid| skip.contains(&pid),
        |pid| {
            reaches(pid, true)
                .map(|found| found.into_iter().filter(|(o, _)| wanted(o)).map(|(o, _)| (o, pid)).collect())
        },
    )
    .ok()?;
    let mut reached: HashMap<Object, i32> = HashMap::new();
    for found in seen {
        let found: Vec<(Object, i32)> = found?;
        for (object, pid) in found {
            reached.entry(object).or_insert(pid);
        }
    }
    Some(reached.into_iter().collect())
}

/// The shared memory objects CRIU would dump that `pid` maps or holds a
/// descriptor of, each with whether it is a System V segment; nothing for
/// a process gone meanwhile, `None` for one that cannot be read. Where
/// `outside`, a process whose maps even root may not read (one holding
/// capabilities criuz lacks: a sandbox's own init here) is known by its
/// descriptors alone: such a process could as well write the tree's
/// private memory, which a dump holds by reference in any case.
fn reaches(pid: i32, outside: bool) -> Option<Vec<(Object, bool)>> {
    use std::io::ErrorKind;
    // Gone, or exiting (its maps then read ESRCH).
    let gone = |e: &std::io::Error| e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH);
    let queried = if outside { shared_mappings(pid) } else { Err(std::io::ErrorKind::Unsupported.into()) };
    let mut objects: Vec<(Object, bool)> = match queried {
        Ok(objects) => objects.into_iter().map(|o| (o, false)).collect(),
        Err(e) if gone(&e) => return Some(Vec::new()),
        Err(e) if outside && e.kind() == ErrorKind::PermissionDenied => Vec::new(),
        Err(_) => match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            Ok(maps) => maps
                .lines()
                .filter_map(SharedObject::parse_reachable)
                .map(|o| ((o.device, o.inode), o.system_v))
                .collect(),
            Err(e) if gone(&e) => return Some(Vec::new()),
            Err(e) if outside && e.kind() == ErrorKind::PermissionDenied => Vec::new(),
            Err(_) => return None,
        },
    };
    let links = match super::fd_links(pid) {
        Ok(links) => links,
        Err(e) if gone(&e) => return Some(objects),
        Err(_) => return None,
    };
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
    Some(objects)
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
        let mut fields = line.splitn(6, ' ');
        let (range, perms, _offset, device, inode) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let path = fields.next()?.trim_start();
        let shared_anonymous =
            perms.ends_with('s') && (path == "/dev/zero (deleted)" || (huge && path.starts_with("/anon_hugepage")));
        let dumped_whole = path.starts_with("/SYSV") || path.starts_with("/memfd:");
        if !(shared_anonymous || dumped_whole) {
            return None;
        }
        let (start, end) = range.split_once('-')?;
        let (major, minor) = device.split_once(':')?;
        Some(SharedObject {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            device: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
            inode: inode.parse().ok()?,
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
mod tests {
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

    /// Shared memory a process outside the tree maps, or holds a descriptor
    /// of, is not the tree's alone; what only the tree reaches is.
    #[test]
    fn shared_memory_a_process_outside_the_tree_reaches_is_not_the_tree_s_alone() {
        let len = 1 << 20;
        // A new mapping (unmapped below) and its object's inode.
        let shared = || {
            let map = shared_anonymous(len);
            (map, inode_mapped_at(map, len))
        };
        // Mapped here and by the process outside; a memfd held here and
        // there as a descriptor only; one mapped here after it started.
        let (inherited, inherited_inode) = shared();
        // SAFETY: a name of our own; the descriptor is closed below.
        let memfd = unsafe { libc::memfd_create(c"criuz-test".as_ptr(), 0) };
        assert!(memfd >= 0);
        let memfd_inode = std::fs::metadata(format!("/proc/self/fd/{memfd}")).unwrap().ino();
        let (unmapped, unmapped_inode) = shared();
        let mut ends = [0; 2];
        // SAFETY: a pipe of our own, closed below.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        // SAFETY: the children only make system calls (fork, munmap, write,
        // pause, _exit): nothing of the parent's runs there.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: as above. The grandchild leaves our tree when its
            // parent exits; it keeps the mapping and the memfd, drops the
            // other mapping, and says its pid.
            unsafe {
                if libc::fork() == 0 {
                    libc::munmap(unmapped, len);
                    let pid = libc::getpid();
                    libc::write(ends[1], (&pid as *const i32).cast(), 4);
                    loop {
                        libc::pause();
                    }
                }
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child; reading our pipe.
        let (waited, outsider) = unsafe {
            let waited = libc::waitpid(child, &mut status, 0);
            let mut pid = 0i32;
            let read = libc::read(ends[0], (&mut pid as *mut i32).cast(), 4);
            (waited, if read == 4 { pid } else { 0 })
        };
        let (mine, mine_inode) = shared();
        let me = std::process::id() as i32;
        let only_mine = reached_only_by(&[me]);
        let named = reached_from_outside(&[me], &HashSet::from([memfd_inode]));
        let unnamed = reached_from_outside(&[me], &HashSet::from([unmapped_inode]));
        // SAFETY: ending the process this test started; closing and
        // unmapping what it made.
        unsafe {
            libc::kill(outsider, libc::SIGKILL);
            libc::close(memfd);
            libc::close(ends[0]);
            libc::close(ends[1]);
            for map in [inherited, unmapped, mine] {
                libc::munmap(map, len);
            }
        }
        assert!(waited == child && outsider > 0, "the process outside the tree did not start");
        assert!(!only_mine.contains(&inherited_inode), "a mapping the process outside holds: {only_mine:?}");
        assert!(!only_mine.contains(&memfd_inode), "a memfd the process outside holds: {only_mine:?}");
        assert!(only_mine.contains(&unmapped_inode), "unmapped outside: {only_mine:?}");
        assert!(only_mine.contains(&mine_inode), "mapped after the fork: {only_mine:?}");
        assert_eq!(named, Some(format!("process {outsider} ({})", current_comm())));
        assert_eq!(unnamed, None);
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
        let only_mine = reached_only_by(&[me]);
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
    fn shared_anonymous(len: usize) -> *mut libc::c_void {
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
    fn inode_mapped_at(map: *mut libc::c_void, len: usize) -> u64 {
        let link = format!("/proc/self/map_files/{:x}-{:x}", map as usize, map as usize + len);
        std::fs::metadata(link).unwrap().ino()
    }

    /// This thread's name, which a process it forks starts with.
    fn current_comm() -> String {
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
