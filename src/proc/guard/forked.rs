//! The guard process itself: what runs in the fork (`Guard`'s doc says
//! why). It keeps to async-signal-safe calls on memory prepared before the
//! fork: it closes what the fork copied, ignores the signals a Ctrl-C
//! sends, takes criuz's messages (userfaultfd copies, a cgroup, a pid to
//! wait for, the tree whole) and, once criuz's end closes without a quit,
//! kills, resumes or ends the tree, runs its command or kills the cgroup.

use super::{CGROUP, CGROUP_PATH_MAX, QUIT, SPARED_MAX, WAIT_FOR, WHOLE};
use crate::proc::tree::{kill_tree, left_stopped, signal_tree_except, wait_ended, wait_untraced};
use crate::spawn::Mask;
use std::os::fd::RawFd;

/// What a dump's guard does with the tree once criuz is gone.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterCriu {
    /// Resumes it once its tracer let go (or signals it as told).
    Resume,
    /// Waits for CRIU to end; ends the tree if CRIU left it stopped (the
    /// dump completed), resumes it otherwise.
    EndIfDumped,
}

/// What the guard works with: its descriptors and its signal mask.
#[derive(Clone, Copy)]
pub(super) struct GuardFds {
    pub(super) tell: RawFd,
    pub(super) fds: RawFd,
    /// The signal mask the guard runs with (`spawn::started_with`).
    pub(super) mask: Option<Mask>,
}

