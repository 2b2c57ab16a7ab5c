//! Handing bytes to CRIU's pipes.

use crate::error::Result;
use std::io::Write;
use std::os::fd::AsRawFd;

/// Writes to CRIU's pipe. CRIU closing its end early is its own business.
pub fn write_pipe(pipe: &mut std::fs::File, data: &[u8]) -> Result<bool> {
    match pipe.write_all(data) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Bytes to send: a range of a buffer (a whole decoded block, or the payload
/// of a raw block still inside its record, which saves a copy).
pub struct Chunk {
    pub buf: Vec<u8>,
    pub range: std::ops::Range<usize>,
}

impl Chunk {
    pub fn whole(buf: Vec<u8>) -> Self {
        Chunk { range: 0..buf.len(), buf }
    }
}

/// Hands buffers to CRIU's pipe with vmsplice: the pipe references our pages
/// instead of copying them, which halves the memory traffic of a restore and
/// keeps the pipe's lock held only briefly (with plain writes, CRIU's reads
/// spun on that lock while we copied). The pipe reads our memory later, so a
/// buffer is kept until the reader has consumed past it (bytes handed over
/// minus FIONREAD), and `finish` waits for the pipe to drain.
pub struct SplicePipe {
    pipe: std::fs::File,
    handed: u64,
    in_flight: std::collections::VecDeque<(u64, Vec<u8>)>,
    closed: bool,
}

impl SplicePipe {
    pub fn new(pipe: std::fs::File) -> Self {
        SplicePipe { pipe, handed: 0, in_flight: Default::default(), closed: false }
    }

    fn unread(&self) -> std::io::Result<u64> {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer we pass.
        if unsafe { libc::ioctl(self.pipe.as_raw_fd(), libc::FIONREAD, &mut n) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n.max(0) as u64)
    }

    fn release_consumed(&mut self) -> std::io::Result<()> {
        let consumed = self.handed - self.unread()?;
        while self.in_flight.front().is_some_and(|(end, _)| *end <= consumed) {
            self.in_flight.pop_front();
        }
        Ok(())
    }

    /// Returns false once CRIU has closed its end (it wants no more).
    pub fn send(&mut self, chunk: Chunk) -> Result<bool> {
        if self.closed {
            return Ok(false);
        }
        let bytes = &chunk.buf[chunk.range.clone()];
        let mut off = 0;
        while off < bytes.len() {
            let iov = libc::iovec { iov_base: bytes[off..].as_ptr() as *mut libc::c_void, iov_len: bytes.len() - off };
            // SAFETY: the iovec points into `buf`, which we keep (in_flight)
            // unchanged until the reader has consumed it.
            let n = unsafe { libc::vmsplice(self.pipe.as_raw_fd(), &iov, 1, 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EPIPE) => {
                        self.closed = true;
                        return Ok(false);
                    }
                    _ => return Err(e.into()),
                }
            }
            off += n as usize;
        }
        self.handed += bytes.len() as u64;
        self.in_flight.push_back((self.handed, chunk.buf));
        self.release_consumed()?;
        Ok(true)
    }

    /// Waits until CRIU has read everything (or closed the pipe), so no
    /// buffer is freed while the pipe still refers to it.
    pub fn finish(mut self) -> Result<()> {
        while !self.closed && !self.in_flight.is_empty() {
            let mut pfd = libc::pollfd { fd: self.pipe.as_raw_fd(), events: 0, revents: 0 };
            // SAFETY: one pollfd of ours; a 1 ms timeout paces the loop.
            unsafe { libc::poll(&mut pfd, 1, 1) };
            if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                // The reader is gone: the pipe dropped its references.
                self.closed = true;
                break;
            }
            self.release_consumed()?;
        }
        Ok(())
    }
}
