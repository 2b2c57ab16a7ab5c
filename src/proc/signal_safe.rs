//! The /proc reads a forked guard may make (`proc::guard`): open, read,
//! getdents64, close and nanosleep on stack memory, no allocation, so that
//! they are async-signal-safe in a fork of a threaded process. A process
//! tree's pids are collected into a fixed array ([`MAX_TREE`]), a
//! process's state and status fields read into stack buffers, and waits
//! are paced polls. The walks above them (`proc::tree`) build on these.

/// Most processes `kill_tree` finds and kills (pids on the stack: the guard
/// cannot allocate). A dump of a larger tree is refused (`tree::too_large`):
/// past it, a dump would end or resume only part of the tree.
pub(crate) const MAX_TREE: usize = 4096;

/// Asks `done` every `every_ms` until it says yes or `limit_ms` has passed.
/// Async-signal-safe as long as `done` is (nanosleep on stack memory).
pub(super) fn poll_until(limit_ms: u32, every_ms: u32, done: impl FnMut() -> bool) {
    let every_us = u64::from(every_ms.max(1)) * 1000;
    poll_paced(limit_ms, every_us, every_us, done);
}

/// [`poll_until`] every 100 µs at first, the pause doubling up to
/// `every_ms`: for what mostly comes within a millisecond (CRIU letting go
/// of a restored tree 0.3-0.8 ms after handing its memory over, 2 cores,
/// session 47), where a millisecond's pause from the start made a lazy tree
/// run 0.4 ms late on average.
pub(super) fn poll_soon(limit_ms: u32, every_ms: u32, done: impl FnMut() -> bool) {
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
pub(super) unsafe fn running(pid: i32) -> bool {
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
pub(super) unsafe fn traced(pid: i32) -> bool {
    // SAFETY: status_number only opens, reads and closes on stack memory.
    unsafe { status_number(pid, b"\nTracerPid:\t") }.is_some_and(|tracer| tracer != 0)
}

/// The number after `key` in /proc/PID/status (`None` if it is gone or
/// does not say). `PID` may be a thread's id: its own line then.
///
/// # Safety
/// Async-signal-safe; no preconditions.
pub(super) unsafe fn status_number(pid: i32, key: &[u8]) -> Option<i32> {
    let mut buf = [0u8; 1024];
    // SAFETY: read_proc only opens, reads and closes on our stack buffer.
    let text = unsafe { read_proc(pid, b"/status", &mut buf) };
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    let digits = text[at..].iter().take_while(|b| b.is_ascii_digit());
    let (value, count) =
        digits.fold((0i32, 0), |(v, c), &d| (v.wrapping_mul(10).wrapping_add(i32::from(d - b'0')), c + 1));
    (count > 0).then_some(value)
}

/// Whether `pid` is stopped, or has SIGSTOP pending (from /proc/PID/status).
///
/// # Safety
/// Async-signal-safe; no preconditions.
pub(super) unsafe fn stopping(pid: i32) -> bool {
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

/// Fills `pids` with `tree` and its descendants, parents first; returns
/// how many. Async-signal-safe.
pub(super) fn collect_tree(tree: &[i32], pids: &mut [i32; MAX_TREE]) -> usize {
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
pub(super) unsafe fn leader_of(tid: i32) -> Option<i32> {
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
    use super::*;

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
}
