//! The kernel socket tricks of criuz's page server (`session::receive`):
//! a receive buffer beyond `net.core.rmem_max` (SO_RCVBUFFORCE), the owner
//! of a loopback peer's socket (the kernel's socket table, /proc/net/tcp),
//! and the cork (TCP_CORK) taken off the dump's end of the connection from
//! here (pidfd_getfd). Without the first or the last the page server is
//! only slower; a peer whose owner cannot be found is refused.

use crate::proc::tree::tree_pids;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Room for this many bytes of pages queued on an accepted connection.
const RECEIVE_BUFFER: libc::c_int = 16 << 20;

/// Gives the connections this listener accepts a receive buffer of
/// [`RECEIVE_BUFFER`] (root may exceed `net.core.rmem_max`), so CRIU can
/// splice ahead while criuz's receiving thread waits for a core. Best
/// effort: without it the kernel's autotuning stays in charge.
pub(crate) fn widen_receive_buffer(listener: &TcpListener) {
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on a descriptor we own, one c_int value.
        let r = unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&RECEIVE_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return;
        }
    }
}

/// The kernel's view of the loopback socket that connected as `peer`: its
/// owner's uid and its inode, from the socket table (/proc/net/tcp, tcp6),
/// where that socket has `peer` as its local address and ours as its
/// remote one.
pub(crate) fn peer_socket(sock: &TcpStream, peer: SocketAddr) -> Option<(u32, u64)> {
    let local = sock.local_addr().ok()?;
    let hex = |a: SocketAddr| -> String {
        let ip = match a.ip() {
            std::net::IpAddr::V4(v4) => v4.octets().iter().rev().map(|b| format!("{b:02X}")).collect::<String>(),
            std::net::IpAddr::V6(v6) => {
                // Four 32-bit words, each in host (little-endian) order.
                v6.octets().chunks(4).flat_map(|w| w.iter().rev()).map(|b| format!("{b:02X}")).collect()
            }
        };
        format!("{ip}:{:04X}", a.port())
    };
    let (want_local, want_remote) = (hex(peer), hex(local));
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|table| {
        let t = std::fs::read_to_string(table).ok()?;
        t.lines().skip(1).find_map(|l| {
            // sl local remote st queues timer retransmits uid timeout inode
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 9 && f[1] == want_local && f[2] == want_remote)
                .then(|| Some((f[7].parse().ok()?, f[9].parse().ok()?)))?
        })
    })
}

/// Takes the cork off CRIU's end of the connection. CRIU corks its
/// page-server socket when it connects and pushes each command that wants
/// an answer with a one-off TCP_NODELAY, all but the last: CLOSE stays in
/// the cork until the kernel's 200 ms cork timer sends it
/// (`disconnect_from_page_server` in criu/page-xfer.c). Measured: CRIU sent
/// CLOSE and criuz read it 0.200 s later (`strace -tt` on CRIU, timestamps
/// in criuz), every time, whatever the size of the dump. The socket is
/// reached in the process that holds it, one of criuz's own descendants
/// (runc's CRIU), through pidfd_getfd(2); it is the other end of the
/// connection criuz accepted, found by its inode. Best effort: without it
/// the dump only ends 0.2 s later.
pub(crate) fn uncork_dump(inode: u64) -> bool {
    let Some(theirs) = socket_of_descendant(inode) else { return false };
    let off: libc::c_int = 0;
    // SAFETY: setsockopt on a descriptor we own, one c_int value.
    let r = unsafe {
        libc::setsockopt(
            theirs.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// A copy of the socket with `inode` as one of criuz's descendants holds it.
fn socket_of_descendant(inode: u64) -> Option<OwnedFd> {
    let link = format!("socket:[{inode}]");
    let me = std::process::id() as i32;
    tree_pids(&[me]).into_iter().filter(|&p| p != me).find_map(|pid| {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
        let fd =
            fds.flatten().find(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == link.as_str()))?;
        their_fd(pid, fd.file_name().to_str()?.parse().ok()?)
    })
}

/// A copy of descriptor `fd` of process `pid` (pidfd_getfd(2): root, or
/// the right to ptrace it).
pub(crate) fn their_fd(pid: i32, fd: RawFd) -> Option<OwnedFd> {
    // SAFETY: pidfd_open and pidfd_getfd return new descriptors (or -1),
    // each owned once here.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return None;
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as RawFd);
        let theirs = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        (theirs >= 0).then(|| OwnedFd::from_raw_fd(theirs as RawFd))
    }
}

/// For a criuz about to die: shuts down every TCP socket it has (the page
/// server's listener and connection, object-store connections), as its
/// death would close them, so that a dump sending pages to it fails now and
/// its CRIU resumes the tree while criuz waits for the runc above it
/// (`proc::interrupt`). Descriptors are looked at once, in /proc/self/fd.
pub(crate) fn shut_down_tcp() {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return };
    for fd in fds.flatten().filter_map(|e| e.file_name().to_str()?.parse::<RawFd>().ok()) {
        let mut domain: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a c_int of ours; a descriptor that is no
        // socket (or no longer open) only fails.
        let r = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN, (&mut domain as *mut libc::c_int).cast(), &mut len)
        };
        if r == 0 && (domain == libc::AF_INET || domain == libc::AF_INET6) {
            // SAFETY: shutdown(2) of a socket of ours; it closes nothing.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}
