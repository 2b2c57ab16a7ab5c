//! A process tree through /proc: its pids and every descendant they have
//! now, signalled, ended or resumed after a dump, waited for while traced,
//! and what memory it holds. The walk that signals a tree allocates nothing
//! (`proc::signal_safe`), so the forked guard (`proc::guard`) uses it too.

use super::holder::{state_of, wait_exit_begun};
use super::signal_safe::{
    collect_tree, leader_of, poll_soon, poll_until, running, status_number, stopping, traced, MAX_TREE,
};

/// Whether `tree` with its descendants has more processes than a dump can
/// end or resume ([`MAX_TREE`]).
pub(crate) fn too_large(tree: &[i32]) -> bool {
    tree_pids(tree).len() >= MAX_TREE
}

/// The process (thread group) that thread `pid` belongs to: `pid` itself
/// for a process; None if it is gone.
pub(crate) fn thread_group(pid: i32) -> Option<i32> {
    // SAFETY: leader_of only opens, reads and closes on stack memory.
    (pid > 0).then(|| unsafe { leader_of(pid) }).flatten()
}

/// Resident bytes of the tree rooted at `pid` (each process's
/// [`resident_kib`] summed; pages shared between its processes counted
/// each time), and what the shared memory objects it maps hold, which
/// CRIU dumps whole (`shmem`): about the most a dump of it can hold.
pub(crate) fn resident_bytes(pid: i32) -> usize {
    let pids = tree_pids(&[pid]);
    let resident: usize = pids
        .iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .map(|status| resident_kib(&status).saturating_mul(1024))
        .sum();
    let shared = usize::try_from(super::shmem::dumped_shared_bytes(&pids)).unwrap_or(usize::MAX);
    resident.saturating_add(shared)
}

/// The memory a process's `/proc/PID/status` says it holds, in KiB: its
/// resident set (`VmRSS`), and what the resident set leaves out but CRIU
/// dumps as it does any other page: its hugetlb pages (`HugetlbPages`) and
/// its pages in swap (`VmSwap`). A dump sized by `VmRSS` alone took a 1 GiB
/// hugetlb heap for 1 MiB, and compressed most of it in haste, then again.
fn resident_kib(status: &str) -> usize {
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse::<usize>().ok())
    };
    ["VmRSS:", "HugetlbPages:", "VmSwap:"].into_iter().map(|f| field(f).unwrap_or(0)).fold(0, usize::saturating_add)
}

/// What of the anonymous memory of `pids` is shared with another process,
/// and all of it, in bytes: `Shared_Dirty` and `Anonymous` of each one's
/// `/proc/PID/smaps_rollup`. Pages a forked child still shares with its
/// parent count there (written before the fork, hence dirty); file pages
/// rarely do (they are dirty only in shared writable mappings). A process
/// that cannot be read counts nothing.
pub(crate) fn shared_anon_bytes(pids: &[i32]) -> (u64, u64) {
    let field = |text: &str, name: &str| -> u64 {
        let kib = text.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse::<u64>().ok());
        kib.unwrap_or(0).saturating_mul(1024)
    };
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).ok())
        .map(|t| (field(&t, "Shared_Dirty:"), field(&t, "Anonymous:")))
        .fold((0, 0), |(s, a), (s2, a2)| (s.saturating_add(s2), a.saturating_add(a2)))
}

/// Waits, checking every millisecond at most (a restored tree is let run
/// the moment CRIU has let go of it) and for at most `limit_ms`, until none of
/// `pids` is traced (its /proc status says `TracerPid:\t0`, or it is gone):
/// until CRIU has let go of a tree it was dumping. Async-signal-safe (open,
/// read, close, nanosleep on stack memory), for the forked guard: a SIGCONT
/// sent while CRIU still holds the tree seized reaches CRIU as a stop it did
/// not expect, and CRIU 4.2 then hangs with the tree traced (seen once in
/// tests/criu_stream.rs's kill-mid-dump test).
pub(crate) fn wait_untraced(pids: &[i32], limit_ms: u32) {
    // SAFETY: `traced` only opens, reads and closes on stack memory.
    poll_soon(limit_ms, 1, || !pids.iter().any(|&p| unsafe { traced(p) }));
}

