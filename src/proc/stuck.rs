//! Whether a restoring CRIU waits for good on a task it traces.
//!
//! In its last restore stages CRIU 4.2.1 seizes every thread of the tree
//! (ptrace) and waits on a futex for them to reach the next stage. A
//! SIGCONT from outside in that window (a shell's job control, a
//! supervisor) stops a seized thread in a ptrace trap, the kernel's notice
//! to the tracer that it was continued. Only CRIU could let it go on, and
//! it waits on its futex instead: both wait forever.
//!
//! Seen from /proc: every thread of CRIU asleep in `futex()`, a thread it
//! traces in a ptrace stop (`t`), and neither has run since the last look.
//! Nothing else in a restore looks like that for long: CRIU collects its
//! tracees' stops with `wait4` and ptrace calls, not futexes, and a thread
//! it waits for that moves on moves its run time. So the same reading
//! twice, [`Watch::FOR`] apart, is that deadlock and not a slow restore
//! (a restore's stages can take long, but then something runs).
//! Trade-off: the wait before it is called stuck is time a hung restore
//! spends; long enough that two readings cannot both catch a thread on its
//! way through a stop, short next to any deadline a restore has.

use super::holder::{holder_of, parent_of, state_of};
use super::signal_safe::status_number;
use super::tree::{run_time, tree_pids};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The threads of `pid` with their run times, or `None` where one is not
/// asleep in `futex()` (or the process is gone).
fn all_in_futex(pid: i32) -> Option<Vec<(i32, u64)>> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let tid: i32 = task.ok()?.file_name().to_str()?.parse().ok()?;
        let dir = format!("/proc/{pid}/task/{tid}");
        if !in_futex(&dir) {
            return None;
        }
        threads.push((tid, run_time(&dir)?));
    }
    threads.sort_unstable();
    Some(threads)
}

/// Whether the thread of `task_dir` sleeps in `futex()`: its `syscall`
/// reads "NR args..." while in a system call, "running" or -1 otherwise.
fn in_futex(task_dir: &str) -> bool {
    std::fs::read_to_string(format!("{task_dir}/syscall"))
        .is_ok_and(|s| s.split_whitespace().next().and_then(|nr| nr.parse::<i64>().ok()) == Some(libc::SYS_futex))
}

/// A thread that CRIU traces, and whether it sits in a ptrace stop (`t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Traced {
    tid: i32,
    trapped: bool,
    ran: u64,
}

/// The threads of `pids` that one of `tracers` (thread ids: `TracerPid`
/// names the thread that attached) traces, by thread id.
fn traced_by(tracers: &[i32], pids: &[i32]) -> Vec<Traced> {
    let mut traced = Vec::new();
    for &pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for tid in tasks.flatten().filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok()) {
            // SAFETY: status_number only opens, reads and closes on stack memory.
            let tracer = unsafe { status_number(tid, b"\nTracerPid:\t") };
            if !tracer.is_some_and(|t| t != 0 && tracers.contains(&t)) {
                continue;
            }
            let dir = format!("/proc/{pid}/task/{tid}");
            let trapped = std::fs::read_to_string(format!("{dir}/stat")).is_ok_and(|s| state_of(&s) == Some('t'));
            let Some(ran) = run_time(&dir) else { continue };
            traced.push(Traced { tid, trapped, ran });
        }
    }
    traced.sort_unstable_by_key(|t| t.tid);
    traced
}

/// A CRIU that waits for good ([`Watch::look`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Stuck {
    /// CRIU itself (the process that traces the tree).
    pub criu: i32,
    /// A thread of the tree in the ptrace trap CRIU does not answer.
    pub trapped: i32,
    /// Every thread CRIU traces: in its last stages, the whole tree.
    pub traced: Vec<i32>,
}

