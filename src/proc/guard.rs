//! The guard of a tree criuz is responsible for: a process forked from
//! criuz that signals the tree if criuz dies before its work is done. A lazy
//! restore's guard kills the restored tree (below); a dump's guard resumes
//! the tree CRIU left stopped (`--leave-stopped`, so that it ends only once
//! its archive is committed), so a criuz killed meanwhile leaves the
//! process running instead of stopped for good. A dump held at CRIU's
//! post-dump hook (`session::criu_hook`) is CRIU's to settle: its guard
//! waits for CRIU to end, and ends the tree CRIU left stopped (the dump
//! completed; resumed, its locked connections would be dead) or lets the
//! tree CRIU rolled back run on.
//!
//! criuz serves the tree's page faults itself (`session::lazy`) through the
//! userfaultfds CRIU hands it. Were criuz to die, those descriptors would
//! close, the kernel would unregister the lazy ranges, and every page not
//! yet copied would read as zero: silent data loss. So criuz passes a copy
//! of each userfaultfd to the guard as it gets it. With the guard's copies
//! open, a thread faulting after criuz died waits instead of reading zeros,
//! and the guard, seeing its command pipe close, kills the tree first and
//! only then exits (releasing the copies). Once kill(2) has queued SIGKILL
//! for a process, none of its threads returns to user space from a fault,
//! so nothing can read a zero page after that.
//!
//! The tree is its restored pids and everything they forked since (a child
//! forked while pages still arrive misses pages too): `tree::kill_tree` finds
//! the descendants through /proc before it kills.
//!
//! A container's restored tree lives in a pid namespace of its own, so its
//! pids mean nothing here: a container's lazy restore kills its cgroup
//! instead ([`Victim::Cgroup`], cgroup v2 `cgroup.kill`, which also takes
//! whatever the tree forks meanwhile). criuz learns the cgroup from CRIU's
//! lazy-pages connection before the first userfaultfd arrives and tells
//! the guard first ([`Guard::target_cgroup`]).
//!
//! A container criuz paused to checkpoint it (`session::container`) has a
//! guard that runs `runc resume` should criuz die ([`Guard::running`]).
//!
//! The guard ignores SIGINT, SIGHUP and SIGTERM: a Ctrl-C that reaches the
//! whole group and kills criuz must still end in the tree's kill.
//!
//! The guard is a fork of a threaded process, so it calls only
//! async-signal-safe functions (poll, read, recvmsg, open, getdents64,
//! kill, signal, close, _exit) on memory prepared before the fork.

use crate::criu::scm;
use crate::error::{Error, Result};
use crate::proc::holder::holder_of;
use crate::proc::restored::{describe_end, end_aborted_tree, held_by_ours, restored_root};
use crate::proc::tree::{kill_tree, tree_pids, wait_untraced};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod forked;

use forked::{guard_main, AfterCriu, GuardFds};

/// Command from criuz: exit and leave the tree alone (its pages are all in
/// place, the restore failed before it ran, or criuz killed it already). Any
/// other byte, or the pipe closing, kills the tree.
const QUIT: u8 = b'q';

/// On the descriptor socket: a cgroup's `cgroup.kill` path follows (u16
/// length, then the bytes). A held userfaultfd comes with any other byte
/// but [`WAIT_FOR`].
const CGROUP: u8 = b'K';

/// On the descriptor socket: a pid (i32) follows, whose end the guard waits
/// for before it acts (a runc that would freeze the container again).
const WAIT_FOR: u8 = b'P';

/// On the descriptor socket: the held tree's pages are all in (see
/// [`Guard::whole`]); a count (u16) of pids (i32 each) follows, those to
/// leave stopped.
const WHOLE: u8 = b'W';

/// Longest `cgroup.kill` path the guard takes (its buffer is on the stack).
const CGROUP_PATH_MAX: usize = 1024;

/// Most processes dumped stopped a whole tree's guard leaves stopped (more
/// are let run: a guard that acts has lost its criuz already).
const SPARED_MAX: usize = 256;

/// What a lazy restore kills should its pages be unable to all arrive.
pub enum Victim {
    /// A restored tree by its pids, and whatever it forked since.
    Tree(Vec<i32>),
    /// A container: everything in its cgroup (the path of its
    /// `cgroup.kill`), known once CRIU connects.
    Cgroup(OnceLock<PathBuf>),
}