/// Waits, at most `limit_ms`, until `pid` is gone or a zombie (another's
/// to reap). Async-signal-safe: the guard uses it.
pub(crate) fn wait_ended(pid: i32, limit_ms: u32) {
    // SAFETY: `running` only opens, reads and closes on stack memory.
    poll_until(limit_ms, 10, || !unsafe { running(pid) });
}

/// Whether CRIU left the processes of `tree` (and descendants) not in
/// `except` stopped, as a dump that completed with `--leave-stopped` does:
/// there is at least one, and each is stopped or has SIGSTOP pending (CRIU
/// sends it just before it lets go). One CRIU rolled back runs again.
/// Async-signal-safe: the guard uses it.
pub(crate) fn left_stopped(tree: &[i32], except: &[i32]) -> bool {
    let mut pids = [0i32; MAX_TREE];
    let n = collect_tree(tree, &mut pids);
    let mut any = false;
    for &p in pids[..n].iter().filter(|p| !except.contains(p)) {
        // SAFETY: `stopping` only opens, reads and closes on stack memory.
        if !unsafe { stopping(p) } {
            return false;
        }
        any = true;
    }
    any
}

/// Every thread of `tree` and its descendants with the CPU time it has run
/// (nanoseconds, from /proc/PID/task/TID/schedstat), or `None` where one
/// of them is not stopped (or ended): a tree that reads the same twice has
/// not run in between. Sorted by thread id.
pub(crate) fn stopped_runtimes(tree: &[i32]) -> Option<Vec<(i32, u64)>> {
    let mut threads = Vec::new();
    for pid in tree_pids(tree) {
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
            let name = task.ok()?.file_name();
            let tid: i32 = name.to_str()?.parse().ok()?;
            let dir = format!("/proc/{pid}/task/{tid}");
            let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
            if !matches!(state_of(&stat)?, 'T' | 't' | 'Z' | 'X') {
                return None;
            }
            threads.push((tid, run_time(&dir)?));
        }
    }
    threads.sort_unstable();
    Some(threads)
}

/// The CPU time the thread of `task_dir` (`/proc/PID/task/TID`) has run,
/// in nanoseconds (the first field of its `schedstat`).
pub(super) fn run_time(task_dir: &str) -> Option<u64> {
    std::fs::read_to_string(format!("{task_dir}/schedstat")).ok()?.split_whitespace().next()?.parse().ok()
}

/// [`stopped_runtimes`] once the tree has settled stopped: two readings
/// 2 ms apart that agree (a thread that has just stopped may still be
/// leaving the CPU), within `limit_ms`.
pub(crate) fn settled_runtimes(tree: &[i32], limit_ms: u32) -> Option<Vec<(i32, u64)>> {
    let mut last = None;
    let mut settled = None;
    poll_until(limit_ms, 2, || {
        let now = stopped_runtimes(tree);
        if now.is_some() && now == last {
            settled = now;
            return true;
        }
        last = now;
        false
    });
    settled
}

/// SIGKILLs every pid of a restored tree and every descendant they have
/// now: a process the tree forked while its pages still arrived misses
/// pages too. Descendants are found first (killing a parent would re-parent
/// its children out of reach), through `/proc/PID/task/TID/children`.
/// Async-signal-safe (open, read, getdents64, close, kill on stack memory),
/// so the guard uses it too.
pub(crate) fn kill_tree(tree: &[i32]) {
    signal_tree(tree, libc::SIGKILL);
}

/// Sends `sig` to every pid of `tree` and every descendant they have now,
/// the deepest first (see [`kill_tree`]).
pub(crate) fn signal_tree(tree: &[i32], sig: i32) {
    signal_tree_except(tree, sig, &[]);
}

