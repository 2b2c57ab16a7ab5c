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

impl RecordStore for File {
    fn size(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
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
