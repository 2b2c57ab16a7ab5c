//! CRIU's image-streaming protocol (`criu dump --stream` / `criu restore
//! --stream`, CRIU >= 3.15; see criu/img-streamer.c).
//!
//! CRIU connects to `streamer-capture.sock` (dump) or `streamer-serve.sock`
//! (restore) in the images directory and, for every image file it opens, sends
//! a length-prefixed `img_streamer_request_entry` (u32 native-endian length,
//! then the protobuf). On restore we answer with `img_streamer_reply_entry`
//! (does the file exist?). Then CRIU passes one end of a fresh pipe with
//! SCM_RIGHTS (plus one dummy byte) and reads or writes the file through it.
//! CRIU may hold several files open at once, so every file gets its own
//! thread; the socket closing means no more files will be opened.
//!
//! This module is the protocol only: sockets, messages and passed pipes. What
//! is done with the files is the sessions' business (`crate::session`).
//! Nothing read from the socket is trusted: lengths are bounded and every
//! malformed message is a [`Error::Protocol`], never a panic.

use crate::error::{Error, Result};
use crate::io::unfinished::Unfinished;
use prost::Message;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub const CAPTURE_SOCKET: &str = "streamer-capture.sock";
pub const SERVE_SOCKET: &str = "streamer-serve.sock";

/// Our own minimal copies of CRIU's images/img-streamer.proto messages.
#[derive(Clone, PartialEq, Message)]
struct ImgStreamerRequestEntry {
    #[prost(string, required, tag = "1")]
    filename: String,
}

#[derive(Clone, PartialEq, Message)]
struct ImgStreamerReplyEntry {
    #[prost(bool, required, tag = "1")]
    exists: bool,
}

/// A listening streamer socket, created 0600 and removed on drop, or by an
/// interruption (`io::unfinished`): in a directory of the user's
/// (`capture`, `serve`), one left behind made the next run there fail
/// with "Address already in use".
pub struct Listener {
    sock: UnixListener,
    path: PathBuf,
    _unfinished: Unfinished,
}

impl Listener {
    pub fn bind(dir: &Path, name: &str) -> Result<Self> {
        // Bound by its absolute path where that fits a socket address, so
        // that /proc/net/unix names it in full (`clear_stale`).
        let path = std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .ok()
            .filter(|p| p.as_os_str().len() < SUN_PATH_MAX)
            .unwrap_or_else(|| dir.join(name));
        if path.as_os_str().len() >= SUN_PATH_MAX {
            // CRIU connects by this path: a socket address holds 107 bytes.
            return Err(Error::Usage(format!(
                "{}: {} bytes, too long for the socket CRIU connects to (at most {}): use a shorter directory \
                 ($TMPDIR, where dump and restore --fill stream make CRIU's, or capture's and serve's -D)",
                path.display(),
                path.as_os_str().len(),
                SUN_PATH_MAX - 1,
            )));
        }
        clear_stale(&path, name)?;
        // The umask makes the socket private from the moment it exists.
        // SAFETY: umask only swaps the process file-mode mask.
        let old = unsafe { libc::umask(0o177) };
        let sock = Unfinished::made(|| UnixListener::bind(&path).map(|s| (s, path.clone())));
        // SAFETY: restoring the previous mask.
        unsafe { libc::umask(old) };
        let (sock, unfinished) = sock.map_err(|e| Error::file(&path, e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| Error::file(&path, e))?;
        sock.set_nonblocking(true)?;
        Ok(Listener { sock, path, _unfinished: unfinished })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for CRIU to connect; `None` if `stop` is set first.
    pub fn accept(&self, stop: &AtomicBool) -> Result<Option<UnixStream>> {
        loop {
            match self.sock.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    return Ok(Some(s));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Error::file(&self.path, e)),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes a socket at `path` that no process listens on: one a killed
/// criuz left (nothing removes it then). A socket some process listens on
/// (a criuz capture or serve still at work there) is refused, found in
/// /proc/net/unix rather than by connecting, which that process would take
/// for CRIU. Anything else there is left for the bind to report.
fn clear_stale(path: &Path, name: &str) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {}
        _ => return Ok(()),
    }
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    if listening(&table, path, name) {
        let busy = std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "another process listens there (a criuz capture or serve still running?)",
        );
        return Err(Error::file(path, busy));
    }
    std::fs::remove_file(path).map_err(|e| Error::file(path, e))
}

/// Whether /proc/net/unix (`table`) has a listening socket (flag
/// `__SO_ACCEPTCON`, 0x10000) bound to `path`, or, bound by a relative path
/// (which names no directory this process can tell), to one called `name`.
fn listening(table: &str, path: &Path, name: &str) -> bool {
    let path = path.to_string_lossy();
    let suffix = format!("/{name}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = fields.get(3).and_then(|f| u32::from_str_radix(f, 16).ok()).unwrap_or(0);
        if fields.len() < 8 || flags & 0x10000 == 0 {
            return false;
        }
        let bound = fields[7..].join(" ");
        bound == path || (!bound.starts_with('/') && (bound == name || bound.ends_with(&suffix)))
    })
}

