//! The processes outside a tree, as a dump sees them before CRIU starts:
//! one walk over every process (`scan_processes`, on every core) reads
//! each one's descriptor links once, and each question a dump asks reads
//! those: does it hold a userfaultfd (`arriving`), the other end of a pipe
//! the tree holds by one end (`pipes`), shared memory of the tree
//! (`shmem`, which then also asks for its shared mappings)? A descriptor
//! link costs the kernel a few microseconds, so beside thousands of
//! processes one walk instead of three is the difference.
//!
//! criuz itself is not looked at, nor, once CRIU runs, what criuz started
//! (CRIU maps what it dumps). The walk races with the processes it looks
//! at: a pipe is only warned of, and who reaches shared memory is asked
//! again before a dump commits ([`shared_reached_from_outside`]).

use super::pipes::{OneSided, OutsideEnd};
use super::shmem::Candidates;
use super::tree::tree_pids;
use super::{arriving, fd_links, scan_processes, shmem, Links};
use crate::error::Result;
use std::collections::HashSet;

/// What a walk asks beside whether the tree's memory is still arriving,
/// which it always asks.
#[derive(Clone, Copy, Default)]
pub struct Ask {
    /// Who holds the other end of the tree's pipes.
    pub pipes: bool,
    /// Which of the tree's shared memory only the tree reaches.
    pub shared: bool,
}

/// What one walk found.
#[derive(Default)]
pub struct Surroundings {
    /// A process of the tree whose memory is still arriving (its lazy
    /// restore not done): see `arriving`.
    pub arriving: Option<i32>,
    /// The tree's pipes whose other end only processes outside it hold.
    pub outside_pipes: Vec<OutsideEnd>,
    /// The shared memory objects (by inode) only the tree reaches, which a
    /// dump may hold by reference while the tree is stopped.
    pub held_shared: HashSet<u64>,
}

/// What a process outside the tree showed.
struct Seen {
    userfaultfd: Option<bool>,
    pipe_ends: Vec<(u64, super::pipes::Held)>,
    /// `None`: not asked, or it could not be read.
    shared: Option<Vec<shmem::Object>>,
}

/// Walks every process outside the tree `pids` once for what `ask` says.
pub fn survey(pids: &[i32], ask: Ask) -> Surroundings {
    let pipes = if ask.pipes { OneSided::of(pids) } else { None };
    let shared = if ask.shared { Candidates::of(pids) } else { None };
    let Some(seen) = walk(pids, &[std::process::id() as i32], |pid, links| Seen {
        userfaultfd: arriving::holds_userfaultfd(&links),
        pipe_ends: match (&pipes, &links) {
            (Some(p), Ok(links)) => p.other_ends(pid, links),
            _ => Vec::new(),
        },
        shared: shared.as_ref().and_then(|c| c.reached_by(pid, &links)),
    }) else {
        // /proc could not be listed: anything may hold anything.
        return Surroundings { arriving: arriving::arriving_in(pids, None), ..Surroundings::default() };
    };
    let userfaultfd_outside = seen.iter().try_fold(false, |any, s| Some(any || s.userfaultfd?));
    // Read before `seen` is taken apart below.
    let shared_unreadable = seen.iter().any(|s| s.shared.is_none());
    let mut ends = Vec::new();
    let mut reached = Vec::new();
    for s in seen {
        ends.extend(s.pipe_ends);
        reached.extend(s.shared.unwrap_or_default());
    }
    Surroundings {
        arriving: arriving::arriving_in(pids, userfaultfd_outside),
        outside_pipes: pipes.map(|p| p.report(ends)).unwrap_or_default(),
        // Nothing is held where a process could not be read: it might
        // reach any of them.
        held_shared: match shared {
            Some(c) if !shared_unreadable => c.unreached(reached),
            _ => HashSet::new(),
        },
    }
}

/// Refuses the tree of `root` while a process of it has memory still
/// arriving (`arriving`): a walk that asks only that.
pub fn refuse_while_arriving(root: i32) -> Result<()> {
    arriving::refuse(survey(&tree_pids(&[root]), Ask::default()).arriving)
}