impl Victim {
    /// Kills it now; a cgroup not yet known has no process that could read
    /// a missing page.
    pub fn kill(&self) {
        match self {
            // Only what this criuz restored (`held_by_ours`): a pid of the
            // tree may be another's by now. A lazy or placed tree stays
            // below criuz until it is whole; once it is, criuz lets go of
            // it, and the tree may go to init as CRIU exits: its root,
            // noted then, still names it (a CUDA resume or a --pidfile that
            // failed after that killed nothing, 1 run in 15).
            Victim::Tree(pids) => kill_tree(&held_by_ours(pids, restored_root())),
            Victim::Cgroup(c) => {
                if let Some(path) = c.get() {
                    let _ = std::fs::write(path, b"1");
                }
            }
        }
    }

    /// Lets a tree held stopped run (SIGCONT to it and all it forked), once
    /// its tracer has let go of it (at most a minute); a container is never
    /// held. CRIU (`--leave-stopped`) says the restore finished before it
    /// stops the tree and detaches: a SIGCONT sent before that stop would
    /// be undone by it, and the tree left stopped for good. Once a process
    /// is untraced its stop was sent, taken or still pending, and SIGCONT
    /// ends either.
    ///
    /// A process dumped stopped (`stopped`: its pid and the signal that had
    /// stopped it) stays stopped, as CRIU's own restore leaves it (a job a
    /// shell stopped, a process a debugger or supervisor holds): one
    /// stopped by SIGSTOP stays in the stop CRIU put it in; one stopped by
    /// another signal (Ctrl-Z's SIGTSTP) is continued and stopped again by
    /// that signal, as CRIU does, so that its parent sees the same stop.
    pub fn resume(&self, stopped: &[(i32, i32)]) {
        if let Victim::Tree(pids) = self {
            wait_untraced(pids, 60_000);
            let held = |p: &i32| stopped.iter().any(|(s, _)| s == p);
            for p in tree_pids(pids).into_iter().filter(|p| !held(p)) {
                // SAFETY: a tree criuz restored (nothing in it ran yet).
                unsafe { libc::kill(p, libc::SIGCONT) };
            }
            for &(p, sig) in stopped.iter().filter(|(_, sig)| *sig != libc::SIGSTOP) {
                // SAFETY: as above.
                unsafe {
                    libc::kill(p, libc::SIGCONT);
                    libc::kill(p, sig);
                }
            }
        }
    }

