//! Random access to archive bytes: the seam between where an archive's bytes
//! are (a file, memory, an object store) and the block source that proves
//! and reads them.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Random access to an archive's bytes.
pub trait RecordStore: Send + Sync {
    /// Bytes in the store.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; fails if the store is shorter.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Whether its bytes are still arriving (an object being fetched), so
    /// that a reader which can start from the index should.
    fn arriving(&self) -> bool {
        false
    }

    /// As [`read_exact_at`](Self::read_exact_at), for a walk of record
    /// headers: a store that reads ahead of its readers does not follow
    /// these reads (a walk skips the payloads that it would read).
    fn read_head_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(buf, offset)
    }

    /// Hints that the [`HEAD_SPAN`] bytes at each of `offsets` (record
    /// headers a walk will read, ascending) are wanted soon. A local file asks the
    /// kernel for them all at once, unless they are already in its page
    /// cache; other stores ignore it.
    fn prefetch_heads(&self, offsets: &[u64]) {
        let _ = offsets;
    }

    /// Whether a store that reads ahead of its readers may (the default);
    /// others ignore it.
    fn read_ahead(&self, on: bool) {
        let _ = on;
    }

    /// How far a store that reads ahead was asked to read (0 for others).
    #[cfg(test)]
    fn read_ahead_wanted(&self) -> u64 {
        0
    }

    /// `len` bytes from `offset`, in a new buffer.
    fn read_vec(&self, len: usize, offset: u64) -> io::Result<Vec<u8>> {
        let mut buf = Vec::with_capacity(len);
        self.read_append(&mut buf, len, offset)?;
        Ok(buf)
    }

    /// Appends `len` bytes from `offset` to `buf` (in place when its
    /// capacity suffices).
    fn read_append(&self, buf: &mut Vec<u8>, len: usize, offset: u64) -> io::Result<()> {
        let at = buf.len();
        buf.resize(at + len, 0);
        self.read_exact_at(&mut buf[at..], offset)
    }
}

/// Bytes from a record's start that [`RecordStore::prefetch_heads`] asks
/// for: a page, which holds any block header at the default block size.
pub const HEAD_SPAN: usize = 4096;

impl RecordStore for File {
    fn size(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    /// From a cold page cache a walk waits for each header in turn (one
    /// small read in flight, each dragging the kernel's read-ahead in
    /// behind it); asked for up front, the device reads them all at once.
    /// `posix_fadvise(WILLNEED)` only starts the reads. Where a sample of
    /// the pages is already cached, nothing is asked (on a warm cache the
    /// calls would cost more than they save).
    fn prefetch_heads(&self, offsets: &[u64]) {
        use std::os::fd::AsRawFd;
        let fd = self.as_raw_fd();
        let samples = [0, offsets.len() / 2, offsets.len().saturating_sub(1)];
        if offsets.is_empty() || samples.iter().all(|&i| page_cached(fd, offsets[i])) {
            return;
        }
        for &o in offsets {
            let Ok(at) = libc::off_t::try_from(o) else { continue };
            // SAFETY: a hint about our own descriptor; it reads into the page cache only.
            unsafe { libc::posix_fadvise(fd, at, HEAD_SPAN as libc::off_t, libc::POSIX_FADV_WILLNEED) };
        }
    }

    /// Reads straight into the spare capacity: zeroing a block-sized buffer
    /// first would cost as much as a fifth of decoding it.
    fn read_append(&self, buf: &mut Vec<u8>, len: usize, offset: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        buf.reserve(len);
        let (at, end) = (buf.len(), buf.len() + len);
        while buf.len() < end {
            let got = buf.len() - at;
            let pos = libc::off_t::try_from(offset + got as u64).map_err(|_| io::ErrorKind::InvalidInput)?;
            // SAFETY: pread writes at most `len - got` bytes into the spare
            // capacity after `buf.len()`, which `reserve(len)` guarantees.
            let n = unsafe { libc::pread(self.as_raw_fd(), buf.as_mut_ptr().add(buf.len()).cast(), len - got, pos) };
            match n {
                n if n > 0 => {
                    // SAFETY: the kernel initialised `n` more bytes.
                    unsafe { buf.set_len(buf.len() + n as usize) };
                }
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether the page holding `offset` is in the page cache: a one-byte read
/// that may not wait for the device (`RWF_NOWAIT`).
fn page_cached(fd: std::os::fd::RawFd, offset: u64) -> bool {
    let mut byte = 0u8;
    let iov = libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 };
    let Ok(at) = libc::off_t::try_from(offset) else { return false };
    // SAFETY: reads at most one byte into `byte`, which outlives the call.
    unsafe { libc::preadv2(fd, &iov, 1, at, libc::RWF_NOWAIT) == 1 }
}

/// An archive held in memory (tests, fuzzing, small archives).
impl RecordStore for Vec<u8> {
    fn size(&self) -> u64 {
        Vec::len(self) as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let src = start.checked_add(buf.len()).and_then(|end| self.get(start..end));
        buf.copy_from_slice(src.ok_or(io::ErrorKind::UnexpectedEof)?);
        Ok(())
    }
}
