//! What holds a pid now, read from /proc/PID/stat (a process, a zombie,
//! one on its way out, a kernel thread), and the waits around a restore
//! that needs pids free: a killed tree's exits, an orphan init reaps late,
//! a session or process group that keeps a pid taken. The allocation
//! cursor is moved above a tree's pids so that nothing started meanwhile
//! takes one of them. Stale answers are expected: each is a snapshot,
//! asked again where it matters.

use super::signal_safe::poll_until;
use std::path::Path;

/// Whether process `pid` exists (a positive pid with a /proc entry).
pub(crate) fn exists(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
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
pub(super) fn parent_in(stat: &str) -> Option<i32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// The state letter of a /proc/PID/stat text (it follows the last ')':
/// the command name may hold one).
pub(super) fn state_of(stat: &str) -> Option<char> {
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

/// The parent of `pid`.
pub(crate) fn parent_of(pid: i32) -> Option<i32> {
    parent_in(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
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

#[cfg(test)]
mod tests {
    use crate::proc::tree::{kill_tree, signal_tree};
    use std::time::Instant;

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
        wait_exit_begun(&[pid], std::time::Duration::from_secs(5));
        assert!(killed(pid).is_some());
        child.wait().unwrap();
        assert_eq!(killed(pid), Some("gone"));
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
