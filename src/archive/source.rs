//! The block source: the only way anything reads a block of an archive.
//!
//! [`Archive::open`] proves a seekable archive whole before handing anything
//! out: it walks every record header from the first to the trailer through
//! `check` (file ids, block order, sizes, chained file checks, E records, the
//! index against the stream) and keeps the proven block headers, a few dozen
//! bytes per block. A block read later by index must then be, byte for byte,
//! the header proven at that position (so a file changed after opening is
//! caught too), with a payload that matches its payload check; decoding it
//! proves its data. What a [`CheckedBlock`] holds has therefore been proven to
//! be the block the index says, at the position it says, of the file it says.
//!
//! [`Archive::open_indexed`] is the one exception, for a restore from an
//! object still arriving: it opens from header, C record and index alone
//! (every archive criuz writes carries a copy of each block header in its
//! index), after `check::check_table`; blocks read are checked against the
//! table as against a walk, and the walk itself runs on a thread behind.
//! Until [`BlockSource::proven`] says it passed, what was read is each the
//! block its index entry says, but the index itself may be a forgery with
//! every check recomputed: a reader waits for the proof before its point of
//! no return (the serve session, before the last block of each page image).
//!
//! A block of an encrypted archive is opened as it is fetched, in place
//! (its AEAD tag proves every byte and its place); from then on it is read
//! like any other, its data check restored from inside the seal.
//!
//! Archives arriving on a pipe are spooled to a private unnamed temporary
//! file first and then opened like any other: CRIU asks for `inventory.img`
//! first and it is written last, so a restore cannot start before the stream
//! has ended anyway, and this keeps one read path and bounded memory.
//!
//! [`RecordStore`] (in `io`) is the seam for where bytes come from (a file,
//! memory, an object being fetched), [`BlockSource`] the seam for what
//! readers consume (one archive, with the parents it refers to).

use super::check::{check_payload, check_table, Checked, CheckedRecords, Payloads};
use super::records::Input;
use crate::codec::Decoder;
use crate::error::{Error, IoContext, Result, ResultContext};
use crate::format::{
    BlockCodec, BlockHeader, ChainEntry, DecodedBlockHeader, DedupPayload, FileEntry, Header, Index, IndexFixed,
    Origin, Trailer, FLAG_PARENT, FLAG_TABLE, HEADER_LEN, INDEX_FIXED, PAGE_SIZE, SEAL_OVERHEAD, TRAILER_LEN,
};
use crate::io::SharedBytes;
use crate::seal::ArchiveKey;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, OnceLock};

pub use crate::io::RecordStore;

/// The most a resolved block handed on by its pieces keeps alive, as a
/// multiple of its own size (beyond it, its pages are copied out): what a
/// reader sizes its read-ahead by for archives that may hold dedup blocks.
pub const PIN_FACTOR: usize = 4;

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
}

/// Smallest and largest read of a walk.
const WALK_BUF: usize = 4096;
const WALK_BUF_MAX: usize = 64 << 10;

impl<'a> StoreInput<'a> {
    /// An input over the whole store, from its start.
    pub(crate) fn new(store: &'a dyn RecordStore) -> Self {
        StoreInput { store, len: store.size(), pos: 0, buf: Vec::new(), buf_at: 0, last_skip: 0 }
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
                self.store.read_exact_at(&mut self.buf, self.pos)?;
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
}

/// A block proven to be block `i` of its file at the position the index
/// says; its data is proven when decoded.
pub struct CheckedBlock {
    pub header: BlockHeader,
    /// The whole record as read; the payload is its tail.
    record: Vec<u8>,
    /// Offset of the record in the archive (for messages).
    pub offset: u64,
    /// Position of the block's first byte in its file.
    pub raw_pos: u64,
    /// Whether this is a resolved dedup block.
    resolved: bool,
    /// For a resolved dedup block: its stored pages, as runs inside decoded
    /// blocks (its own literal pages and its parents'); `record` is empty.
    /// Each holder names its archive, so a failed data check can name every
    /// archive the pages came from (the damage may be in any of them).
    pieces: Vec<(Arc<Holder>, Range<usize>)>,
}

impl CheckedBlock {
    fn payload(&self) -> &[u8] {
        &self.record[self.record.len() - self.header.stored_len as usize..]
    }

    /// The stored bytes, gathered into one buffer if the block is resolved.
    fn contiguous(&self) -> Cow<'_, [u8]> {
        if self.pieces.is_empty() {
            return Cow::Borrowed(self.payload());
        }
        let mut all = Vec::with_capacity(self.header.stored_len as usize);
        for (h, r) in &self.pieces {
            all.extend_from_slice(&h.bytes[r.clone()]);
        }
        Cow::Owned(all)
    }

    /// Whether this is a resolved dedup block (its pages live in other blocks).
    pub fn is_resolved(&self) -> bool {
        self.resolved
    }