    /// Waits (a few seconds at most) until it is gone, killing it again
    /// after a second. Says how the processes criuz reaped ended (a tree's,
    /// with criuz its subreaper; nothing of a container).
    pub fn wait_gone(&self) -> String {
        match self {
            Victim::Tree(pids) => {
                let ended = end_aborted_tree(pids, restored_root());
                let said: Vec<String> = ended.iter().map(|(p, st)| format!("pid {p} {}", describe_end(*st))).collect();
                said.join(", ")
            }
            Victim::Cgroup(c) => {
                let Some(procs) = c.get().map(|k| k.with_file_name("cgroup.procs")) else { return String::new() };
                let t = std::time::Instant::now();
                while std::fs::read_to_string(&procs).is_ok_and(|s| !s.trim().is_empty()) {
                    if t.elapsed() > std::time::Duration::from_secs(1) {
                        self.kill();
                    }
                    if t.elapsed() > std::time::Duration::from_secs(5) {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                String::new()
            }
        }
    }
}

pub struct Guard {
    /// Taken by the first release.
    tell: std::sync::Mutex<Option<OwnedFd>>,
    fds: UnixStream,
    pid: libc::pid_t,
}

impl Guard {
    /// Forks the guard of a lazily restored `tree`: it kills the tree if
    /// criuz dies before [`release`](Self::release).
    pub fn start(tree: &[i32]) -> Result<Guard> {
        Self::signalling(tree, libc::SIGKILL)
    }

    /// Forks the guard of a dumped `tree` CRIU leaves stopped: it resumes
    /// the tree (SIGCONT) if criuz dies before [`release`](Self::release),
    /// but for the processes of `stopped` (stopped before the dump).
    pub fn resuming(tree: &[i32], stopped: &[i32]) -> Result<Guard> {
        Self::spawn(tree, libc::SIGCONT, None, stopped, AfterCriu::Resume)
    }

    /// [`resuming`](Self::resuming) for a dump held at CRIU's post-dump
    /// hook (`session::criu_hook`), where CRIU, not criuz, says how it
    /// ended: should criuz die, the guard waits for the CRIU it is told of
    /// ([`wait_for`](Self::wait_for)) to end. A CRIU that rolled back has
    /// resumed the tree, its connections unlocked. One that completed (its
    /// hook answered only once the archive was committed) left it stopped
    /// with its connections locked for the restore: resumed, it would run
    /// on with those dead ("permission denied"), so the guard ends it, as
    /// the dump would have.
    pub fn resuming_unless_dumped(tree: &[i32], stopped: &[i32]) -> Result<Guard> {
        Self::spawn(tree, libc::SIGCONT, None, stopped, AfterCriu::EndIfDumped)
    }

    /// The guard of a dumped tree CRIU leaves stopped: [`resuming`](Self::resuming),
    /// or, for a dump held at CRIU's post-dump hook (`at_hook`),
    /// [`resuming_unless_dumped`](Self::resuming_unless_dumped).
    pub fn of_dump(tree: &[i32], stopped: &[i32], at_hook: bool) -> Result<Guard> {
        match at_hook {
            false => Self::resuming(tree, stopped),
            true => Self::resuming_unless_dumped(tree, stopped),
        }
    }

    /// Forks a guard that runs `argv` (a program by its path, then its
    /// arguments) if criuz dies before [`release`](Self::release): a paused
    /// container's `runc resume`.
    pub fn running(argv: &[&std::ffi::OsStr]) -> Result<Guard> {
        let argv: Vec<std::ffi::CString> = argv
            .iter()
            .map(|a| std::ffi::CString::new(a.as_bytes()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::Usage("a NUL byte in a command for the guard".into()))?;
        Self::spawn(&[], 0, Some(argv), &[], AfterCriu::Resume)
    }

    fn signalling(tree: &[i32], sig: i32) -> Result<Guard> {
        Self::spawn(tree, sig, None, &[], AfterCriu::Resume)
    }

    /// `spared`: pids `sig` is not sent to.
    fn spawn(
        tree: &[i32],
        sig: i32,
        argv: Option<Vec<std::ffi::CString>>,
        spared: &[i32],
        after: AfterCriu,
    ) -> Result<Guard> {
        // The pointer array execv takes, made before the fork.
        let mut argp: Vec<*const libc::c_char> = argv.iter().flatten().map(|a| a.as_ptr()).collect();
        argp.push(std::ptr::null());
        let exec = argv.as_ref().map(|_| argp.as_slice());
        let (tell_r, tell_w) = crate::io::pipe()?;
        let (ours, theirs) = UnixStream::pair()?;
        let tree = tree.to_vec();
        let spared = spared.to_vec();
        let fds = GuardFds { tell: tell_r.as_raw_fd(), fds: theirs.as_raw_fd(), mask: crate::spawn::started_with() };
        // SAFETY: the child runs only async-signal-safe calls on memory
        // prepared above (see the module documentation), and never returns.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: in the child, which does nothing else: guard_main keeps
            // to async-signal-safe calls on `fds`, `tree`, `spared` and
            // `exec`, made above.
            unsafe { guard_main(fds, &tree, sig, exec, &spared, after) }
        }
        if pid < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        drop((tell_r, theirs));
        Ok(Guard { tell: std::sync::Mutex::new(Some(tell_w)), fds: ours, pid })
    }

    /// Forks the guard of a lazily restored container: it kills the cgroup
    /// named by [`target_cgroup`](Self::target_cgroup) if criuz dies before
    /// [`release`](Self::release).
    pub fn start_for(victim: &Victim) -> Result<Guard> {
        match victim {
            Victim::Tree(pids) => Self::start(pids),
            Victim::Cgroup(_) => Self::signalling(&[], libc::SIGKILL),
        }
    }

    /// Tells the guard which cgroup to kill; sent before any userfaultfd
    /// it holds, on the same socket, so it arrives first.
    pub fn target_cgroup(&self, kill: &Path) -> Result<()> {
        let bytes = kill.as_os_str().as_bytes();
        if bytes.len() >= CGROUP_PATH_MAX || bytes.contains(&0) {
            return Err(Error::Criu(format!("{}: cgroup path too long for the guard", kill.display())));
        }
        let mut msg = vec![CGROUP];
        msg.extend_from_slice(&(bytes.len() as u16).to_ne_bytes());
        msg.extend_from_slice(bytes);
        std::io::Write::write_all(&mut &self.fds, &msg)
            .map_err(|err| Error::CriuIo { what: "cannot tell the guard the restored container's cgroup".into(), err })
    }

    /// Tells the guard to wait for process `pid` to end before it runs its
    /// command or kills a cgroup, and to kill a restored tree once more
    /// after it ended (the last one told counts): what criuz started may
    /// still change what the guard undoes (a runc that would freeze the
    /// container again, a CRIU still forking the tree).
    pub fn wait_for(&self, pid: u32) -> Result<()> {
        let mut msg = vec![WAIT_FOR];
        msg.extend_from_slice(&(pid as i32).to_ne_bytes());
        std::io::Write::write_all(&mut &self.fds, &msg)
            .map_err(|err| Error::CriuIo { what: "cannot tell the guard which process to wait for".into(), err })
    }

    /// Gives the guard a copy of a userfaultfd of the tree.
    pub fn hold(&self, fd: RawFd) -> Result<()> {
        scm::send_fd(&self.fds, fd).map_err(|err| Error::CriuIo {
            what: "cannot pass the restored tree's userfaultfd to the guard".into(),
            err,
        })
    }

    /// Tells the guard that the tree it holds stopped has every page in
    /// place and is about to be let run: it lets go of its copies of the
    /// userfaultfds (pages left out as zero then read as zero), and should
    /// criuz die from now on, it lets the tree run (SIGCONT, once CRIU let
    /// go of it) instead of killing it, but for `stopped` (pid, signal: the
    /// processes dumped stopped). criuz tells it this before it lets the
    /// tree run and releases it after: released first, a criuz killed
    /// between the two left the tree stopped for good.
    pub fn whole(&self, stopped: &[(i32, i32)]) -> Result<()> {
        let mut msg = vec![WHOLE];
        msg.extend_from_slice(&(stopped.len().min(SPARED_MAX) as u16).to_ne_bytes());
        for (pid, _) in stopped.iter().take(SPARED_MAX) {
            msg.extend_from_slice(&pid.to_ne_bytes());
        }
        std::io::Write::write_all(&mut &self.fds, &msg)
            .map_err(|err| Error::CriuIo { what: "cannot tell the guard the restored tree is whole".into(), err })
    }

    /// Lets the guard exit without touching the tree.
    pub fn release(&self) {
        let tell = self.tell.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(fd) = tell {
            // SAFETY: one byte from a local to our pipe; a guard already gone
            // gives EPIPE (SIGPIPE is ignored in Rust programs).
            unsafe { libc::write(fd.as_raw_fd(), (&QUIT as *const u8).cast(), 1) };
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), 0) };
        }
    }
}

