//! Fetching an archive's records: [`RecordReader`] reads a record at the
//! offset the index gives, small ones through a read-ahead window, checks
//! its header against the one the opening proved, and opens a sealed block
//! in place. [`StoreInput`] is the front-to-back input of a header walk.
//!
//! A struct the opened archive owns rather than methods of it, so that the
//! read side of dedup (`resolve`) can fetch without knowing the archive.
//! A block of an encrypted archive is opened as it is fetched (its AEAD tag
//! proves every byte and its place); from then on it is read like any
//! other, its data check restored from inside the seal.

use super::records::Input;
use crate::error::{Error, Result, TruncatedUnderReader};
use crate::format::{BlockCodec, BlockHeader, BlockRef, DecodedBlockHeader, PAGE_SIZE, SEAL_OVERHEAD};
use crate::io::RecordStore;
use crate::seal::ArchiveKey;
use std::io;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Reads a store front to back through a small buffer, so a header walk
/// costs about one read per block; where the payloads skipped are small (the
/// blocks of an incremental child), one read covers several records.
pub(crate) struct StoreInput<'a> {
    store: &'a dyn RecordStore,
    len: u64,
    pos: u64,
    buf: Vec<u8>,
    /// Store offset of `buf[0]`.
    buf_at: u64,
    /// The last skip, which predicts how far the next record lies.
    last_skip: u64,
    /// Only record headers are read (payloads skipped): reads a store's
    /// read-ahead does not follow.
    heads_only: bool,
}

/// Smallest and largest read of a walk. The smallest holds a block's header
/// and the next record's start (a longer record is read on as needed): a
/// walk of a 1 GiB `mixed` archive (4,096 page blocks, page cache warm)
/// took 7.6 ms with 512-byte reads against 11.4 ms with 4 KiB ones, medians
/// of six (a one-off harness timing `archive::open`, session 34): the rest
/// of each 4 KiB was copied for nothing.
const WALK_BUF: usize = 512;
const WALK_BUF_MAX: usize = 64 << 10;

impl<'a> StoreInput<'a> {
    /// An input over the whole store, from its start.
    pub(crate) fn new(store: &'a dyn RecordStore) -> Self {
        StoreInput { store, len: store.size(), pos: 0, buf: Vec::new(), buf_at: 0, last_skip: 0, heads_only: false }
    }

    /// An input for a walk that skips every payload.
    pub(crate) fn heads(store: &'a dyn RecordStore) -> Self {
        StoreInput { heads_only: true, ..Self::new(store) }
    }

    /// As [`heads`](Self::heads), from `pos` of a store taken to be `len`
    /// bytes long (as the walk it reads ahead of found it).
    pub(crate) fn heads_from(store: &'a dyn RecordStore, len: u64, pos: u64) -> Self {
        StoreInput { len, pos: pos.min(len), ..Self::heads(store) }
    }

    /// The store's length as this input takes it, and its position.
    pub(crate) fn len_and_pos(&self) -> (u64, u64) {
        (self.len, self.pos)
    }
}

impl Input for StoreInput<'_> {
    fn read_full(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut got = 0;
        while got < out.len() && self.pos < self.len {
            let in_buf = self.pos >= self.buf_at && self.pos < self.buf_at + self.buf.len() as u64;
            if !in_buf {
                // Read past the next few records when the payloads between
                // them are small; otherwise just the next header.
                let ahead = if self.last_skip < WALK_BUF_MAX as u64 / 4 { WALK_BUF_MAX } else { WALK_BUF };
                let n = (self.len - self.pos).min(ahead.max(out.len() - got) as u64) as usize;
                self.buf.resize(n, 0);
                // The walk's length is the store's size as the walk began:
                // a read within it that meets the end met a truncation.
                let read = if self.heads_only {
                    self.store.read_head_at(&mut self.buf, self.pos)
                } else {
                    self.store.read_exact_at(&mut self.buf, self.pos)
                };
                read.map_err(|e| TruncatedUnderReader::wrap(e, self.pos))?;
                self.buf_at = self.pos;
            }
            let start = (self.pos - self.buf_at) as usize;
            let n = (self.buf.len() - start).min(out.len() - got);
            out[got..got + n].copy_from_slice(&self.buf[start..start + n]);
            got += n;
            self.pos += n as u64;
        }
        Ok(got)
    }
    fn skip(&mut self, n: u64) -> io::Result<u64> {
        let n = n.min(self.len - self.pos);
        self.pos += n;
        self.last_skip = n;
        Ok(n)
    }
    /// What the walk buffer holds is copied; the rest (a payload, mostly)
    /// is read from the store straight into `buf`, not through the buffer.
    fn read_append(&mut self, buf: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        if self.heads_only {
            // A walk's reads stay header reads (`read_head_at`).
            return crate::archive::records::read_append_zeroed(self, buf, n);
        }
        let in_buf = self.pos >= self.buf_at && self.pos < self.buf_at + self.buf.len() as u64;
        let mut got = 0;
        if in_buf {
            let start = (self.pos - self.buf_at) as usize;
            let k = (self.buf.len() - start).min(n);
            buf.extend_from_slice(&self.buf[start..start + k]);
            got = k;
            self.pos += k as u64;
        }
        let rest = ((n - got) as u64).min(self.len - self.pos) as usize;
        if rest > 0 {
            self.store.read_append(buf, rest, self.pos).map_err(|e| TruncatedUnderReader::wrap(e, self.pos))?;
            self.pos += rest as u64;
            got += rest;
        }
        Ok(got)
    }
}

