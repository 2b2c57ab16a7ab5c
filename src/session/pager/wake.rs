//! What reaches the pager's poll from other threads: a failure found beside
//! it (`Abort`), and the gates that hold part of the work back until
//! another thread says (`Gate`), each a socket pair whose shut side reads as
//! ready for good.

use crate::error::Error;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::OnceLock;

/// A failure found beside the pager (the proof of the stored bytes, behind
/// the running tree). The pager fails with it once CRIU has handed over
/// every userfaultfd, not before: then the victim is known (a container's
/// cgroup is learnt from CRIU's connection) and no userfaultfd is still in
/// flight to be dropped unserved, so the victim is killed before any copy
/// of a userfaultfd closes, as for a copy that failed.
pub(crate) struct Abort {
    why: OnceLock<Error>,
    wake: Wake,
}

impl Abort {
    pub(crate) fn new() -> std::io::Result<Abort> {
        Ok(Abort { why: OnceLock::new(), wake: Wake::new()? })
    }

    /// Makes the pager fail with `why` (the first failure given wins).
    pub(crate) fn fail(&self, why: Error) {
        let _ = self.why.set(why);
        self.wake.ring();
    }

    /// The failure given, if any.
    pub(super) fn failure(&self) -> Option<&Error> {
        self.why.get()
    }

    /// The descriptor the pager's poll waits on for a failure.
    pub(super) fn fd(&self) -> std::os::fd::RawFd {
        self.wake.fd()
    }
}

/// What wakes the pager's poll from another thread, for good once rung
/// (the shut side of a socket pair reads as ready, level-triggered).
struct Wake {
    ring: UnixStream,
    woken: UnixStream,
}

impl Wake {
    fn new() -> std::io::Result<Wake> {
        let (ring, woken) = UnixStream::pair()?;
        Ok(Wake { ring, woken })
    }

    fn ring(&self) {
        let _ = self.ring.shutdown(std::net::Shutdown::Both);
    }

    /// The descriptor the poll waits on.
    fn fd(&self) -> std::os::fd::RawFd {
        self.woken.as_raw_fd()
    }
}

/// A door another thread opens once, for good, waking the pager's poll.
/// Two uses: a lazy tree CRIU leaves stopped until something else lets it
/// run (the walks behind) holds the pager's fill back until it runs (on 2
/// cores the fill slowed the walks the tree waits for), faults served
/// meanwhile; and a held tree's huge-page spans wait until CRIU has exited
/// having restored it (`Pager::writing_huge_pages_after`).
pub(crate) struct Gate {
    open: AtomicBool,
    wake: Wake,
}

impl Gate {
    pub(crate) fn new() -> std::io::Result<Gate> {
        Ok(Gate { open: AtomicBool::new(false), wake: Wake::new()? })
    }

    pub(crate) fn open(&self) {
        self.open.store(true, Ordering::Release);
        self.wake.ring();
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// The descriptor the pager's poll waits on for the gate to open.
    pub(super) fn fd(&self) -> std::os::fd::RawFd {
        self.wake.fd()
    }
}

/// A gated fill ([`Pager::run`](super::Pager::run)): the gate, and where to tell that CRIU has
/// handed over all of the tree's memory (dropped untold if it never did).
pub(crate) type Gated<'g> = (&'g Gate, Sender<()>);