/// [`signal_tree`], sparing the pids of `except` (processes that were
/// stopped before a dump, to stay so). Async-signal-safe.
pub(crate) fn signal_tree_except(tree: &[i32], sig: i32, except: &[i32]) {
    let mut pids = [0i32; MAX_TREE];
    let n = collect_tree(tree, &mut pids);
    for &p in pids[..n].iter().rev().filter(|p| !except.contains(p)) {
        // SAFETY: a tree criuz restored or dumped, and what it forked.
        unsafe { libc::kill(p, sig) };
    }
}

/// Ends a dumped tree CRIU left stopped (`root` and what it forked), once
/// its archive is committed. Killed, not waited for: the kernel frees the
/// tree's memory behind the command (tens of ms a GiB here; `criu dump -D`
/// waits for it), and a restore started meanwhile waits for the pids it
/// needs; only the start of each exit is waited for, so that no process of
/// the tree still looks alive once the command returns.
pub(crate) fn end_dumped(root: i32) {
    let pids = tree_pids(&[root]);
    kill_tree(&pids);
    wait_exit_begun(&pids, std::time::Duration::from_secs(1));
}

/// Resumes a dumped tree after a failure, once no tracer holds it, but for
/// the processes of `stopped_before` (stopped before the dump, to stay so).
pub(crate) fn resume_dumped(root: i32, stopped_before: &[i32]) {
    wait_untraced(&tree_pids(&[root]), 60_000);
    signal_tree_except(&[root], libc::SIGCONT, stopped_before);
}

/// A thread of `tree` or of a descendant that another process traces (a
/// debugger, strace), and its tracer: CRIU must trace every thread it
/// dumps itself, and on one already traced it fails with "Unable to
/// interrupt task", which does not say why.
pub(crate) fn traced_thread(tree: &[i32]) -> Option<(i32, i32)> {
    for pid in tree_pids(tree) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for tid in tasks.flatten().filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok()) {
            // SAFETY: status_number only opens, reads and closes on stack memory.
            if let Some(tracer) = unsafe { status_number(tid, b"\nTracerPid:\t") }.filter(|&t| t != 0) {
                return Some((tid, tracer));
            }
        }
    }
    None
}

/// Whether `pid` is the init of a pid namespace: criuz's own (pid 1), or
/// one below it (its `NSpid` in /proc/PID/status ends in 1 after its pid
/// here). CRIU dumps such a tree with its namespace and restores it in a
/// new one, its pids numbered inside it: pids that mean nothing here.
pub(crate) fn pid_namespace_init(pid: i32) -> bool {
    if pid == 1 {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    status.lines().find_map(|l| l.strip_prefix("NSpid:")).is_some_and(|ids| {
        let ids: Vec<&str> = ids.split_whitespace().collect();
        ids.len() > 1 && ids.last() == Some(&"1")
    })
}

/// The processes of `tree` (and their descendants) that are stopped now
/// (a job a shell stopped, a process paused by SIGSTOP): a dump that fails
/// resumes the tree, but not these.
pub(crate) fn stopped_pids(tree: &[i32]) -> Vec<i32> {
    let stopped =
        |p: &i32| std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|stat| state_of(&stat) == Some('T'));
    tree_pids(tree).into_iter().filter(stopped).collect()
}