/// The longest path a socket address holds, with its terminating NUL.
pub(crate) const SUN_PATH_MAX: usize = 108;

/// Reads one request; `None` when CRIU has closed the connection.
pub fn read_request(sock: &mut UnixStream) -> Result<Option<String>> {
    let mut len = [0u8; 4];
    let got = crate::archive::records::read_full(sock, &mut len)?;
    if got == 0 {
        return Ok(None);
    }
    if got < 4 {
        return Err(Error::Protocol("connection closed inside a request".into()));
    }
    let len = u32::from_ne_bytes(len) as usize;
    if len > 64 << 10 {
        return Err(Error::Protocol(format!("request of {len} bytes is not a file request")));
    }
    let mut buf = vec![0u8; len];
    if crate::archive::records::read_full(sock, &mut buf)? < len {
        return Err(Error::Protocol("connection closed inside a request".into()));
    }
    let req = ImgStreamerRequestEntry::decode(&buf[..]).map_err(|e| Error::Protocol(format!("bad request: {e}")))?;
    Ok(Some(req.filename))
}

pub fn send_reply(sock: &mut UnixStream, exists: bool) -> Result<()> {
    let body = ImgStreamerReplyEntry { exists }.encode_to_vec();
    let mut msg = (body.len() as u32).to_ne_bytes().to_vec();
    msg.extend_from_slice(&body);
    sock.write_all(&msg)?;
    Ok(())
}

/// Asks for a pipe of `splice::PIPE_BYTES`: fewer wake-ups than the default
/// 64 KiB. 1 MiB is the unprivileged maximum by default
/// (/proc/sys/fs/pipe-max-size).
pub fn grow_pipe(fd: &OwnedFd) {
    // SAFETY: fcntl on a descriptor we own; failure just keeps the default size.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, crate::criu::splice::PIPE_BYTES as libc::c_int) };
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 1001 /srv/images/streamer-capture.sock
0000000000000000: 00000002 00000000 00000000 0001 03 1002 /srv/old/streamer-capture.sock
0000000000000000: 00000002 00000000 00010000 0001 01 1003 rel/streamer-serve.sock
";

    #[test]
    fn a_socket_counts_as_in_use_only_while_something_listens_on_it() {
        let capture = |dir: &str| Path::new(dir).join(CAPTURE_SOCKET);
        assert!(listening(TABLE, &capture("/srv/images"), CAPTURE_SOCKET));
        // Connected, not listening: what a killed criuz's CRIU may hold.
        assert!(!listening(TABLE, &capture("/srv/old"), CAPTURE_SOCKET));
        assert!(!listening(TABLE, &capture("/srv/other"), CAPTURE_SOCKET));
        // Bound relative to a directory this process cannot tell: in use.
        assert!(listening(TABLE, &Path::new("/anywhere").join(SERVE_SOCKET), SERVE_SOCKET));
    }

    #[test]
    fn a_socket_left_behind_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().canonicalize().unwrap();
        let path = dir.join(CAPTURE_SOCKET);
        // Another process's listener (a criuz capture at work there).
        let live = UnixListener::bind(&path).unwrap();
        let e = Listener::bind(&dir, CAPTURE_SOCKET).err().expect("a second listener must be refused");
        assert!(e.to_string().contains("another process listens there"), "{e}");
        // Closed without removing its file, as a killed criuz leaves it.
        drop(live);
        assert!(path.exists());
        let ours = Listener::bind(&dir, CAPTURE_SOCKET).unwrap();
        drop(ours);
        assert!(!path.exists(), "a listener removes its socket");
    }
}