    /// Whether handing on a resolved block's pieces keeps at most
    /// [`PIN_FACTOR`] times its own bytes alive: pieces pin the whole blocks they lie in
    /// until the reader is done, which for a block whose pages were gathered
    /// from many parent blocks (a heap that moved) would cost more memory
    /// than copying them out.
    pub fn shares_cheaply(&self) -> bool {
        let mut pinned = 0;
        let mut seen: Vec<*const Holder> = Vec::new();
        for (h, _) in &self.pieces {
            if !seen.contains(&Arc::as_ptr(h)) {
                seen.push(Arc::as_ptr(h));
                pinned += h.pinned;
            }
        }
        pinned <= PIN_FACTOR * self.header.stored_len as usize
    }

    /// For a resolved block: checks its data over its pieces where they lie
    /// and gives them back for handing on without a copy.
    pub fn into_pieces_checked(self) -> Result<Vec<(SharedBytes, Range<usize>)>> {
        let parts: Vec<&[u8]> = self.pieces.iter().map(|(h, r)| &h.bytes[r.clone()]).collect();
        crate::codec::check_parts(&self.header, &parts).map_err(|e| self.damaged(e))?;
        Ok(self.pieces.into_iter().map(|(h, r)| (h as SharedBytes, r)).collect())
    }

    fn damaged(&self, why: crate::codec::DecodeError) -> Error {
        if !self.resolved {
            return Error::corrupt(self.offset, why);
        }
        let mut from: Vec<&str> = Vec::new();
        for (h, _) in &self.pieces {
            if !from.contains(&&*h.archive) {
                from.push(&h.archive);
            }
        }
        Error::corrupt(self.offset, format!("{why} after resolving its references into {}", from.join(", ")))
    }

    /// Decodes the whole block (zero pages rebuilt) into `out`, checking its data.
    pub fn decode(&self, dec: &mut Decoder, out: &mut Vec<u8>) -> Result<()> {
        dec.decode(&self.header, &self.contiguous(), out).map_err(|e| self.damaged(e))
    }

    /// Decodes only the stored pages (zero pages left out), checking their data.
    pub fn decode_stored(&self, dec: &mut Decoder, out: &mut Vec<u8>) -> Result<()> {
        dec.decode_stored(&self.header, &self.contiguous(), out).map_err(|e| self.damaged(e))
    }

    /// For a raw block: checks its data and gives back the record with the
    /// range of its payload, which is then the data itself (no copy).
    pub fn into_raw_checked(self, dec: &Decoder) -> Result<(Vec<u8>, std::ops::Range<usize>)> {
        debug_assert_eq!(self.header.codec, BlockCodec::Raw);
        if self.is_resolved() {
            let all = self.contiguous().into_owned();
            dec.check_raw(&self.header, &all).map_err(|e| self.damaged(e))?;
            let len = all.len();
            return Ok((all, 0..len));
        }
        dec.check_raw(&self.header, self.payload()).map_err(|e| self.damaged(e))?;
        let start = self.record.len() - self.header.stored_len as usize;
        let end = self.record.len();
        Ok((self.record, start..end))
    }
}

/// What every reader of blocks reads from.
pub trait BlockSource: Send + Sync {
    /// Names the archive in messages.
    fn label(&self) -> &str;
    fn header(&self) -> &Header;
    /// The proven index.
    fn index(&self) -> &Index;
    /// The proven header of block `i` of a file and the position of its first
    /// byte (no I/O); `None` past the file's end.
    fn block_header(&self, file_id: u32, i: usize) -> Option<(&BlockHeader, u64)>;
    /// Block `i` of a file, read and checked; `None` past the file's end.
    fn block(&self, file_id: u32, i: usize) -> Result<Option<CheckedBlock>>;

    /// Waits until the whole archive is proven (at once unless it was opened
    /// from its index, see [`Archive::open_indexed`]). A reader must call it
    /// before it hands on what can no longer be taken back (the last block
    /// of a page image: CRIU cannot finish a process without it).
    fn proven(&self) -> Result<()> {
        Ok(())
    }

    /// Reads every stored byte of the archive and of its parents against
    /// its check, without decoding: compressed payloads against their
    /// payload checks, raw ones against their data checks, sealed ones
    /// through their seals. What a lazy restore proves before the tree may
    /// run (a damaged archive then stops it while nothing runs); the data
    /// of a compressed block is still proven as it is decoded.
    fn prove_stored(&self) -> Result<()>;

    fn find(&self, name: &str) -> Option<&FileEntry> {
        self.index().find(name)
    }

    /// A whole file, decoded and checked (for small files such as metadata).
    fn read_file(&self, entry: &FileEntry) -> Result<Vec<u8>> {
        let (mut dec, mut all, mut out) = (Decoder::new(), Vec::new(), Vec::new());
        let mut i = 0;
        while let Some(b) = self.block(entry.file_id, i)? {
            b.decode(&mut dec, &mut out)?;
            all.extend_from_slice(&out);
            i += 1;
        }
        Ok(all)
    }
}