/// The guard process (see the module documentation): only async-signal-safe
/// calls, on memory prepared before the fork.
///
/// # Safety
///
/// Only in the child of a fork, which must call nothing else: `f` holds the
/// descriptors made for it before the fork, and it never returns.
pub(super) unsafe fn guard_main(
    f: GuardFds,
    tree: &[i32],
    sig: i32,
    exec: Option<&[*const libc::c_char]>,
    spared: &[i32],
    after: AfterCriu,
) -> ! {
    // criuz's ends must close when criuz dies, and so must everything else
    // the fork copied: a copy of a socket criuz listens on (a dump's
    // post-dump hook) would take CRIU's connection for a criuz that is
    // gone, and CRIU would wait at its hook for ever while the guard waits
    // for CRIU; a copy of a pipe would keep its reader from seeing the end.
    // SAFETY: closes descriptors of this process only, none of which it
    // uses but its own two (and the standard streams, kept for a command).
    unsafe { close_all_but(&[f.tell, f.fds]) };
    // SAFETY: signal(2) with SIG_IGN installs no handler.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    // The forking thread's mask holds criuz's signals back
    // (`interrupt::install`): a guard, and what it runs, start with the
    // mask criuz was started with (`spawn`).
    if let Some(Mask(mask)) = f.mask {
        // SAFETY: sigprocmask is async-signal-safe; `mask` was copied
        // before the fork.
        unsafe { libc::sigprocmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut()) };
    }
    let mut fds = [
        libc::pollfd { fd: f.tell, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: f.fds, events: libc::POLLIN, revents: 0 },
    ];
    // A cgroup's `cgroup.kill`, NUL-terminated, once criuz names one.
    let mut cgroup = [0u8; CGROUP_PATH_MAX + 1];
    let mut has_cgroup = false;
    let mut wait_pid = 0i32;
    // Once the tree is whole (`WHOLE`): the processes to leave stopped.
    let mut whole = Whole { told: false, spared: [0; SPARED_MAX], n: 0 };
    let mut let_go = false;
    loop {
        // SAFETY: poll(2) on the two pollfds of `fds`, which live across it.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            continue;
        }
        let taken = fds[1].revents == 0
            // SAFETY: take_message is async-signal-safe and fills our own buffers.
            || unsafe { take_message(f.fds, &mut cgroup, &mut has_cgroup, &mut wait_pid, &mut whole) };
        if !taken {
            // criuz's end closed: the command pipe says what to do.
            fds[1].fd = -1;
        }
        if whole.told && !let_go {
            // The userfaultfd copies: every descriptor but the guard's two.
            // SAFETY: as at the start, this process's own descriptors.
            unsafe { close_all_but(&[f.tell, f.fds]) };
            let_go = true;
        }
        if fds[0].revents != 0 {
            let mut b = 0u8;
            // SAFETY: reads at most one byte into `b`.
            let r = unsafe { libc::read(f.tell, (&mut b as *mut u8).cast(), 1) };
            // SAFETY: __errno_location points at this thread's errno.
            if r < 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
                continue;
            }
            if !(r == 1 && b == QUIT) {
                // What criuz sent before it went, the cgroup above all.
                let mut one = libc::pollfd { fd: fds[1].fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: poll(2) on `one`, which lives across it.
                while one.fd >= 0 && unsafe { libc::poll(&mut one, 1, 0) } == 1 {
                    // SAFETY: as above, our own buffers.
                    if !unsafe { take_message(f.fds, &mut cgroup, &mut has_cgroup, &mut wait_pid, &mut whole) } {
                        one.fd = -1;
                    }
                }
                let mut sig = sig;
                let mut spared = spared;
                if whole.told {
                    // Every page in: the tree runs, as criuz was about to
                    // let it, its userfaultfds let go first.
                    if !let_go {
                        // SAFETY: as at the start, this process's own descriptors.
                        unsafe { close_all_but(&[f.tell, f.fds]) };
                    }
                    sig = libc::SIGCONT;
                    spared = &whole.spared[..whole.n];
                }
                if after == AfterCriu::EndIfDumped {
                    if wait_pid > 0 {
                        wait_ended(wait_pid, 15 * 60 * 1000);
                    }
                    wait_untraced(tree, 60_000);
                    if left_stopped(tree, spared) {
                        kill_tree(tree);
                        sig = 0;
                    }
                }
                if sig == libc::SIGCONT {
                    // A dump's tree: only once CRIU has let go of it.
                    wait_untraced(tree, 60_000);
                }
                if sig != 0 {
                    signal_tree_except(tree, sig, spared);
                }
                if wait_pid > 0 {
                    wait_ended(wait_pid, 15 * 60 * 1000);
                    if sig == libc::SIGKILL {
                        // What it waited for (a restoring CRIU) may have
                        // forked more of the tree after the kill above.
                        kill_tree(tree);
                    }
                }
                if let Some(argv) = exec {
                    // SAFETY: fork, execv, _exit and waitpid are
                    // async-signal-safe; `argv` is a NULL-terminated array of
                    // NUL-terminated strings made before the guard's fork.
                    unsafe {
                        let pid = libc::fork();
                        if pid == 0 {
                            libc::execv(argv[0], argv.as_ptr());
                            libc::_exit(127);
                        }
                        if pid > 0 {
                            libc::waitpid(pid, std::ptr::null_mut(), 0);
                        }
                    }
                }
                if has_cgroup {
                    // SAFETY: `cgroup` holds a NUL-terminated path (take_message).
                    let fd = unsafe { libc::open(cgroup.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC) };
                    if fd >= 0 {
                        // SAFETY: one byte from a static to the descriptor
                        // just opened, then closed once.
                        unsafe {
                            libc::write(fd, b"1".as_ptr().cast(), 1);
                            libc::close(fd);
                        }
                    }
                }
            }
            // SAFETY: ends this process without running anything of criuz's
            // (no destructors, no atexit handlers).
            unsafe { libc::_exit(0) };
        }
    }
}

/// Closes every descriptor from 3 up but `keep`.
///
/// # Safety
/// Async-signal-safe (close_range, close); the caller must own what it
/// closes.
pub(super) unsafe fn close_all_but(keep: &[RawFd]) {
    let mut from: RawFd = 3;
    let mut kept = [keep.first().copied().unwrap_or(-1), keep.get(1).copied().unwrap_or(-1)];
    kept.sort_unstable();
    for upto in kept.into_iter().filter(|&k| k >= 3).map(Some).chain([None]) {
        let last = upto.map_or(RawFd::MAX, |k| k - 1);
        if from <= last {
            // SAFETY: close_range(2) on this process's descriptors.
            let r = unsafe { libc::syscall(libc::SYS_close_range, from as u32, last as u32, 0u32) };
            if r != 0 {
                // Before Linux 5.9: one at a time, as far as any can be open.
                let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                // SAFETY: getrlimit fills a local.
                let max = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } {
                    0 => lim.rlim_cur.min(1 << 20) as RawFd,
                    _ => 1024,
                };
                for fd in from..=last.min(max) {
                    // SAFETY: close(2) on this process's descriptors.
                    unsafe { libc::close(fd) };
                }
            }
        }
        if let Some(k) = upto {
            from = k + 1;
        }
    }
}

