//! A process tree through /proc: its pids and every descendant they have
//! now, found and signalled without allocation (open, read, getdents64,
//! close and kill on stack memory), so that the forked guard
//! (`proc::guard`) can use the same walk; and the pid checks around a
//! restore (what holds a pid, waiting for an aborted tree to be gone).

use std::path::Path;
use std::time::Instant;

/// Most processes `kill_tree` finds and kills (pids on the stack: the guard
/// cannot allocate). A dump of a larger tree is refused ([`too_large`]):
/// past it, a dump would end or resume only part of the tree.
pub(crate) const MAX_TREE: usize = 4096;

/// Whether `tree` with its descendants has more processes than a dump can
/// end or resume ([`MAX_TREE`]).
pub(crate) fn too_large(tree: &[i32]) -> bool {
    tree_pids(tree).len() >= MAX_TREE
}

/// Whether process `pid` exists (a positive pid with a /proc entry).
pub(crate) fn exists(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The process (thread group) that thread `pid` belongs to: `pid` itself
/// for a process; None if it is gone.
pub(crate) fn thread_group(pid: i32) -> Option<i32> {
    // SAFETY: leader_of only opens, reads and closes on stack memory.
    (pid > 0).then(|| unsafe { leader_of(pid) }).flatten()
}

/// The process that holds a pid now.
pub struct Holder {
    /// Its command name ("?" where /proc/PID/stat does not say).
    pub comm: String,
    /// A zombie its parent has not reaped yet.
    pub zombie: bool,
    /// Killed and on its way out (the kernel still freeing its memory and
    /// closing its files): a zombie or gone shortly.
    pub exiting: bool,
    /// Its parent's pid (0 where /proc/PID/stat does not say).
    pub parent: i32,
    /// A kernel thread: no user memory to checkpoint, and CRIU's attempt to
    /// trace it reads as a tracing failure.
    pub kernel_thread: bool,
}

/// What holds `pid` now, if anything (from /proc/PID/stat).
pub fn holder_of(pid: i32) -> Option<Holder> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(holder_in(&stat))
}

/// The [`Holder`] a /proc/PID/stat text describes.
fn holder_in(stat: &str) -> Holder {
    let comm = stat.split_once('(').and_then(|(_, r)| r.rsplit_once(')')).map_or("?", |(c, _)| c);
    Holder {
        comm: comm.to_string(),
        zombie: is_zombie(stat),
        exiting: is_exiting(stat),
        parent: parent_in(stat).unwrap_or(0),
        kernel_thread: flags_in(stat).is_some_and(|f| f & PF_KTHREAD != 0),
    }
}

/// A process that keeps a pid taken by naming it as its process group or
/// session: the kernel frees a pid only once no process has it as its id,
/// its group's or its session's. A session leader's child that outlived it
/// (a restored tree's root killed, its forked child left) keeps the root's
/// pid, which has no /proc entry then, and CRIU's fork of it fails "File
/// exists".
pub(crate) struct Naming {
    /// The pid named.
    pub pid: i32,
    /// The process naming it.
    pub by: i32,
    /// "session" or "process group".
    pub as_what: &'static str,
    pub holder: Holder,
}

