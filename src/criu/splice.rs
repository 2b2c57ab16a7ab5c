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
/// buffer is kept until the reader must have consumed past it: each pipe
/// slot holds at most a page, so at most the pipe's size of what was handed
/// over can be unread. `finish` waits for the pipe to drain.
///
/// CRIU's read holds the pipe's lock while it copies everything the pipe
/// holds into fresh memory; a vmsplice arriving meanwhile spins on that lock
/// (a fifth of a restore's CPU, on two cores taken from the decoders). So
/// chunks are queued and handed over in batches that fill the pipe, and a
/// full pipe is waited on with poll: the kernel wakes a writer of a full pipe
/// only once the read has ended and let go of the lock. Where CRIU frees
/// little per read, the writer then naps before it hands more over
/// ([`ROOM_NAP`]): CRIU reads a forked child's pages one at a time (it
/// compares each with its parent's), and a writer woken by each read handed
/// over one page per wake (up to 99,000 context switches in a 1 GiB tree's
/// restore on 2 cores; 3,000-7,800 so: docs/BENCHMARKS.md, session 79).
/// The room is what the next vmsplice takes: asking the pipe (FIONREAD)
/// takes its lock, and spun there while CRIU read.
pub struct SplicePipe {
    pipe: std::fs::File,
    /// Bytes handed to the pipe so far.
    handed: u64,
    /// Chunks handed (their end in `handed`), kept until read.
    in_flight: std::collections::VecDeque<(u64, Chunk)>,
    /// Chunks not handed yet, and how far into the first one we are.
    queued: std::collections::VecDeque<Chunk>,
    queued_bytes: usize,
    first_done: usize,
    /// The pipe's size: at most this much of what was handed is unread.
    capacity: u64,
    closed: bool,
    /// The last vmsplice after a wait (the room a read made) filled the
    /// pipe from less than a quarter of it: CRIU frees little per read, and
    /// a wake is a nap.
    little_room: bool,
}

/// Iovecs per vmsplice call (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// The pipe size asked for (see `streamer::grow_pipe`), and the most worth
/// gathering before handing over. CRIU never resizes the pipes it passes.
pub const PIPE_BYTES: usize = 1 << 20;

/// How long a writer woken with little room sleeps before it hands more
/// over: a reader taking a page at a time frees a few dozen pages meanwhile
/// (the timer's slack makes it about 0.1 ms), while what is still in the
/// pipe keeps it busy.
const ROOM_NAP: std::time::Duration = std::time::Duration::from_micros(50);

impl SplicePipe {
    pub fn new(pipe: std::fs::File) -> Self {
        // SAFETY: F_GETPIPE_SZ on a descriptor we own; it returns the size.
        let size = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_GETPIPE_SZ) };
        // Unknown (not a pipe): rely on FIONREAD in `finish` only, and keep
        // everything until then.
        let capacity = if size > 0 { size as u64 } else { u64::MAX };
        SplicePipe {
            pipe,
            handed: 0,
            in_flight: Default::default(),
            queued: Default::default(),
            queued_bytes: 0,
            first_done: 0,
            capacity,
            closed: false,
            little_room: false,
        }
    }

    fn unread(&self) -> std::io::Result<u64> {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer we pass.
        if unsafe { libc::ioctl(self.pipe.as_raw_fd(), libc::FIONREAD, &mut n) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n.max(0) as u64)
    }

    /// Drops the chunks the reader has consumed, by the pipe's own count
    /// (FIONREAD takes the pipe's lock, and spins while CRIU reads: only
    /// for `finish`).
    fn release_consumed(&mut self) -> std::io::Result<()> {
        let consumed = self.handed - self.unread()?;
        self.release_before(consumed);
        Ok(())
    }

    /// Drops the chunks that end at or before `consumed`.
    fn release_before(&mut self, consumed: u64) {
        while self.in_flight.front().is_some_and(|(end, _)| *end <= consumed) {
            self.in_flight.pop_front();
        }
    }

    /// Queues a chunk; nothing is handed over before [`SplicePipe::flush`].
    pub fn queue(&mut self, chunk: Chunk) {
        self.queued_bytes += chunk.len();
        self.queued.push_back(chunk);
    }

    /// Whether enough is queued to fill the pipe.
    pub fn has_pipe_full(&self) -> bool {
        self.queued_bytes >= PIPE_BYTES
    }

    /// Hands every queued chunk to the pipe, waiting while it is full.
    /// Returns false once CRIU has closed its end (it wants no more).
    pub fn flush(&mut self) -> Result<bool> {
        // The pipe was full and a read made room: this vmsplice takes it.
        let mut woken = false;
        while !self.queued.is_empty() {
            if self.closed {
                return Ok(false);
            }
            let iovs = self.queued_iovecs();
            if iovs.is_empty() {
                // Only empty chunks are left.
                self.advance(0);
                continue;
            }
            let want: usize = iovs.iter().map(|v| v.iov_len).sum();
            // SAFETY: the iovecs point into queued chunks' buffers, which are
            // kept (queued, then in_flight) unchanged until the reader has
            // consumed them.
            let n = unsafe { libc::vmsplice(self.pipe.as_raw_fd(), iovs.as_ptr(), iovs.len(), 0) };
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
            let filled = (n as usize) < want;
            if std::mem::take(&mut woken) {
                self.little_room = filled && (n as u64) < self.capacity / 4;
            }
            self.advance(n as usize);
            self.release_before(self.handed.saturating_sub(self.capacity));
            if filled && !self.queued.is_empty() {
                self.wait_writable()?;
                if self.little_room {
                    std::thread::sleep(ROOM_NAP);
                }
                woken = true;
            }
        }
        Ok(true)
    }

    /// Iovecs for what is queued, up to IOV_MAX.
    fn queued_iovecs(&self) -> Vec<libc::iovec> {
        let mut skip = self.first_done;
        let mut iovs = Vec::new();
        'chunks: for chunk in &self.queued {
            for (owner, r) in &chunk.parts {
                let bytes = &(**owner).as_ref()[r.clone()];
                if skip >= bytes.len() {
                    skip -= bytes.len();
                    continue;
                }
                let bytes = &bytes[skip..];
                skip = 0;
                iovs.push(libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() });
                if iovs.len() == IOV_MAX {
                    break 'chunks;
                }
            }
        }
        iovs
    }

    /// Moves `n` handed bytes from the queue to `in_flight`.
    fn advance(&mut self, n: usize) {
        self.handed += n as u64;
        self.queued_bytes -= n;
        let mut left = self.first_done + n;
        while let Some(front) = self.queued.front() {
            let len = front.len();
            if left < len {
                break;
            }
            left -= len;
            let chunk = self.queued.pop_front().expect("front exists");
            let end = self.handed - left as u64;
            self.in_flight.push_back((end, chunk));
        }
        self.first_done = left;
    }

    /// Sleeps until the full pipe has room (the reader's read has ended).
    fn wait_writable(&mut self) -> Result<()> {
        loop {
            let mut pfd = libc::pollfd { fd: self.pipe.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            // SAFETY: one pollfd of ours.
            let r = unsafe { libc::poll(&mut pfd, 1, -1) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                self.closed = true;
                return Ok(());
            }
            if pfd.revents & libc::POLLOUT != 0 {
                return Ok(());
            }
        }
    }

    /// Waits until CRIU has read everything handed over (or closed the
    /// pipe), so no buffer is freed while the pipe still refers to it. What
    /// is still queued (a serve that failed) is never handed over.
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
