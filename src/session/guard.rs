//! The guard of a lazy restore: a process forked from criuz that runs CRIU's
//! lazy-pages daemon as its own child and kills the restored tree the moment
//! either of them fails.
//!
//! A lazily restored process reads zeros wherever a page had not arrived
//! when the daemon's userfaultfd closed, so the tree must die before that
//! can matter:
//! - the daemon dies abnormally (crash, signal, error exit): the guard is its
//!   parent and learns of it from a pidfd at once, kills the tree, and
//!   reports the wait status to criuz;
//! - criuz dies: the guard holds a copy of criuz's end of the page-server
//!   socket, so the daemon keeps waiting for pages instead of leaving holes,
//!   and the guard, seeing its command pipe close, kills the tree, then the
//!   daemon;
//! - criuz finds a damaged block: criuz kills the tree itself before it
//!   closes the socket.
//!
//! The guard is a fork of a threaded process, so it calls only
//! async-signal-safe functions (poll, read, write, kill, waitpid, fork,
//! execv, signal, _exit) on memory prepared before the fork. It reports the
//! daemon's pid first, so criuz can hold copies of the tree's userfaultfds
//! (`session::lazy`): with those open, a dead daemon leaves faulting threads
//! blocked, not reading zeros, until the guard's kill lands.

use crate::error::{Error, Result};
use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

/// Command from criuz: stop the daemon and leave the tree alone (the restore
/// failed before the tree ran, or criuz already killed it). Any other byte,
/// or the pipe closing, kills the tree.
const QUIT: u8 = b'q';

pub struct Guard {
    tell: Option<OwnedFd>,
    status: OwnedFd,
    pid: libc::pid_t,
    /// The daemon's pid, as the guard reported it first.
    pub daemon_pid: libc::pid_t,
    daemon: Option<ExitStatus>,
}

fn cstring(s: &OsStr) -> Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| Error::Usage(format!("{}: contains a NUL byte", s.to_string_lossy())))
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl Guard {
    /// Forks the guard, which runs `program args` (the daemon) with
    /// `inherit` left open across exec and standard streams on /dev/null,
    /// and guards `tree`.
    pub fn start(program: &Path, args: &[&OsStr], inherit: RawFd, tree: &[i32]) -> Result<Guard> {
        let path = cstring(program.as_os_str())?;
        let mut argv_owned = vec![path.clone()];
        for a in args {
            argv_owned.push(cstring(a)?);
        }
        let mut argv: Vec<*const libc::c_char> = argv_owned.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let devnull = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
        let (tell_r, tell_w) = pipe()?;
        let (status_r, status_w) = pipe()?;
        let tree = tree.to_vec();
        let fds = GuardFds {
            inherit,
            devnull: devnull.as_raw_fd(),
            tell: tell_r.as_raw_fd(),
            status: status_w.as_raw_fd(),
            not_ours: [tell_w.as_raw_fd(), status_r.as_raw_fd()],
        };

        // SAFETY: the child runs only async-signal-safe calls on memory
        // prepared above (see the module documentation), and never returns.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { guard_main(&path, &argv, fds, &tree) }
        }
        if pid < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // The guard's ends (tell_r, status_w) and /dev/null close here.
        drop((tell_r, status_w, devnull));
        let mut g = Guard { tell: Some(tell_w), status: status_r, pid, daemon_pid: 0, daemon: None };
        match g.read_i32() {
            Some(d) if d > 0 => g.daemon_pid = d,
            _ => {
                g.read_status();
                return Err(Error::Criu(format!("cannot run {}", program.display())));
            }
        }
        Ok(g)
    }

    /// The daemon's exit status, if it has ended (without waiting).
    pub fn daemon_ended(&mut self) -> Option<ExitStatus> {
        if self.daemon.is_none() {
            let mut p = libc::pollfd { fd: self.status.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd of ours, no wait.
            if unsafe { libc::poll(&mut p, 1, 0) } == 1 {
                self.read_status();
            }
        }
        self.daemon
    }

    /// Waits for the daemon to end.
    pub fn wait_daemon(&mut self) -> ExitStatus {
        if self.daemon.is_none() {
            self.read_status();
        }
        self.daemon.expect("status read")
    }

    /// Stops the daemon, leaving the tree alone.
    pub fn stop_daemon(&mut self) {
        self.tell(QUIT);
        self.wait_daemon();
    }

    fn tell(&mut self, word: u8) {
        if let Some(fd) = self.tell.take() {
            // SAFETY: one byte from a local to our pipe; a guard already gone
            // gives EPIPE (SIGPIPE is ignored in Rust programs).
            unsafe { libc::write(fd.as_raw_fd(), (&word as *const u8).cast(), 1) };
        }
    }

    fn read_i32(&mut self) -> Option<i32> {
        let mut v: i32 = 0;
        let mut got = 0usize;
        while got < 4 {
            // SAFETY: reading into the bytes of a local i32.
            let n = unsafe {
                libc::read(self.status.as_raw_fd(), (&mut v as *mut i32).cast::<u8>().add(got).cast(), 4 - got)
            };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n <= 0 {
                return None;
            }
            got += n as usize;
        }
        Some(v)
    }

    fn read_status(&mut self) {
        // A guard that died without a word counts as a killed daemon.
        let st = self.read_i32().unwrap_or(libc::SIGKILL);
        self.daemon = Some(ExitStatus::from_raw(st));
        // The guard exits once it has reported.
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), 0) };
        self.tell = None;
    }
}

