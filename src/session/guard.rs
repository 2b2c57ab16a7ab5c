//! The guard of a tree criuz is responsible for: a process forked from
//! criuz that signals the tree if criuz dies before its work is done. A lazy
//! restore's guard kills the restored tree (below); a dump's guard resumes
//! the tree CRIU left stopped (`--leave-stopped`, so that it ends only once
//! its archive is committed), so a criuz killed meanwhile leaves the
//! process running instead of stopped for good.
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
//! forked while pages still arrive misses pages too): `kill_tree` finds the
//! descendants through /proc before it kills.
//!
//! A container's restored tree lives in a pid namespace of its own, so its
//! pids mean nothing here: a container's lazy restore kills its cgroup
//! instead ([`Victim::Cgroup`], cgroup v2 `cgroup.kill`, which also takes
//! whatever the tree forks meanwhile). criuz learns the cgroup from CRIU's
//! lazy-pages connection before the first userfaultfd arrives and tells
//! the guard first ([`Guard::target_cgroup`]).
//!
//! The guard ignores SIGINT, SIGHUP and SIGTERM: a Ctrl-C that reaches the
//! whole group and kills criuz must still end in the tree's kill.
//!
//! The guard is a fork of a threaded process, so it calls only
//! async-signal-safe functions (poll, read, recvmsg, open, getdents64,
//! kill, signal, close, _exit) on memory prepared before the fork.

use crate::criu::scm;
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Command from criuz: exit and leave the tree alone (its pages are all in
/// place, the restore failed before it ran, or criuz killed it already). Any
/// other byte, or the pipe closing, kills the tree.
const QUIT: u8 = b'q';

/// On the descriptor socket: a cgroup's `cgroup.kill` path follows (u16
/// length, then the bytes). A held userfaultfd comes with any other byte.
const CGROUP: u8 = b'K';

/// Longest `cgroup.kill` path the guard takes (its buffer is on the stack).
const CGROUP_PATH_MAX: usize = 1024;

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
            Victim::Tree(pids) => kill_tree(pids),
            Victim::Cgroup(c) => {
                if let Some(path) = c.get() {
                    let _ = std::fs::write(path, b"1");
                }
            }
        }
    }

    /// Waits (a few seconds at most) until it is gone, killing it again
    /// after a second.
    pub fn wait_gone(&self) {
        match self {
            Victim::Tree(pids) => crate::session::checkpoint::end_aborted_tree(pids),
            Victim::Cgroup(c) => {
                let Some(procs) = c.get().map(|k| k.with_file_name("cgroup.procs")) else { return };
                let t = std::time::Instant::now();
                while std::fs::read_to_string(&procs).is_ok_and(|s| !s.trim().is_empty()) {
                    if t.elapsed() > std::time::Duration::from_secs(1) {
                        self.kill();
                    }
                    if t.elapsed() > std::time::Duration::from_secs(5) {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        }
    }
}

/// The `cgroup.kill` of the cgroup v2 group process `pid` is in, if there
/// is one to kill that holds nothing but descendants of `owner` (criuz,
/// which started runc, which started CRIU and, beside CRIU, the restored
/// tree; not without a cgroup v2 mount, not the root group, not a group
/// criuz is in itself); otherwise why not.
pub fn cgroup_kill_of(pid: u32, owner: u32) -> std::result::Result<PathBuf, String> {
    let text =
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|e| format!("/proc/{pid}/cgroup: {e}"))?;
    let group = text.lines().find_map(|l| l.strip_prefix("0::")).ok_or("no cgroup v2 group")?;
    if group == "/" || group.split('/').any(|c| c == "..") {
        return Err(format!("its cgroup v2 group is {group:?}"));
    }
    // cgroup.kill takes the group's descendants too: never one that holds
    // criuz itself (a container run in criuz's own group).
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let own = own.lines().find_map(|l| l.strip_prefix("0::")).ok_or("criuz is in no cgroup v2 group")?;
    if own == group || own.starts_with(&format!("{group}/")) {
        return Err(format!("its group {group} holds criuz itself"));
    }
    let dir = cgroup2_mount().ok_or("no cgroup v2 mount")?.join(group.trim_start_matches('/'));
    // Only a group of criuz's own processes: runc moves CRIU into the
    // container's group to restore, and CRIU forks the restored tree's root
    // as its own sibling (a child of runc), so both are there; a CRIU left
    // in a group shared with anything else (cgroups not managed) would make
    // the kill take that too.
    let procs_file = dir.join("cgroup.procs");
    let procs = std::fs::read_to_string(&procs_file).map_err(|e| format!("{}: {e}", procs_file.display()))?;
    if let Some(other) = procs.split_whitespace().find(|p| !p.parse().is_ok_and(|p| descends_from(p, owner))) {
        let comm = std::fs::read_to_string(format!("/proc/{other}/comm")).unwrap_or_default();
        return Err(format!("its group {group} also holds pid {other} ({}), not one of criuz's", comm.trim()));
    }
    let kill = dir.join("cgroup.kill");
    if kill.is_file() {
        Ok(kill)
    } else {
        Err(format!("{} is missing", kill.display()))
    }
}

/// Where the whole cgroup v2 hierarchy is mounted (its root, from
/// mountinfo: id parent dev root mountpoint opts... - fstype source opts).
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        (post.split(' ').next() == Some("cgroup2") && pre.split(' ').nth(3) == Some("/"))
            .then(|| pre.split(' ').nth(4).map(PathBuf::from))?
    })
}