/// A seekable archive, proven whole when opened.
pub struct Archive {
    store: Box<dyn RecordStore>,
    label: Arc<str>,
    header: Header,
    index: Index,
    /// Proven block headers and first-byte positions, by file id.
    blocks: Vec<Vec<ProvenBlock>>,
    /// The parents named by the C record (empty without parents).
    chain: Vec<ChainEntry>,
    /// The opened parents, in C record order (see `archive::parent`), or
    /// the news that they could not be opened.
    parents: OnceLock<std::result::Result<Vec<Arc<Archive>>, ()>>,
    /// Set while the parents are being walked: a reader that meets a
    /// reference first waits for them instead of failing.
    parents_coming: AtomicBool,
    /// Recently decoded blocks that references point into.
    holders: Mutex<VecDeque<(u32, u32, Arc<Holder>)>>,
    /// The last read-ahead window: (offset, bytes). Holders keep a share
    /// of it instead of copying their record out.
    window: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
    /// Whether the full walk has proven the archive (unset while it runs).
    proof: OnceLock<std::result::Result<(), Error>>,
    /// An encrypted archive's key: every block is opened with it as read.
    key: Option<Arc<ArchiveKey>>,
}

/// Bytes read at once for small records.
const READ_AHEAD: usize = 256 << 10;

/// The stored pages of a block that references may point at, and for each
/// stored page its offset in `bytes` (`None`: the page is itself a reference,
/// which no reference may point at).
struct Holder {
    /// The buffer its pages lie in: its own decoded bytes, or the record as
    /// read (possibly inside a read-ahead window shared with other records).
    bytes: Arc<Vec<u8>>,
    pages: Vec<Option<usize>>,
    /// Bytes it keeps alive on its own account (its record, not the whole
    /// window: the window's other records are other holders' share).
    pinned: usize,
    /// The archive's label (for messages).
    archive: Arc<str>,
}

/// A record as read: the buffer it lies in (its own, or a shared read-ahead
/// window), its range there, its header (checked against the walk) and its
/// offset in the archive.
struct Fetched {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
    header: BlockHeader,
    offset: u64,
}

/// What the opening walk proved about a block.
struct ProvenBlock {
    header: BlockHeader,
    /// Position of its first byte in its file.
    raw_pos: u64,
    /// For a dedup block, the pages its P record lists: its literal pages
    /// must be exactly these (checked whenever it is decoded).
    literal_pages: Option<u32>,
}

impl AsRef<[u8]> for Holder {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Decoded holder blocks kept per archive for references to hit again: a
/// child's blocks refer to their parents' blocks in about the same order, so
/// a few per archive suffice, and memory stays bounded along a long chain.
const HOLDER_CACHE: usize = 4;

thread_local! {
    /// A decoder per thread for resolving references (its zstd context is
    /// worth keeping).
    static DECODER: std::cell::RefCell<Decoder> = std::cell::RefCell::new(Decoder::new());
}

/// Room for `len` bytes starting on a page boundary: the buffer (holding
/// `start` bytes of padding) and `start`. Pages handed to CRIU's pipe from
/// such a buffer each fill one pipe slot; a page at any other offset spans
/// two, which halves what the pipe holds and splits CRIU's copies (a chain
/// restore, whose blocks are pieced together from pages of many records,
/// took about a tenth longer that way).
fn page_aligned(len: usize) -> (Vec<u8>, usize) {
    let mut v: Vec<u8> = Vec::with_capacity(len + PAGE_SIZE);
    let start = v.as_ptr().align_offset(PAGE_SIZE);
    v.resize(start, 0);
    (v, start)
}

/// `buf[range]` where it lies if that is on a page boundary (a record read
/// on its own), else copied onto one (a record in a read-ahead window: a
/// few KiB); see [`page_aligned`].
fn page_aligned_share(buf: &Arc<Vec<u8>>, range: Range<usize>) -> (Arc<Vec<u8>>, usize) {
    if (buf.as_ptr() as usize + range.start) % PAGE_SIZE == 0 {
        return (buf.clone(), range.start);
    }
    let (mut v, start) = page_aligned(range.len());
    v.extend_from_slice(&buf[range]);
    (Arc::new(v), start)
}

/// Decodes `payload` (`expect` bytes once decoded) onto a page boundary.
fn decode_aligned(codec: BlockCodec, payload: &[u8], expect: usize, offset: u64) -> Result<(Arc<Vec<u8>>, usize)> {
    let (mut v, start) = page_aligned(expect);
    DECODER
        .with(|d| d.borrow_mut().decompress_after(codec, payload, expect, &mut v))
        .map_err(|e| Error::corrupt(offset, e))?;
    Ok((Arc::new(v), start))
}

impl Archive {
    /// Opens and proves an archive file or object; errors name it.
    pub fn open(path: &Path) -> Result<Arc<Archive>> {
        let (store, label) = crate::io::open_store(path)?;
        Ok(Arc::new(Archive::from_store(store, label.clone()).context(|| label)?))
    }