/// The pids of `tree` and every descendant they have now, parents before
/// children (not async-signal-safe: it allocates).
pub(crate) fn tree_pids(tree: &[i32]) -> Vec<i32> {
    let mut pids = Box::new([0i32; MAX_TREE]);
    let n = collect_tree(tree, &mut pids);
    pids[..n].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::holder::parent_in;
    use std::time::Instant;

    #[test]
    fn hugetlb_and_swapped_pages_count_as_resident() {
        let status = "Name:\thuge\nVmRSS:\t    1180 kB\nRssAnon:\t     112 kB\nVmSwap:\t    4096 kB\n\
                      HugetlbPages:\t 1048576 kB\nThreads:\t1\n";
        use super::resident_kib;
        assert_eq!(resident_kib(status), 1180 + 4096 + 1_048_576);
        assert_eq!(resident_kib("Name:\tkthread\nThreads:\t1\n"), 0, "a kernel thread's status has neither");
        assert!(resident_kib(&std::fs::read_to_string("/proc/self/status").unwrap()) > 0);
    }

    /// The pids whose parent is `pid`, from every process's stat.
    fn children_by_stat(pid: i32) -> Vec<i32> {
        let mut kids: Vec<i32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| parent_in(&s) == Some(pid)))
            .collect();
        kids.sort_unstable();
        kids
    }

    /// A parent with more children than one read of its `children` file
    /// holds (4 KiB: some 680 five-digit pids): every child is in the tree,
    /// and no pid cut in two at the read's end (an unrelated process) is.
    /// A tree past [`MAX_TREE`] is said to be too large for a dump.
    #[test]
    fn a_tree_with_a_thousand_children_is_read_whole() {
        let (pid, kids, mut found) = with_children(1000, |pid| tree_pids(&[pid]));
        assert_eq!(found.remove(0), pid);
        found.sort_unstable();
        assert_eq!(found, kids);
        let (_, kids, (small, large)) =
            with_children(MAX_TREE, |pid| (too_large(&[kids_of_first(pid)]), too_large(&[pid])));
        assert_eq!(kids.len(), MAX_TREE);
        assert!(!small && large, "a tree of {} processes is too large, one of 1 is not", MAX_TREE + 1);
    }

    fn kids_of_first(pid: i32) -> i32 {
        children_by_stat(pid)[0]
    }

    /// Runs `look` on a shell with `n` children (sleeps), then ends them by
    /// the pids read from stat, never by what `look` found: a reader that
    /// got a wrong pid must not be trusted to signal it.
    fn with_children<T>(n: usize, look: impl FnOnce(i32) -> T) -> (i32, Vec<i32>, T) {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", &format!("i=0; while [ $i -lt {n} ]; do sleep 60 & i=$((i+1)); done; wait")])
            .spawn()
            .unwrap();
        let pid = sh.id() as i32;
        let t = std::time::Instant::now();
        let kids = loop {
            let kids = children_by_stat(pid);
            if kids.len() == n || t.elapsed() > std::time::Duration::from_secs(60) {
                break kids;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let seen = look(pid);
        for &k in &kids {
            // SAFETY: plain kill of this test's own shell's children.
            unsafe { libc::kill(k, libc::SIGKILL) };
        }
        let _ = sh.kill();
        let _ = sh.wait();
        assert_eq!(kids.len(), n, "the shell started its children");
        (pid, kids, seen)
    }

    #[test]
    fn a_traced_process_is_waited_for_until_its_tracer_lets_go() {
        let spawn = || std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let mut held = spawn();
        let pid = held.id() as i32;
        // SAFETY: seizing our own child (root in CI); it is killed below.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0) } == 0 {
            // SAFETY: reads /proc on stack memory.
            assert!(unsafe { traced(pid) }, "a seized process is traced");
            let t = Instant::now();
            wait_untraced(&[pid], 100);
            assert!(t.elapsed() >= std::time::Duration::from_millis(90), "it waits while the tracer holds on");
        }
        held.kill().unwrap();
        held.wait().unwrap();
        let mut free = spawn();
        let pid = free.id() as i32;
        // SAFETY: as above.
        assert!(!unsafe { traced(pid) }, "a process nobody traces is not traced");
        let t = Instant::now();
        wait_untraced(&[pid, i32::MAX], 10_000);
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "nothing to wait for");
        free.kill().unwrap();
        free.wait().unwrap();
    }
}
