//! Processes for the bench: pipelines of commands whose CPU and peak memory
//! come from wait4, a rate-limited relay standing in for a network link
//! (`pipeline`), reaping of the checkpointed and restored trees (the bench
//! is their child subreaper), and the machine around the runs (`host`).

use crate::error::{Error, Result};
use std::io;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod host;
mod pipeline;

pub use host::{copy_exe, dir_bytes, drop_caches, file_bytes, read_through, warm_bytes, warm_guest_memory, Tmpfs};
pub use pipeline::{pipeline, relay, Dst, Finished, Src};

/// CPU and peak resident memory of the commands of one step.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu_s: f64,
    pub maxrss_kib: u64,
}

impl Usage {
    pub fn add(&mut self, o: Usage) {
        self.cpu_s += o.cpu_s;
        self.maxrss_kib = self.maxrss_kib.max(o.maxrss_kib);
    }

    fn of(ru: &libc::rusage) -> Usage {
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Usage { cpu_s: tv(ru.ru_utime) + tv(ru.ru_stime), maxrss_kib: ru.ru_maxrss.max(0) as u64 }
    }
}

/// Makes orphaned descendants (the restored trees) our children, so we reap them.
pub fn become_subreaper() -> Result<()> {
    // SAFETY: prctl with constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(Error::Invalid(format!("cannot become child subreaper: {}", io::Error::last_os_error())));
    }
    Ok(())
}

/// Idle processes kept beside a run (`--idle-processes`): each a `sleep`
/// with /dev/null for its streams, ended and reaped when dropped, and
/// killed by the kernel should the bench die first.
pub struct IdleProcesses(Vec<std::process::Child>);

impl IdleProcesses {
    pub fn start(n: usize) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let mut idle = IdleProcesses(Vec::with_capacity(n));
        for _ in 0..n {
            let mut sleep = Command::new("sleep");
            // SAFETY: prctl is async-signal-safe, and nothing else runs
            // between fork and exec.
            unsafe {
                sleep.pre_exec(|| match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) {
                    0 => Ok(()),
                    _ => Err(io::Error::last_os_error()),
                })
            };
            let child = sleep
                .arg("infinity")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| {
                    Error::Invalid(format!("cannot start idle process {} of {n}: sleep: {e}", idle.0.len() + 1))
                })?;
            idle.0.push(child);
        }
        Ok(idle)
    }
}

impl Drop for IdleProcesses {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// Restricts this process (and all it starts later) to the first `n` CPUs
/// of its current affinity mask; returns them.
pub fn pin_to_cpus(n: usize) -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
    // fills it, with its own size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a cpu_set_t we own, its size with it.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(Error::Invalid(format!("sched_getaffinity: {}", io::Error::last_os_error())));
    }
    // SAFETY: CPU_ISSET reads a set we own, for indexes below its capacity.
    let allowed: Vec<usize> =
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect();
    if n == 0 || n > allowed.len() {
        return Err(Error::Usage(format!("--cpus {n}: this run may use {} CPUs", allowed.len())));
    }
    // SAFETY: as above, an empty set filled with valid CPU indexes.
    let mut pinned: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &allowed[..n] {
        // SAFETY: `c` is below CPU_SETSIZE (it came from the set).
        unsafe { libc::CPU_SET(c, &mut pinned) };
    }
    // SAFETY: `pinned` is a cpu_set_t we own, its size with it.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &pinned) } != 0 {
        return Err(Error::Invalid(format!("sched_setaffinity: {}", io::Error::last_os_error())));
    }
    Ok(allowed[..n].to_vec())
}

/// wait4 on one pid; None if it has not exited (with WNOHANG).
fn wait4(pid: i32, nohang: bool) -> io::Result<Option<(i32, Usage)>> {
    loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value to be overwritten.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let flags = if nohang { libc::WNOHANG } else { 0 };
        // SAFETY: status and ru are ours; pid names one process.
        let r = unsafe { libc::wait4(pid, &mut status, flags, &mut ru) };
        if r == pid {
            return Ok(Some((status, Usage::of(&ru))));
        }
        if r == 0 {
            return Ok(None);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status}")
    }
}

/// Reaps every zombie child. Only call when no pipeline is running (it would
/// take their exit status and usage). Each one's wait status is kept for
/// [`killed_by`] and [`ended_as`].
pub fn reap_zombies() {
    loop {
        let mut status = 0;
        // SAFETY: non-blocking reap of any exited child, into our own int.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            break;
        }
        let mut reaped = REAPED.lock().unwrap_or_else(|e| e.into_inner());
        if reaped.len() >= REAPED_KEPT {
            reaped.remove(0);
        }
        reaped.push((pid, status));
    }
}

