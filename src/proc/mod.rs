//! OS machinery under the sessions: what criuz asks of Linux beyond plain
//! files and pipes. `tree` walks a process tree through /proc and signals
//! it on the allocation-free reads of `signal_safe`, so that `guard`, a
//! process forked from criuz that ends (or resumes) a tree should criuz die
//! first, can use it too; `holder` says what holds a pid and waits for
//! pids to be free; `restored` keeps a restore's processes criuz's own (the
//! subreaper, what CRIU leaves, the root of a tree let go of); `cgroup`
//! finds the cgroup v2 group of a container that may be killed whole;
//! `socket` holds the page server's kernel socket tricks (a forced receive
//! buffer, the owner of a loopback peer from /proc/net/tcp, and the dump's
//! TCP_CORK taken off through pidfd_getfd); `memory` is what memory criuz
//! may count on (the machine's, or its memory cgroup's); `pipes` finds the
//! pipes a tree shares with processes outside it; `shmem` what the shared
//! memory objects a tree maps hold, and which of them only the tree
//! reaches; `budget` is the machine-wide memory share every criuz's absorb
//! memory comes from; `claim` lets one dump at a time checkpoint a tree;
//! `arriving` tells a tree whose lazy restore is still copying its memory
//! in; `outside` walks every process outside a tree once for what
//! `arriving`, `pipes` and `shmem` ask of them; `interrupt` turns a Ctrl-C
//! into a clean end (what criuz had not finished is removed);
//! `foreground` waits for a restored tree's root as its parent and passes
//! its end on; `capabilities` reads which of CRIU's criuz holds;
//! `huge_pages` finds where a restored process's memory may be transparent
//! huge pages and writes it there; `stuck` tells a restoring CRIU that waits
//! for good on a task it traces.
//!
//! Trade-offs: Linux only, by design. The socket tricks are best effort (a
//! failure costs time, never correctness) and want root; the /proc walks
//! race with the processes they look at, so they are used where a stale
//! answer is harmless or is checked again. Unsafe code (system calls) lives
//! here rather than in the sessions, every block with the reason it is
//! sound. Nothing here knows about archives or sessions: `proc` imports
//! only `error`, `criu::scm`, `io::leftover` and `io::unfinished`.

pub mod arriving;
pub mod budget;
pub mod capabilities;
pub mod cgroup;
pub mod claim;
pub mod foreground;
pub mod guard;
pub mod holder;
pub mod huge_pages;
pub mod interrupt;
pub mod memory;
pub mod outside;
pub mod pipes;
pub mod restored;
pub mod shmem;
pub mod signal_safe;
pub mod socket;
pub mod stuck;
pub mod tree;

/// The processes /proc lists now (thread-group leaders).
pub(crate) fn all_pids() -> std::io::Result<Vec<i32>> {
    Ok(std::fs::read_dir("/proc")?.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
}

/// `visit` run on every process /proc lists but those `skip` names, split
/// over the cores (at most 16); the answers in no particular order. A walk
/// of every process's descriptors reads a link per descriptor: with 5,000
/// idle processes, 0.12 s on one core of this VM, 0.07-0.09 s on two (a
/// one-off harness, not kept).
pub(crate) fn scan_processes<T: Send>(
    skip: impl Fn(i32) -> bool,
    visit: impl Fn(i32) -> T + Sync,
) -> std::io::Result<Vec<T>> {
    let mut pids = all_pids()?;
    pids.retain(|&pid| !skip(pid));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
    let chunk = pids.len().div_ceil(threads).max(1);
    let walk = |pids: &[i32]| pids.iter().map(|&p| visit(p)).collect::<Vec<T>>();
    Ok(std::thread::scope(|s| {
        // A chunk whose thread the system will not start (a pids limit) is
        // walked here, after the others.
        let mut here = Vec::new();
        let mut walks = Vec::new();
        for pids in pids.chunks(chunk) {
            match std::thread::Builder::new().name("criuz-scan".into()).spawn_scoped(s, move || walk(pids)) {
                Ok(w) => walks.push(w),
                Err(_) => here.push(pids),
            }
        }
        let mut seen: Vec<T> = here.into_iter().flat_map(walk).collect();
        for w in walks {
            seen.extend(w.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        }
        seen
    }))
}

/// One mapping's line of `/proc/PID/maps`, which is also its first line in
/// `/proc/PID/smaps`: `start-end perms offset device inode [path]`, the
/// fields one space apart, the path padded out to a column.
pub(crate) struct MapsLine<'a> {
    pub start: u64,
    pub end: u64,
    pub perms: &'a str,
    pub device: &'a str,
    pub inode: &'a str,
    /// Empty for anonymous memory with no name.
    pub path: &'a str,
}

impl<'a> MapsLine<'a> {
    /// `None` for a line that is not one (a field line of smaps).
    pub(crate) fn parse(line: &'a str) -> Option<MapsLine<'a>> {
        let mut fields = line.splitn(6, ' ');
        let (range, perms, _offset, device, inode) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let (start, end) = range.split_once('-')?;
        Some(MapsLine {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            perms,
            device,
            inode,
            path: fields.next().unwrap_or("").trim_start(),
        })
    }
}

/// What each descriptor of a process is, as its /proc link reads.
pub(crate) type Links = Vec<(i32, std::path::PathBuf)>;

/// What each descriptor of `pid` is, as its /proc link reads: (fd, target).
/// A descriptor closed meanwhile is left out.
pub(crate) fn fd_links(pid: i32) -> std::io::Result<Links> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, std::fs::read_link(e.path()).ok()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_scan_visits_every_process_but_those_skipped() {
        let me = std::process::id() as i32;
        let seen = super::scan_processes(|_| false, |pid| pid).unwrap();
        assert!(seen.contains(&me) && seen.contains(&1), "{seen:?}");
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), seen.len(), "a process visited twice");
        let seen = super::scan_processes(|pid| pid == me, |pid| pid).unwrap();
        assert!(!seen.contains(&me) && seen.contains(&1), "{seen:?}");
    }
}
