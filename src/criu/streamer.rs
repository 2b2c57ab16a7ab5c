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

/// A listening streamer socket, created 0600 and removed on drop.
pub struct Listener {
    sock: UnixListener,
    path: PathBuf,
}

impl Listener {
    pub fn bind(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(name);
        // The umask makes the socket private from the moment it exists.
        // SAFETY: umask only swaps the process file-mode mask.
        let old = unsafe { libc::umask(0o177) };
        let sock = UnixListener::bind(&path);
        // SAFETY: restoring the previous mask.
        unsafe { libc::umask(old) };
        let sock = sock.map_err(|e| Error::file(&path, e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| Error::file(&path, e))?;
        sock.set_nonblocking(true)?;
        Ok(Listener { sock, path })
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