/// Whether `pid` is `ancestor` or below it (parents through /proc).
fn descends_from(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..4096 {
        if pid == ancestor {
            return true;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
        // The parent is the second field after the command's closing paren.
        match stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok()) {
            Some(parent) if parent > 0 && parent != pid => pid = parent,
            _ => return false,
        }
    }
    false
}

pub struct Guard {
    tell: Option<OwnedFd>,
    fds: UnixStream,
    pid: libc::pid_t,
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
    /// Forks the guard of a lazily restored `tree`: it kills the tree if
    /// criuz dies before [`release`](Self::release).
    pub fn start(tree: &[i32]) -> Result<Guard> {
        Self::signalling(tree, libc::SIGKILL)
    }

    /// Forks the guard of a dumped `tree` CRIU leaves stopped: it resumes
    /// the tree (SIGCONT) if criuz dies before [`release`](Self::release).
    pub fn resuming(tree: &[i32]) -> Result<Guard> {
        Self::signalling(tree, libc::SIGCONT)
    }

    fn signalling(tree: &[i32], sig: i32) -> Result<Guard> {
        let (tell_r, tell_w) = pipe()?;
        let (ours, theirs) = UnixStream::pair()?;
        let tree = tree.to_vec();
        let fds = GuardFds {
            tell: tell_r.as_raw_fd(),
            fds: theirs.as_raw_fd(),
            not_ours: [tell_w.as_raw_fd(), ours.as_raw_fd()],
        };
        // SAFETY: the child runs only async-signal-safe calls on memory
        // prepared above (see the module documentation), and never returns.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { guard_main(fds, &tree, sig) }
        }
        if pid < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        drop((tell_r, theirs));
        Ok(Guard { tell: Some(tell_w), fds: ours, pid })
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
            .map_err(|e| Error::Criu(format!("cannot tell the guard the restored container's cgroup: {e}")))
    }

    /// Gives the guard a copy of a userfaultfd of the tree.
    pub fn hold(&self, fd: RawFd) -> Result<()> {
        scm::send_fd(&self.fds, fd)
            .map_err(|e| Error::Criu(format!("cannot pass the restored tree's userfaultfd to the guard: {e}")))
    }

    /// Lets the guard exit without touching the tree.
    pub fn release(&mut self) {
        if let Some(fd) = self.tell.take() {
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
pub fn wait_guarded(child: &mut std::process::Child) -> Result<std::process::ExitStatus> {
    let guard = Guard::start(&[child.id() as i32]).ok();
    loop {
        // SAFETY: waitid with WNOWAIT on our own child: reports its end and
        // leaves it a zombie, so its pid stays taken.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::waitid(libc::P_PID, child.id(), &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    drop(guard);
    Ok(child.wait()?)
}

/// Descriptors the guard works with, and criuz's ends it must close.
#[derive(Clone, Copy)]
struct GuardFds {
    tell: RawFd,
    fds: RawFd,
    not_ours: [RawFd; 2],
}

/// Most processes `kill_tree` finds and kills (pids on the stack: the guard
/// cannot allocate).
const MAX_TREE: usize = 4096;

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
    let mut pids = [0i32; MAX_TREE];
    let n = collect_tree(tree, &mut pids);
    for &p in pids[..n].iter().rev() {
        // SAFETY: a tree criuz restored or dumped, and what it forked.
        unsafe { libc::kill(p, sig) };
    }
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
        // SAFETY: only system calls on stack buffers we own.
        n = unsafe { add_children(pids[i], pids, n) };
        i += 1;
    }
    n
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
unsafe fn add_children(pid: i32, pids: &mut [i32; MAX_TREE], mut n: usize) -> usize {
    let mut path = [0u8; 64];
    let task = proc_path(&mut path, &[Part::Text(b"/proc/"), Part::Num(pid.into()), Part::Text(b"/task")]);
    let dir = libc::open(task.as_ptr().cast(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC);
    if dir < 0 {
        return n;
    }
    let mut entries = [0u8; 2048];
    loop {
        let got = libc::syscall(libc::SYS_getdents64, dir, entries.as_mut_ptr(), entries.len());
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
            let fd = libc::open(children.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                continue;
            }
            let mut text = [0u8; 4096];
            let len = libc::read(fd, text.as_mut_ptr().cast(), text.len());
            libc::close(fd);
            let mut child = 0i32;
            let mut in_number = false;
            for &b in text[..len.max(0) as usize].iter().chain(b" ") {
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
        }
    }
    libc::close(dir);
    n
}

/// The guard process (see the module documentation): only async-signal-safe
/// calls, on memory prepared before the fork.
unsafe fn guard_main(f: GuardFds, tree: &[i32], sig: i32) -> ! {
    // criuz's ends must close when criuz dies.
    for fd in f.not_ours {
        libc::close(fd);
    }
    libc::signal(libc::SIGINT, libc::SIG_IGN);
    libc::signal(libc::SIGHUP, libc::SIG_IGN);
    libc::signal(libc::SIGTERM, libc::SIG_IGN);
    let mut fds = [
        libc::pollfd { fd: f.tell, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: f.fds, events: libc::POLLIN, revents: 0 },
    ];
    // A cgroup's `cgroup.kill`, NUL-terminated, once criuz names one.
    let mut cgroup = [0u8; CGROUP_PATH_MAX + 1];
    let mut has_cgroup = false;
    loop {
        if libc::poll(fds.as_mut_ptr(), 2, -1) < 0 {
            continue;
        }
        if fds[1].revents != 0 && !take_message(f.fds, &mut cgroup, &mut has_cgroup) {
            // criuz's end closed: the command pipe says what to do.
            fds[1].fd = -1;
        }
        if fds[0].revents != 0 {
            let mut b = 0u8;
            let r = libc::read(f.tell, (&mut b as *mut u8).cast(), 1);
            if r < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if !(r == 1 && b == QUIT) {
                // What criuz sent before it went, the cgroup above all.
                let mut one = libc::pollfd { fd: fds[1].fd, events: libc::POLLIN, revents: 0 };
                while one.fd >= 0 && libc::poll(&mut one, 1, 0) == 1 {
                    if !take_message(f.fds, &mut cgroup, &mut has_cgroup) {
                        one.fd = -1;
                    }
                }
                signal_tree(tree, sig);
                if has_cgroup {
                    let fd = libc::open(cgroup.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd >= 0 {
                        libc::write(fd, b"1".as_ptr().cast(), 1);
                        libc::close(fd);
                    }
                }
            }
            libc::_exit(0);
        }
    }
}

/// Takes one message from criuz: a userfaultfd to hold (receiving it is
/// holding it, never closed until the guard exits) or a cgroup to kill.
/// False once criuz's end is closed. Async-signal-safe.
unsafe fn take_message(sock: RawFd, cgroup: &mut [u8; CGROUP_PATH_MAX + 1], has_cgroup: &mut bool) -> bool {
    let mut byte = 0u8;
    let mut iov = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let mut control = [0u64; 8];
    let mut msg: libc::msghdr = std::mem::zeroed();
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    if libc::recvmsg(sock, &mut msg, 0) <= 0 {
        return false;
    }
    if byte == CGROUP {
        let mut len = [0u8; 2];
        if !read_exactly(sock, &mut len) {
            return false;
        }
        let n = u16::from_ne_bytes(len) as usize;
        if n == 0 || n > CGROUP_PATH_MAX || !read_exactly(sock, &mut cgroup[..n]) {
            return false;
        }
        cgroup[n] = 0;
        *has_cgroup = true;
    }
    true
}

/// Reads exactly `buf.len()` bytes (async-signal-safe: the guard uses it).
unsafe fn read_exactly(fd: RawFd, buf: &mut [u8]) -> bool {
    let mut at = 0;
    while at < buf.len() {
        let r = libc::read(fd, buf[at..].as_mut_ptr().cast(), buf.len() - at);
        if r < 0 && *libc::__errno_location() == libc::EINTR {
            continue;
        }
        if r <= 0 {
            return false;
        }
        at += r as usize;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command};

    /// A cgroup v2 group made for one test, removed (its processes killed
    /// first) when dropped.
    struct TestGroup(PathBuf);

    impl TestGroup {
        fn new(name: &str) -> TestGroup {
            let mount = cgroup2_mount().expect("a cgroup v2 mount (lazy container restores need one)");
            let dir = mount.join(format!("criuz-test-{name}-{}", std::process::id()));
            std::fs::create_dir(&dir).unwrap();
            TestGroup(dir)
        }
        fn admit(&self, pid: u32) {
            std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
        }
    }

    impl Drop for TestGroup {
        fn drop(&mut self) {
            let _ = std::fs::write(self.0.join("cgroup.kill"), "1");
            for _ in 0..500 {
                for sub in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
                    let _ = std::fs::remove_dir(sub.path());
                }
                if std::fs::remove_dir(&self.0).is_ok() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }

    fn sleeper() -> Child {
        Command::new("sleep").arg("60").spawn().unwrap()
    }

    /// A shell (standing in for CRIU) with a child of its own.
    fn parent_with_child() -> (Child, u32) {
        let sh = Command::new("sh").args(["-c", "sleep 60 & wait"]).spawn().unwrap();
        let mut kid = None;
        for _ in 0..500 {
            let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", sh.id())).unwrap_or_default();
            kid = kids.split_whitespace().next().map(|k| k.parse().unwrap());
            if kid.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        match kid {
            Some(kid) => (sh, kid),
            None => {
                reap(vec![sh]);
                panic!("the shell started no child")
            }
        }
    }

    fn reap(mut children: Vec<Child>) {
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// What `cgroup_kill_of(pid, ..)` says when criuz is in group `dir`: the
    /// test binary runs [`own_group_probe`] there.
    fn probe_in(dir: &Path, pid: u32) -> String {
        let procs = std::ffi::CString::new(dir.join("cgroup.procs").into_os_string().into_vec()).unwrap();
        let mut probe = Command::new(std::env::current_exe().unwrap());
        probe.args(["--exact", "session::guard::tests::own_group_probe", "--ignored", "--nocapture"]);
        probe.env("CRIUZ_PROBE_PID", pid.to_string());
        // Everything in the groups descends from the test: only the rule
        // under test can refuse.
        probe.env("CRIUZ_PROBE_OWNER", std::process::id().to_string());
        // SAFETY: open, write and close are async-signal-safe; `procs` was
        // built before the fork.
        unsafe {
            probe.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writer itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        };
        let out = probe.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        text
    }

    #[test]
    #[ignore = "run by a_group_criuz_is_in_is_never_killed, in a group of its own"]
    fn own_group_probe() {
        let var = |name: &str| match std::env::var(name).map(|p| p.parse().unwrap()) {
            Ok(0) | Err(_) => std::process::id(),
            Ok(p) => p,
        };
        println!("probe: {:?}", cgroup_kill_of(var("CRIUZ_PROBE_PID"), var("CRIUZ_PROBE_OWNER")).ok());
    }

    #[test]
    fn a_group_criuz_is_in_is_never_killed() {
        // Each group below holds nothing but processes of the test's own:
        // every other rule would let it be killed.
        let group = TestGroup::new("own");
        let text = probe_in(&group.0, 0);
        assert!(text.contains("probe: None"), "{text}");
        // criuz in a group below the one asked about (cgroup.kill takes the
        // descendant groups too).
        let below = group.0.join("criuz");
        std::fs::create_dir(&below).unwrap();
        let child = sleeper();
        group.admit(child.id());
        assert_eq!(cgroup_kill_of(child.id(), std::process::id()), Ok(group.0.join("cgroup.kill")));
        let text = probe_in(&below, child.id());
        assert!(text.contains("probe: None"), "{text}");
        drop(group);
        reap(vec![child]);
    }

    /// A process of the test's own making that is not its descendant (a
    /// shell's background child, orphaned when the shell exits).
    fn stranger() -> u32 {
        let out = Command::new("sh").args(["-c", "sleep 60 >/dev/null 2>&1 & echo $!"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    #[test]
    fn only_a_group_of_criuz_s_own_processes_is_killed() {
        let me = std::process::id();
        let group = TestGroup::new("private");
        let (criu, kid) = parent_with_child();
        group.admit(criu.id());
        group.admit(kid);
        assert_eq!(cgroup_kill_of(criu.id(), me), Ok(group.0.join("cgroup.kill")));
        // CRIU's sibling (the restored tree's root, a child of runc).
        let sibling = sleeper();
        group.admit(sibling.id());
        assert_eq!(cgroup_kill_of(criu.id(), me), Ok(group.0.join("cgroup.kill")));
        // Anything else in the group (cgroups not managed, a group shared
        // with another container): the group is refused, not killed.
        let stranger = stranger();
        group.admit(stranger);
        let why = cgroup_kill_of(criu.id(), me).unwrap_err();
        assert!(why.contains(&format!("pid {stranger}")), "{why}");
        drop(group);
        reap(vec![criu, sibling]);
    }
}