    /// Walks every record header of `store` through the checks.
    pub fn from_store(store: Box<dyn RecordStore>, label: String) -> Result<Archive> {
        let Walked { header, index, blocks, chain, key } = walk(&*store)?;
        Ok(Archive::assemble(store, label, header, index, blocks, chain, true, key))
    }

    /// An archive from what its opening proved; `proven`: the whole of it
    /// (else the walk behind will say).
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        store: Box<dyn RecordStore>,
        label: String,
        header: Header,
        index: Index,
        blocks: Vec<Vec<ProvenBlock>>,
        chain: Vec<ChainEntry>,
        proven: bool,
        key: Option<Arc<ArchiveKey>>,
    ) -> Archive {
        Archive {
            store,
            label: label.into(),
            header,
            index,
            blocks,
            chain,
            parents: OnceLock::new(),
            parents_coming: AtomicBool::new(false),
            holders: Mutex::new(VecDeque::new()),
            window: Mutex::new(None),
            proof: if proven { OnceLock::from(Ok(())) } else { OnceLock::new() },
            key,
        }
    }

    /// An encrypted archive's key (`None` when it is not encrypted).
    pub fn key(&self) -> Option<&Arc<ArchiveKey>> {
        self.key.as_ref()
    }

    /// How this archive's page ids are made (keyed in an encrypted chain).
    pub fn page_ids(&self) -> crate::seal::PageIds {
        self.key.as_ref().map_or_else(crate::seal::PageIds::plain, |k| k.page_ids())
    }

