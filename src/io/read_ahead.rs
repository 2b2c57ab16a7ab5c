//! Read-ahead for an archive read from a local file: a thread asks the
//! kernel to read the file front to back (`readahead(2)`, 4 MiB at a time,
//! into the page cache, nothing copied out), up to [`WINDOW`] past the
//! furthest byte its readers asked for, so that a restore from a cold page
//! cache finds its blocks already read instead of waiting for each read in
//! turn (the kernel's own read-ahead, 128 KiB by default, keeps one small
//! request in flight: a restore then read at a fifth of the disk's rate).
//! On a warm cache it costs a lookup per page: reading into a buffer
//! instead cost a lazy restore a tenth of its time to running.
//!
//! Only reads near what is already read move the window: a jump far ahead
//! (the trailer and index at the end, a lazy restore's page fault) is read
//! as it is, without dragging everything before it in. What the thread
//! reads goes to the page cache, which the kernel reclaims as it needs; the
//! window bounds how far it runs ahead of use. The thread stops when the
//! store is dropped. A walk of the record headers does not move the window
//! (it would drag in every payload it skips), and a reader may pause it:
//! a restore opens its archive with it paused until its pages are read
//! (`archive::OpenOptions::read_ahead_at_once`).

use super::RecordStore;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex};

/// How far ahead of the furthest byte asked for the thread reads.
pub const WINDOW: u64 = 256 << 20;
/// One request of the thread: large enough that the device streams.
const CHUNK: usize = 4 << 20;

/// A file whose reads are preceded by a read-ahead thread.
pub struct ReadAhead {
    file: Arc<File>,
    size: u64,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// Read up to here (by the thread).
    done: u64,
    /// Read up to here, as readers asked.
    want: u64,
    /// Reads do not move the window (see [`RecordStore::read_ahead`]).
    paused: bool,
    stop: bool,
}

impl ReadAhead {
    pub fn new(file: File) -> ReadAhead {
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let file = Arc::new(file);
        let shared = Arc::new(Shared::default());
        let (f, s) = (file.clone(), shared.clone());
        // Without a thread (none to be had) reads simply go to the file.
        let _ = std::thread::Builder::new().name("criuz-read-ahead".into()).spawn(move || read_ahead(&f, size, &s));
        ReadAhead { file, size, shared }
    }

    /// A reader asked for bytes up to `end` from `offset`.
    fn asked(&self, offset: u64, end: u64) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.paused && offset <= st.done + WINDOW && end + WINDOW > st.want {
            st.want = end + WINDOW;
            self.shared.wake.notify_one();
        }
    }
}

fn read_ahead(file: &File, size: u64, shared: &Shared) {
    use std::os::fd::AsRawFd;
    loop {
        let (from, to) = {
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            while !st.stop && st.want <= st.done {
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.stop {
                return;
            }
            (st.done, st.want.min(size))
        };
        let n = (to.saturating_sub(from) as usize).min(CHUNK);
        let Ok(at) = libc::off64_t::try_from(from) else { return };
        // SAFETY: readahead(2) on our own descriptor only fills the page cache.
        if n == 0 || unsafe { libc::readahead(file.as_raw_fd(), at, n) } != 0 {
            // The end, or an error that the reader's own read reports.
            return;
        }
        shared.state.lock().unwrap_or_else(|e| e.into_inner()).done = from + n as u64;
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        self.shared.wake.notify_one();
    }
}

impl RecordStore for ReadAhead {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.asked(offset, offset + buf.len() as u64);
        FileExt::read_exact_at(&*self.file, buf, offset)
    }

    fn read_append(&self, buf: &mut Vec<u8>, len: usize, offset: u64) -> io::Result<()> {
        self.asked(offset, offset + len as u64);
        (*self.file).read_append(buf, len, offset)
    }

    /// Not followed: a walk of the headers moving the window would read
    /// every payload it skips (a lazy restore's whole archive before its
    /// process could run).
    fn read_head_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&*self.file, buf, offset)
    }

    /// Running, the thread reads at least up to [`WINDOW`] (or further,
    /// where readers have moved it): the heads it will reach are left to
    /// it, as one stream. Asked for one by one as well, they split that
    /// stream into small reads around them (from a cold cache a placed
    /// restore of a 214 MiB archive then waited for its reads: session 89).
    fn prefetch_heads(&self, offsets: &[u64]) {
        let reach = {
            let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.paused {
                0
            } else {
                st.want.max(WINDOW)
            }
        };
        let beyond = offsets.partition_point(|&o| o < reach);
        self.file.prefetch_heads(&offsets[beyond..])
    }

    /// Paused, reads leave the window where it is, and the thread stops
    /// once it has read that far; the next read after a resume moves it.
    fn read_ahead(&self, on: bool) {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).paused = !on;
    }

    #[cfg(test)]
    fn read_ahead_wanted(&self) -> u64 {
        self.wanted()
    }
}

impl ReadAhead {
    /// How far readers have asked the thread to read.
    #[cfg(test)]
    pub(crate) fn wanted(&self) -> u64 {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).want
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paused_reads_leave_the_window_and_a_resumed_read_moves_it() {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), vec![7u8; 1 << 20]).unwrap();
        let store = ReadAhead::new(File::open(tmp.path()).unwrap());
        store.read_ahead(false);
        store.read_vec(4096, 0).unwrap();
        let mut head = [0u8; 64];
        store.read_head_at(&mut head, 8192).unwrap();
        assert_eq!(store.wanted(), 0);
        store.read_ahead(true);
        store.read_head_at(&mut head, 8192).unwrap();
        assert_eq!(store.wanted(), 0, "a header read is not followed");
        store.read_vec(4096, 4096).unwrap();
        assert_eq!(store.wanted(), 8192 + WINDOW);
    }

    #[test]
    fn reads_through_the_read_ahead_are_the_file_s_bytes() {
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), &data).unwrap();
        let store = ReadAhead::new(File::open(tmp.path()).unwrap());
        assert_eq!(store.size(), data.len() as u64);
        let mut at = 0;
        while at < data.len() {
            let n = (100_000).min(data.len() - at);
            assert_eq!(store.read_vec(n, at as u64).unwrap(), &data[at..at + n]);
            at += n;
        }
        let mut tail = vec![0u8; 10];
        assert!(store.read_exact_at(&mut tail, data.len() as u64 - 5).is_err());
    }
}