/// Children [`reap_zombies`] reaped and their wait statuses, the latest last.
static REAPED: std::sync::Mutex<Vec<(i32, i32)>> = std::sync::Mutex::new(Vec::new());
const REAPED_KEPT: usize = 256;

fn reaped_status(pid: i32) -> Option<i32> {
    let reaped = REAPED.lock().unwrap_or_else(|e| e.into_inner());
    reaped.iter().rev().find(|(p, _)| *p == pid).map(|&(_, status)| status)
}

/// The signal that killed child `pid`, if [`reap_zombies`] reaped it so.
pub fn killed_by(pid: i32) -> Option<i32> {
    reaped_status(pid).filter(|&s| libc::WIFSIGNALED(s)).map(|s| libc::WTERMSIG(s))
}

/// Waits (at most `limit`) for `child` to end, and says how, as a shell
/// does: its exit code, or 128 + the signal that killed it. Finds it in
/// what [`reap_zombies`] reaped if that took it first. None: still running.
pub fn ended_as(child: &mut std::process::Child, limit: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => {
                use std::os::unix::process::ExitStatusExt;
                return Some(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)));
            }
            Ok(None) if t.elapsed() < limit => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => return None,
            Err(_) => {
                let s = reaped_status(child.id() as i32)?;
                return Some(if libc::WIFSIGNALED(s) { 128 + libc::WTERMSIG(s) } else { libc::WEXITSTATUS(s) });
            }
        }
    }
}

pub fn exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Running (not a zombie waiting to be reaped).
pub fn alive(pid: i32) -> bool {
    state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// The process's state letter (R, S, D, T, t, Z, ...), if it exists.
pub fn state(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// Killed and on its way out, or ended since (a zombie, or gone): a `criuz
/// dump` returns once its tree has begun to exit, not once the kernel has
/// freed it. Read once: a caller that saw the process in a running state a
/// moment ago must not take one that became a zombie in between for one
/// still running (the fault campaign once stopped on "outlived its dump"
/// that way).
pub fn exiting_or_ended(pid: i32) -> bool {
    criuz::proc::holder::holder_of(pid).is_none_or(|h| h.exiting || h.zombie)
}

/// Stopped (by a signal, or under a tracer).
pub fn stopped(pid: i32) -> bool {
    matches!(state(pid), Some('T' | 't'))
}

/// Fields of /proc/PID/stat after the command name.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(String::from).collect())
}

pub fn parent(pid: i32) -> Option<i32> {
    ppid(pid)
}

fn ppid(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// The anonymous memory of `pids` (their `Pss_Anon` added up, KiB), and
/// their private huge pages (`Private_Hugetlb`, which `Pss_Anon` leaves
/// out): a page shared copy-on-write between them counts once, zero pages
/// never written count nothing.
pub fn pss_anon_kib(pids: &[i32]) -> u64 {
    rollup_kib(pids, &["Pss_Anon:", "Private_Hugetlb:"])
}

/// Of `pids`' anonymous memory, what is transparent huge pages
/// (`AnonHugePages`), KiB.
pub fn anon_huge_kib(pids: &[i32]) -> u64 {
    rollup_kib(pids, &["AnonHugePages:"])
}

/// The `fields` of each of `pids`' `/proc/PID/smaps_rollup` added up, KiB;
/// a process that cannot be read counts nothing.
fn rollup_kib(pids: &[i32], fields: &[&str]) -> u64 {
    let field = |text: &str, name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse::<u64>().ok()).unwrap_or(0)
    };
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).ok())
        .map(|t| fields.iter().map(|f| field(&t, f)).sum::<u64>())
        .sum()
}

/// CPU seconds (user and system) of the waited-for children so far.
pub fn children_cpu() -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Runs `cmd` to its end, its standard input empty: its wall seconds, the
/// CPU seconds of the processes it waited for (its own included) and its
/// standard output; its failure as an error naming `what`, with its
/// standard error.
pub fn run_measured(cmd: &mut Command, what: &str) -> Result<(f64, f64, Vec<u8>)> {
    let (t, cpu) = (Instant::now(), children_cpu());
    let out = cmd.stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(Error::Invalid(format!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok((t.elapsed().as_secs_f64(), children_cpu() - cpu, out.stdout))
}

pub fn cpu_seconds(pid: i32) -> Option<f64> {
    let f = stat_fields(pid)?;
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 / hz)
}

/// The file name of the program a process runs (`/proc/PID/exe`).
pub fn program(pid: i32) -> Option<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let name = exe.file_name()?.to_string_lossy().into_owned();
    // A program whose file was replaced since reads "NAME (deleted)".
    Some(name.strip_suffix(" (deleted)").map(str::to_string).unwrap_or(name))
}