    /// Opens an archive for a reader that should not wait for all of it (a
    /// restore from an object still arriving): from its header, C record and
    /// index alone when it has a block table (`FLAG_TABLE`). The index must
    /// pass `check::check_table`, each block read is checked against its
    /// table entry as against a walk, and the full walk runs on a thread
    /// behind: [`BlockSource::proven`] waits for it. An archive without a
    /// table is walked first, as by [`Archive::from_store`].
    pub fn open_indexed(store: Box<dyn RecordStore>, label: String) -> Result<Arc<Archive>> {
        let mut records = CheckedRecords::new(StoreInput::new(&*store), Payloads::None)?;
        let header = records.header().clone();
        if header.flags & FLAG_TABLE == 0 {
            drop(records);
            return Ok(Arc::new(Archive::from_store(store, label)?));
        }
        let key = records.key().cloned();
        let after_key = records.offset();
        let (chain, data_start) = if header.flags & FLAG_PARENT != 0 {
            match records.next_record()? {
                Some((_, Checked::Chain(chain))) => (chain, records.offset()),
                _ => unreachable!("the checks let only the chain record come first"),
            }
        } else {
            (Vec::new(), after_key)
        };
        drop(records);
        let (index, index_offset) = read_index(&*store, &header, key.as_deref())?;
        check_table(&header, &chain, data_start, &index, index_offset)?;
        let blocks = index
            .files
            .iter()
            .map(|f| {
                let mut raw_pos = 0;
                f.table
                    .iter()
                    .map(|t| {
                        let literal_pages = (t.header.codec == BlockCodec::Dedup).then_some(t.ids);
                        let b = ProvenBlock { header: t.header.clone(), raw_pos, literal_pages };
                        raw_pos += u64::from(t.header.raw_len);
                        b
                    })
                    .collect()
            })
            .collect();
        let archive = Arc::new(Archive::assemble(store, label, header, index, blocks, chain, false, key));
        let behind = archive.clone();
        std::thread::Builder::new()
            .name("criuz-proof".into())
            .spawn(move || {
                // Readers wait for this result: it must be set however the walk ends.
                let walked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| behind.walk_matches()));
                let r = walked.unwrap_or(Err(Error::Cancelled)).map_err(|e| e.context(behind.label.to_string()));
                let _ = behind.proof.set(r);
            })
            .map_err(Error::Io)?;
        Ok(archive)
    }

    /// The full walk of an archive opened from its index: every record
    /// through the checks, and the index it ends with must be the one opened.
    fn walk_matches(&self) -> Result<()> {
        let walked = walk(&*self.store)?;
        if walked.header != self.header || walked.chain != self.chain || walked.index != self.index {
            return Err(Error::corrupt(0, "the archive's records disagree with its index"));
        }
        Ok(())
    }

    /// The parents this archive refers to, as its C record names them.
    pub fn chain(&self) -> &[ChainEntry] {
        &self.chain
    }

    /// The opened parents (empty until attached).
    pub fn parents(&self) -> &[Arc<Archive>] {
        match self.parents.get() {
            Some(Ok(p)) => p,
            _ => &[],
        }
    }

    /// Says that the parents are being walked and will be attached (or
    /// reported failed): readers that need them wait until then.
    pub(crate) fn expect_parents(&self) {
        self.parents_coming.store(true, Ordering::Release);
    }

    /// Says that the parents cannot be attached: waiting readers fail as
    /// cancelled (whoever walked them reports why). A no-op once attached.
    pub(crate) fn parents_failed(&self) {
        let _ = self.parents.set(Err(()));
    }

    /// The parents, waiting for a walk under way to end.
    fn attached_parents(&self) -> Result<&[Arc<Archive>]> {
        let state = match self.parents.get() {
            // A reference with no chain points at an unknown parent.
            None if self.chain.is_empty() => return Ok(&[]),
            Some(state) => state,
            None if self.parents_coming.load(Ordering::Acquire) => self.parents.wait(),
            None => return Err(Error::Usage(format!("{}: its parents were not opened", self.label))),
        };
        state.as_deref().map_err(|_| Error::Cancelled)
    }

    /// The archive's records from the start, checked again as they are read.
    pub(crate) fn records(&self, payloads: Payloads) -> Result<CheckedRecords<StoreInput<'_>>> {
        CheckedRecords::new(StoreInput::new(&*self.store), payloads)
    }

    /// Gives the archive its opened parents, in C record order; each must be
    /// the archive the C record names.
    pub fn attach_parents(&self, parents: Vec<Arc<Archive>>) -> Result<()> {
        if parents.len() != self.chain.len()
            || parents.iter().zip(&self.chain).any(|(p, e)| p.header.archive_id != e.archive_id)
        {
            return Err(Error::Usage(format!("{}: parents given do not match its chain", self.label)));
        }
        self.parents.set(Ok(parents)).map_err(|_| Error::Usage(format!("{}: parents already attached", self.label)))
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
    /// blocks handed to CRIU where they lie (see [`page_aligned`]). A block
    /// served whole needs no such care (one slot more per block).
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
        let mut cached = self.window.lock().unwrap();
        let hit = matches!(&*cached, Some((at, w)) if *at <= offset && end <= at + w.len() as u64);
        if !hit {
            let want = (self.store.size().saturating_sub(offset)).min(READ_AHEAD as u64) as usize;
            if want < len {
                drop(cached);
                return direct();
            }
            // The old window's memory is reused unless a holder still keeps a
            // share of it; a new one is read into unzeroed memory (zeroing
            // the windows of a chain's children cost a tenth of its decoding).
            let w = match cached.take().and_then(|(_, w)| Arc::try_unwrap(w).ok()) {
                Some(mut w) => {
                    w.resize(want, 0);
                    self.store.read_exact_at(&mut w, offset)?;
                    w
                }
                None => self.store.read_vec(want, offset)?,
            };
            *cached = Some((offset, Arc::new(w)));
        }
        let (at, w) = cached.as_ref().expect("window filled");
        Ok((w.clone(), (offset - at) as usize))
    }

    /// Reads record `i` of a file and checks its header against the walk;
    /// `pieced`: its pages will be pieced into other blocks (a holder).
    fn fetch(&self, file_id: u32, i: usize, pieced: bool) -> Result<Option<Fetched>> {
        let Some(entry) = self.index.files.get(file_id as usize) else { return Ok(None) };
        let Some(r) = entry.blocks.get(i) else { return Ok(None) };
        let proven = &self.blocks[file_id as usize][i].header;
        let end_aligned = pieced || proven.codec == BlockCodec::Dedup;
        let (buf, start) = self.read_ahead(r.record_len as usize, r.offset, end_aligned).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::corrupt(r.offset, "archive was truncated after it was opened")
            } else {
                Error::Io(e)
            }
        })?;
        let range = start..start + r.record_len as usize;
        let DecodedBlockHeader { header, len: header_len } = BlockHeader::decode(&buf[range.clone()], r.offset)?;
        if header != *proven || header_len + header.stored_len as usize != range.len() {
            return Err(Error::corrupt(
                r.offset,
                format!("block {i} of {} changed after the archive was opened", entry.name),
            ));
        }
        let fetched = Fetched { buf, range, header, offset: r.offset };
        if !fetched.header.sealed {
            return Ok(Some(fetched));
        }
        self.open_sealed(fetched, i as u32).map(Some)
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

    /// Record `i` of a file as fetched, as a block of its own, its payload
    /// checked against its payload check.
    fn checked(&self, file_id: u32, i: usize, f: Fetched) -> Result<CheckedBlock> {
        let Fetched { buf, range, header, offset } = f;
        // Only the payload's place at the record's end matters afterwards.
        let record = match Arc::try_unwrap(buf) {
            Ok(v) if range.end == v.len() => v,
            Ok(v) => v[range].to_vec(),
            Err(shared) => shared[range].to_vec(),
        };
        let raw_pos = self.blocks[file_id as usize][i].raw_pos;
        let block = CheckedBlock { header, record, offset, raw_pos, resolved: false, pieces: Vec::new() };
        check_payload(&block.header, block.payload(), offset, self.key.is_some())?;
        Ok(block)
    }

    /// The extents and inner payload of dedup block `block` of a file, whose
    /// literal pages must be the ones its P record listed.
    fn dedup_payload<'b>(
        &self,
        file_id: u32,
        block: u32,
        header: &BlockHeader,
        payload: &'b [u8],
        offset: u64,
    ) -> Result<(DedupPayload, &'b [u8])> {
        let stored = header.pages() - header.zero_pages();
        let crate::format::DecodedDedup { head: dp, inner_payload: inner } =
            DedupPayload::decode(payload, stored, offset)?;
        let listed = self.blocks[file_id as usize].get(block as usize).and_then(|b| b.literal_pages);
        if listed != Some(dp.literal_pages()) {
            return Err(Error::corrupt(offset, "the page id record does not list the block's literal pages"));
        }
        Ok((dp, inner))
    }

    /// The stored pages of block `block` of a file, for references into it.
    ///
    /// A holder is read without its payload check and decoded without its
    /// data check: every byte taken from it ends up in a referring block
    /// whose data check proves it (damage anywhere in a holder, including its
    /// extents, can only make that check fail, and the error then names the
    /// archives involved). Hashing the holders too would double the hashing
    /// of a chain restore. Its structure is still checked: the header against
    /// the walk, the extents, and the P count of a dedup block.
    fn holder(&self, file_id: u32, block: u32) -> Result<Arc<Holder>> {
        if let Some(h) = self.holders.lock().unwrap().iter().find(|h| (h.0, h.1) == (file_id, block)) {
            return Ok(h.2.clone());
        }
        let Fetched { buf, range, header: h, offset, .. } =
            self.fetch(file_id, block as usize, true)?.ok_or_else(|| {
                Error::corrupt(
                    0,
                    format!("a reference points at block {block} of file {file_id}, which does not exist"),
                )
            })?;
        let payload = &buf[range.end - h.stored_len as usize..range.end];
        let label = self.label.clone();
        let holder = if h.codec == BlockCodec::Dedup {
            let (dp, inner) = self.dedup_payload(file_id, block, &h, payload, offset)?;
            // Raw literal pages (new random data, the usual case) are the
            // payload's tail.
            let (bytes, start) = match dp.inner {
                BlockCodec::Raw => page_aligned_share(&buf, range.end - inner.len()..range.end),
                codec => decode_aligned(codec, inner, dp.literal_len as usize, offset)?,
            };
            let pages = dp.literal_slots().map(|k| k.map(|k| start + k * PAGE_SIZE)).collect();
            Holder { pages, pinned: range.len().max(dp.literal_len as usize), bytes, archive: label }
        } else {
            if h.codec == BlockCodec::Raw && h.stored_len as usize != h.stored_raw_len() {
                return Err(Error::corrupt(offset, "raw block payload has the wrong length"));
            }
            let (bytes, start) = match h.codec {
                BlockCodec::Raw => page_aligned_share(&buf, range.end - payload.len()..range.end),
                codec => decode_aligned(codec, payload, h.stored_raw_len(), offset)?,
            };
            let pages = (0..h.stored_raw_len() / PAGE_SIZE).map(|p| Some(start + p * PAGE_SIZE)).collect();
            Holder { pages, pinned: range.len().max(h.stored_raw_len()), bytes, archive: label }
        };
        let holder = Arc::new(holder);
        let mut cache = self.holders.lock().unwrap();
        if cache.len() == HOLDER_CACHE {
            cache.pop_front();
        }
        cache.push_back((file_id, block, holder.clone()));
        Ok(holder)
    }

    /// Resolves a dedup block into the raw block of its stored pages; its
    /// data check (applied when it is decoded) then proves the result.
    fn resolve(&self, file_id: u32, block: u32, f: Fetched) -> Result<CheckedBlock> {
        let Fetched { buf, range, header, offset } = f;
        let payload = &buf[range.end - header.stored_len as usize..range.end];
        check_payload(&header, payload, offset, self.key.is_some())?;
        let (dp, inner) = self.dedup_payload(file_id, block, &header, payload, offset)?;
        let archive = self.label.clone();
        // Literal pages on a page boundary, as for holders.
        let (bytes, mut lit) = match dp.inner {
            BlockCodec::Raw => page_aligned_share(&buf, range.end - inner.len()..range.end),
            codec => decode_aligned(codec, inner, dp.literal_len as usize, offset)?,
        };
        let literal = Holder { pinned: range.len().max(dp.literal_len as usize), bytes, pages: Vec::new(), archive };
        let literal = Arc::new(literal);
        let mut len = 0;
        let mut pieces: Vec<(Arc<Holder>, Range<usize>)> = Vec::new();
        // The holder the last extent used: consecutive extents mostly point
        // into the same block, and the cache takes a lock.
        let mut last: Option<((u16, u32, u32), Arc<Holder>)> = None;
        let mut push = |holder: &Arc<Holder>, range: Range<usize>| {
            len += range.len();
            match pieces.last_mut() {
                Some((h, r)) if Arc::ptr_eq(h, holder) && r.end == range.start => r.end = range.end,
                _ => pieces.push((holder.clone(), range)),
            }
        };
        for e in &dp.extents {
            let n = e.count as usize;
            match e.origin {
                Origin::Literal => {
                    push(&literal, lit..lit + n * PAGE_SIZE);
                    lit += n * PAGE_SIZE;
                }
                Origin::Ref { source, file_id, block, first } => {
                    let target: &Archive = match source {
                        0 => self,
                        k => self
                            .attached_parents()?
                            .get(k as usize - 1)
                            .map(|a| &**a)
                            .ok_or_else(|| Error::corrupt(offset, format!("reference to unknown parent {k}")))?,
                    };
                    let holder = match &last {
                        Some((key, h)) if *key == (source, file_id, block) => h.clone(),
                        _ => {
                            let h = target.holder(file_id, block).map_err(|e| e.context(target.label.to_string()))?;
                            last = Some(((source, file_id, block), h.clone()));
                            h
                        }
                    };
                    let missing = || Error::corrupt(offset, "a reference points at a page that is not stored there");
                    let mut pages = holder.pages.get(first as usize..first as usize + n).ok_or_else(missing)?;
                    // Runs of pages that lie back to back in the holder are one piece.
                    while let Some(&start) = pages.first() {
                        let start = start.ok_or_else(missing)?;
                        let run = 1 + pages[1..]
                            .iter()
                            .enumerate()
                            .take_while(|(k, at)| **at == Some(start + (k + 1) * PAGE_SIZE))
                            .count();
                        push(&holder, start..start + run * PAGE_SIZE);
                        pages = &pages[run..];
                    }
                }
            }
        }
        let header = BlockHeader { codec: BlockCodec::Raw, stored_len: len as u32, ..header };
        let raw_pos = self.blocks[file_id as usize][block as usize].raw_pos;
        Ok(CheckedBlock { header, record: Vec::new(), offset, raw_pos, resolved: true, pieces })
    }

    /// Opens an archive from a path, or from standard input for `-`: spooled
    /// to an unnamed private temporary file, at most `spool_cap` bytes.
    pub fn open_spec(spec: &Path, spool_cap: u64) -> Result<Arc<Archive>> {
        if !crate::io::is_stdio(spec) {
            return Archive::open(spec);
        }
        Ok(Arc::new(Archive::from_reader(std::io::stdin().lock(), spool_cap, "stdin")?))
    }

    /// Like [`Archive::open_spec`], but an object still arriving is opened
    /// from its index ([`Archive::open_indexed`]): a file or a spooled pipe
    /// is walked in milliseconds, a download only once it has all arrived.
    pub fn open_early(spec: &Path, spool_cap: u64) -> Result<Arc<Archive>> {
        if crate::io::is_stdio(spec) {
            return Archive::open_spec(spec, spool_cap);
        }
        let (store, label) = crate::io::open_store(spec)?;
        if !store.arriving() {
            return Ok(Arc::new(Archive::from_store(store, label.clone()).context(|| label)?));
        }
        Archive::open_indexed(store, label.clone()).context(|| label)
    }

    /// An archive arriving front to back (a pipe): spooled to an unnamed
    /// private temporary file of at most `spool_cap` bytes, then opened.
    pub fn from_reader(inp: impl Read, spool_cap: u64, label: &str) -> Result<Archive> {
        let file = spool(inp, spool_cap).context(|| label.to_string())?;
        Archive::from_store(Box::new(file), label.to_string()).context(|| label.to_string())
    }
}

