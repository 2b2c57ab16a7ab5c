//! Faults and how they are injected into one running operation: a criuz
//! command (alone, or with the peer at the other end of its pipe) is
//! started, and at a random moment within the time a clean run of the same
//! operation took, the fault strikes. A kill finds its victim then (CRIU,
//! a child of criuz or of runc, may not have started yet: it is waited
//! for while the operation lasts); a full disk is set up before the start.
//! An operation that ends before its fault could strike counts as a trial
//! with no fault injected.

use crate::error::{Error, Result};
use crate::proc;
use crate::s3;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What goes wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// SIGKILL of criuz (or of the criuz at the consuming end of a pipe).
    KillCriuz,
    /// SIGINT to criuz (a Ctrl-C): it must remove what it had not finished
    /// before it dies, with no next run to sweep.
    InterruptCriuz,
    /// SIGKILL of the CRIU that criuz (or runc) runs.
    KillCriu,
    /// SIGKILL of the S3 server (restarted, with its data, afterwards).
    KillS3,
    /// The output's file system fills up (a tmpfs smaller than the output).
    Enospc,
    /// The process at the other end of the pipe dies.
    PeerDies,
    /// SIGCONT to the tree being restored, from outside criuz (a job
    /// control shell, a supervisor), once CRIU has named its processes.
    ContinueTree,
}

/// Every fault the campaign knows.
pub const FAULTS: &[Fault] = &[
    Fault::KillCriuz,
    Fault::InterruptCriuz,
    Fault::KillCriu,
    Fault::KillS3,
    Fault::Enospc,
    Fault::PeerDies,
    Fault::ContinueTree,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::KillCriuz => "kill-criuz",
            Fault::InterruptCriuz => "sigint-criuz",
            Fault::KillCriu => "kill-criu",
            Fault::KillS3 => "kill-s3",
            Fault::Enospc => "enospc",
            Fault::PeerDies => "peer-dies",
            Fault::ContinueTree => "sigcont-tree",
        }
    }
}

/// An operation to run: a criuz command, and where its standard streams
/// come from and go. `PipeFrom`/`PipeTo` run `cat` at the other end.
pub enum Op {
    Alone(Command),
    /// `cat FILE | criuz …`
    PipeFrom(PathBuf, Command),
    /// `criuz … | cat > FILE`
    PipeTo(Command, PathBuf),
    /// `criuz restore` without `-d`: done once FILE (its `--pidfile`)
    /// names the restored root; criuz then goes on waiting for the tree as
    /// its parent, and the outcome holds it ([`Outcome::waiting`]).
    Foreground(Command, PathBuf),
}

/// How one run of an operation ended.
#[derive(Debug)]
pub struct Outcome {
    /// Every process of the operation exited 0.
    pub ok: bool,
    /// The fault struck while the operation ran.
    pub injected: bool,
    /// criuz died by a signal (a kill, an interruption).
    pub by_signal: bool,
    pub seconds: f64,
    /// criuz's exit status and the tail of its standard error.
    pub said: String,
    /// A foreground restore's criuz, still waiting for the tree it restored.
    pub waiting: Option<Child>,
}

/// The S3 server of the campaign, which a fault may kill.
pub struct S3 {
    dir: PathBuf,
    server: Option<s3::Server>,
}

