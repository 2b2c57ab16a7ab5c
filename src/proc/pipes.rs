//! Pipes a tree shares with processes outside it. CRIU restores a pipe from
//! the ends the tree held: one whose other end only an outside process
//! held (`app | logger`, `producer | app`) comes back with nobody there, so
//! the restored writer dies of SIGPIPE at its next write, and a reader sees
//! end of input. CRIU dumps such a tree without a word. criuz says so
//! before it dumps, so that the user can dump the whole pipeline or hand
//! the restore a pipe of their own (`--inherit-fd`).
//!
//! Trade-off: finding the other end reads the descriptor links of every
//! process on the machine (about 7 µs a descriptor, split over the cores),
//! in the one walk a dump makes of them before CRIU freezes anything
//! (`outside`); an end's mode is read only where the tree holds a pipe by
//! one end. A process criuz cannot read is passed over: this is a
//! warning, never a refusal.

use super::Links;
use crate::proc::holder::holder_of;
use std::collections::HashMap;
use std::fmt;

/// A pipe the tree holds by one end whose other end a process outside it
/// holds.
#[derive(Debug, PartialEq, Eq)]
pub struct OutsideEnd {
    /// The process of the tree, its descriptor and its name.
    pub pid: i32,
    pub fd: i32,
    pub comm: String,
    /// The tree writes to the pipe (else it reads from it).
    pub writes: bool,
    /// The pipe's inode, CRIU's key for it (`pipe:[INODE]`).
    pub inode: u64,
    /// The outside process holding the other end, and its name.
    pub other: i32,
    pub other_comm: String,
}

impl fmt::Display for OutsideEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pid, comm, fd, other, other_comm) = (self.pid, &self.comm, self.fd, self.other, &self.other_comm);
        let key = format!("-- --inherit-fd 'fd[{fd}]:pipe:[{}]'", self.inode);
        if self.writes {
            write!(
                f,
                "process {pid} ({comm}) writes to a pipe (its fd {fd}) that process {other} ({other_comm}) reads, \
                 outside the tree: restored, it finds nobody reading there, and its next write there kills it \
                 (SIGPIPE). Dump the whole pipeline, or restore with {key} and criuz's fd {fd} the pipe to write to"
            )
        } else {
            write!(
                f,
                "process {pid} ({comm}) reads a pipe (its fd {fd}) that process {other} ({other_comm}) writes, \
                 outside the tree: restored, it reads end of input there. Dump the whole pipeline, or restore with \
                 {key} and criuz's fd {fd} the pipe to read"
            )
        }
    }
}

/// One end of a pipe as a process holds it.
#[derive(Clone, Copy)]
pub(crate) struct Held {
    pid: i32,
    fd: i32,
    reads: bool,
    writes: bool,
}

/// The pipes a tree holds by one end: what the walk of the processes
/// outside it (`outside`) looks for.
pub(crate) struct OneSided {
    /// Per pipe, whether the tree reads it, writes it, and one end it holds.
    inside: HashMap<u64, (bool, bool, Held)>,
}

impl OneSided {
    /// The pipes of the tree `pids` held by one end; `None` where there
    /// are none.
    pub(crate) fn of(pids: &[i32]) -> Option<OneSided> {
        let mut inside: HashMap<u64, (bool, bool, Held)> = HashMap::new();
        for &pid in pids {
            for (inode, held) in pipe_ends(pid) {
                let e = inside.entry(inode).or_insert((false, false, held));
                e.0 |= held.reads;
                e.1 |= held.writes;
            }
        }
        inside.retain(|_, (reads, writes, _)| reads != writes);
        (!inside.is_empty()).then_some(OneSided { inside })
    }

    /// The other ends of those pipes that `pid`, outside the tree, holds
    /// (its descriptors read `links`). An end's access mode is read only
    /// for the tree's pipes (4,000 processes of 5 descriptors each added
    /// 140 ms to a dump on one core reading every pipe's mode, 75 ms so on
    /// 2 cores).
    pub(crate) fn other_ends(&self, pid: i32, links: &Links) -> Vec<(u64, Held)> {
        let mut ends = Vec::new();
        for (fd, inode) in pipes_among(links) {
            let Some((_, tree_writes, _)) = self.inside.get(&inode) else { continue };
            let Some(held) = held_end(pid, fd) else { continue };
            let other_side = if *tree_writes { held.reads } else { held.writes };
            if other_side {
                ends.push((inode, held));
            }
        }
        ends
    }

    /// One report per pipe of the `found` other ends.
    pub(crate) fn report(&self, found: impl IntoIterator<Item = (u64, Held)>) -> Vec<OutsideEnd> {
        let mut reports: Vec<OutsideEnd> = Vec::new();
        for (inode, held) in found {
            let (_, tree_writes, ours) = self.inside[&inode];
            if !reports.iter().any(|f| f.inode == inode) {
                reports.push(OutsideEnd {
                    pid: ours.pid,
                    fd: ours.fd,
                    comm: comm_of(ours.pid),
                    writes: tree_writes,
                    inode,
                    other: held.pid,
                    other_comm: comm_of(held.pid),
                });
            }
        }
        reports.sort_by_key(|f| (f.pid, f.fd));
        reports
    }
}

/// The pipe ends process `pid` holds: (inode, how). A process gone or not
/// readable holds none here.
fn pipe_ends(pid: i32) -> Vec<(u64, Held)> {
    pipe_links(pid).into_iter().filter_map(|(fd, inode)| Some((inode, held_end(pid, fd)?))).collect()
}

/// The descriptors of `pid` that are pipes: (fd, the pipe's inode).
fn pipe_links(pid: i32) -> Vec<(i32, u64)> {
    pipes_among(&super::fd_links(pid).unwrap_or_default())
}

/// The descriptors among `links` that are pipes: (fd, the pipe's inode).
fn pipes_among(links: &Links) -> Vec<(i32, u64)> {
    links.iter().filter_map(|(fd, link)| Some((*fd, pipe_inode(link.to_str()?)?))).collect()
}

/// How `pid` holds the pipe on its descriptor `fd` (`None` once it is gone).
fn held_end(pid: i32, fd: i32) -> Option<Held> {
    let (reads, writes) = match access_mode(pid, fd)? {
        libc::O_RDONLY => (true, false),
        libc::O_WRONLY => (false, true),
        _ => (true, true),
    };
    Some(Held { pid, fd, reads, writes })
}

/// The inode of a `pipe:[N]` descriptor link.
fn pipe_inode(link: &str) -> Option<u64> {
    link.strip_prefix("pipe:[")?.strip_suffix(']')?.parse().ok()
}

/// The access mode (O_ACCMODE bits) of descriptor `fd` of `pid`, from its
/// fdinfo's octal `flags`.
fn access_mode(pid: i32, fd: i32) -> Option<i32> {
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?.trim();
    Some(i32::from_str_radix(flags, 8).ok()? & libc::O_ACCMODE)
}

fn comm_of(pid: i32) -> String {
    holder_of(pid).map_or_else(|| "?".to_string(), |h| h.comm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipe_link_names_its_inode() {
        assert_eq!(pipe_inode("pipe:[21709259]"), Some(21709259));
        assert_eq!(pipe_inode("socket:[5]"), None);
        assert_eq!(pipe_inode("/tmp/pipe:[5]"), None);
    }
}
