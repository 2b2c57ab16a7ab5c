//! The programs criuz runs (CRIU, runc, podman, a probe's `--version`)
//! start with the signal mask criuz itself was started with.
//!
//! criuz's threads hold back the signals it takes (`proc::interrupt`: only
//! its signal thread takes them, so that none is lost when a foreground
//! restore replaces criuz's image), and a child keeps the mask of the
//! thread that forked it through `exec`: `std::process` leaves it as it
//! is. Without this, CRIU or runc, and what they start, would hold SIGINT,
//! SIGTERM and SIGHUP back. Every program criuz runs is made here
//! (clippy.toml turns `Command::new` away elsewhere). The `pre_exec` this
//! adds takes `std::process` off `posix_spawn` onto fork and exec, a cost
//! of page tables that only a criuz holding much memory would feel; none
//! does where it starts a program (CRIU and runc are started first).

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::OnceLock;

/// The mask criuz was started with, once `proc::interrupt` holds signals
/// back; unset in a process that never did (tests, the bench), whose
/// children keep its mask as `std::process` gives it.
static STARTED_WITH: OnceLock<Mask> = OnceLock::new();

/// A signal mask (`sigset_t` is plain data: bits).
#[derive(Clone, Copy)]
pub struct Mask(pub libc::sigset_t);

/// Notes the mask criuz was started with, before it holds signals back.
pub fn note_started_with(mask: Mask) {
    let _ = STARTED_WITH.set(mask);
}

/// The mask criuz was started with, where criuz changed its own.
pub fn started_with() -> Option<Mask> {
    STARTED_WITH.get().copied()
}

/// `Command::new(program)`, whose child starts with the mask criuz was
/// started with.
#[allow(clippy::disallowed_methods)]
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new(program);
    if let Some(Mask(mask)) = started_with() {
        // SAFETY: sigprocmask is async-signal-safe, and `mask` is a copy
        // made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                libc::sigprocmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut());
                Ok(())
            });
        }
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The child of a thread that holds SIGTERM back starts without it
    /// held back once the mask criuz started with is noted.
    #[test]
    fn a_child_starts_with_the_mask_criuz_was_started_with() {
        // In a thread of its own, so that no other test's children see it.
        std::thread::spawn(|| {
            // SAFETY: signal sets of ours; pthread_sigmask changes this
            // thread's mask only.
            let before = unsafe {
                let mut before: libc::sigset_t = std::mem::zeroed();
                let mut term: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut term);
                libc::sigaddset(&mut term, libc::SIGTERM);
                libc::pthread_sigmask(libc::SIG_BLOCK, &term, &mut before);
                before
            };
            let blocked = |cmd: &mut Command| {
                let out = cmd.args(["SigBlk", "/proc/self/status"]).output().unwrap();
                let line = String::from_utf8(out.stdout).unwrap();
                let bits = u64::from_str_radix(line.split_whitespace().last().unwrap(), 16).unwrap();
                bits & (1 << (libc::SIGTERM - 1)) != 0
            };
            #[allow(clippy::disallowed_methods)]
            let plain = blocked(&mut Command::new("grep"));
            assert!(plain, "std::process keeps the parent thread's mask: this module is needed");
            note_started_with(Mask(before));
            assert!(!blocked(&mut command("grep")), "the child holds SIGTERM back");
        })
        .join()
        .unwrap();
    }
}