/// Looks at a restore's CRIU now and then ([`Watch::look`]) and says when
/// it waits for good: the CRIU criuz runs, the one runc runs below it, or
/// podman's, which runs outside criuz's tree.
pub(crate) struct Watch {
    below: Below,
    /// CRIU, once seen: the first `criu` at or below where it runs, parents
    /// before children (the tree CRIU forks comes after it, named `criu`
    /// too until its restorer names it), with the processes its tree is
    /// looked for below. Looked for again once it has ended: runc asks a
    /// CRIU for its version before the one that restores.
    criu: Option<(i32, Vec<i32>)>,
    first: Option<(Instant, Reading)>,
}

/// Where a restore's CRIU runs.
enum Below {
    /// At or below this child of criuz (CRIU, or runc); the tree it
    /// restores is among criuz's descendants (CRIU's, or with
    /// `--restore-sibling` its parent's).
    Child(i32),
    /// Below a process whose `PATH` begins with this directory, as criuz
    /// gave it to podman: conmon, which leaves criuz's tree as it starts,
    /// the runc it runs, and the tree that runc's CRIU restores beside it.
    /// CRIU itself cannot be known by it: it writes its title over its
    /// environment.
    PathFirst(PathBuf),
}

/// One look that saw every thread of a `criu` in `futex()` and a thread it
/// traces trapped: that CRIU, its threads and what it traces, each thread
/// with its run time.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reading {
    criu: i32,
    threads: Vec<(i32, u64)>,
    traced: Vec<Traced>,
}

impl Watch {
    /// How long the same stuck reading must last.
    pub(crate) const FOR: Duration = Duration::from_secs(2);

    /// Watches `below` (a child of this process) and what it runs.
    pub(crate) fn new(below: i32) -> Self {
        Watch { below: Below::Child(below), criu: None, first: None }
    }

    /// Watches the CRIU run below whatever process has `dir` first on its
    /// `PATH` (a directory private to this criuz), wherever it is.
    pub(crate) fn path_first(dir: PathBuf) -> Self {
        Watch { below: Below::PathFirst(dir), criu: None, first: None }
    }

    /// Whether a CRIU has waited for good: a thread it traces has sat in
    /// a ptrace stop, and CRIU on its futexes, nothing of either having
    /// run, for [`Self::FOR`]. Its tracees are looked for among this
    /// process's descendants, or podman's processes ([`Below`]), only while
    /// every thread of CRIU sleeps in `futex()`.
    pub(crate) fn look(&mut self) -> Option<Stuck> {
        let now = self.read();
        match (&self.first, now) {
            (Some((since, first)), Some(now)) if *first == now => (since.elapsed() >= Self::FOR).then(|| Stuck {
                criu: now.criu,
                trapped: now.traced.iter().find(|t| t.trapped).map_or(0, |t| t.tid),
                traced: now.traced.iter().map(|t| t.tid).collect(),
            }),
            (_, now) => {
                self.first = now.map(|r| (Instant::now(), r));
                None
            }
        }
    }

    fn read(&mut self) -> Option<Reading> {
        let alive = |p: i32| holder_of(p).is_some_and(|h| h.comm == "criu" && !h.zombie);
        if !self.criu.as_ref().is_some_and(|(c, _)| alive(*c)) {
            let (search, tree) = match &self.below {
                // SAFETY: getpid has no preconditions.
                Below::Child(child) => (vec![*child], vec![unsafe { libc::getpid() }]),
                Below::PathFirst(dir) => {
                    let holders = path_first_holders(dir);
                    (holders.clone(), holders)
                }
            };
            self.criu = tree_pids(&search).into_iter().find(|&p| alive(p)).map(|c| (c, tree));
        }
        let (criu, tree) = self.criu.as_ref()?;
        let threads = all_in_futex(*criu)?;
        let tids: Vec<i32> = threads.iter().map(|&(tid, _)| tid).collect();
        let traced = traced_by(&tids, &tree_pids(tree));
        traced.iter().any(|t| t.trapped).then_some(Reading { criu: *criu, threads, traced })
    }
}