/// Whether a workload's pid, whose process ran `workload_program`, now
/// names a process of another program: its tree is gone and the pid was
/// given again (pids wrap at 32,768 on this VM). The fault campaign once
/// signalled and killed such a pid: a restarted S3 server that had taken it
/// (session 70). A process CRIU has not finished restoring (still `criu`)
/// is the workload's. The program is the workload's own, not
/// `criuz-workload` alone: a restored Redis, JVM or Python once counted as
/// another program and was left running after every cycle (session 73).
pub fn taken_by_another(pid: i32, workload_program: &str) -> bool {
    program(pid).is_some_and(|name| name != workload_program && name != "criu")
}

/// This process's children that still run (not zombies): once every cycle
/// has ended its workload, none should.
pub fn live_children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut tree = tree(me);
    tree.remove(0);
    tree.retain(|&p| ppid(p) == Some(me) && alive(p));
    tree
}

/// `root` and all its descendants, root first.
pub fn tree(root: i32) -> Vec<i32> {
    let mut parent = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            if let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) {
                if let Some(pp) = ppid(pid) {
                    parent.push((pid, pp));
                }
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parent.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// True if `pid` is a descendant of this process: the only processes the
/// bench ever signals (a pid that died may have been reused by a stranger).
pub fn is_ours(pid: i32) -> bool {
    let me = std::process::id() as i32;
    let mut p = pid;
    for _ in 0..64 {
        match ppid(p) {
            Some(pp) if pp == me => return true,
            Some(pp) if pp > 1 => p = pp,
            _ => return false,
        }
    }
    false
}

/// Waits until `pid` has exited and is reaped (or gone); returns its usage
/// when it was our child. Errors if it is still alive after `timeout`.
pub fn reap(pid: i32, timeout: Duration) -> Result<Option<Usage>> {
    let t = Instant::now();
    loop {
        match wait4(pid, true) {
            Ok(Some((_, u))) => return Ok(Some(u)),
            Ok(None) => {}
            Err(_) if !exists(pid) => return Ok(None),
            Err(_) => {}
        }
        if t.elapsed() > timeout {
            return Err(Error::Invalid(format!("process {pid} is still alive after {timeout:?}")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILLs the processes (those that are ours) and reaps them.
pub fn kill_tree(pids: &[i32]) {
    for &p in pids {
        if exists(p) && is_ours(p) {
            // SAFETY: signalling our own descendant.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
    for &p in pids {
        let _ = reap(p, Duration::from_secs(30));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pid of another program is not a workload's; a pid that names
    /// nothing is left to whoever asks.
    #[test]
    fn a_pid_given_to_another_program_is_not_the_workload_s() {
        let me = std::process::id() as i32;
        let mine = program(me).expect("this test's own program");
        assert!(taken_by_another(me, "redis-server"), "this test's process is not a Redis");
        assert!(!taken_by_another(me, &mine), "this test's process runs its own program");
        assert!(!taken_by_another(i32::MAX, "redis-server"), "a pid that names nothing");
    }

    #[test]
    fn idle_processes_run_until_dropped_and_are_reaped() {
        let idle = IdleProcesses::start(3).unwrap();
        let pids: Vec<u32> = idle.0.iter().map(|c| c.id()).collect();
        let state = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        let sleeping = || pids.iter().all(|&p| state(p).is_some_and(|s| s.contains("(sleep) S")));
        // Each runs `sleep` once it has exec'd.
        let since = Instant::now();
        while !sleeping() && since.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(sleeping(), "{pids:?}");
        drop(idle);
        // Reaped, not left as zombies (a pid reused meanwhile is no sleep of ours).
        assert!(pids.iter().all(|&p| state(p).is_none_or(|s| !s.contains("(sleep)"))), "{pids:?}");
    }

    #[test]
    fn a_reaped_child_killed_by_a_signal_is_remembered_by_pid() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGTRAP) };
        let t = Instant::now();
        while killed_by(pid).is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "the child was never reaped");
            reap_zombies();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(killed_by(pid), Some(libc::SIGTRAP));
        assert_eq!(killed_by(i32::MAX), None);
        // Reaped already: this only finds it gone.
        let _ = child.wait();
    }

    #[test]
    fn a_zombie_or_a_gone_pid_has_ended_and_a_sleeper_has_not() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        assert!(!exiting_or_ended(pid), "a sleeping child is running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let t = Instant::now();
        // A test beside this one may reap every zombie of the process.
        while !matches!(state(pid), Some('Z') | None) {
            assert!(t.elapsed() < Duration::from_secs(10), "the child never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(exiting_or_ended(pid), "a zombie (or reaped) child has ended");
        let _ = child.wait();
        assert!(exiting_or_ended(pid), "a reaped pid has ended");
    }
}
