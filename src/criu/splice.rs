//! Handing bytes to CRIU's pipes.

use crate::error::Result;
use crate::io::SharedBytes;
use std::io::Write;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// Writes to CRIU's pipe. CRIU closing its end early is its own business.
pub fn write_pipe(pipe: &mut std::fs::File, data: &[u8]) -> Result<bool> {
    match pipe.write_all(data) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Bytes to send, in order: ranges of buffers (a whole decoded block, the
/// payload of a raw block still inside its record, or the pieces of decoded
/// parent blocks a resolved incremental block is made of), never copied.
pub struct Chunk {
    parts: Vec<(SharedBytes, Range<usize>)>,
}

impl Chunk {
    pub fn whole(buf: Vec<u8>) -> Self {
        let len = buf.len();
        Chunk::range(buf, 0..len)
    }

    pub fn range(buf: Vec<u8>, range: Range<usize>) -> Self {
        Chunk { parts: vec![(Arc::new(buf), range)] }
    }

    pub fn parts(parts: Vec<(SharedBytes, Range<usize>)>) -> Self {
        Chunk { parts }
    }

    pub fn len(&self) -> usize {
        self.parts.iter().map(|(_, r)| r.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Hands buffers to CRIU's pipe with vmsplice: the pipe references our pages
/// instead of copying them, which halves the memory traffic of a restore and
/// keeps the pipe's lock held only briefly (with plain writes, CRIU's reads
/// spun on that lock while we copied). The pipe reads our memory later, so a
/// buffer is kept until the reader has consumed past it (bytes handed over
/// minus FIONREAD), and `finish` waits for the pipe to drain.
/// Iovecs per vmsplice call (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

pub struct SplicePipe {
    pipe: std::fs::File,
    handed: u64,
    in_flight: std::collections::VecDeque<(u64, Chunk)>,
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
        let mut iovs: Vec<libc::iovec> = chunk
            .parts
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(owner, r)| {
                let bytes = &(**owner).as_ref()[r.clone()];
                libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }
            })
            .collect();
        let total: usize = iovs.iter().map(|v| v.iov_len).sum();
        let mut next = 0;
        while next < iovs.len() {
            let count = (iovs.len() - next).min(IOV_MAX);
            // SAFETY: the iovecs point into the chunk's buffers, which we keep
            // (in_flight) unchanged until the reader has consumed them.
            let n = unsafe { libc::vmsplice(self.pipe.as_raw_fd(), iovs[next..].as_ptr(), count, 0) };
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
            let mut n = n as usize;
            while n > 0 {
                let v = &mut iovs[next];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    next += 1;
                } else {
                    // SAFETY: still within the same buffer (n < iov_len).
                    v.iov_base = unsafe { v.iov_base.add(n) };
                    v.iov_len -= n;
                    n = 0;
                }
            }
        }
        self.handed += total as u64;
        self.in_flight.push_back((self.handed, chunk));
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