impl Drop for Guard {
    /// criuz is alive to drop it, so criuz itself killed the tree where that
    /// was needed; killing the pids again could hit unrelated processes (a
    /// restore that failed before the tree ran).
    fn drop(&mut self) {
        if self.daemon.is_none() {
            self.stop_daemon();
        }
    }
}

/// Descriptors the guard works with, and criuz's ends it must close.
#[derive(Clone, Copy)]
struct GuardFds {
    inherit: RawFd,
    devnull: RawFd,
    tell: RawFd,
    status: RawFd,
    not_ours: [RawFd; 2],
}

/// SIGKILLs every pid of a restored tree. Only kill(2): async-signal-safe,
/// so the guard uses it too.
pub(crate) fn kill_tree(tree: &[i32]) {
    for &p in tree {
        // SAFETY: the restored tree's pids, which are ours to end.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
}

/// The guard process (see the module documentation): only async-signal-safe
/// calls, on memory prepared before the fork.
unsafe fn guard_main(path: &CString, argv: &[*const libc::c_char], f: GuardFds, tree: &[i32]) -> ! {
    // criuz's end of the command pipe must close when criuz dies.
    for fd in f.not_ours {
        libc::close(fd);
    }
    let (tell, status) = (f.tell, f.status);
    // A Ctrl-C reaches the whole group: the guard must outlive criuz to kill
    // the tree, and the daemon (inheriting this) must keep serving until then.
    libc::signal(libc::SIGINT, libc::SIG_IGN);
    libc::signal(libc::SIGHUP, libc::SIG_IGN);
    libc::signal(libc::SIGTERM, libc::SIG_IGN);
    let daemon = libc::fork();
    if daemon == 0 {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::dup2(f.devnull, 0);
        libc::dup2(f.devnull, 1);
        libc::dup2(f.devnull, 2);
        libc::fcntl(f.inherit, libc::F_SETFD, 0);
        libc::execv(path.as_ptr(), argv.as_ptr());
        libc::_exit(127);
    }
    let report = |st: i32| -> ! {
        libc::write(status, (&st as *const i32).cast(), 4);
        libc::_exit(0)
    };
    // The daemon's pid first (-1: no daemon), its wait status when it ends.
    libc::write(status, (&daemon as *const i32).cast(), 4);
    if daemon < 0 {
        report(127 << 8);
    }
    let pidfd = libc::syscall(libc::SYS_pidfd_open, daemon, 0) as libc::c_int;
    let mut fds = [
        libc::pollfd { fd: tell, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: pidfd, events: libc::POLLIN, revents: 0 },
    ];
    // Without a pidfd (kernel < 5.3) only criuz's word ends the wait.
    let n = if pidfd < 0 { 1 } else { 2 };
    loop {
        if libc::poll(fds.as_mut_ptr(), n, -1) < 0 {
            continue;
        }
        let mut st = 0;
        if n == 2 && fds[1].revents != 0 {
            libc::waitpid(daemon, &mut st, 0);
            if !(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0) {
                kill_tree(tree);
            }
            report(st);
        }
        if fds[0].revents != 0 {
            let mut b = 0u8;
            let r = libc::read(tell, (&mut b as *mut u8).cast(), 1);
            if r < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if !(r == 1 && b == QUIT) {
                kill_tree(tree);
            }
            libc::kill(daemon, libc::SIGKILL);
            libc::waitpid(daemon, &mut st, 0);
            report(st);
        }
    }
}
