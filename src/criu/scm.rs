//! Descriptors passed over a Unix socket the way CRIU passes them: one
//! dummy byte carrying `SCM_RIGHTS` (criu/include/common/scm.h). The
//! streamer protocol hands over pipes this way, the lazy-pages socket
//! userfaultfds, and criuz its userfaultfd copies to the lazy restore's guard.

use crate::error::{Error, Result};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Receives one descriptor; `what` names it in errors ("the pipe").
pub fn recv_fd(sock: &UnixStream, what: &str) -> Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(RawFd);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| Error::Protocol(format!("receiving {what}: {e}")))?;
    if msg.bytes == 0 {
        return Err(Error::Protocol(format!("connection closed before {what} was passed")));
    }
    for c in msg.cmsgs().map_err(|e| Error::Protocol(format!("bad control message: {e}")))? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel just installed this descriptor for us.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                for &extra in &fds[1..] {
                    // SAFETY: likewise; we did not ask for them.
                    drop(unsafe { OwnedFd::from_raw_fd(extra) });
                }
                return Ok(owned);
            }
        }
    }
    Err(Error::Protocol(format!("no descriptor where {what} should be")))
}

/// Sends one descriptor.
pub fn send_fd(sock: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    let fds = [fd];
    let iov = [std::io::IoSlice::new(b"d")];
    sendmsg::<()>(sock.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)?;
    Ok(())
}