impl S3 {
    pub fn start(dir: &Path) -> Result<S3> {
        Ok(S3 { dir: dir.to_path_buf(), server: Some(s3::Server::start(dir, None)?) })
    }
    pub fn pid(&self) -> Option<i32> {
        self.server.as_ref().map(|s| s.pid())
    }
    fn kill(&mut self) {
        if let Some(s) = self.server.take() {
            s.kill();
        }
    }
    /// Starts it again (same data) if a fault killed it.
    pub fn ensure(&mut self) -> Result<()> {
        if self.server.is_none() {
            self.server = Some(s3::Server::start(&self.dir, None)?);
            // SeaweedFS answers (and lists its bucket) before it has loaded
            // the volumes a SIGKILL left: reads of older objects fail with
            // InternalError for a while. What is judged is criuz, not the
            // server's recovery: wait until every object reads throughout.
            let t = Instant::now();
            while !s3::all_readable() && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        Ok(())
    }
}

/// Runs `op` with `fault` striking after `delay` (ENOSPC is set up by the
/// caller); `limit` bounds the whole operation (a hang is a failure of the
/// campaign, never a wait forever).
pub fn run(op: Op, fault: Option<Fault>, delay: Duration, s3: &mut S3, log: &Path, limit: Duration) -> Result<Outcome> {
    let stderr = || std::fs::File::create(log).map_err(|e| Error::file(log, e));
    let mut pidfile = None;
    let (mut criuz, peer) = match op {
        Op::Alone(mut c) => (spawn(c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr()?))?, None),
        Op::Foreground(mut c, file) => {
            pidfile = Some(file);
            (spawn(c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr()?))?, None)
        }
        Op::PipeFrom(file, mut c) => {
            let mut cat = spawn(Command::new("cat").arg(&file).stdin(Stdio::null()).stdout(Stdio::piped()))?;
            let out = cat.stdout.take().map(Stdio::from).unwrap_or_else(Stdio::null);
            (spawn(c.stdin(out).stdout(Stdio::null()).stderr(stderr()?))?, Some(cat))
        }
        Op::PipeTo(mut c, file) => {
            let mut z = spawn(c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr()?))?;
            let to = std::fs::File::create(&file).map_err(|e| Error::file(&file, e))?;
            let from = z.stdout.take().map(Stdio::from).unwrap_or_else(Stdio::null);
            let cat = spawn(Command::new("sh").args(["-c", "exec cat"]).stdin(from).stdout(to))?;
            (z, Some(cat))
        }
    };
    let mut peer = peer;
    let t = Instant::now();
    let mut injected = false;
    let mut struck = fault.is_none() || fault == Some(Fault::Enospc);
    let mut status = None;
    let mut peer_status = None;
    loop {
        if status.is_none() {
            status = criuz.try_wait()?;
        }
        if let (Some(p), None) = (peer.as_mut(), peer_status) {
            peer_status = p.try_wait()?;
        }
        let peer_done = peer.is_none() || peer_status.is_some();
        if status.is_some() && peer_done {
            break;
        }
        if status.is_none() && pidfile.as_deref().is_some_and(names_a_pid) {
            break;
        }
        if !struck && t.elapsed() >= delay && status.is_none() {
            struck = strike(fault, &criuz, peer.as_ref(), s3, &mut injected);
        }
        if t.elapsed() > limit {
            let _ = criuz.kill();
            if let Some(p) = peer.as_mut() {
                let _ = p.kill();
            }
            let _ = criuz.wait();
            return Err(Error::Invalid(format!("the operation hung for {limit:?} (see {})", log.display())));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if fault == Some(Fault::Enospc) {
        injected = true;
    }
    // What the operation started lives on after a kill (runc under a killed
    // criuz fails and cleans up on its own time): it is let finish, for at
    // most half a minute, before anything is judged or retried (a stopped
    // one will not finish); what is left after the retry is a leftover.
    let me = std::process::id() as i32;
    let waiter = status.is_none().then(|| criuz.id() as i32);
    let t_end = Instant::now();
    while t_end.elapsed() < Duration::from_secs(30)
        && proc::tree(me).into_iter().filter(|&p| Some(p) != waiter).any(|p| {
            let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
            matches!(comm.trim(), "runc" | "criu" | "criuz") && proc::alive(p) && !proc::stopped(p)
        })
    {
        proc::reap_zombies();
        std::thread::sleep(Duration::from_millis(20));
    }
    let tail = std::fs::read_to_string(log).unwrap_or_default();
    let tail: Vec<&str> = tail.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = tail[tail.len().saturating_sub(2)..].join(" | ");
    let Some(status) = status else {
        // Only a foreground restore leaves the loop with criuz running.
        return Ok(Outcome {
            ok: true,
            injected,
            by_signal: false,
            seconds: t.elapsed().as_secs_f64(),
            said: format!("running as the restored tree's parent: {tail}"),
            waiting: Some(criuz),
        });
    };
    Ok(Outcome {
        ok: status.success() && peer_status.is_none_or(|s| s.success()),
        injected,
        by_signal: std::os::unix::process::ExitStatusExt::signal(&status).is_some(),
        seconds: t.elapsed().as_secs_f64(),
        said: format!("{status}: {tail}"),
        waiting: None,
    })
}

/// The pid file a restore writes once its tree runs holds a pid.
fn names_a_pid(file: &Path) -> bool {
    std::fs::read_to_string(file).is_ok_and(|s| s.trim().parse::<i32>().is_ok_and(|p| p > 0))
}

fn spawn(c: &mut Command) -> Result<Child> {
    let name = c.get_program().to_string_lossy().into_owned();
    c.spawn().map_err(|e| Error::Invalid(format!("cannot run {name}: {e}")))
}

/// Strikes if the victim is there; false to try again on the next poll.
fn strike(fault: Option<Fault>, criuz: &Child, peer: Option<&Child>, s3: &mut S3, injected: &mut bool) -> bool {
    let kill = |pid: i32| {
        // SAFETY: SIGKILL to a process this campaign started (criuz, its
        // peer, or a CRIU under them: found among their descendants).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    };
    match fault {
        Some(Fault::KillCriuz) => {
            // In a pipe into criuz, the criuz at the end is the victim.
            kill(criuz.id() as i32);
            *injected = true;
        }
        Some(Fault::InterruptCriuz) => {
            // SAFETY: SIGINT to the criuz this campaign started.
            unsafe { libc::kill(criuz.id() as i32, libc::SIGINT) };
            *injected = true;
        }
        Some(Fault::PeerDies) => {
            if let Some(p) = peer {
                kill(p.id() as i32);
                *injected = true;
            }
        }
        Some(Fault::KillS3) => {
            s3.kill();
            *injected = true;
        }
        Some(Fault::KillCriu) => {
            // CRIU itself, not a helper it forked (a kerndat probe, a task
            // being restored): the first `criu` below criuz (or runc).
            let Some(criu) = proc::tree(criuz.id() as i32).into_iter().skip(1).find(|&p| is_criu(p)) else {
                return false;
            };
            kill(criu);
            *injected = true;
        }
        Some(Fault::ContinueTree) => {
            // The restored processes below criuz (CRIU's own until its
            // restorer gives each its name back), traced by CRIU or not: a
            // SIGCONT while CRIU 4.2.1 holds a task under ptrace in its last
            // restore stages stops the task in a ptrace trap CRIU never
            // answers, and CRIU waits for it for good, which criuz must end
            // (`proc::stuck`) rather than wait with it.
            let tree: Vec<i32> =
                proc::tree(criuz.id() as i32).into_iter().skip(1).filter(|&p| !is_criu_or_criuz(p)).collect();
            if tree.is_empty() {
                return false;
            }
            for p in tree {
                // SAFETY: SIGCONT to a process restored under the criuz
                // this campaign started.
                unsafe { libc::kill(p, libc::SIGCONT) };
            }
            *injected = true;
        }
        Some(Fault::Enospc) | None => {}
    }
    true
}

fn is_criu_or_criuz(pid: i32) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    matches!(comm.trim(), "criu" | "criuz" | "")
}

/// A `criu` whose parent is not one: CRIU's main process.
fn is_criu(pid: i32) -> bool {
    let comm = |p: i32| std::fs::read_to_string(format!("/proc/{p}/comm")).map(|c| c.trim() == "criu");
    comm(pid).unwrap_or(false) && !proc::parent(pid).is_some_and(|pp| comm(pp).unwrap_or(false))
}
