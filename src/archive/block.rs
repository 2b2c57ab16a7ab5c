//! What every reader of an archive's blocks reads through: the
//! [`BlockSource`] trait and the [`CheckedBlock`] it hands out.
//!
//! A [`CheckedBlock`] has been proven to be block `i` of its file at the
//! position the index says (its header against the opening's proof, its
//! payload against its payload check or seal); decoding it proves its data.
//! A resolved dedup block is made of pieces of other blocks' stored pages
//! ([`Holder`]s, from `resolve`); its data check, applied when it is
//! decoded or handed on, proves the whole. This file imports nothing else
//! of `archive/`: it is the seam the rest is built on.

use crate::codec::Decoder;
use crate::error::{Error, Result};
use crate::format::{BlockCodec, BlockHeader, FileEntry, Header, Index};
use crate::io::SharedBytes;
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

/// The most a resolved block handed on by its pieces keeps alive, as a
/// multiple of its own size (beyond it, its pages are copied out): what a
/// reader sizes its read-ahead by for archives that may hold dedup blocks.
pub const PIN_FACTOR: usize = 4;

/// A block proven to be block `i` of its file at the position the index
/// says; its data is proven when decoded.
pub struct CheckedBlock {
    pub header: BlockHeader,
    /// The whole record as read; the payload is its tail.
    pub(crate) record: Vec<u8>,
    /// Offset of the record in the archive (for messages).
    pub offset: u64,
    /// Position of the block's first byte in its file.
    pub raw_pos: u64,
    /// Whether this is a resolved dedup block.
    pub(crate) resolved: bool,
    /// For a resolved dedup block: its stored pages, as runs inside decoded
    /// blocks (its own literal pages and its parents'); `record` is empty.
    /// Each holder names its archive, so a failed data check can name every
    /// archive the pages came from (the damage may be in any of them).
    pub(crate) pieces: Vec<(Arc<Holder>, Range<usize>)>,
}

impl CheckedBlock {
    pub(crate) fn payload(&self) -> &[u8] {
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

    /// As [`decode_stored`](Self::decode_stored), into a buffer of its own
    /// where the pages start on a page boundary (each then one slot of
    /// CRIU's pipe: see [`super::fetch::page_aligned`]); gives back the
    /// buffer and where the pages lie in it.
    pub fn decode_stored_page_aligned(&self, dec: &mut Decoder) -> Result<(Vec<u8>, std::ops::Range<usize>)> {
        let len = self.header.stored_raw_len();
        let (mut buf, start) = super::fetch::page_aligned(len);
        dec.decode_stored_after(&self.header, &self.contiguous(), &mut buf).map_err(|e| self.damaged(e))?;
        Ok((buf, start..start + len))
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
    /// from its index behind, see `archive::open`). A reader must call it
    /// before it hands on what can no longer be taken back (the last block
    /// of a page image: CRIU cannot finish a process without it).
    fn proven(&self) -> Result<()> {
        Ok(())
    }

    /// How the walk of the parents ended, waiting for one under way (see
    /// `archive::Parents::Behind`): why they could not be opened, if they
    /// could not. A restore that failed for want of a parent's page reports
    /// this as the cause.
    fn parents_walked(&self) -> Result<()> {
        Ok(())
    }

    /// Reads every stored byte of the archive and of its parents against
    /// its check, without decoding: compressed payloads against their
    /// payload checks, raw ones against their data checks, sealed ones
    /// through their seals. What a lazy restore proves before the tree may
    /// run (a damaged archive then stops it while nothing runs); the data
    /// of a compressed block is still proven as it is decoded.
    fn prove_stored(&self) -> Result<()>;

    /// Whether the archive's store may read ahead of its readers (it may
    /// until told otherwise). A lazy restore pauses it until its tree runs.
    /// Resumed, it lets a walk behind that waited for it start
    /// (`archive::OpenOptions::read_ahead_at_once`).
    fn read_ahead(&self, on: bool) {
        let _ = on;
    }

    /// Lets a walk behind that waits for the archive's pages to be wanted
    /// start now, before they are: for a reader that waits for the proof
    /// before it reads them (a lazy tree is proven before it runs), so that
    /// the walk overlaps what comes before.
    fn start_proof(&self) {}

    fn find(&self, name: &str) -> Option<&FileEntry> {
        self.index().find(name)
    }

    /// A whole file, decoded and checked (for small files such as metadata).
    /// What its checks find names the archive and the file (a failed read
    /// names the archive already).
    fn read_file(&self, entry: &FileEntry) -> Result<Vec<u8>> {
        thread_local! {
            /// One decoder per thread: a restore reads a metadata file per
            /// thread of the tree (`core-TID.img`), and a fresh zstd context
            /// each time was 4% of a 256-thread restore's own time.
            static DECODER: std::cell::RefCell<Decoder> = std::cell::RefCell::new(Decoder::new());
        }
        let read = |dec: &mut Decoder| {
            let (mut all, mut out) = (Vec::new(), Vec::new());
            let mut i = 0;
            while let Some(b) = self.block(entry.file_id, i)? {
                b.decode(dec, &mut out)?;
                all.extend_from_slice(&out);
                i += 1;
            }
            Ok(all)
        };
        // A read within a read (through a parent) gets a decoder of its own.
        let read = DECODER.with(|d| match d.try_borrow_mut() {
            Ok(mut dec) => read(&mut dec),
            Err(_) => read(&mut Decoder::new()),
        });
        // An error already labelled with this archive (an I/O failure of a
        // block read) gains the file's name; one labelled with another (a
        // parent's) keeps its own label, which names where the fault lies.
        let named = |e: Error| e.context(format!("{}: {}", self.label(), entry.name));
        read.map_err(|e| match e {
            Error::Context { context, inner } if context == self.label() => named(*inner),
            e @ Error::Context { .. } => e,
            e => named(e),
        })
    }
}

/// The stored pages of a block that references may point at, and for each
/// stored page its offset in `bytes` (`None`: the page is itself a reference,
/// which no reference may point at).
pub(crate) struct Holder {
    /// The buffer its pages lie in: its own decoded bytes, or the record as
    /// read (possibly inside a read-ahead window shared with other records).
    pub(crate) bytes: Arc<Vec<u8>>,
    pub(crate) pages: Vec<Option<usize>>,
    /// Bytes it keeps alive on its own account (its record, not the whole
    /// window: the window's other records are other holders' share).
    pub(crate) pinned: usize,
    /// The archive's label (for messages).
    pub(crate) archive: Arc<str>,
}

impl AsRef<[u8]> for Holder {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}
