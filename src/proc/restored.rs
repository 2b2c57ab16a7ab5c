//! The processes of a restore as criuz's own: criuz is the subreaper of
//! what CRIU forks, so a failed restore reaps what CRIU left (its stray
//! helpers, an aborted tree) and returns with the tree's pids free; once
//! the tree runs whole criuz lets go of it and remembers its root (and the
//! `--pidfile` it owes) for an interruption to name. Which processes are
//! this restore's is judged by descent from criuz or from that root, never
//! by pid alone: pids are reused.

use super::holder::{descends_from, exists, holder_of, parent_of};
use super::tree::kill_tree;
use std::time::Instant;

/// Makes criuz the child subreaper of what it starts: what CRIU leaves of a
/// tree it began to restore and abandoned becomes criuz's to reap, not
/// init's (which may reap it late, or, in many containers, never), so a
/// failed restore returns with the tree's pids free (`end_aborted_tree`).
/// A restored tree that outlives criuz goes on to init (or the next
/// subreaper up) when criuz exits, as before.
pub(crate) fn become_subreaper() {
    // SAFETY: prctl with constant arguments; it only changes who inherits
    // our orphaned descendants.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// The restored tree runs whole (every page in): its restore can no longer
/// fail, and criuz is no longer the subreaper of what it started. What the
/// tree orphans from now on goes where it would under plain CRIU (to init,
/// or to a subreaper above criuz): without -d criuz waits as long as the
/// tree runs (`proc::foreground`, which reaps only what is its own), and as
/// the tree's subreaper it would collect every process the tree orphans (a
/// shell's background job, a daemon's double fork). (The few a lazy tree
/// orphans while its pages still arrive stay criuz's: `proc::foreground`
/// reaps them as they end.) `root`: the tree's root process, which an
/// interruption's message then names as running on.
pub(crate) fn let_go_of_restored_tree(root: Option<i32>) {
    stop_being_subreaper();
    RESTORED_ROOT.store(root.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// The first half of [`let_go_of_restored_tree`]: what the tree orphans
/// from now on is not criuz's to reap; the tree is not yet named whole.
pub(crate) fn stop_being_subreaper() {
    // SAFETY: prctl with constant arguments, as in `become_subreaper`.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
}

/// The root of a tree this criuz restored whole (0: none).
static RESTORED_ROOT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The `--pidfile` of the restore under way.
static RESTORED_PIDFILE: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

/// Notes the `--pidfile` the restore under way publishes once its tree runs,
/// for [`write_running_pidfile`].
pub(crate) fn note_restored_pidfile(pidfile: Option<&std::path::Path>) {
    *RESTORED_PIDFILE.lock().unwrap_or_else(|e| e.into_inner()) = pidfile.map(std::path::Path::to_path_buf);
}

/// For an interrupted criuz whose restored tree runs on: writes the root's
/// pid to the restore's `--pidfile` (the restore publishes it only after the
/// tree was let run, so an interruption in between left a running tree that
/// whoever waits for that file never learns of); the file, if one was asked
/// for. Written beside it and renamed, as the restore's own publish does.
pub(crate) fn write_running_pidfile(root: i32) -> Option<std::io::Result<std::path::PathBuf>> {
    let to = RESTORED_PIDFILE.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
    let tmp = to.with_file_name(crate::io::name_beside(to.file_name().unwrap_or_default(), "interrupted", 0));
    let written = std::fs::write(&tmp, format!("{root}\n")).and_then(|()| std::fs::rename(&tmp, &to));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Some(written.map(|()| to))
}

/// The root of the tree this criuz restored whole and let go of, if any:
/// what descends from it is this restore's to end, wherever it went.
pub(crate) fn restored_root() -> Option<i32> {
    let root = RESTORED_ROOT.load(std::sync::atomic::Ordering::Relaxed);
    (root > 0).then_some(root)
}

/// The root of the tree this criuz restored whole, while it runs.
pub(crate) fn restored_root_running() -> Option<i32> {
    let root = RESTORED_ROOT.load(std::sync::atomic::Ordering::Relaxed);
    (root > 0 && holder_of(root).is_some_and(|h| !h.zombie)).then_some(root)
}

/// After CRIU exits: kills and reaps what it forked and left behind (all
/// named `criu`, now criuz's children as its subreaper). CRIU killed while
/// a probe it forked was stopped under its ptrace (kerndat's breakpoint
/// check) leaves that probe stopped for good, holding copies of CRIU's
/// descriptors: the image socket criuz serves would never reach its end.
/// A restored tree's processes have their own names by the time CRIU
/// exits, and `keep` spares them anyway.
pub(crate) fn end_criu_strays(keep: &[i32]) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for _ in 0..8 {
        let mut strays: Vec<i32> = children_of(me).into_iter().filter(|p| !keep.contains(p) && is_criu(*p)).collect();
        // Under runc: CRIU died (a zombie runc has not reaped yet, as runc
        // still reads CRIU's socket), and the `criu`s beside it are strays
        // that runc inherited. Only CRIU itself counts, a `criu` whose
        // parent is not one: a helper of a live CRIU is a zombie for a
        // moment whenever it ends, and its siblings are CRIU's helpers at
        // work (its namespace dumper, for one). CRIU runs as criuz's child
        // or runc's, so two levels down are looked at, never the tree a
        // runc in the foreground restored and waits for.
        let near: Vec<i32> = children_of(me).into_iter().flat_map(|c| [vec![c], children_of(c)].concat()).collect();
        for p in near {
            let parent = parent_of(p).unwrap_or(0);
            let criu_itself = holder_of(parent).is_none_or(|h| h.comm != "criu");
            if criu_itself && holder_of(p).is_some_and(|h| h.zombie && h.comm == "criu") {
                strays.extend(
                    children_of(parent)
                        .into_iter()
                        .filter(|&s| s != p && holder_of(s).is_some_and(|h| !h.zombie && h.comm == "criu")),
                );
            }
        }
        if strays.is_empty() {
            return;
        }
        for &p in &strays {
            // SAFETY: a process CRIU forked below criuz (ours to reap when it
            // is our child; the parent it has reaps it otherwise).
            unsafe {
                libc::kill(p, libc::SIGKILL);
                libc::waitpid(p, std::ptr::null_mut(), libc::WNOHANG);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// For a criuz about to die: kills its restoring `criu` children (CRIU,
/// which dies with criuz anyway, and what it forked, which comes to criuz,
/// the subreaper, as CRIU dies) until none is left alive, for at most two
/// seconds. A dumping CRIU is left alone: killed while its parasite runs in
/// the tree it would take the tree with it (RELIABILITY.md, CRIU's trap);
/// left alone, it fails on its closed stream and resumes the tree.
pub(crate) fn end_restoring_criu() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let restoring_children = || -> Vec<i32> {
        children_of(me)
            .into_iter()
            .filter(|&p| holder_of(p).is_some_and(|h| h.comm == "criu" && !h.zombie))
            .filter(|&p| restoring(p))
            .collect()
    };
    let ended = |pids: &[i32]| pids.iter().all(|&p| holder_of(p).is_none_or(|h| h.zombie));
    let t = std::time::Instant::now();
    let limit = std::time::Duration::from_secs(2);
    let mut killed: Vec<i32> = Vec::new();
    // Until no restoring `criu` is left, and every one killed is a zombie:
    // only then has it handed what it forked to criuz (its command line is
    // gone while it exits, before that).
    while t.elapsed() < limit {
        let left = restoring_children();
        if left.is_empty() && ended(&killed) {
            return;
        }
        for p in left {
            // SAFETY: our own child, unreaped (its zombie keeps the pid ours;
            // whoever waits for it, or init after criuz, reaps it).
            unsafe { libc::kill(p, libc::SIGKILL) };
            killed.push(p);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// For a criuz about to die: waits, at most `limit`, until each `runc`
/// or `podman` child of criuz has ended (it stays unreaped: its waiter
/// reaps it). podman's restore runs CRIU through the `PATH` directory in
/// criuz's work directory: removed under it, a restore that had not yet
/// started CRIU fails half-way, keeping the container it made. Whether a
/// `podman` was among them.
pub(crate) fn wait_runtime_children(limit: std::time::Duration) -> bool {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let running =
        |comm: &str| children_of(me).into_iter().any(|p| holder_of(p).is_some_and(|h| h.comm == comm && !h.zombie));
    let podman = running("podman");
    let t = std::time::Instant::now();
    while t.elapsed() < limit && (running("runc") || running("podman")) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    podman
}

/// Whether `pid` runs (or was forked from) `criu restore`: its first
/// argument, as its command line says.
fn restoring(pid: i32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    cmdline.split(|&b| b == 0).nth(1) == Some(b"restore")
}

fn is_criu(pid: i32) -> bool {
    holder_of(pid).is_some_and(|h| h.comm == "criu")
}

/// After a failed restore: kills and reaps every child criuz has left (call
/// it once criuz's own helpers, the guard, are gone). criuz is the
/// subreaper of its restores, so whatever CRIU (or runc's CRIU) forked
/// and abandoned is criuz's child by now: a task left waiting for a CRIU
/// that died, a container process whose cgroup criuz never learned. None
/// of it may outlive the failure, holding pids, a cgroup, or memory.
pub(crate) fn end_orphans() {
    for _ in 0..8 {
        let left = own_children();
        if left.is_empty() {
            return;
        }
        for p in left {
            // SAFETY: our own child, reaped below, so its pid cannot have
            // been reused; its children come to us and the next round.
            unsafe {
                libc::kill(p, libc::SIGKILL);
                libc::waitpid(p, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// This process's children (of every thread).
fn own_children() -> Vec<i32> {
    // SAFETY: getpid has no preconditions.
    children_of(unsafe { libc::getpid() })
}

/// The children of `pid` (of every thread of it).
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
        .collect()
}

/// After an aborted restore: CRIU kills the tree it had begun but does not
/// wait for it, so criuz waits until none of the tree's pids (free before
/// the restore) is taken, reaping those that are its own zombies (it is
/// the subreaper of the restore, `become_subreaper`) and killing what still
/// runs after a second; it gives up after five. "Exit 3, nothing runs, the
/// pids are free" then holds when criuz returns, so a restore retried at
/// once can have them. Returns how those criuz reaped ended (pid, wait
/// status): a tree that was killed, not one that crashed on a page.
/// `root`: the root of the tree this restore's CRIU restored, from its
/// pidfile, where it wrote one: a tree let go of (`let_go_of_restored_tree`)
/// before CRIU exited went to init, no longer below criuz, and is still
/// this restore's to end.
pub(crate) fn end_aborted_tree(pids: &[i32], root: Option<i32>) -> Vec<(i32, i32)> {
    let mut ended = Vec::new();
    let mut taken = |p: &i32| {
        let mut status = 0;
        // SAFETY: a non-blocking wait for one pid; for a process that is not
        // our child it fails with ECHILD and changes nothing.
        if unsafe { libc::waitpid(*p, &mut status, libc::WNOHANG) } == *p {
            ended.push((*p, status));
        }
        exists(*p) && is_ours(*p, root)
    };
    let t = Instant::now();
    while pids.iter().fold(false, |any, p| taken(p) | any) {
        if t.elapsed() > std::time::Duration::from_secs(1) {
            kill_tree(&held_by_ours(pids, root));
        }
        if t.elapsed() > std::time::Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    ended
}

/// How a reaped process ended, in words ("killed by signal 9").
pub(crate) fn describe_end(status: i32) -> String {
    if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    }
}

/// The pids of `pids` that a process this criuz restored holds: one that
/// descends from it (CRIU forks the tree below criuz, the subreaper of
/// what CRIU leaves). A pid held by anything else went to another process
/// meanwhile (the tree of another restore of the same checkpoint, which
/// made this one's CRIU fail "Can't fork", or a pid reused): not criuz's
/// to wait for, nor to kill. A failed restore killed the tree of the
/// restore that had won, which reported success. `root`: the restored
/// tree's root where this restore's CRIU named it (its pidfile): what
/// descends from it is this restore's too, wherever it was reparented.
pub(crate) fn held_by_ours(pids: &[i32], root: Option<i32>) -> Vec<i32> {
    pids.iter().copied().filter(|&p| is_ours(p, root)).collect()
}

/// Whether the process `pid` is one this criuz restored (see
/// [`held_by_ours`]).
fn is_ours(pid: i32, root: Option<i32>) -> bool {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() } as u32;
    pid > 0 && (descends_from(pid as u32, me) || root.is_some_and(|r| r > 1 && descends_from(pid as u32, r as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interruption after the restored tree was let run, before the
    /// restore published its pidfile, writes it: the one this restore was
    /// asked for, whole, with the root's pid; none where none was asked.
    #[test]
    fn an_interrupted_restore_whose_tree_runs_on_writes_its_pidfile() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("restored.pid");
        note_restored_pidfile(Some(&file));
        let written = write_running_pidfile(4242).expect("a pidfile was asked for").unwrap();
        assert_eq!(written, file);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "4242\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "nothing but the pidfile is left");
        note_restored_pidfile(None);
        assert!(write_running_pidfile(4242).is_none());
    }
}
