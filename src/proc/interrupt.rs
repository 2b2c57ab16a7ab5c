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
//!
//! From the moment a tree criuz restores in the foreground runs whole
//! ([`stand_in_once_restored`]), and while criuz waits for it
//! ([`forward_to`]), criuz is that tree's stand-in: the signals a
//! supervisor or a user sends criuz (these three, SIGQUIT, SIGUSR1,
//! SIGUSR2) go on to the tree's root instead, as a container's init passes
//! them on, and criuz exits as the root does. A terminal's own signals are
//! not sent twice: one the kernel raised (Ctrl-C) reached the root already
//! where it shares criuz's process group.
//!
//! Only the signal thread takes these signals: every other thread blocks
//! them from birth (they inherit the mask [`install`] gives the main
//! thread; the programs criuz runs, and its guards, get the mask criuz was
//! started with: `spawn`). So when criuz replaces its image to wait for the tree
//! ([`hold_through_exec`]), the signal thread blocks them too and passes on
//! what it had taken; one sent after that stays pending in the kernel,
//! which keeps it across `exec` for the new image. Before, a signal the
//! handler had recorded but the thread not yet passed on was lost with
//! the old image (a clean-clone CI run's SIGTERM, sent as the pidfile
//! appeared, never reached the root).

use crate::io::unfinished;
use crate::proc::{guard, restored, socket};
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::{Handle, SignalsInfo};
use signal_hook::low_level::siginfo::{Cause, Origin};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};

/// The signals that interrupt criuz.
const INTERRUPTING: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];
/// Taken as well while a tree restored in the foreground runs, to pass on
/// (a service's dump, reload or rotate requests).
const PASSED_ON: [i32; 3] = [SIGQUIT, SIGUSR1, SIGUSR2];

/// A restore in the foreground is under way ([`stand_in_once_restored`]).
static STAND_IN: AtomicBool = AtomicBool::new(false);

/// The signal thread's handle, to take more signals once criuz forwards.
static HANDLE: OnceLock<Handle> = OnceLock::new();

/// The root that signals go on to, while criuz waits for it (it is criuz's
/// unreaped child meanwhile, so its pid cannot name another process; the
/// lock keeps a forward from racing the reap).
static FORWARD_TO: Mutex<Option<i32>> = Mutex::new(None);

/// Takes SIGINT, SIGTERM and SIGHUP for the rest of the process's life, on
/// the signal thread alone (the calling thread, and every thread it starts
/// after, holds them back). Call it before any other thread exists. Best
/// effort: where the thread or the handlers cannot be had, a signal kills
/// criuz as before, and the next run sweeps what it left.
pub fn install() {
    // A write past the file-size limit (`ulimit -f`) then fails with EFBIG,
    // reported naming the file, and what was unfinished is removed; by
    // default SIGXFSZ killed criuz mid-write with a shell's "File size
    // limit exceeded" and its temporary file left behind.
    // SAFETY: sets a signal's disposition to ignored; no handler runs.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    // SIGCHLD ignored by whoever started criuz (and so inherited) makes
    // the kernel reap criuz's children itself: no wait could tell how CRIU
    // ended, and a dump failed "No child processes" with its tree left
    // stopped. criuz waits for its children, so the default it needs.
    // SAFETY: sets a signal's disposition to the default; no handler runs.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    // One ignored when criuz started stays ignored (`nohup`, a shell's
    // background job without job control), as it would without this.
    let mut taken: Vec<i32> = INTERRUPTING.into_iter().filter(|&sig| !ignored(sig)).collect();
    taken.push(hold_request());
    let Ok(mut signals) = SignalsInfo::<WithOrigin>::new(taken) else { return };
    let handle = signals.handle();
    // The mask criuz was started with: the signal thread's own. Where that
    // holds these signals back (the image a foreground restore replaces
    // itself with, `hold_through_exec`), they stay held until `forward_to`.
    let inherited = set_held_back(libc::SIG_BLOCK);
    // The programs criuz runs start with it (`spawn`), not with its own.
    crate::spawn::note_started_with(crate::spawn::Mask(inherited));
    let spawned = std::thread::Builder::new().name("criuz-signals".into()).spawn(move || {
        // SAFETY: restores, in this thread only, a mask pthread_sigmask gave.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &inherited, std::ptr::null_mut()) };
        loop {
            let mut hold = false;
            for origin in signals.wait() {
                match origin.signal == hold_request() {
                    true => hold |= HOLD.requested.load(Ordering::Acquire),
                    false => take(&origin),
                }
            }
            if hold {
                // From now on no thread of this image takes them: one sent
                // stays pending, for the next image. What the handlers had
                // recorded before goes on now. The thread reads on, should
                // `exec` fail and the main thread take them again.
                set_held_back(libc::SIG_BLOCK);
                signals.pending().filter(|o| o.signal != hold_request()).for_each(|o| take(&o));
                *HOLD.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
                HOLD.answered.notify_all();
            }
        }
    });
    match spawned {
        Ok(_) => {
            let _ = HANDLE.set(handle);
        }
        // Without the thread (its handlers went with it) they act as they
        // would without criuz's: the main thread's mask as it was.
        Err(_) => {
            // SAFETY: as above, in the main thread.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &inherited, std::ptr::null_mut()) };
        }
    }
}

