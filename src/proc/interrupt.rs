//! A criuz interrupted by SIGINT, SIGTERM or SIGHUP removes what it had not
//! finished (`io::unfinished`: temporary archives, work and staging
//! directories), says so in one line, and dies by the same signal, so a
//! shell or supervisor sees the interruption it sent.
//!
//! Processes are left to the guards that already handle a criuz killed
//! outright (a dump's tree is resumed, a restored tree that has not been
//! let run, or whose pages are not all in, is killed; `proc::guard`); a
//! restoring CRIU is killed first, and what it forked with it (a dumping
//! one fails on its closed stream and resumes its tree, as before). The
//! signals are taken on a thread of their own (`signal-hook`'s self-pipe),
//! so the cleanup runs as ordinary code, not in a signal handler.

use crate::io::unfinished;
use crate::proc::{guard, socket, tree};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Takes SIGINT, SIGTERM and SIGHUP for the rest of the process's life.
/// Best effort: where the thread or the handlers cannot be had, a signal
/// kills criuz as before, and the next run sweeps what it left.
pub fn install() {
    // One ignored when criuz started stays ignored (`nohup`, a shell's
    // background job without job control), as it would without this.
    let taken: Vec<i32> = [SIGINT, SIGTERM, SIGHUP].into_iter().filter(|&sig| !ignored(sig)).collect();
    let Ok(mut signals) = signal_hook::iterator::Signals::new(taken) else { return };
    let _ = std::thread::Builder::new().name("criuz-signals".into()).spawn(move || {
        if let Some(sig) = signals.forever().next() {
            die_interrupted(sig);
        }
    });
}

/// Whether `sig`'s disposition is to be ignored.
fn ignored(sig: i32) -> bool {
    // SAFETY: sigaction(2) with no new action only reads the current one
    // into a zeroed struct of ours.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// Set once an interruption has begun to end the process.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// For the binary, before it exits: where an interruption is under way, the
/// interruption ends the process (so its removals are not cut short, and
/// no error that the interruption itself caused is reported); this never
/// returns then.
pub fn wait_for_interruption() {
    while INTERRUPTED.load(Ordering::Acquire) {
        std::thread::park();
    }
}

fn die_interrupted(sig: i32) -> ! {
    INTERRUPTED.store(true, Ordering::Release);
    // A restoring CRIU first (it would die with criuz anyway): killed
    // later, while a probe it forked was stopped under its ptrace, it would
    // leave that probe stopped for good, and its work directory, by which
    // the next run's sweep would have found the probe, is gone by then.
    // And a runc: one criuz waits for under a guard is killed now, as its
    // guard would kill it once criuz is gone; one whose CRIU sends pages to
    // criuz's page server ends once that server's sockets are shut down
    // (as criuz's death would close them: CRIU fails and resumes the
    // container). Either way it can no longer make its work directory
    // again after that is removed.
    let ended = unfinished::end_unfinished(|| {
        guard::end_guarded_children();
        tree::end_restoring_criu();
        socket::shut_down_tcp();
        tree::wait_runc_children(std::time::Duration::from_secs(5));
    });
    let mut line = format!("criuz: interrupted ({})", signal_name(sig));
    if ended.removed > 0 {
        line.push_str("; what it had not finished is removed");
    }
    for kept in &ended.kept {
        line.push_str(&format!("; kept {} (it may hold the only copy of the checkpoint)", kept.display()));
    }
    for left in &ended.left {
        line.push_str(&format!("; could not remove {}", left.display()));
    }
    for published in &ended.published {
        line.push_str(&format!("; {} was complete before it and stays", published.display()));
    }
    if let Some(root) = tree::restored_root_running() {
        line.push_str(&format!("; the restored tree (pid {root}) was whole before it and runs on"));
    }
    let mut err = std::io::stderr().lock();
    // After a progress bar's unfinished line.
    let start = if err.is_terminal() { "\n" } else { "" };
    let _ = writeln!(err, "{start}{line}");
    let _ = err.flush();
    let _ = signal_hook::low_level::emulate_default_handler(sig);
    // The default action of these three signals ends the process; should it
    // not have, end it with the status a shell gives a death by `sig`.
    // SAFETY: _exit(2) ends the process at once; nothing is left to run.
    unsafe { libc::_exit(128 + sig) }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}