/// The first process (by /proc's order) that names one of `pids` as its
/// session or process group while having another pid of its own. Reading
/// every process's stat costs about 30 µs a process (4,000 processes: 120
/// ms on 2 cores): only where one of `pids` names a process group, which
/// `kill(-pid, 0)` says at once. A session whose members all left its
/// leader's group goes unseen ([`namer_among`] finds it once CRIU's failure
/// names the pid).
pub(crate) fn named_elsewhere(pids: &[i32]) -> Option<Naming> {
    let group_named = |p: i32| {
        // SAFETY: signal 0 to a process group checks that it exists, nothing more.
        let sent = p > 1 && unsafe { libc::kill(-p, 0) } == 0;
        sent || (p > 1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    };
    if !pids.iter().any(|&p| group_named(p)) {
        return None;
    }
    namer_among(pids)
}

/// [`named_elsewhere`] without its shortcut: a walk of every process, for
/// a pid CRIU could not have (a session all of whose members left its
/// leader's process group is found so too).
pub(crate) fn namer_among(pids: &[i32]) -> Option<Naming> {
    let entries = std::fs::read_dir("/proc").ok()?;
    entries.flatten().find_map(|e| {
        let by: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // After the command's closing paren: state, ppid, pgrp, session.
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(2);
        let group: i32 = fields.next()?.parse().ok()?;
        let session: i32 = fields.next()?.parse().ok()?;
        let (pid, as_what) = [(session, "session"), (group, "process group")]
            .into_iter()
            .find(|&(named, _)| named != by && pids.contains(&named))?;
        Some(Naming { pid, by, as_what, holder: holder_in(&stat) })
    })
}

/// Waits, at most `limit`, while a process on its way out (as
/// [`wait_exits`] judges it) names one of `pids` ([`named_elsewhere`]).
pub(crate) fn wait_unnamed(pids: &[i32], limit: std::time::Duration) {
    let limit_ms = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
    // A walk of every process: not every millisecond.
    poll_until(limit_ms, 20, || named_elsewhere(pids).is_none_or(|n| !on_its_way_out(&n.holder)));
}

/// How process `pid`, held stopped, has ended, if it has: gone, a zombie,
/// exiting, or with a SIGKILL pending (a stopped task takes it when it next
/// runs: the OOM killer's kill is sent as the charge fails, and the task
/// may not have begun to exit when that is looked at). `None` while it is
/// alive and nothing has killed it.
pub(crate) fn killed(pid: i32) -> Option<&'static str> {
    let Some(holder) = holder_of(pid) else { return Some("gone") };
    if holder.zombie || holder.exiting {
        return Some("dead");
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return Some("gone") };
    sigkill_pending(&status).then_some("killed")
}

/// Whether a /proc/PID/status text shows a SIGKILL pending, to its thread
/// or its whole process.
fn sigkill_pending(status: &str) -> bool {
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    status
        .lines()
        .filter_map(|l| l.strip_prefix("SigPnd:").or_else(|| l.strip_prefix("ShdPnd:")))
        .any(|mask| u64::from_str_radix(mask.trim(), 16).is_ok_and(|m| m & sigkill != 0))
}

/// The parent pid of a /proc/PID/stat text (the second field after the
/// command's closing paren).
fn parent_in(stat: &str) -> Option<i32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// The state letter of a /proc/PID/stat text (it follows the last ')':
/// the command name may hold one).
fn state_of(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether the /proc/PID/stat text `stat` is a zombie's.
fn is_zombie(stat: &str) -> bool {
    state_of(stat) == Some('Z')
}

/// The kernel's PF_EXITING task flag (include/linux/sched.h): set once a
/// task has begun to exit.
const PF_EXITING: u64 = 0x4;
/// The kernel's PF_KTHREAD task flag: a kernel thread.
const PF_KTHREAD: u64 = 0x0020_0000;

/// Whether the /proc/PID/stat text `stat` is a task's that has begun to
/// exit (its flags, the ninth field, carry PF_EXITING).
fn is_exiting(stat: &str) -> bool {
    flags_in(stat).is_some_and(|f| f & PF_EXITING != 0)
}

/// The kernel's flags of the process a /proc/PID/stat text describes (after
/// the command's closing paren: state, ppid, pgrp, session, tty, tpgid,
/// flags).
fn flags_in(stat: &str) -> Option<u64> {
    stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(6)?.parse().ok())
}

/// Waits, at most `limit`, until none of `pids` is on its way out (each
/// gone, held by a process that is not exiting, or a zombie that only its
/// own parent can reap): a dump returns once its tree is killed, not once
/// the kernel has freed it, so a restore started right after waits here for
/// the pids it needs. A zombie of init is waited for too: a tree restored
/// with -d belongs to init once criuz has returned, and an init may reap a
/// second late (this project's VMs) where a restore run right after the
/// tree was killed would fail on its pid. A zombie of any other process
/// waits for that process, which may never reap it: not waited for.
pub(crate) fn wait_exits(pids: &[i32], limit: std::time::Duration) {
    wait_while_any(pids, limit, on_its_way_out);
}

/// Moves this pid namespace's allocation cursor (`ns_last_pid`) up to the
/// highest of `pids` where it is below it, so that the tasks started while
/// CRIU restores a tree with those pids (criuz's and CRIU's threads, any
/// other program on the machine) get pids above them, not one of theirs
/// that CRIU has yet to create ("Can't fork for N: File exists"). CRIU
/// creates each process with its pid asked for (`clone3`), which the cursor
/// does not steer. Where the cursor cannot be written (no CAP_SYS_ADMIN or
/// CAP_CHECKPOINT_RESTORE), the restore goes on as before.
pub(crate) fn allocate_new_pids_above(pids: &[i32]) {
    const CURSOR: &str = "/proc/sys/kernel/ns_last_pid";
    let Some(&highest) = pids.iter().max() else { return };
    let now = std::fs::read_to_string(CURSOR).ok().and_then(|s| s.trim().parse::<i32>().ok());
    if now.is_some_and(|now| now < highest) {
        let _ = std::fs::write(CURSOR, highest.to_string());
    }
}