/// What the signal thread does with one signal it has taken.
fn take(origin: &Origin) {
    if forwarded(origin) {
        return;
    }
    if INTERRUPTING.contains(&origin.signal) {
        end_now(Ending::Signal(origin.signal));
    }
    // One of `PASSED_ON` before the tree ran, or after its root ended
    // (criuz exits then anyway): dropped.
}

/// The signal by which [`hold_through_exec`] wakes the signal thread: a
/// real-time one of criuz's own, which nothing else sends (one sent from
/// outside without a request is dropped).
fn hold_request() -> i32 {
    libc::SIGRTMIN() + 2
}

/// [`hold_through_exec`]'s request to the signal thread, and its answer.
struct Hold {
    requested: AtomicBool,
    done: Mutex<bool>,
    answered: Condvar,
}

static HOLD: Hold = Hold { requested: AtomicBool::new(false), done: Mutex::new(false), answered: Condvar::new() };

/// From now on, until [`stop_forwarding`], the signals criuz takes go on
/// to `root` (a restored tree's root, criuz's own child, not yet reaped)
/// instead of interrupting criuz. Best effort: where criuz could not take
/// signals at all, they end it as before, and the tree runs on. What
/// [`hold_through_exec`] held back is taken from here on.
pub fn forward_to(root: i32) {
    *FORWARD_TO.lock().unwrap_or_else(|e| e.into_inner()) = Some(root);
    take_passed_on();
    set_held_back(libc::SIG_UNBLOCK);
}

/// Takes [`PASSED_ON`] too (those not ignored): a service's requests
/// reach its root instead of ending criuz by their default action.
fn take_passed_on() {
    if let Some(handle) = HANDLE.get() {
        for sig in PASSED_ON.into_iter().filter(|&sig| !ignored(sig)) {
            let _ = handle.add_signal(sig);
        }
    }
}

/// For a restore in the foreground, before it starts: once its tree runs
/// whole (`restored::restored_root_running`), the signals that would interrupt
/// criuz go on to the tree's root, as they do once criuz waits for it
/// ([`forward_to`]); before that, they interrupt the restore, which ends
/// the tree. Without it, a SIGINT or SIGTERM in the few milliseconds
/// between the pidfile's publication and that wait ended criuz while the
/// tree ran on without it (a supervisor would start the service again
/// beside it; found by the fault campaign, `restore-foreground`). The
/// signals passed on are taken from now on: one that comes before the
/// tree runs is dropped (it was meant for the service).
pub fn stand_in_once_restored() {
    STAND_IN.store(true, Ordering::Release);
    take_passed_on();
}

/// Just before criuz replaces its image to wait for the tree it restored
/// (`exec`, same pid): the signals it passes on are held back by every
/// thread, so that one sent meanwhile waits, pending, for the new image's
/// [`forward_to`] instead of finding its default action there (ending
/// criuz); what the signal thread had taken goes on to the root first.
/// Waits for the signal thread at most a second (it may be busy ending
/// criuz).
pub fn hold_through_exec() {
    set_held_back(libc::SIG_BLOCK);
    if HANDLE.get().is_none() {
        return;
    }
    HOLD.requested.store(true, Ordering::Release);
    let done = HOLD.done.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: raise(3) sends a signal to this thread, which has it
    // unblocked; its handler (signal-hook's) wakes the signal thread.
    if unsafe { libc::raise(hold_request()) } != 0 {
        return;
    }
    let _ = HOLD.answered.wait_timeout_while(done, std::time::Duration::from_secs(1), |done| !*done);
}

/// Blocks or unblocks, in the calling thread, the signals criuz takes and
/// passes on; the mask the thread had before.
fn set_held_back(how: libc::c_int) -> libc::sigset_t {
    // SAFETY: signal sets of ours, filled by sigemptyset/sigaddset, given
    // to pthread_sigmask, which changes only this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in INTERRUPTING.into_iter().chain(PASSED_ON) {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(how, &set, &mut before);
        before
    }
}

