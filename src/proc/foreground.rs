//! A restore criuz waits for (`restore` without `-d`), as a container's
//! entrypoint or a service manager's main process: CRIU restores the tree's
//! root as criuz's own child (`--restore-sibling`) and returns, so criuz,
//! like any parent, learns how the root ended and exits with that status.
//! CRIU waiting for the tree itself (plain `criu restore`) returns 0
//! however the tree ended, which hid a crash from whatever restarts it.
//!
//! Meanwhile criuz is no subreaper (what the tree orphans goes to init, or
//! to a subreaper above criuz, as it would under plain CRIU) and the
//! signals it is sent go on to the root (`interrupt::forward_to`).

use crate::error::{Error, Result};
use crate::proc::{interrupt, restored};

/// How a restored tree's root ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this status.
    Exited(i32),
    /// A signal ended it.
    Killed(i32),
}

impl Ended {
    /// The exit status that stands for it: the root's own, or, for a death
    /// by a signal, 128 plus the signal's number, as a shell reports one.
    pub fn exit_code(self) -> u8 {
        match self {
            Ended::Exited(code) => code as u8,
            Ended::Killed(sig) => (128 + sig).clamp(0, 255) as u8,
        }
    }
}

/// Waits until `root`, the root of a tree criuz restored and criuz's own
/// child, has ended, passing the signals criuz is sent on to it; reaps it
/// and says how it ended.
pub fn wait_for_root(root: i32) -> Result<Ended> {
    restored::let_go_of_restored_tree(Some(root));
    interrupt::forward_to(root);
    let waited = wait_unreaped(root);
    // Before the reap frees the pid for another process.
    interrupt::stop_forwarding();
    waited?;
    let mut status = 0;
    // SAFETY: our own child, which has ended; this reaps it.
    if unsafe { libc::waitpid(root, &mut status, 0) } != root {
        return Err(lost(root, std::io::Error::last_os_error()));
    }
    if libc::WIFSIGNALED(status) {
        Ok(Ended::Killed(libc::WTERMSIG(status)))
    } else {
        Ok(Ended::Exited(libc::WEXITSTATUS(status)))
    }
}

/// Waits until `root` has ended, leaving it unreaped (its pid stays its own
/// until the reap). Any other child that ends meanwhile is reaped: one the
/// tree orphaned while criuz was still its subreaper (a lazy tree's stays
/// criuz's until its proof behind is done), which would stay a zombie.
fn wait_unreaped(root: i32) -> Result<()> {
    // SAFETY: getpid has no preconditions.
    if crate::proc::holder::parent_of(root) != Some(unsafe { libc::getpid() }) {
        return Err(lost(root, std::io::Error::from_raw_os_error(libc::ECHILD)));
    }
    loop {
        // SAFETY: waitid(2) into a zeroed siginfo of ours; WNOWAIT leaves the
        // child to reap.
        let (rc, ended) = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let rc = libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT);
            (rc, info.si_pid())
        };
        if rc == 0 && ended == root {
            return Ok(());
        }
        if rc == 0 {
            // SAFETY: our own child, ended: this reaps it.
            unsafe { libc::waitpid(ended, std::ptr::null_mut(), 0) };
            continue;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(lost(root, err));
        }
    }
}

fn lost(root: i32, err: std::io::Error) -> Error {
    Error::Criu(format!("cannot wait for the restored tree's root (pid {root}), not criuz's child: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_s_end_becomes_criuz_s_exit_status() {
        assert_eq!(Ended::Exited(0).exit_code(), 0);
        assert_eq!(Ended::Exited(7).exit_code(), 7);
        assert_eq!(Ended::Killed(libc::SIGKILL).exit_code(), 137);
        assert_eq!(Ended::Killed(libc::SIGTERM).exit_code(), 143);
    }

    /// (Waiting for a child of its own is tested with real restores,
    /// tests/criu_stream.rs: it reaps whatever child of the test process
    /// ends meanwhile.)
    #[test]
    fn a_root_that_is_not_criuz_s_child_is_an_error() {
        let e = wait_for_root(1).unwrap_err();
        assert!(e.to_string().contains("pid 1"), "{e}");
    }
}
