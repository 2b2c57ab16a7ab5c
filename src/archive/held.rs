//! Blocks held by reference: a pipe per block, spliced from CRIU's pipe.
//!
//! CRIU's pages reach criuz as pipe buffers that reference the frozen
//! tree's own pages (its parasite vmsplices them, CRIU splices them on).
//! Reading them copies each page under the pipe's lock, into memory that
//! must first be faulted in and zeroed: on 2 cores absorbing half a GiB
//! that way cost about 0.2 s of CPU (docs/BENCHMARKS.md, session 34).
//! Splicing them into a pipe of our own moves the references instead, so
//! a block CRIU has written costs neither a copy nor memory while it waits
//! for a worker, which reads it into a buffer of its own when it encodes it.
//!
//! This is sound only while nothing can write those pages: the tree must
//! stay stopped until every held block has been read, which the dump
//! checks before it commits (`session::checkpoint`), and the pages must be
//! the tree's alone: its private memory, or shared memory no process
//! outside the tree maps or holds a descriptor of (`proc::shmem`, checked
//! before CRIU starts and again before the dump commits; `session::capture`
//! holds only those pages images). A pipe
//! that cannot be had (descriptors or pipe memory spent) leaves the block
//! to the copying path. What a stopped tree's memory can still receive is
//! the kernel's own writes for requests in flight (an AIO completing into
//! its ring), which CRIU does not carry across a checkpoint in any case.
//!
//! Safe against the pages' memory itself: a held reference keeps the page
//! as it was whatever happens to the tree's mappings (a page that is
//! migrated, collapsed into a huge page or copied on write leaves the held
//! one's bytes alone), and when the tree is ended the pages live on until
//! their pipe is read or closed.