/// Whether a process that holds a pid will soon let it go by itself (see
/// [`wait_exits`]).
fn on_its_way_out(h: &Holder) -> bool {
    if h.zombie {
        h.parent == 1
    } else {
        h.exiting
    }
}

/// Waits, at most `limit`, until each of `pids` has begun to exit (or is a
/// zombie, or gone). A SIGKILL queued to a stopped task takes effect when
/// the task next runs: a dump that returned straight after `kill_tree`
/// could leave a process that still looks alive for a moment to a script
/// checking for it. Only the start of the exit is waited for, not the
/// freeing of its memory.
pub(crate) fn wait_exit_begun(pids: &[i32], limit: std::time::Duration) {
    wait_while_any(pids, limit, |h| !h.exiting && !h.zombie);
}

/// Waits, at most `limit`, while the holder of any of `pids` is `still`.
fn wait_while_any(pids: &[i32], limit: std::time::Duration, still: impl Fn(&Holder) -> bool) {
    let limit_ms = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
    poll_until(limit_ms, 1, || !pids.iter().any(|&p| holder_of(p).is_some_and(|h| still(&h))));
}

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
    // SAFETY: prctl with constant arguments, as in `become_subreaper`.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
    RESTORED_ROOT.store(root.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
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
/// child of criuz has ended (it stays unreaped: its waiter reaps it).
pub(crate) fn wait_runc_children(limit: std::time::Duration) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let t = std::time::Instant::now();
    while t.elapsed() < limit
        && children_of(me).into_iter().any(|p| holder_of(p).is_some_and(|h| h.comm == "runc" && !h.zombie))
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Whether `pid` runs (or was forked from) `criu restore`: its first
/// argument, as its command line says.
fn restoring(pid: i32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    cmdline.split(|&b| b == 0).nth(1) == Some(b"restore")
}

/// The parent of `pid`.
pub(crate) fn parent_of(pid: i32) -> Option<i32> {
    parent_in(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
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

/// Asks `done` every `every_ms` until it says yes or `limit_ms` has passed.
/// Async-signal-safe as long as `done` is (nanosleep on stack memory).
fn poll_until(limit_ms: u32, every_ms: u32, done: impl FnMut() -> bool) {
    let every_us = u64::from(every_ms.max(1)) * 1000;
    poll_paced(limit_ms, every_us, every_us, done);
}

/// [`poll_until`] every 100 µs at first, the pause doubling up to
/// `every_ms`: for what mostly comes within a millisecond (CRIU letting go
/// of a restored tree 0.3-0.8 ms after handing its memory over, 2 cores,
/// session 47), where a millisecond's pause from the start made a lazy tree
/// run 0.4 ms late on average.
fn poll_soon(limit_ms: u32, every_ms: u32, done: impl FnMut() -> bool) {
    let every_us = u64::from(every_ms.max(1)) * 1000;
    poll_paced(limit_ms, 100.min(every_us), every_us, done);
}

/// Asks `done`, pausing `first_us`, then twice as long each time up to
/// `most_us`, until it says yes or `limit_ms` has passed.
fn poll_paced(limit_ms: u32, first_us: u64, most_us: u64, mut done: impl FnMut() -> bool) {
    let limit_us = u64::from(limit_ms) * 1000;
    let (mut waited_us, mut pause_us) = (0u64, first_us.clamp(1, 999_999));
    loop {
        if done() || waited_us >= limit_us {
            return;
        }
        let pause = libc::timespec { tv_sec: 0, tv_nsec: (pause_us * 1000) as libc::c_long };
        // SAFETY: nanosleep reads `pause`, which outlives the call; the
        // remainder is not wanted.
        unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
        waited_us += pause_us;
        pause_us = (pause_us * 2).min(most_us.clamp(1, 999_999));
    }
}

/// Reads the start of /proc/`pid`/`file` into `buf`; empty if `pid` is
/// gone.
///
/// # Safety
/// Async-signal-safe (open, read, close on the caller's memory); no
/// preconditions.
unsafe fn read_proc<'a>(pid: i32, file: &[u8], buf: &'a mut [u8]) -> &'a [u8] {
    let mut path = [0u8; 64];
    let at = proc_path(&mut path, &[Part::Text(b"/proc/"), Part::Num(pid.into()), Part::Text(file)]);
    // SAFETY: `at` is a NUL-terminated path (proc_path) that outlives the call.
    let fd = unsafe { libc::open(at.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return &buf[..0];
    }
    // SAFETY: reads at most `buf.len()` bytes into the caller's buffer;
    // closes the descriptor just opened, once.
    let n = unsafe {
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        n
    };
    &buf[..n.max(0) as usize]
}

/// Whether `pid` exists and is not a zombie (from /proc/PID/stat).
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn running(pid: i32) -> bool {
    // SAFETY: `state` only opens, reads and closes on stack memory.
    !matches!(unsafe { state(pid) }, Some(b'Z' | b'X') | None)
}

/// The state letter of `pid` (from /proc/PID/stat; `None` if it is gone).
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn state(pid: i32) -> Option<u8> {
    let mut buf = [0u8; 512];
    // SAFETY: read_proc only opens, reads and closes on our stack buffer.
    let text = unsafe { read_proc(pid, b"/stat", &mut buf) };
    // The state follows the last ')' (the command name may hold one).
    let at = text.iter().rposition(|&c| c == b')')?;
    text.get(at + 2).copied()
}

/// Whether `pid` has a tracer (from /proc/PID/status; false if it is gone).
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn traced(pid: i32) -> bool {
    // SAFETY: status_number only opens, reads and closes on stack memory.
    unsafe { status_number(pid, b"\nTracerPid:\t") }.is_some_and(|tracer| tracer != 0)
}

/// The number after `key` in /proc/PID/status (`None` if it is gone or
/// does not say). `PID` may be a thread's id: its own line then.
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn status_number(pid: i32, key: &[u8]) -> Option<i32> {
    let mut buf = [0u8; 1024];
    // SAFETY: read_proc only opens, reads and closes on our stack buffer.
    let text = unsafe { read_proc(pid, b"/status", &mut buf) };
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    let digits = text[at..].iter().take_while(|b| b.is_ascii_digit());
    let (value, count) =
        digits.fold((0i32, 0), |(v, c), &d| (v.wrapping_mul(10).wrapping_add(i32::from(d - b'0')), c + 1));
    (count > 0).then_some(value)
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

/// Whether `pid` is stopped, or has SIGSTOP pending (from /proc/PID/status).
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn stopping(pid: i32) -> bool {
    // SAFETY: `state` only opens, reads and closes on stack memory.
    if unsafe { state(pid) } == Some(b'T') {
        return true;
    }
    let mut buf = [0u8; 4096];
    // SAFETY: read_proc only opens, reads and closes on our stack buffer.
    let text = unsafe { read_proc(pid, b"/status", &mut buf) };
    let field = |key: &[u8]| {
        let at = text.windows(key.len()).position(|w| w == key)? + key.len();
        Some(&text[at..at + text[at..].iter().position(|&c| c == b'\n').unwrap_or(text.len() - at)])
    };
    // The pending-signal masks, in hex: SIGSTOP (19) is bit 18.
    let stop_pending = |v: &[u8]| {
        let bits = v.iter().try_fold(0u64, |acc, &c| Some(acc << 4 | (c as char).to_digit(16)? as u64));
        bits.is_some_and(|b| b & (1 << (libc::SIGSTOP - 1)) != 0)
    };
    field(b"ShdPnd:\t").is_some_and(stop_pending) || field(b"SigPnd:\t").is_some_and(stop_pending)
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
            let schedstat = std::fs::read_to_string(format!("{dir}/schedstat")).ok()?;
            threads.push((tid, schedstat.split_whitespace().next()?.parse().ok()?));
        }
    }
    threads.sort_unstable();
    Some(threads)
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

/// Whether `pid` is `ancestor` or below it (parents through /proc).
pub(crate) fn descends_from(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..4096 {
        if pid == ancestor {
            return true;
        }
        match parent_of(pid as i32) {
            Some(parent) if parent > 0 && parent as u32 != pid => pid = parent as u32,
            _ => return false,
        }
    }
    false
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

/// Fills `pids` with `tree` and its descendants, parents first; returns
/// how many. Async-signal-safe.
fn collect_tree(tree: &[i32], pids: &mut [i32; MAX_TREE]) -> usize {
    let mut n = 0;
    for &p in tree.iter().take(MAX_TREE) {
        pids[n] = p;
        n += 1;
    }
    let mut i = 0;
    while i < n {
        // A thread id (a restored tree's pids hold every thread's, as CRIU
        // must have them free) stands for its process: its `task` directory
        // is its whole group's, so walking each thread walked the group once
        // per thread (a 300-thread process: 90,000 opens, 0.8 s before a
        // lazy restore's tree ran). The group is walked once, from its
        // leader.
        // SAFETY: only system calls on stack buffers we own.
        match unsafe { leader_of(pids[i]) } {
            Some(leader) if leader != pids[i] => {
                if n < MAX_TREE && !pids[..n].contains(&leader) {
                    pids[n] = leader;
                    n += 1;
                }
            }
            // SAFETY: as above.
            _ => n = unsafe { add_children(pids[i], pids, n) },
        }
        i += 1;
    }
    n
}

/// The thread group (process) `tid` belongs to, from /proc/TID/status
/// (`None` if it is gone).
///
/// # Safety
/// Async-signal-safe; no preconditions.
unsafe fn leader_of(tid: i32) -> Option<i32> {
    // SAFETY: status_number only opens, reads and closes on stack memory.
    unsafe { status_number(tid, b"\nTgid:\t") }
}

/// A piece of a /proc path: text, or a number written in decimal.
enum Part<'a> {
    Text(&'a [u8]),
    Num(i64),
}

/// Writes `parts` and a NUL into `buf` (no allocation: the guard uses it).
fn proc_path<'a>(buf: &'a mut [u8; 64], parts: &[Part]) -> &'a [u8] {
    let mut at = 0;
    for part in parts {
        let mut digits = [0u8; 20];
        let bytes: &[u8] = match *part {
            Part::Text(b) => b,
            Part::Num(mut v) => {
                let mut k = digits.len();
                loop {
                    k -= 1;
                    digits[k] = b'0' + (v % 10) as u8;
                    v /= 10;
                    if v == 0 {
                        break;
                    }
                }
                &digits[k..]
            }
        };
        let end = (at + bytes.len()).min(buf.len() - 1);
        buf[at..end].copy_from_slice(&bytes[..end - at]);
        at = end;
    }
    buf[at] = 0;
    &buf[..=at]
}

/// Appends the children of every thread of `pid` not yet in `pids[..n]`;
/// returns the new count.
///
/// # Safety
///
/// No precondition on the caller: it makes system calls (open, getdents64,
/// read, close) only on paths and buffers of its own stack and descriptors
/// it opened itself.
unsafe fn add_children(pid: i32, pids: &mut [i32; MAX_TREE], mut n: usize) -> usize {
    let mut path = [0u8; 64];
    let task = proc_path(&mut path, &[Part::Text(b"/proc/"), Part::Num(pid.into()), Part::Text(b"/task")]);
    // SAFETY: `task` is a NUL-terminated path (proc_path) that outlives the call.
    let dir = unsafe { libc::open(task.as_ptr().cast(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if dir < 0 {
        return n;
    }
    let mut entries = [0u8; 2048];
    loop {
        // SAFETY: getdents64 on our own directory descriptor writes at most
        // `entries.len()` bytes into `entries`.
        let got = unsafe { libc::syscall(libc::SYS_getdents64, dir, entries.as_mut_ptr(), entries.len()) };
        if got <= 0 {
            break;
        }
        let mut at = 0usize;
        while at + 19 < got as usize {
            // linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name.
            let reclen = u16::from_ne_bytes([entries[at + 16], entries[at + 17]]) as usize;
            let name = &entries[at + 19..at + reclen.max(19)];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            at += reclen.max(1);
            if name.is_empty() || !name.iter().all(u8::is_ascii_digit) {
                continue;
            }
            let mut path = [0u8; 64];
            let tid = name.iter().fold(0i64, |v, d| v * 10 + i64::from(d - b'0'));
            let children = proc_path(
                &mut path,
                &[
                    Part::Text(b"/proc/"),
                    Part::Num(pid.into()),
                    Part::Text(b"/task/"),
                    Part::Num(tid),
                    Part::Text(b"/children"),
                ],
            );
            // SAFETY: `children` is a NUL-terminated path (proc_path) that
            // outlives the call.
            let fd = unsafe { libc::open(children.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                continue;
            }
            // Read to its end: a thread with many children fills more than
            // one read, and a pid cut at a read's end is carried over to the
            // next (one read of 4 KiB once lost the children past some 680
            // and took the cut pid's first digits for another process).
            let mut text = [0u8; 4096];
            let mut child = 0i32;
            let mut in_number = false;
            loop {
                // SAFETY: read on the descriptor just opened writes at most
                // `text.len()` bytes into `text`.
                let len = unsafe { libc::read(fd, text.as_mut_ptr().cast(), text.len()) };
                let end = len <= 0;
                let last: &[u8] = if end { b" " } else { b"" };
                for &b in text[..len.max(0) as usize].iter().chain(last) {
                    if b.is_ascii_digit() {
                        child = child * 10 + i32::from(b - b'0');
                        in_number = true;
                    } else if in_number {
                        if n < MAX_TREE && !pids[..n].contains(&child) {
                            pids[n] = child;
                            n += 1;
                        }
                        child = 0;
                        in_number = false;
                    }
                }
                if end {
                    break;
                }
            }
            // SAFETY: `fd` is ours, closed once and not used after.
            unsafe { libc::close(fd) };
        }
    }
    // SAFETY: `dir` is ours, closed once and not used after.
    unsafe { libc::close(dir) };
    n
}

#[cfg(test)]
mod tests {
    #[test]
    fn hugetlb_and_swapped_pages_count_as_resident() {
        let status = "Name:\thuge\nVmRSS:\t    1180 kB\nRssAnon:\t     112 kB\nVmSwap:\t    4096 kB\n\
                      HugetlbPages:\t 1048576 kB\nThreads:\t1\n";
        use super::resident_kib;
        assert_eq!(resident_kib(status), 1180 + 4096 + 1_048_576);
        assert_eq!(resident_kib("Name:\tkthread\nThreads:\t1\n"), 0, "a kernel thread's status has neither");
        assert!(resident_kib(&std::fs::read_to_string("/proc/self/status").unwrap()) > 0);
    }

    /// A session leader forks a child into a process group of its own and
    /// exits: its pid has no process and no group, yet the session keeps
    /// it taken. The shortcut misses it; the walk names the child.
    #[test]
    fn a_session_kept_by_a_process_of_another_group_is_named() {
        let (read, write) = crate::io::pipe().unwrap();
        let (r, w) = (std::os::fd::AsRawFd::as_raw_fd(&read), std::os::fd::AsRawFd::as_raw_fd(&write));
        // SAFETY: the children call only async-signal-safe functions
        // (setsid, fork, setpgid, write, pause, _exit) before they end.
        let leader = unsafe { libc::fork() };
        if leader == 0 {
            // SAFETY: as above, in the forked children only.
            unsafe {
                libc::setsid();
                let member = libc::fork();
                if member == 0 {
                    libc::setpgid(0, 0);
                    libc::write(w, b"!".as_ptr().cast(), 1);
                    loop {
                        libc::pause();
                    }
                }
                libc::_exit(0);
            }
        }
        let mut byte = 0u8;
        // SAFETY: reads one byte into `byte`, then reaps our own child.
        unsafe {
            assert_eq!(libc::read(r, (&mut byte as *mut u8).cast(), 1), 1);
            libc::waitpid(leader, std::ptr::null_mut(), 0);
        }
        let found = super::namer_among(&[leader]);
        let missed = super::named_elsewhere(&[leader]);
        if let Some(n) = &found {
            // SAFETY: the member this test forked.
            unsafe { libc::kill(n.by, libc::SIGKILL) };
        }
        let n = found.expect("the session's member");
        assert_eq!((n.pid, n.as_what), (leader, "session"));
        assert!(missed.is_none(), "no process group is named by the leader's pid");
    }

    use super::*;

    #[test]
    fn a_killed_process_reads_as_killed_until_it_is_gone() {
        let status =
            |pnd: &str, shd: &str| format!("Name:\tx\nSigPnd:\t{pnd}\nShdPnd:\t{shd}\nSigBlk:\t0000000000000100\n");
        assert!(!sigkill_pending(&status("0000000000000000", "0000000000004000")));
        assert!(sigkill_pending(&status("0000000000000100", "0000000000000000")));
        assert!(sigkill_pending(&status("0000000000000000", "0000000000000102")));
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id() as i32;
        assert_eq!(killed(pid), None);
        child.kill().unwrap();
        // Killed, not reaped: dead (or, for an instant, SIGKILL pending).
        crate::proc::tree::wait_exit_begun(&[pid], std::time::Duration::from_secs(5));
        assert!(killed(pid).is_some());
        child.wait().unwrap();
        assert_eq!(killed(pid), Some("gone"));
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

    /// How often each pace asks, counted by the pauses it takes (not by
    /// the clock): `poll_soon` asks after 0.1, 0.3 and 0.7 ms of a 1 ms
    /// limit and once more past it, `poll_until` at the start and after
    /// its one pause; an answer of yes ends either at once.
    #[test]
    fn a_soon_poll_asks_within_the_first_millisecond_and_both_keep_the_limit() {
        let asks = |poll: fn(u32, u32, &mut dyn FnMut() -> bool)| {
            let mut n = 0;
            poll(1, 1, &mut || {
                n += 1;
                false
            });
            n
        };
        assert_eq!(asks(|l, e, d| poll_soon(l, e, d)), 5);
        assert_eq!(asks(|l, e, d| poll_until(l, e, d)), 2);
        let mut n = 0;
        poll_soon(60_000, 1, || {
            n += 1;
            true
        });
        assert_eq!(n, 1);
    }

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

    #[test]
    fn a_killed_process_reads_as_exiting_and_a_running_one_does_not() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let running = holder_of(pid).unwrap();
        assert!(!running.exiting && !running.zombie, "a sleeping process is not on its way out");
        child.kill().unwrap();
        // Not reaped yet: a zombie, which began to exit.
        let t = Instant::now();
        while !holder_of(pid).unwrap().zombie {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the killed child never became a zombie");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(holder_of(pid).unwrap().exiting, "a zombie carries PF_EXITING");
        let t = Instant::now();
        wait_exit_begun(&[pid], std::time::Duration::from_secs(10));
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "a zombie has begun to exit");
        let t = Instant::now();
        wait_exits(&[pid], std::time::Duration::from_secs(10));
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "a zombie is not waited for");
        child.wait().unwrap();
        // A stopped process, killed: its exit has begun once this returns.
        let mut stopped = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = stopped.id() as i32;
        signal_tree(&[pid], libc::SIGSTOP);
        kill_tree(&[pid]);
        wait_exit_begun(&[pid], std::time::Duration::from_secs(10));
        let h = holder_of(pid).unwrap();
        assert!(h.exiting || h.zombie, "a killed process still looks alive");
        stopped.wait().unwrap();
        // The flags field, past a command name with spaces and parentheses.
        let stat = |flags: u64| format!("77 (a) b) c) R 1 77 77 0 -1 {flags} 90 0 0 0");
        assert!(is_exiting(&stat(0x400104)) && !is_exiting(&stat(0x400100)));
        assert_eq!(parent_in(&stat(0)), Some(1));
    }

    /// A tree restored with -d is init's once criuz returns; killed, it stays
    /// a zombie until init reaps it, which an init may do a second late (as
    /// this project's VMs' does). A restore run straight after waits for
    /// that, where it failed on the pid before.
    #[test]
    fn a_killed_orphan_is_waited_for_until_init_reaps_it() {
        // An orphan: a shell starts it in the background and exits. (Unless
        // a subreaper above this test adopts it, it is init's, pid 1.)
        let out = std::process::Command::new("sh")
            .args(["-c", "sleep 30 </dev/null >/dev/null 2>&1 & echo $!"])
            .stdout(std::process::Stdio::piped())
            .output()
            .unwrap();
        let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let t = Instant::now();
        while holder_of(pid).is_some_and(|h| h.parent != 1 && h.comm == "sh") {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the shell never let go of its child");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let adopter = holder_of(pid).expect("the orphan runs").parent;
        assert_ne!(adopter, std::process::id() as i32, "this test process is nobody's subreaper");
        kill_tree(&[pid]);
        // As a dump returns: once the kill has taken.
        wait_exit_begun(&[pid], std::time::Duration::from_secs(10));
        wait_exits(&[pid], std::time::Duration::from_secs(10));
        assert!(
            holder_of(pid).is_none_or(|h| !h.zombie),
            "pid {pid} is still a zombie of pid {adopter}: not waited for until it was reaped"
        );
    }
}