/// Bytes read at once for small records.
const READ_AHEAD: usize = 256 << 10;

/// A record as read: the buffer it lies in (its own, or a shared read-ahead
/// window), its range there, its header (checked against the walk) and its
/// offset in the archive.
pub(crate) struct Fetched {
    pub(crate) buf: Arc<Vec<u8>>,
    pub(crate) range: Range<usize>,
    pub(crate) header: BlockHeader,
    pub(crate) offset: u64,
}

/// Reads the records of one archive's store.
pub(crate) struct RecordReader {
    store: Box<dyn RecordStore>,
    /// The last read-ahead window: (offset, bytes). Holders keep a share
    /// of it instead of copying their record out.
    window: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
    /// An encrypted archive's key: every block is opened with it as read.
    key: Option<Arc<ArchiveKey>>,
}

impl RecordReader {
    pub(crate) fn new(store: Box<dyn RecordStore>, key: Option<Arc<ArchiveKey>>) -> Self {
        RecordReader { store, window: Mutex::new(None), key }
    }

    pub(crate) fn store(&self) -> &dyn RecordStore {
        &*self.store
    }

    pub(crate) fn key(&self) -> Option<&Arc<ArchiveKey>> {
        self.key.as_ref()
    }

    /// The `len` bytes at `offset`, small records through a read-ahead
    /// window: the blocks of an incremental child are a few KiB each and are
    /// read in order (each block of a chain restore reads one from every
    /// parent), so one read serves many of them instead of a system call
    /// each. Returns the buffer they lie in and where they start there.
    ///
    /// With `end_aligned`, a record read on its own ends on a page boundary:
    /// its stored pages, the payload's tail (raw literal pages, a raw
    /// block's pages), then lie on page boundaries and are pieced into the
    /// blocks handed to CRIU where they lie (see [`page_aligned`]); a raw
    /// block's payload is handed over where it lies too. A block decoded
    /// for CRIU is decoded onto a page boundary instead
    /// ([`CheckedBlock::decode_stored_page_aligned`](super::CheckedBlock::decode_stored_page_aligned)).
    fn read_ahead(&self, len: usize, offset: u64, end_aligned: bool) -> io::Result<(Arc<Vec<u8>>, usize)> {
        let direct = || {
            if !end_aligned {
                return self.store.read_vec(len, offset).map(|v| (Arc::new(v), 0));
            }
            let (mut v, start) = page_aligned(len + PAGE_SIZE);
            let start = start + (PAGE_SIZE - len % PAGE_SIZE) % PAGE_SIZE;
            v.resize(start, 0);
            self.store.read_append(&mut v, len, offset).map(|()| (Arc::new(v), start))
        };
        if len > READ_AHEAD / 4 {
            return direct();
        }
        let end = offset + len as u64;
        let old = {
            let mut cached = self.window.lock().unwrap();
            if let Some((at, w)) = cached.as_ref().filter(|(at, w)| *at <= offset && end <= at + w.len() as u64) {
                return Ok((w.clone(), (offset - at) as usize));
            }
            cached.take()
        };
        let want = (self.store.size().saturating_sub(offset)).min(READ_AHEAD as u64) as usize;
        if want < len {
            return direct();
        }
        // Read outside the lock: the fill threads of a placed restore read
        // blocks side by side and must not queue behind each other's reads
        // (a reader that misses meanwhile reads a window of its own). The old
        // window's memory is reused unless a holder still keeps a share of
        // it; a new one is read into unzeroed memory (zeroing the windows of
        // a chain's children cost a tenth of its decoding).
        let w = match old.and_then(|(_, w)| Arc::try_unwrap(w).ok()) {
            Some(mut w) => {
                w.resize(want, 0);
                self.store.read_exact_at(&mut w, offset)?;
                w
            }
            None => self.store.read_vec(want, offset)?,
        };
        let w = Arc::new(w);
        *self.window.lock().unwrap() = Some((offset, w.clone()));
        Ok((w, 0))
    }