/// What a walk of every record header through the checks proved.
struct Walked {
    header: Header,
    index: Index,
    blocks: Vec<Vec<ProvenBlock>>,
    chain: Vec<ChainEntry>,
    key: Option<Arc<ArchiveKey>>,
}

/// Walks every record header of `store` through the checks.
fn walk(store: &dyn RecordStore) -> Result<Walked> {
    let mut records = CheckedRecords::new(StoreInput::new(store), Payloads::None)?;
    let header = records.header().clone();
    let key = records.key().cloned();
    let mut blocks: Vec<Vec<ProvenBlock>> = Vec::new();
    let mut chain = Vec::new();
    loop {
        match records.next_record()? {
            Some((_, Checked::FileBegin { .. })) => blocks.push(Vec::new()),
            Some((_, Checked::Block { header, raw_pos, .. })) => {
                blocks[header.file_id as usize].push(ProvenBlock { header, raw_pos, literal_pages: None });
            }
            Some((_, Checked::Ids { file_id, count, .. })) => {
                if let Some(b) = blocks[file_id as usize].last_mut().filter(|b| b.header.codec == BlockCodec::Dedup) {
                    b.literal_pages = Some(count);
                }
            }
            Some((_, Checked::Chain(entries))) => chain = entries,
            Some((_, Checked::FileEnd(_))) => {}
            Some((_, Checked::Index(index))) => return Ok(Walked { header, index, blocks, chain, key }),
            None => unreachable!("the index ends the records"),
        }
    }
}