use crate::codec::PageBuf;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Descriptors left to everything else (CRIU's pipes, the archive, /proc):
/// this many, or a quarter of a smaller limit.
const SPARE_FDS: u64 = 1024;

/// Descriptors the held pipes alive now in this process take: two for a
/// pipe still filling, one once it is sealed.
static LIVE_FDS: Descriptors = Descriptors::new();

/// A count of descriptors in use against a ceiling.
struct Descriptors(AtomicUsize);

impl Descriptors {
    const fn new() -> Self {
        Descriptors(AtomicUsize::new(0))
    }

    /// Takes a new pipe's two, if they fit under `most`.
    fn claim_pipe(&self, most: usize) -> bool {
        if self.0.fetch_add(2, Ordering::Relaxed) + 2 > most {
            self.0.fetch_sub(2, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn give_back(&self, n: usize) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Descriptors held pipes may take at once: the descriptor limit (raised
/// to its hard ceiling the first time) less the spare ones
/// ([`SPARE_FDS`]). A sealed block keeps only its read end, so this is
/// also about how many blocks a dump holds at once; counting a pipe as two
/// for its whole life held half as many (at 20,000 descriptors, 2.3 GiB of
/// a 4 GiB dump, the rest copied: docs/BENCHMARKS.md, session 78).
/// A dump must never fail for want of a descriptor it could have had by
/// copying: the spare ones stay free whatever is held.
pub(crate) fn most_held() -> usize {
    static MOST: OnceLock<usize> = OnceLock::new();
    *MOST.get_or_init(|| {
        let limit = crate::io::open_files_limit();
        let spare = SPARE_FDS.min(limit / 4);
        usize::try_from(limit.saturating_sub(spare)).unwrap_or(usize::MAX)
    })
}

/// One block's bytes, held as references in a pipe of its own.
pub struct HeldPipe {
    read: OwnedFd,
    /// Closed once the block is complete (the read end is all it needs).
    write: Option<OwnedFd>,
    len: usize,
}

/// A new pipe's two descriptors, counted in [`LIVE_FDS`], that no pipe took.
struct Unclaimed;

impl Drop for Unclaimed {
    fn drop(&mut self) {
        LIVE_FDS.give_back(2);
    }
}

impl Drop for HeldPipe {
    fn drop(&mut self) {
        LIVE_FDS.give_back(1 + usize::from(self.write.is_some()));
    }
}

/// What one splice did.
pub enum Spliced {
    /// Moved this many bytes (0: the source reached its end).
    Bytes(usize),
    /// The source has bytes but this pipe has no slot left for them.
    Full,
}

impl HeldPipe {
    /// A pipe with a slot for each page of a `block` (CRIU's pages arrive
    /// as whole pages; pieces, which would take more slots, leave the block
    /// to be copied: [`Spliced::Full`]), or `None` where none can be had.
    pub fn new(block: usize) -> Option<HeldPipe> {
        if !LIVE_FDS.claim_pipe(most_held()) {
            return None;
        }
        // From here on a `HeldPipe` or `Unclaimed` gives the count back.
        let unclaimed = Unclaimed;
        let (read, write) = crate::io::pipe().ok()?;
        let want = block.max(4096);
        // SAFETY: fcntl on a descriptor we own.
        let got = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, want as libc::c_int) };
        if got < 0 || (got as usize) < want {
            return None;
        }
        std::mem::forget(unclaimed);
        Some(HeldPipe { read, write: Some(write), len: 0 })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Moves up to `max` bytes from the pipe `src`, waiting for some to
    /// arrive, without ever waiting for room here.
    pub fn splice_from(&mut self, src: RawFd, max: usize) -> std::io::Result<Spliced> {
        let Some(write) = &self.write else { return Ok(Spliced::Full) };
        let mut poll = libc::pollfd { fd: src, events: libc::POLLIN, revents: 0 };
        loop {
            // SAFETY: splice between two pipe descriptors, no offsets.
            let n = unsafe {
                libc::splice(
                    src,
                    std::ptr::null_mut(),
                    write.as_raw_fd(),
                    std::ptr::null_mut(),
                    max,
                    libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
                )
            };
            if n >= 0 {
                self.len += n as usize;
                return Ok(Spliced::Bytes(n as usize));
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) if poll.revents & libc::POLLIN != 0 => return Ok(Spliced::Full),
                Some(libc::EAGAIN) => {
                    // Nothing to move yet: wait for the source (its end,
                    // an error or data), then try once more.
                    // SAFETY: poll on one descriptor we were handed.
                    while unsafe { libc::poll(&mut poll, 1, -1) } < 0 {
                        let e = std::io::Error::last_os_error();
                        if e.kind() != std::io::ErrorKind::Interrupted {
                            return Err(e);
                        }
                    }
                    if poll.revents & libc::POLLIN == 0 {
                        // Hung up with nothing left: the end.
                        return Ok(Spliced::Bytes(0));
                    }
                }
                _ => return Err(e),
            }
        }
    }

    /// No more bytes will be added: the write end closes, and its
    /// descriptor is free for another block.
    pub fn seal(&mut self) {
        if self.write.take().is_some() {
            LIVE_FDS.give_back(1);
        }
    }

    /// Appends every byte held to `buf`.
    pub fn read_into(mut self, buf: &mut impl ReadTarget) -> std::io::Result<()> {
        self.seal();
        let mut left = self.len;
        while left > 0 {
            let (at, room) = buf.room(left);
            if room == 0 {
                return Err(std::io::Error::other("no room left for a held block's bytes"));
            }
            // SAFETY: read(2) writes at most `room` bytes at `at`, which
            // `room` gave as writable.
            let n = unsafe { libc::read(self.read.as_raw_fd(), at.cast(), room.min(left)) };
            match n {
                0 => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
                n if n > 0 => {
                    // SAFETY: the kernel initialised `n` bytes there.
                    unsafe { buf.filled(n as usize) };
                    left -= n as usize;
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

/// A buffer `read(2)` appends to: a worker's page-aligned buffer, or a block's buffer
/// (`slab::SlabBuf`), so that a held block that must be copied after all
/// is read once, straight where it goes.
pub trait ReadTarget {
    /// Where the next bytes go, with room for `want` of them where the
    /// buffer can grow: the place and how many fit there.
    fn room(&mut self, want: usize) -> (*mut u8, usize);
    /// Marks `n` more bytes as written.
    ///
    /// # Safety
    /// The `n` bytes at `room`'s place were initialised, and `n` is at most
    /// what it said fits.
    unsafe fn filled(&mut self, n: usize);
}

impl ReadTarget for PageBuf {
    fn room(&mut self, want: usize) -> (*mut u8, usize) {
        let spare = self.spare(want);
        (spare.as_mut_ptr(), spare.len())
    }

    unsafe fn filled(&mut self, n: usize) {
        PageBuf::filled(self, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::FromRawFd;

    /// A pipe (`flags` for pipe2), its write end as a file.
    fn pipe(flags: libc::c_int) -> (std::fs::File, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | flags) }, 0);
        // SAFETY: both were just created and are ours alone.
        unsafe { (std::fs::File::from_raw_fd(fds[1]), OwnedFd::from_raw_fd(fds[0])) }
    }

    #[test]
    fn a_sealed_pipe_leaves_room_for_another_under_the_ceiling() {
        let fds = Descriptors::new();
        assert!(fds.claim_pipe(5) && fds.claim_pipe(5), "two filling pipes: 4 of 5");
        assert!(!fds.claim_pipe(5), "a third would take 6");
        fds.give_back(1);
        assert!(fds.claim_pipe(5), "one sealed: 3, and a third pipe fits");
        assert!(!fds.claim_pipe(5));
        fds.give_back(2);
        fds.give_back(1);
        fds.give_back(2);
        assert_eq!(fds.0.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_held_block_reads_back_what_was_spliced_in_and_the_end_is_seen() {
        let (mut w, r) = pipe(0);
        // Fifteen pages, written a page at a time as CRIU does.
        let data: Vec<u8> = (0..15 * 4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let writer = {
            let data = data.clone();
            std::thread::spawn(move || {
                for piece in data.chunks(4096) {
                    w.write_all(piece).unwrap();
                }
            })
        };
        let mut held = HeldPipe::new(64 << 10).unwrap();
        loop {
            match held.splice_from(r.as_raw_fd(), (64 << 10) - held.len()).unwrap() {
                Spliced::Bytes(0) => break,
                Spliced::Bytes(_) => {}
                Spliced::Full => panic!("room for the whole block"),
            }
        }
        writer.join().unwrap();
        assert_eq!(held.len(), data.len());
        let mut buf = PageBuf::new();
        buf.extend_from_slice(&[1, 2, 3]);
        held.read_into(&mut buf).unwrap();
        assert_eq!(buf[..3], [1, 2, 3], "appended");
        assert_eq!(buf[3..], data);
    }

    #[test]
    fn a_pipe_without_slots_left_says_so_instead_of_waiting() {
        // A packet pipe: every write a slot of its own, never merged.
        let (mut w, r) = pipe(libc::O_DIRECT);
        for _ in 0..8 {
            w.write_all(&[9u8; 16]).unwrap();
        }
        // Two slots: two of the eight writes fit.
        let mut held = HeldPipe::new(8192).unwrap();
        let mut moved = 0;
        let full = loop {
            match held.splice_from(r.as_raw_fd(), 1 << 20).unwrap() {
                Spliced::Full => break true,
                Spliced::Bytes(0) => break false,
                Spliced::Bytes(n) => moved += n,
            }
        };
        assert!(full, "held {moved} bytes");
        assert_eq!(held.len(), 32);
        let mut buf = PageBuf::new();
        held.read_into(&mut buf).unwrap();
        assert_eq!(buf[..], [9u8; 32]);
    }
}