impl Drop for Guard {
    /// criuz is alive to drop it, so criuz itself killed the tree where that
    /// was needed; killing the pids again could hit unrelated processes (a
    /// restore that failed before the tree ran).
    fn drop(&mut self) {
        self.release();
    }
}

/// Waits for `child` under a guard that kills it and everything it forked
/// should criuz die first. For a runc checkpoint criuz follows: runc would
/// finish a checkpoint nobody packs and end the container; killed, its CRIU
/// lets go of the container mid-dump and it runs on. The guard is released
/// before the child is reaped, while its pid cannot have been reused.
pub fn wait_guarded(child: &mut std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    let guard = Guard::start(&[child.id() as i32]).ok();
    guarded_children().push(child.id() as i32);
    loop {
        // SAFETY: siginfo_t is plain data, for which all zeros is valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid with WNOWAIT on our own child: reports its end and
        // leaves it a zombie, so its pid stays taken.
        let r = unsafe { libc::waitid(libc::P_PID, child.id(), &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    // Forgotten before it is reaped: while listed, its pid is its own.
    guarded_children().retain(|&p| p != child.id() as i32);
    drop(guard);
    child.wait()
}

/// The children [`wait_guarded`] waits for, until each has ended (not yet
/// reaped).
static GUARDED_CHILDREN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

fn guarded_children() -> std::sync::MutexGuard<'static, Vec<i32>> {
    GUARDED_CHILDREN.lock().unwrap_or_else(|p| p.into_inner())
}

/// For a criuz about to die: does now what the guards of
/// [`wait_guarded`] would do once it is dead (kills each such child and
/// what it forked), and waits, at most two seconds, until they have ended,
/// so that nothing they would still do (a runc making its work directory
/// again) comes after criuz's removals. The list stays held: no child is
/// reaped, so no pid is reused, before criuz dies.
pub(crate) fn end_guarded_children() {
    let children = guarded_children();
    for &p in children.iter() {
        kill_tree(&[p]);
    }
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(2)
        && children.iter().any(|&p| holder_of(p).is_some_and(|h| !h.zombie))
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::mem::forget(children);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A pid no process holds now, well past the last one handed out.
    fn free_pid() -> i32 {
        let read = |f: &str| std::fs::read_to_string(f).unwrap().trim().parse::<i32>().unwrap();
        let (last, max) = (read("/proc/sys/kernel/ns_last_pid"), read("/proc/sys/kernel/pid_max"));
        (1..).map(|k| (last + 5000 + k) % max).find(|&p| p > 300 && !Path::new(&format!("/proc/{p}")).exists()).unwrap()
    }

    /// Forks a child that sleeps until killed, as pid `pid` (clone3's
    /// `set_tid`, which takes root); `None` without the privilege.
    fn fork_as(pid: i32) -> Option<i32> {
        #[repr(C)]
        struct CloneArgs {
            flags: u64,
            pidfd: u64,
            child_tid: u64,
            parent_tid: u64,
            exit_signal: u64,
            stack: u64,
            stack_size: u64,
            tls: u64,
            set_tid: u64,
            set_tid_size: u64,
            cgroup: u64,
        }
        let tids = [pid as libc::pid_t];
        let args = CloneArgs {
            flags: 0,
            pidfd: 0,
            child_tid: 0,
            parent_tid: 0,
            exit_signal: libc::SIGCHLD as u64,
            stack: 0,
            stack_size: 0,
            tls: 0,
            set_tid: tids.as_ptr() as u64,
            set_tid_size: 1,
            cgroup: 0,
        };
        // SAFETY: clone3 without CLONE_VM is a fork; the child only pauses
        // (async-signal-safe) until it is killed.
        let r = unsafe { libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
        if r == 0 {
            loop {
                // SAFETY: pause(2) takes nothing.
                unsafe { libc::pause() };
            }
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "clone3 as pid {pid}: {e}");
            return None;
        }
        Some(r as i32)
    }

    #[test]
    fn a_tree_forked_after_criuz_died_is_killed_once_the_awaited_process_ends() {
        // A restoring CRIU may fork the tree after criuz died and the guard
        // first killed it: the guard kills again once CRIU has ended.
        let pid = free_pid();
        let guard = Guard::start(&[pid]).unwrap();
        let mut criu = std::process::Command::new("sleep").arg("1").spawn().unwrap();
        guard.wait_for(criu.id()).unwrap();
        // criuz dies: its end of the command pipe closes without a word.
        drop(guard.tell.lock().unwrap().take());
        // The guard's first kill has found no such pid by now.
        std::thread::sleep(Duration::from_millis(200));
        let Some(forked) = fork_as(pid) else {
            eprintln!("SKIP: forking as a given pid needs root");
            criu.wait().unwrap();
            return;
        };
        criu.wait().unwrap();
        // SAFETY: reaping our own child, the guard, which exits once done.
        unsafe { libc::waitpid(guard.pid, std::ptr::null_mut(), 0) };
        let t = Instant::now();
        let mut status = 0;
        // SAFETY: waitpid on our own child, without blocking.
        while unsafe { libc::waitpid(forked, &mut status, libc::WNOHANG) } == 0 {
            if t.elapsed() > Duration::from_secs(2) {
                // SAFETY: killing and reaping our own child.
                unsafe {
                    libc::kill(forked, libc::SIGKILL);
                    libc::waitpid(forked, &mut status, 0);
                }
                panic!("a process forked as the tree's pid after criuz died outlived the guard");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "status {status:#x}");
    }

    /// The state letter of `pid` (/proc/PID/stat).
    fn state_of_pid(pid: i32) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat.rsplit_once(')').unwrap().1.trim_start().chars().next().unwrap()
    }

    #[test]
    fn a_whole_tree_whose_criuz_dies_before_it_ran_is_let_run() {
        // criuz tells the guard the held tree is whole, then lets it run,
        // then releases the guard. Killed between the first and the last,
        // criuz leaves the guard to let it run (released first, it left
        // the tree stopped for good), but for a process dumped stopped;
        // and the guard lets go of its userfaultfd copies when told.
        let mut run = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let mut stays = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let (pid, kept) = (run.id() as i32, stays.id() as i32);
        // SAFETY: stopping our own children.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
            libc::kill(kept, libc::SIGSTOP);
        }
        let t = Instant::now();
        while state_of_pid(pid) != 'T' || state_of_pid(kept) != 'T' {
            assert!(t.elapsed() < Duration::from_secs(5), "the children never stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
        let guard = Guard::start(&[pid, kept]).unwrap();
        // A pipe's write end stands in for a userfaultfd the guard holds.
        let (pipe_r, pipe_w) = crate::io::pipe().unwrap();
        guard.hold(pipe_w.as_raw_fd()).unwrap();
        drop(pipe_w);
        guard.whole(&[(kept, libc::SIGSTOP)]).unwrap();
        let mut ready = libc::pollfd { fd: pipe_r.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll(2) on one pollfd that lives across it.
        assert_eq!(unsafe { libc::poll(&mut ready, 1, 5000) }, 1, "the guard kept its copy");
        let mut b = 0u8;
        // SAFETY: reads at most one byte into `b`.
        assert_eq!(unsafe { libc::read(pipe_r.as_raw_fd(), (&mut b as *mut u8).cast(), 1) }, 0, "not at its end");
        // criuz dies: its end of the command pipe closes without a word.
        drop(guard.tell.lock().unwrap().take());
        // SAFETY: reaping our own child, the guard, which exits once done.
        unsafe { libc::waitpid(guard.pid, std::ptr::null_mut(), 0) };
        let t = Instant::now();
        while state_of_pid(pid) == 'T' {
            assert!(t.elapsed() < Duration::from_secs(5), "the whole tree was left stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(state_of_pid(kept), 'T', "a process dumped stopped stays stopped");
        for c in [&mut run, &mut stays] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// What a descriptor of `pid` is (`socket:[N]`, `pipe:[N]`, a path).
    fn fd_targets(pid: i32) -> Vec<PathBuf> {
        let dir = format!("/proc/{pid}/fd");
        std::fs::read_dir(&dir).map_or(Vec::new(), |d| d.flatten().filter_map(|e| e.path().read_link().ok()).collect())
    }

    #[test]
    fn the_guard_holds_no_copy_of_what_criuz_had_open() {
        // A copy of a listening socket took CRIU's post-dump hook's
        // connection for a criuz that had died: CRIU waited at its hook,
        // and the guard waited for CRIU.
        let dir = tempfile::tempdir().unwrap();
        let listener = std::os::unix::net::UnixListener::bind(dir.path().join("s")).unwrap();
        let (pipe_r, _pipe_w) = crate::io::pipe().unwrap();
        let ours: Vec<PathBuf> = [listener.as_raw_fd(), pipe_r.as_raw_fd()]
            .iter()
            .map(|fd| Path::new(&format!("/proc/self/fd/{fd}")).read_link().unwrap())
            .collect();
        let guard = Guard::resuming(&[free_pid()], &[]).unwrap();
        let t = Instant::now();
        // Closed as the guard starts: its two own descriptors and the
        // standard streams are all it keeps.
        while fd_targets(guard.pid).len() > 5 && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let held = fd_targets(guard.pid);
        assert!(held.len() <= 5, "the guard holds {held:?}");
        assert!(ours.iter().all(|o| !held.contains(o)), "the guard holds one of {ours:?}: {held:?}");
        guard.release();
    }

    /// A dump at CRIU's post-dump hook whose criuz died: once the CRIU the
    /// guard was told of has ended, a tree left stopped (a completed dump,
    /// its connections locked) is ended, one that runs (rolled back) is
    /// left to run.
    #[test]
    fn a_dump_tree_criu_left_stopped_is_ended_and_one_it_let_run_runs_on() {
        for left_stopped in [true, false] {
            let mut tree = std::process::Command::new("sleep").arg("60").spawn().unwrap();
            let pid = tree.id() as i32;
            if left_stopped {
                // SAFETY: stopping our own child, as CRIU leaves a dumped tree.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
            }
            let guard = Guard::resuming_unless_dumped(&[pid], &[]).unwrap();
            let mut criu = std::process::Command::new("sleep").arg("0.3").spawn().unwrap();
            guard.wait_for(criu.id()).unwrap();
            // criuz dies.
            drop(guard.tell.lock().unwrap().take());
            criu.wait().unwrap();
            // SAFETY: reaping our own child, the guard, which exits once done.
            unsafe { libc::waitpid(guard.pid, std::ptr::null_mut(), 0) };
            let ended = tree.try_wait().unwrap();
            if left_stopped {
                let ended = ended.or_else(|| {
                    std::thread::sleep(Duration::from_millis(200));
                    tree.try_wait().unwrap()
                });
                let status = ended.expect("a tree CRIU left stopped must be ended");
                assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
            } else {
                assert!(ended.is_none(), "a tree CRIU let run must run on: {ended:?}");
                tree.kill().unwrap();
                tree.wait().unwrap();
            }
        }
    }
}