/// Reads and checks the trailer and the index it points at; returns the
/// index and its offset.
fn read_index(store: &dyn RecordStore, header: &Header, key: Option<&ArchiveKey>) -> Result<(Index, u64)> {
    let size = store.size();
    let truncated = || Error::corrupt(size, "archive is truncated (no trailer)");
    if size < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(truncated());
    }
    let at = size - TRAILER_LEN as u64;
    let trailer: [u8; TRAILER_LEN] = store.read_vec(TRAILER_LEN, at)?.try_into().expect("trailer length");
    let Trailer { index_offset: offset, index_len: len } = Trailer::decode(&trailer, at)?;
    // The format bounds the index body below 4 GiB, so a damaged trailer
    // cannot make this read more.
    if offset.checked_add(len) != Some(at) || !((INDEX_FIXED + 8) as u64..(1 << 32) + 28).contains(&len) {
        return Err(Error::corrupt(at, "trailer does not point at the index"));
    }
    let rec = store.read_vec(len as usize, offset)?;
    let IndexFixed { count, body_len } =
        IndexFixed::decode(rec[..INDEX_FIXED].try_into().expect("index header"), offset)?;
    if body_len + (INDEX_FIXED + 8) as u64 != len {
        return Err(Error::corrupt(at, "trailer does not point at the index"));
    }
    let body = &rec[INDEX_FIXED..INDEX_FIXED + body_len as usize];
    let check = u64::from_le_bytes(rec[INDEX_FIXED + body.len()..].try_into().expect("index check"));
    let index = super::records::index_from_body(key, body, check, count, offset + INDEX_FIXED as u64, header.flags)?;
    Ok((index, offset))
}

