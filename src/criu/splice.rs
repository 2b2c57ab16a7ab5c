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
/// chunks are queued and handed over in batches (each up to where one of
/// CRIU's reads ends, below), and a
/// full pipe is waited on with poll: the kernel wakes a writer of a full pipe
/// only once the read has ended and let go of the lock. Where CRIU frees
/// little per read, the writer then naps before it hands more over
/// ([`ROOM_NAP`]): CRIU reads a forked child's pages one at a time (it
/// compares each with its parent's), and a writer woken by each read handed
/// over one page per wake (up to 99,000 context switches in a 1 GiB tree's
/// restore on 2 cores; 3,000-7,800 so: docs/BENCHMARKS.md, session 79).
/// The room is what the next vmsplice takes: asking the pipe (FIONREAD)
/// takes its lock, and spun there while CRIU read.
///
/// CRIU reads a process's pages one pagemap entry per read call (1 MiB
/// runs, as it dumps them), and a read keeps the lock until it has its
/// length or the pipe is empty. A handover that ended inside an entry left
/// the next read draining the rest while the writer's next vmsplice spun on
/// the lock: a sixth of a 1 GiB stream restore's CPU on 2 cores. So a
/// handover ends where one of CRIU's reads ends ([`with_read_ends`], from the
/// pagemap criuz serves), a pipe's worth at most, and is handed over only
/// once it is all queued; its pages lie on page boundaries, one slot each
/// (a page across two took 65 slots a block, so a 1 MiB entry no longer
/// fit). A whole entry then fills the pipe exactly, and the writer's next
/// vmsplice finds it full and sleeps until CRIU's read has ended.
///
/// [`with_read_ends`]: SplicePipe::with_read_ends
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
    /// Where CRIU's reads of this stream end, as byte offsets into it,
    /// ascending (those at or before `handed` dropped as it passes them);
    /// empty where unknown.
    read_ends: std::collections::VecDeque<u64>,
    /// Where the handover under way ends, once part of it is handed.
    handover_end: Option<u64>,
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
            read_ends: Default::default(),
            handover_end: None,
        }
    }

    /// Where CRIU's reads of the stream will end (byte offsets, ascending):
    /// handovers end there (see [`SplicePipe`]). Ends that are wrong cost
    /// only time: every byte is handed over in order whatever they say.
    pub fn with_read_ends(mut self, ends: Vec<u64>) -> Self {
        self.read_ends = ends.into();
        self
    }

    /// The length of the next handover: up to the last of CRIU's read ends
    /// within a pipe's worth; `None` where there is none (a read longer
    /// than the pipe, or ends unknown), and a handover is what is queued.
    /// A handover part of which is handed runs on to its end.
    fn next_handover(&self) -> Option<usize> {
        if let Some(end) = self.handover_end.filter(|&end| end > self.handed) {
            return Some((end - self.handed) as usize);
        }
        let reach = self.handed + self.capacity.min(PIPE_BYTES as u64);
        let ahead = self.read_ends.iter().skip_while(|&&end| end <= self.handed);
        let end = ahead.take_while(|&&end| end <= reach).last()?;
        Some((end - self.handed) as usize)
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

    /// Whether the next handover is all queued (without read ends: a pipe's
    /// worth).
    pub fn has_handover(&self) -> bool {
        self.queued_bytes >= self.next_handover().unwrap_or(PIPE_BYTES)
    }

    /// Hands the queued chunks to the pipe, as far as whole handovers go,
    /// waiting while it is full. Returns false once CRIU has closed its end
    /// (it wants no more).
    pub fn flush(&mut self) -> Result<bool> {
        self.hand_over(false)
    }

    /// As [`flush`](Self::flush), handing over everything queued (the end
    /// of the stream).
    pub fn flush_all(&mut self) -> Result<bool> {
        self.hand_over(true)
    }

    fn hand_over(&mut self, all: bool) -> Result<bool> {
        // The pipe was full and a read made room: this vmsplice takes it.
        let mut woken = false;
        while !self.queued.is_empty() {
            if self.closed {
                return Ok(false);
            }
            let limit = self.next_handover();
            // A handover goes whole; but where CRIU frees a little at a time
            // (a forked child's pages, compared one by one) one already
            // begun goes on as chunks come: CRIU's reads then hold the lock
            // only briefly, and holding the rest back left it waiting
            // (two to three times the context switches of such a restore).
            let begun = self.little_room && self.handover_end.is_some_and(|end| end > self.handed);
            if !all && !begun && limit.is_some_and(|len| self.queued_bytes < len) {
                break;
            }
            self.handover_end = limit.map(|len| self.handed + len as u64);
            let iovs = self.queued_iovecs(limit.unwrap_or(usize::MAX));
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

    /// Iovecs for what is queued, up to `limit` bytes and IOV_MAX iovecs.
    fn queued_iovecs(&self, mut limit: usize) -> Vec<libc::iovec> {
        let mut skip = self.first_done;
        let mut iovs = Vec::new();
        'chunks: for chunk in &self.queued {
            for (owner, r) in &chunk.parts {
                let bytes = &(**owner).as_ref()[r.clone()];
                if skip >= bytes.len() {
                    skip -= bytes.len();
                    continue;
                }
                let bytes = &bytes[skip..bytes.len().min(skip.saturating_add(limit))];
                skip = 0;
                limit -= bytes.len();
                iovs.push(libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() });
                if iovs.len() == IOV_MAX || limit == 0 {
                    break 'chunks;
                }
            }
        }
        iovs
    }

    /// Moves `n` handed bytes from the queue to `in_flight`.
    fn advance(&mut self, n: usize) {
        self.handed += n as u64;
        while self.read_ends.front().is_some_and(|&end| end <= self.handed) {
            self.read_ends.pop_front();
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::PAGE_SIZE;
    use std::io::Read;
    use std::os::fd::FromRawFd;

    fn pipe() -> (std::fs::File, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors, then ours.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh descriptors nobody else owns.
        unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) }
    }

    /// `pages` pages of `byte`, on page boundaries (one pipe slot each).
    fn pages(pages: usize, byte: u8) -> Chunk {
        let (mut v, start) = crate::archive::page_aligned(pages * PAGE_SIZE);
        v.resize(start + pages * PAGE_SIZE, byte);
        Chunk::range(v, start..start + pages * PAGE_SIZE)
    }

    fn unread(pipe: &std::fs::File) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int.
        assert_eq!(unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut n) }, 0);
        n as usize
    }

    fn read_pages(reader: &mut std::fs::File, pages: usize) -> Vec<u8> {
        let mut buf = vec![0; pages * PAGE_SIZE];
        reader.read_exact(&mut buf).unwrap();
        buf
    }

    #[test]
    fn a_handover_ends_where_criu_reads_end_and_goes_only_whole() {
        let (mut reader, writer) = pipe();
        // A pipe of 16 slots; CRIU's reads end after 3, 10 and 20 pages.
        let slots = 16 * PAGE_SIZE as libc::c_int;
        // SAFETY: F_SETPIPE_SZ on our own pipe.
        assert_eq!(unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, slots) }, slots);
        let ends = [3, 10, 20].map(|p| (p * PAGE_SIZE) as u64).to_vec();
        let mut out = SplicePipe::new(writer).with_read_ends(ends);
        let mut got = Vec::new();

        // The next handover runs to the last read end within a pipe's
        // worth (10 pages), and nothing goes before all of it is queued.
        out.queue(pages(2, 1));
        assert!(!out.has_handover());
        assert!(out.flush().unwrap());
        assert_eq!(unread(&reader), 0);
        out.queue(pages(9, 2));
        assert!(out.has_handover());
        assert!(out.flush().unwrap());
        assert_eq!(unread(&reader), 10 * PAGE_SIZE, "the handover stops at the read end inside the chunk");
        got.extend(read_pages(&mut reader, 10));

        // Then up to the next end (20 pages), once it is all queued; past
        // the last end, what is queued goes with it.
        out.queue(pages(8, 3));
        assert!(!out.has_handover());
        out.queue(pages(3, 4));
        assert!(out.has_handover());
        assert!(out.flush().unwrap());
        assert_eq!(unread(&reader), 12 * PAGE_SIZE);
        got.extend(read_pages(&mut reader, 12));
        out.queue(pages(1, 5));
        assert!(out.flush_all().unwrap());
        got.extend(read_pages(&mut reader, 1));
        out.finish().unwrap();

        let want: Vec<u8> =
            [(2, 1u8), (9, 2), (8, 3), (3, 4), (1, 5)].iter().flat_map(|&(n, b)| vec![b; n * PAGE_SIZE]).collect();
        assert!(got == want, "every byte in order, whatever the read ends");
    }
}