/// A process outside the tree `pids` that maps or holds one of the shared
/// memory objects `inodes` names (whatever its device), named for the
/// user; also where a process cannot be read, since it might.
pub fn shared_reached_from_outside(pids: &[i32], inodes: &HashSet<u64>) -> Option<String> {
    const UNREADABLE: &str = "a process whose maps or descriptors criuz cannot read";
    if inodes.is_empty() {
        return None;
    }
    // CRIU and its helpers may map the objects still (a CRIU waiting at
    // its post-dump hook): criuz's whole tree is passed over.
    let seen = walk(pids, &tree_pids(&[std::process::id() as i32]), |pid, links| {
        let reached = shmem::outsider_reaches(pid, &links)?;
        Some(reached.iter().any(|object| inodes.contains(&object.1)).then_some(pid))
    });
    let Some(seen) = seen.and_then(|seen| seen.into_iter().collect::<Option<Vec<_>>>()) else {
        return Some(UNREADABLE.into());
    };
    seen.into_iter().flatten().next().map(|pid| {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        format!("process {pid} ({})", comm.trim())
    })
}

/// `visit` run on every process but those of the tree `pids` and the
/// processes `ours` (criuz's), with its descriptor links; `None` where
/// /proc cannot be listed.
fn walk<T: Send>(
    pids: &[i32],
    ours: &[i32],
    visit: impl Fn(i32, std::io::Result<Links>) -> T + Sync,
) -> Option<Vec<T>> {
    let skip: HashSet<i32> = pids.iter().chain(ours).copied().collect();
    scan_processes(|pid| skip.contains(&pid), |pid| visit(pid, fd_links(pid))).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::shmem::tests::{current_comm, inode_mapped_at, shared_anonymous};
    use std::os::unix::fs::MetadataExt;
    use std::process::{Command, Stdio};

    /// A child writing to a pipe another process reads is reported with
    /// its end, and one holding both ends of its own pipe is not. (What the
    /// children inherit besides, from whoever runs the tests, may be
    /// reported too.)
    #[test]
    fn a_pipe_read_outside_the_tree_is_found() {
        let sleeper = || {
            let mut c = Command::new("sleep");
            c.arg("30").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
            c
        };
        let (read, write) = crate::io::pipe().unwrap();
        let inode = |fd: &std::os::fd::OwnedFd| {
            std::fs::metadata(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd))).unwrap().ino()
        };
        let ino = inode(&read);
        let mut child = sleeper().stdout(Stdio::from(write)).spawn().unwrap();
        let mut reader = sleeper().stdin(Stdio::from(read)).spawn().unwrap();
        let pid = child.id() as i32;
        let found = survey(&tree_pids(&[pid]), Ask { pipes: true, shared: false }).outside_pipes;
        let _ = (child.kill(), reader.kill(), child.wait(), reader.wait());
        let f = found.iter().find(|f| f.inode == ino).unwrap_or_else(|| panic!("{found:?}"));
        assert!(f.writes && f.pid == pid && f.fd == 1 && f.other == reader.id() as i32, "{f:?}");
        assert!(f.to_string().contains("kills it (SIGPIPE)") && f.to_string().contains("fd[1]:pipe:["), "{f}");
        // Both ends in the tree: nothing to say of that pipe.
        let (r, w) = crate::io::pipe().unwrap();
        let ino = inode(&r);
        let mut both = sleeper().stdin(Stdio::from(r)).stdout(Stdio::from(w)).spawn().unwrap();
        let found = survey(&tree_pids(&[both.id() as i32]), Ask { pipes: true, shared: false }).outside_pipes;
        let _ = (both.kill(), both.wait());
        assert!(!found.iter().any(|f| f.inode == ino), "{found:?}");
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
        let only_mine = survey(&[me], Ask { pipes: false, shared: true }).held_shared;
        let named = shared_reached_from_outside(&[me], &HashSet::from([memfd_inode]));
        let unnamed = shared_reached_from_outside(&[me], &HashSet::from([unmapped_inode]));
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
}