/// Copies an archive arriving on a pipe into an unnamed temporary file
/// (mode 0600, gone when closed).
fn spool(mut inp: impl Read, cap: u64) -> Result<File> {
    let dir = std::env::temp_dir();
    let mut file = tempfile::tempfile_in(&dir).at(&dir)?;
    let copied = std::io::copy(&mut (&mut inp).take(cap.saturating_add(1)), &mut file).at(&dir)?;
    if copied > cap {
        return Err(Error::Usage(format!(
            "the archive is larger than --pipe-buffer ({cap} bytes); raise it, or restore from a file"
        )));
    }
    file.flush().at(&dir)?;
    Ok(file)
}

impl BlockSource for Archive {
    fn label(&self) -> &str {
        &self.label
    }

    fn header(&self) -> &Header {
        &self.header
    }

    fn index(&self) -> &Index {
        &self.index
    }

    fn block_header(&self, file_id: u32, i: usize) -> Option<(&BlockHeader, u64)> {
        self.blocks.get(file_id as usize)?.get(i).map(|b| (&b.header, b.raw_pos))
    }

    fn proven(&self) -> Result<()> {
        self.proof.wait().as_ref().map_err(Error::duplicate).copied()
    }

    fn prove_stored(&self) -> Result<()> {
        for a in std::iter::once(self).chain(self.parents().iter().map(|p| &**p)) {
            let mut records = a.records(Payloads::All).context(|| a.label.to_string())?;
            // An AEAD tag proves every byte of an opened payload.
            let sealed = records.key().is_some();
            while let Some((offset, rec)) = records.next_record().context(|| a.label.to_string())? {
                if let Checked::Block { header, payload: Some(p), .. } = rec {
                    if header.codec == BlockCodec::Raw && !sealed {
                        crate::codec::check_parts(&header, &[&p])
                            .map_err(|e| Error::corrupt(offset, e))
                            .context(|| a.label.to_string())?;
                    }
                }
            }
        }
        Ok(())
    }

    fn block(&self, file_id: u32, i: usize) -> Result<Option<CheckedBlock>> {
        match self.fetch(file_id, i, false)? {
            Some(f) if f.header.codec == BlockCodec::Dedup => self.resolve(file_id, i as u32, f).map(Some),
            Some(f) => self.checked(file_id, i, f).map(Some),
            None => Ok(None),
        }
    }
}