/// The processes whose `PATH` begins with `dir`, by their environment
/// (readable where criuz may trace them), but for those below another:
/// each process once in their trees.
fn path_first_holders(dir: &Path) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let want = dir.as_os_str().as_bytes();
    let mut found: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            env.split(|&b| b == 0)
                .find_map(|var| var.strip_prefix(b"PATH="))
                .is_some_and(|path| path.split(|&b| b == b':').next() == Some(want))
        })
        .collect();
    found.sort_unstable();
    let below_another = |pid: i32| {
        let mut p = pid;
        std::iter::from_fn(|| {
            p = parent_of(p).filter(|&q| q > 1)?;
            Some(p)
        })
        .any(|q| found.binary_search(&q).is_ok())
    };
    found.iter().copied().filter(|&p| !below_another(p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let t = Instant::now();
        while !done() {
            assert!(t.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// What the watch reads, on the kernel it runs on: a seized child runs
    /// on, and a SIGCONT then stops it in a ptrace trap that lasts, its run
    /// time still, while its tracer sleeps in `futex()`.
    #[test]
    fn a_seized_child_continued_sits_in_a_trap_while_its_tracer_waits_on_a_futex() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id() as i32;
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<bool>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // ptrace belongs to the thread that attached: this one, which then
        // waits on a channel (a futex) as CRIU waits for its stage.
        let tracer = std::thread::spawn(move || {
            // SAFETY: seizing our own child.
            assert_eq!(unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0) }, 0, "PTRACE_SEIZE");
            // SAFETY: gettid has no preconditions.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            if go_rx.recv().unwrap() {
                // SAFETY: continuing our own child.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            }
            let _ = done_rx.recv();
        });
        let tracer_tid = tid_rx.recv().unwrap();
        let dir = format!("/proc/self/task/{tracer_tid}");
        std::thread::sleep(Duration::from_millis(50));
        let seized = traced_by(&[tracer_tid], &[pid]);
        assert!(seized.len() == 1 && !seized[0].trapped, "seized, not stopped: {seized:?}");
        go_tx.send(true).unwrap();
        until("the trap", || traced_by(&[tracer_tid], &[pid]).iter().any(|t| t.trapped));
        until("the tracer in futex()", || in_futex(&dir));
        let first = traced_by(&[tracer_tid], &[pid]);
        std::thread::sleep(Duration::from_millis(200));
        let second = traced_by(&[tracer_tid], &[pid]);
        assert!(traced_by(&[tracer_tid + 100_000], &[pid]).is_empty(), "traced by another");
        done_tx.send(()).unwrap();
        tracer.join().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(first.iter().map(|t| (t.tid, t.trapped)).collect::<Vec<_>>(), vec![(pid, true)]);
        assert_eq!(first, second, "the trapped child does not run");
    }

    /// podman's processes are found by the directory criuz puts first on
    /// their `PATH`: the topmost of a tree that has it, not a process that
    /// has it elsewhere on its `PATH`.
    #[test]
    fn processes_are_found_by_the_directory_first_on_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let first = format!("{}:/usr/bin:/bin", dir.path().display());
        let mut holder = Command::new("sh").args(["-c", "sleep 30 & wait"]).env("PATH", &first).spawn().expect("sh");
        let later = format!("/usr/bin:/bin:{}", dir.path().display());
        let mut other = Command::new("sleep").arg("30").env("PATH", later).spawn().expect("sleep");
        until("the holder's child", || !tree_pids(&[holder.id() as i32])[1..].is_empty());
        assert_eq!(path_first_holders(dir.path()), vec![holder.id() as i32], "the topmost holder only");
        for c in [&mut holder, &mut other] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// A process that is not CRIU, or not waiting on a futex, is never
    /// read stuck.
    #[test]
    fn a_process_that_traces_nothing_is_not_stuck() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let mut w = Watch::new(child.id() as i32);
        assert_eq!(w.look(), None);
        assert!(w.first.is_none(), "no criu there");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(Watch::new(child.id() as i32).look(), None, "gone");
    }
}