/// Takes one message from criuz: a userfaultfd to hold (receiving it is
/// holding it, never closed until the guard exits) or a cgroup to kill.
/// False once criuz's end is closed. Async-signal-safe.
///
/// # Safety
///
/// No precondition on the caller: recvmsg and read write only into buffers
/// of its own stack and into `cgroup`.
pub(super) unsafe fn take_message(
    sock: RawFd,
    cgroup: &mut [u8; CGROUP_PATH_MAX + 1],
    has_cgroup: &mut bool,
    wait_pid: &mut i32,
    whole: &mut Whole,
) -> bool {
    let mut byte = 0u8;
    let mut iov = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data, for which all zeros is valid (no
    // buffers, filled in below).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` points at `iov` (one byte, `byte`) and `control`, all
    // of which live across the call and are as long as it says.
    if unsafe { libc::recvmsg(sock, &mut msg, 0) } <= 0 {
        return false;
    }
    if byte == CGROUP {
        let mut len = [0u8; 2];
        // SAFETY: read_exactly writes only into `len`.
        if !unsafe { read_exactly(sock, &mut len) } {
            return false;
        }
        let n = u16::from_ne_bytes(len) as usize;
        // SAFETY: read_exactly writes only into `cgroup[..n]`.
        if n == 0 || n > CGROUP_PATH_MAX || !unsafe { read_exactly(sock, &mut cgroup[..n]) } {
            return false;
        }
        cgroup[n] = 0;
        *has_cgroup = true;
    } else if byte == WAIT_FOR {
        let mut pid = [0u8; 4];
        // SAFETY: read_exactly writes only into `pid`.
        if !unsafe { read_exactly(sock, &mut pid) } {
            return false;
        }
        *wait_pid = i32::from_ne_bytes(pid);
    } else if byte == WHOLE {
        let mut count = [0u8; 2];
        // SAFETY: read_exactly writes only into `count`.
        if !unsafe { read_exactly(sock, &mut count) } {
            return false;
        }
        let n = (u16::from_ne_bytes(count) as usize).min(SPARED_MAX);
        for slot in whole.spared.iter_mut().take(n) {
            let mut pid = [0u8; 4];
            // SAFETY: read_exactly writes only into `pid`.
            if !unsafe { read_exactly(sock, &mut pid) } {
                return false;
            }
            *slot = i32::from_ne_bytes(pid);
        }
        whole.n = n;
        whole.told = true;
    }
    true
}

/// What a guard knows once criuz told it the held tree is whole.
pub(super) struct Whole {
    told: bool,
    /// Pids to leave stopped (dumped stopped), the first `n`.
    spared: [i32; SPARED_MAX],
    n: usize,
}

/// Reads exactly `buf.len()` bytes (async-signal-safe: the guard uses it).
///
/// # Safety
///
/// No precondition on the caller: read writes only into `buf`.
pub(super) unsafe fn read_exactly(fd: RawFd, buf: &mut [u8]) -> bool {
    let mut at = 0;
    while at < buf.len() {
        // SAFETY: read writes at most `buf.len() - at` bytes into `buf[at..]`.
        let r = unsafe { libc::read(fd, buf[at..].as_mut_ptr().cast(), buf.len() - at) };
        // SAFETY: __errno_location points at this thread's errno.
        if r < 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
            continue;
        }
        if r <= 0 {
            return false;
        }
        at += r as usize;
    }
    true
}