    /// Reads the record of block `i` of file `file` at `at`, and checks its
    /// header against `proven`, the one the opening proved; `pieced`: its
    /// pages will be pieced into other blocks (a holder).
    pub(crate) fn fetch(
        &self,
        at: &BlockRef,
        proven: &BlockHeader,
        i: usize,
        file: &str,
        pieced: bool,
    ) -> Result<Fetched> {
        // A raw block's payload is handed to CRIU where it lies.
        let end_aligned = pieced || matches!(proven.codec, BlockCodec::Dedup | BlockCodec::Raw);
        let (buf, start) = self
            .read_ahead(at.record_len as usize, at.offset, end_aligned)
            .map_err(|e| TruncatedUnderReader::wrap(e, at.offset))?;
        let range = start..start + at.record_len as usize;
        let DecodedBlockHeader { header, len: header_len } = BlockHeader::decode(&buf[range.clone()], at.offset)?;
        if header != *proven || header_len + header.stored_len as usize != range.len() {
            return Err(Error::corrupt(at.offset, format!("block {i} of {file} changed after the archive was opened")));
        }
        let fetched = Fetched { buf, range, header, offset: at.offset };
        if !fetched.header.sealed {
            return Ok(fetched);
        }
        self.open_sealed(fetched, i as u32)
    }

    /// Opens a sealed block in place (a copy if its buffer is shared): its
    /// plain payload then ends where the record ended, so a record read to
    /// end on a page boundary keeps its pages on page boundaries. The tag
    /// proves every byte, so the payload check is not hashed as well.
    /// `header` is then the block as it was before sealing, the range its
    /// plain payload alone.
    fn open_sealed(&self, f: Fetched, block: u32) -> Result<Fetched> {
        let Fetched { buf, range, header, offset } = f;
        let key =
            self.key.as_ref().ok_or_else(|| Error::corrupt(offset, "sealed block in an archive without a key"))?;
        let (mut v, range) = match Arc::try_unwrap(buf) {
            Ok(v) => (v, range),
            Err(shared) => {
                let len = range.len();
                let (mut v, start) = page_aligned(len + PAGE_SIZE);
                let start = start + (PAGE_SIZE - len % PAGE_SIZE) % PAGE_SIZE;
                v.resize(start, 0);
                v.extend_from_slice(&shared[range]);
                (v, start..start + len)
            }
        };
        let payload = range.end - header.stored_len as usize..range.end;
        let plain = key.open_block(&header, block, &mut v[payload.clone()]).map_err(|e| Error::corrupt(offset, e))?;
        let range = payload.start + SEAL_OVERHEAD..range.end;
        Ok(Fetched { buf: Arc::new(v), range, header: plain, offset })
    }
}

/// Room for `len` bytes starting on a page boundary: the buffer (holding
/// `start` bytes of padding) and `start`. Pages handed to CRIU's pipe from
/// such a buffer each fill one pipe slot; a page at any other offset spans
/// two, which halves what the pipe holds and splits CRIU's copies (a chain
/// restore, whose blocks are pieced together from pages of many records,
/// took about a tenth longer that way).
pub(crate) fn page_aligned(len: usize) -> (Vec<u8>, usize) {
    let mut v: Vec<u8> = Vec::with_capacity(len + PAGE_SIZE);
    let start = v.as_ptr().align_offset(PAGE_SIZE);
    v.resize(start, 0);
    (v, start)
}

/// `buf[range]` where it lies if that is on a page boundary (a record read
/// on its own), else copied onto one (a record in a read-ahead window: a
/// few KiB); see [`page_aligned`].
pub(crate) fn page_aligned_share(buf: &Arc<Vec<u8>>, range: Range<usize>) -> (Arc<Vec<u8>>, usize) {
    if (buf.as_ptr() as usize + range.start) % PAGE_SIZE == 0 {
        return (buf.clone(), range.start);
    }
    let (mut v, start) = page_aligned(range.len());
    v.extend_from_slice(&buf[range]);
    (Arc::new(v), start)
}