/// Ends [`forward_to`]: call it before the root is reaped.
pub fn stop_forwarding() {
    *FORWARD_TO.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Passes `origin`'s signal on to the root criuz forwards to, if any;
/// whether there was one. A signal the kernel raised for a terminal
/// (Ctrl-C, a hang-up) went to the terminal's foreground process group:
/// where the root is in criuz's group it has it already.
fn forwarded(origin: &Origin) -> bool {
    let forward = FORWARD_TO.lock().unwrap_or_else(|e| e.into_inner());
    // Standing in before the wait: the root is criuz's child, not reaped
    // while it runs (`restored_root_running` reads that it does).
    let standing_in = || STAND_IN.load(Ordering::Acquire).then(restored::restored_root_running).flatten();
    let Some(root) = forward.or_else(standing_in) else { return false };
    // SAFETY: getpgid and getpgrp only read process attributes; `root` is
    // our unreaped child while `forward` is held (see FORWARD_TO).
    let shares_group = unsafe { libc::getpgid(root) == libc::getpgrp() };
    let sent = matches!(origin.cause, Cause::Sent(_));
    if sent || !shares_group {
        // SAFETY: as above; signalling our own child.
        unsafe { libc::kill(root, origin.signal) };
    }
    true
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

/// Why criuz ends before its command does.
enum Ending {
    /// One of [`INTERRUPTING`].
    Signal(i32),
    /// A panic: a thread the system would not start (a cgroup's pids
    /// limit), or a bug; said in words.
    Panic(String),
}

/// From now on a panic in any thread ends criuz as an interruption does
/// (what it had not finished removed, processes left to their guards, one
/// line), with exit status 1. Without it, a panic in one of several threads
/// that wait for each other could leave the others waiting for good (a
/// restore whose thread watching for CRIU's pidfile could not be started
/// waited forever for a CRIU it never ran), and a backtrace was the error.
pub fn end_on_panic() {
    let criuz = std::process::id();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // A process forked from criuz (a guard) holds a copy of criuz's
        // list of unfinished outputs: it must never remove them.
        if std::process::id() != criuz {
            return default(info);
        }
        let text = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // std's words for a thread the system would not start.
        let what = if text.starts_with("failed to spawn thread") {
            // Each thread's stack is address space; without a limit on
            // that, a pids limit is the likelier cause.
            match super::memory::address_space_left() {
                Some(left) => format!(
                    "the system refused to start a thread (criuz's address space is limited, ulimit -v, with {} \
                     MiB left; or a pids limit on its cgroup)",
                    left >> 20
                ),
                None => "the system refused to start a thread (a pids limit on criuz's cgroup?)".to_string(),
            }
        } else {
            let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
            format!("internal error{at}: {text}")
        };
        end_now(Ending::Panic(what))
    }));
}

fn end_now(ending: Ending) -> ! {
    if INTERRUPTED.swap(true, Ordering::AcqRel) {
        // Another thread is ending criuz already; it exits the process.
        loop {
            std::thread::park();
        }
    }
    // A restoring CRIU first (it would die with criuz anyway): killed
    // later, while a probe it forked was stopped under its ptrace, it would
    // leave that probe stopped for good, and its work directory, by which
    // the next run's sweep would have found the probe, is gone by then.
    // And a runc: one criuz waits for under a guard is killed now, as its
    // guard would kill it once criuz is gone; one whose CRIU sends pages to
    // criuz's page server ends once that server's sockets are shut down
    // (as criuz's death would close them: CRIU fails and resumes the
    // container). Either way it can no longer make its work directory
    // again after that is removed. A podman restoring a container is let
    // end too: its CRIU runs outside criuz's tree, through criuz's work
    // directory.
    let mut podman_waited = false;
    let end_processes = || {
        guard::end_guarded_children();
        restored::end_restoring_criu();
        socket::shut_down_tcp();
        podman_waited = restored::wait_runtime_children(std::time::Duration::from_secs(5));
    };
    let (ended, mut line) = match &ending {
        Ending::Signal(sig) => {
            (unfinished::end_unfinished(end_processes), format!("criuz: interrupted ({})", signal_name(*sig)))
        }
        Ending::Panic(what) => (
            unfinished::end_unfinished_within(std::time::Duration::from_secs(2), end_processes),
            format!("criuz: {what}"),
        ),
    };
    if ended.removed > 0 {
        line.push_str("; what it had not finished is removed");
    }
    if ended.busy {
        line.push_str("; what it had not finished is left for the next run to remove");
    }
    for kept in &ended.kept {
        line.push_str(&format!("; kept {} (it may hold the only copy of the checkpoint)", kept.display()));
    }
    for left in &ended.left {
        line.push_str(&format!("; could not remove {}", left.display()));
    }
    if podman_waited {
        line.push_str("; the podman it ran was let end first (`podman ps -a` shows where that left the container)");
    }
    for published in &ended.published {
        line.push_str(&format!("; {} was complete before it and stays", published.display()));
    }
    if let Some(root) = restored::restored_root_running() {
        line.push_str(&format!("; the restored tree (pid {root}) was whole before it and runs on"));
        match restored::write_running_pidfile(root) {
            Some(Ok(file)) => line.push_str(&format!(" (its pid is in {})", file.display())),
            Some(Err(e)) => line.push_str(&format!(" (its pid could not be written to --pidfile: {e})")),
            None => {}
        }
    }
    let mut err = std::io::stderr().lock();
    // After a progress bar's unfinished line.
    let start = if err.is_terminal() { "\n" } else { "" };
    let _ = writeln!(err, "{start}{line}");
    let _ = err.flush();
    let status = match ending {
        Ending::Signal(sig) => {
            let _ = signal_hook::low_level::emulate_default_handler(sig);
            // The default action of these three signals ends the process;
            // should it not have, end it with the status a shell gives a
            // death by `sig`.
            128 + sig
        }
        Ending::Panic(_) => 1,
    };
    // SAFETY: _exit(2) ends the process at once; nothing is left to run.
    unsafe { libc::_exit(status) }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}
