//! Record framing: the writer that appends records to any `Write`, and the
//! reader that takes them off any [`Input`] one at a time. Both are plain
//! framing over `format`'s pure encoders and decoders; neither decides
//! whether an archive is whole and consistent (that is `check`'s job), and
//! no block payload is decompressed here.
//!
//! The reader can leave payloads unread ([`SeqReader::next_head`] then
//! [`SeqReader::skip_payload`]): over a seekable file that reads only record
//! headers, which is how a seekable archive is proven whole before a restore.

use crate::error::{Error, Result};
use crate::format::{
    block_header_len, chain_body_len, check_index_body, decode_chain_record, decode_end_record, decode_index_body,
    decode_key_record, encode_chain_record, encode_end_record, encode_file_record_bytes, encode_ids_record,
    encode_index_body_and_trailer, encode_key_record, encode_name_field, file_record_name_len, key_record_len,
    BlockHeader, BlockRef, ChainEntry, DecodedBlockHeader, EntryMeta, FileEnd, FileEntry, FileKind, FileRecord, Header,
    IdsFixed, Index, IndexFixed, KeyRecord, NameField, PageId, RecordType, TableEntry, Trailer, BLOCK_FIXED,
    CHAIN_FIXED, END_LEN, FILE_FIXED, FLAG_SEALED, FLAG_TABLE, FLAG_TREE, HEADER_LEN, IDS_FIXED, INDEX_FIXED,
    KEY_FIXED, MAGIC, PAGE_ID_LEN, TRAILER_LEN,
};
use crate::seal::ArchiveKey;
use std::io::{self, Read, Write};
use std::sync::Arc;

/// Append-only archive writer. Tracks every record's offset so it can write
/// the index at the end; never seeks. Dropping it without [`finish`] leaves
/// an archive with no index or trailer, which every reader rejects.
///
/// [`finish`]: ArchiveWriter::finish
pub struct ArchiveWriter<W: Write> {
    out: W,
    offset: u64,
    files: Vec<OpenFile>,
    scratch: Vec<u8>,
    /// The header's flags: whether the index carries the block table.
    flags: u16,
    /// An encrypted archive's key: names and the index are sealed here,
    /// block payloads before they reach the writer (on the workers).
    key: Option<Arc<ArchiveKey>>,
}

struct OpenFile {
    entry: FileEntry,
    check: xxhash_rust::xxh3::Xxh3,
    ended: bool,
}

impl<W: Write> ArchiveWriter<W> {
    /// Writes the header, and the C record when the archive has parents
    /// (`chain` must then be given, its first entry the header's parent id).
    pub fn new(out: W, header: &Header, chain: &[ChainEntry]) -> Result<Self> {
        Self::sealed(out, header, chain, None)
    }

    /// As [`new`](Self::new); an encrypted archive (header flag `SEALED`)
    /// gets its K record after the header and its key seals names and index.
    pub fn sealed(
        mut out: W,
        header: &Header,
        chain: &[ChainEntry],
        key: Option<(Arc<ArchiveKey>, KeyRecord)>,
    ) -> Result<Self> {
        if key.is_some() != (header.flags & FLAG_SEALED != 0) {
            return Err(Error::Usage("an encrypted archive needs its key, and only it".into()));
        }
        out.write_all(&header.encode())?;
        let mut offset = HEADER_LEN as u64;
        let key = match key {
            Some((k, rec)) => {
                let rec = encode_key_record(&rec);
                out.write_all(&rec)?;
                offset += rec.len() as u64;
                Some(k)
            }
            None => None,
        };
        if !chain.is_empty() {
            let rec = encode_chain_record(chain);
            out.write_all(&rec)?;
            offset += rec.len() as u64;
        }
        Ok(ArchiveWriter { out, offset, files: Vec::new(), scratch: Vec::new(), flags: header.flags, key })
    }

    /// The P record for the block just written: ids of its stored pages.
    pub fn write_ids(&mut self, file_id: u32, ids: &[PageId]) -> Result<()> {
        if let Some(t) = self.files.get_mut(file_id as usize).and_then(|f| f.entry.table.last_mut()) {
            t.ids = ids.len() as u32;
        }
        self.scratch.clear();
        encode_ids_record(file_id, ids, &mut self.scratch);
        self.flush_scratch()
    }

    /// Starts a file; returns its id for the blocks that follow.
    /// Starts an entry; `meta` is given exactly when the archive is a tree.
    pub fn begin_file(&mut self, name: &str, kind: FileKind, meta: Option<EntryMeta>) -> Result<u32> {
        let tree = self.flags & FLAG_TREE != 0;
        crate::format::check_entry_name(name, tree)
            .map_err(|why| Error::Usage(format!("bad image file name {name:?}: {why}")))?;
        if meta.is_some() != tree || (!tree && !kind.is_file()) {
            return Err(Error::Usage(format!("{name}: entry metadata and kind need a tree archive")));
        }
        let file_id = self.files.len() as u32;
        self.scratch.clear();
        let field = encode_name_field(name, meta.as_ref());
        match &self.key {
            Some(k) => encode_file_record_bytes(file_id, &k.seal_name(file_id, kind, &field), kind, &mut self.scratch),
            None => encode_file_record_bytes(file_id, &field, kind, &mut self.scratch),
        }
        let entry = FileEntry {
            file_id,
            name: name.to_string(),
            meta,
            kind,
            raw_size: 0,
            file_check: 0,
            record_offset: self.offset,
            blocks: Vec::new(),
            table: Vec::new(),
        };
        self.files.push(OpenFile { entry, check: xxhash_rust::xxh3::Xxh3::new(), ended: false });
        self.flush_scratch()?;
        Ok(file_id)
    }

    pub fn write_block(&mut self, header: &BlockHeader, payload: &[u8]) -> Result<()> {
        debug_assert_eq!(header.stored_len as usize, payload.len());
        let file = open_file(&mut self.files, header.file_id)?;
        self.scratch.clear();
        header.encode(&mut self.scratch);
        let record_len = (self.scratch.len() + payload.len()) as u32;
        file.entry.blocks.push(BlockRef { offset: self.offset, raw_len: header.raw_len, record_len });
        if self.flags & FLAG_TABLE != 0 {
            file.entry.table.push(TableEntry { header: header.clone(), ids: 0 });
        }
        file.entry.raw_size += u64::from(header.raw_len);
        file.check.update(&header.data_check.to_le_bytes());
        self.flush_scratch()?;
        self.out.write_all(payload)?;
        self.offset += payload.len() as u64;
        Ok(())
    }

    pub fn end_file(&mut self, file_id: u32) -> Result<()> {
        let file = open_file(&mut self.files, file_id)?;
        file.ended = true;
        file.entry.file_check = file.check.digest();
        let end = FileEnd { file_id, raw_size: file.entry.raw_size, file_check: file.entry.file_check };
        self.scratch.clear();
        encode_end_record(&end, &mut self.scratch);
        self.flush_scratch()
    }

    /// Writes the index and trailer; every file must have ended. Returns the
    /// output, the index and the archive's length.
    pub fn finish(mut self) -> Result<(W, Index, u64)> {
        if let Some(f) = self.files.iter().find(|f| !f.ended) {
            return Err(Error::Usage(format!("image file {} was never completed", f.entry.name)));
        }
        let index = Index { files: self.files.drain(..).map(|f| f.entry).collect() };
        let count = index.files.len() as u32;
        let mut body = index.encode_body(self.flags);
        if let Some(k) = &self.key {
            body = k.seal_index(count, body);
        }
        let tail = encode_index_body_and_trailer(body, count, self.offset);
        self.out.write_all(&tail)?;
        self.offset += tail.len() as u64;
        self.out.flush()?;
        Ok((self.out, index, self.offset))
    }

    fn flush_scratch(&mut self) -> Result<()> {
        self.out.write_all(&self.scratch)?;
        self.offset += self.scratch.len() as u64;
        Ok(())
    }
}

fn open_file(files: &mut [OpenFile], file_id: u32) -> Result<&mut OpenFile> {
    files
        .get_mut(file_id as usize)
        .filter(|f| !f.ended)
        .ok_or_else(|| Error::Usage(format!("record for unknown or ended file {file_id}")))
}

/// Where a sequential reader takes bytes from: a pipe skips by reading, a
/// seekable file by moving its position (so a header walk reads headers only).
pub trait Input: Send {
    /// Fills as much of `buf` as the input has; returns the count (less only at EOF).
    fn read_full(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Skips `n` bytes; returns how many were there to skip.
    fn skip(&mut self, n: u64) -> io::Result<u64>;
    /// Appends up to `n` bytes to `buf`; returns the count (less only at
    /// EOF). Inputs that can read into `buf`'s spare capacity do, instead of
    /// zeroing it first.
    fn read_append(&mut self, buf: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        read_append_zeroed(self, buf, n)
    }
    /// The record at `offset`, the input's position, already read and
    /// parsed on another thread (`archive::walk_ahead`), the input moved
    /// past its head; `None` where nothing was (then the reader reads it).
    fn parsed_ahead(&mut self, offset: u64) -> Option<ParsedHead> {
        let _ = offset;
        None
    }
}

/// A record [`SeqReader::next_head`] returned, from a reader of the same
/// archive started at another record: what the reader at its offset would
/// return, since a record's parse depends on its bytes and the archive's
/// header and key alone.
#[derive(Debug)]
pub struct ParsedHead {
    pub record: Record,
    /// Bytes from the record's start to its payload (for the index, to the
    /// end of the archive).
    pub head_len: u64,
    /// A page id record's payload, which every reader reads.
    pub payload: Option<Vec<u8>>,
}

/// [`Input::read_append`] through [`Input::read_full`], into zeroed room.
pub(crate) fn read_append_zeroed<I: Input + ?Sized>(inp: &mut I, buf: &mut Vec<u8>, n: usize) -> io::Result<usize> {
    let at = buf.len();
    buf.resize(at + n, 0);
    let got = inp.read_full(&mut buf[at..])?;
    buf.truncate(at + got);
    Ok(got)
}

/// A streaming input (pipe, stdin, any reader).
pub struct StreamInput<R: Read>(pub R);

impl<R: Read + Send> Input for StreamInput<R> {
    fn read_full(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        read_full(&mut self.0, buf)
    }
    fn skip(&mut self, n: u64) -> io::Result<u64> {
        io::copy(&mut (&mut self.0).take(n), &mut io::sink())
    }
    fn read_append(&mut self, buf: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        buf.reserve_exact(n);
        (&mut self.0).take(n as u64).read_to_end(buf)
    }
}

/// One record as read, before any cross-record check.
#[derive(Debug)]
pub enum Record {
    FileBegin {
        file_id: u32,
        name: String,
        kind: FileKind,
        meta: Option<EntryMeta>,
    },
    /// A block header; its payload is next in the input, `stored_len` bytes.
    Block {
        header: BlockHeader,
        header_len: usize,
    },
    FileEnd(FileEnd),
    /// The index, whose trailer points back at it; the archive ends here.
    Index {
        index: Index,
        record_len: u64,
    },
    /// The parents this archive refers to (version 2).
    Chain(Vec<ChainEntry>),
    /// Page ids of the block before it; `count` ids and their check follow
    /// as the payload (version 2).
    Ids {
        file_id: u32,
        count: u32,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Unlock {
    Required,
    IfPossible,
}

/// Reads an archive front to back, checking each record's own seal and
/// lengths. What records mean together is checked by `check::StreamCheck`.
pub struct SeqReader<I: Input> {
    inp: I,
    offset: u64,
    pub header: Header,
    /// An encrypted archive's key, from its K record (`None` when it is not
    /// encrypted, or when opened locked).
    key: Option<Arc<ArchiveKey>>,
    /// What an encrypted archive's K record says (also when locked).
    key_record: Option<KeyRecord>,
    /// Payload bytes of the last block header that are still unread.
    pending_payload: u64,
    /// The pending payload, read ahead with its record ([`ParsedHead`]).
    payload_ahead: Option<Vec<u8>>,
    done: bool,
}

impl<I: Input> SeqReader<I> {
    /// Reads the header; an encrypted archive's key is unlocked through the
    /// keyring (`seal::keyring`), or the archive is refused as locked.
    pub fn new(inp: I) -> Result<Self> {
        Self::open(inp, Unlock::Required)
    }

    /// As [`new`](Self::new), but an encrypted archive that no key given
    /// opens is read without it: names come back as `#<file id>` and the
    /// index as empty (`inspect` shows what is public this way; nothing
    /// else may).
    pub fn new_or_locked(inp: I) -> Result<Self> {
        Self::open(inp, Unlock::IfPossible)
    }

    fn open(mut inp: I, unlock: Unlock) -> Result<Self> {
        let mut b = [0u8; HEADER_LEN];
        let got = inp.read_full(&mut b)?;
        if got == 0 {
            // Nothing arrived (a pipe whose writer failed, an empty file):
            // no archive at all, rather than a damaged one.
            return Err(Error::Mismatch("empty (0 bytes): not a criuz archive".into()));
        }
        if got < HEADER_LEN {
            if got >= 8 && b[0..8] != MAGIC || got < 8 && b[..got] != MAGIC[..got] {
                return Err(Error::corrupt(0, "not a criuz archive (bad magic)"));
            }
            return Err(Error::corrupt(got as u64, "truncated: archive ends inside the header"));
        }
        let header = Header::decode(&b)?;
        let mut r = SeqReader {
            inp,
            offset: HEADER_LEN as u64,
            header,
            key: None,
            key_record: None,
            pending_payload: 0,
            payload_ahead: None,
            done: false,
        };
        if r.header.flags & FLAG_SEALED != 0 {
            let start = r.offset;
            let mut rec = vec![0u8; KEY_FIXED];
            r.exact(&mut rec, "the key record")?;
            let n = key_record_len(rec[..].try_into().expect("fixed part"), start)?;
            rec.resize(KEY_FIXED + n + 4, 0);
            r.exact(&mut rec[KEY_FIXED..], "the key record")?;
            let kr = decode_key_record(&rec, start)?;
            match crate::seal::keyring::unlock(&kr, start) {
                Ok(chain) => r.key = Some(Arc::new(chain.archive(&r.header))),
                Err(Error::Locked(_) | Error::KeyNeeded(_)) if unlock == Unlock::IfPossible => {}
                Err(e) => return Err(e),
            }
            r.key_record = Some(kr);
        }
        Ok(r)
    }

    /// A reader of an archive already opened (its `header` read, its `key`
    /// unlocked) whose input stands at `offset`, a record's start: records
    /// from there on, read as a reader from the start would read them.
    pub(crate) fn resume(inp: I, offset: u64, header: Header, key: Option<Arc<ArchiveKey>>) -> Self {
        SeqReader { inp, offset, header, key, key_record: None, pending_payload: 0, payload_ahead: None, done: false }
    }

    /// The key of an encrypted archive opened with it.
    pub fn key(&self) -> Option<&Arc<ArchiveKey>> {
        self.key.as_ref()
    }

    /// An encrypted archive's K record.
    pub fn key_record(&self) -> Option<&KeyRecord> {
        self.key_record.as_ref()
    }

    /// Whether names, index and payloads are sealed and there is no key.
    fn locked(&self) -> bool {
        self.header.flags & FLAG_SEALED != 0 && self.key.is_none()
    }

    /// Offset of the next byte to be read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        let got = self.inp.read_full(buf)?;
        self.offset += got as u64;
        if got < buf.len() {
            return Err(Error::corrupt(self.offset, format!("truncated: archive ends inside {what}")));
        }
        Ok(())
    }

    /// Reads the payload of the block or page id record just returned by
    /// [`next_head`](Self::next_head).
    pub fn read_payload(&mut self) -> Result<Vec<u8>> {
        if let Some(payload) = self.payload_ahead.take() {
            let n = std::mem::take(&mut self.pending_payload);
            debug_assert_eq!(n, payload.len() as u64);
            let got = self.inp.skip(n)?;
            self.offset += got;
            if got < n {
                return Err(Error::corrupt(self.offset, "truncated: archive ends inside a block payload"));
            }
            return Ok(payload);
        }
        let n = std::mem::take(&mut self.pending_payload) as usize;
        let mut payload = Vec::with_capacity(n);
        let got = self.inp.read_append(&mut payload, n)?;
        self.offset += got as u64;
        if got < n {
            return Err(Error::corrupt(self.offset, "truncated: archive ends inside a block payload"));
        }
        Ok(payload)
    }

    /// Leaves the payload of the block just returned unread.
    pub fn skip_payload(&mut self) -> Result<()> {
        self.payload_ahead = None;
        let n = std::mem::take(&mut self.pending_payload);
        let got = self.inp.skip(n)?;
        self.offset += got;
        if got < n {
            return Err(Error::corrupt(self.offset, "truncated: archive ends inside a block payload"));
        }
        Ok(())
    }

    /// The next record and its offset; `None` after the index (end of
    /// archive). A block's payload must be read or skipped before the next call.
    pub fn next_head(&mut self) -> Result<Option<(u64, Record)>> {
        if self.pending_payload != 0 {
            self.skip_payload()?;
        }
        if self.done {
            return Ok(None);
        }
        let start = self.offset;
        if let Some(ahead) = self.inp.parsed_ahead(start) {
            self.offset += ahead.head_len;
            self.pending_payload = ahead.record.payload_len();
            self.payload_ahead = ahead.payload.filter(|p| p.len() as u64 == self.pending_payload);
            self.done = matches!(ahead.record, Record::Index { .. });
            return Ok(Some((start, ahead.record)));
        }
        let mut t = [0u8; 1];
        if self.inp.read_full(&mut t)? == 0 {
            return Err(Error::corrupt(start, "truncated: archive ends before its index"));
        }
        self.offset += 1;
        let rec = match RecordType::from_byte(t[0], start)? {
            RecordType::File => {
                let mut rec = vec![0u8; FILE_FIXED];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "a file record")?;
                rec.resize(FILE_FIXED + file_record_name_len(&rec) + 4, 0);
                self.exact(&mut rec[FILE_FIXED..], "a file record")?;
                let FileRecord { file_id, name, kind } = FileRecord::decode(&rec, start)?;
                let at = start + FILE_FIXED as u64;
                let tree = self.header.flags & FLAG_TREE != 0;
                let NameField { name, meta } = match &self.key {
                    Some(k) => NameField::decode(k.open_name(file_id, kind, name, at)?, tree, at)?,
                    None if self.locked() => NameField { name: format!("#{file_id}"), meta: None },
                    None => NameField::decode(name.to_vec(), tree, at)?,
                };
                Record::FileBegin { file_id, name, kind, meta }
            }
            RecordType::Block => {
                let mut rec = vec![0u8; BLOCK_FIXED];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "a block header")?;
                let len = block_header_len(&rec, start)?;
                rec.resize(len + 4, 0);
                self.exact(&mut rec[BLOCK_FIXED..], "a block header")?;
                let DecodedBlockHeader { header, len: header_len } = BlockHeader::decode(&rec, start)?;
                if header.raw_len > self.header.block_size {
                    return Err(Error::corrupt(start, "block is larger than the archive's block size"));
                }
                Record::Block { header, header_len }
            }
            RecordType::Chain => {
                let mut rec = vec![0u8; CHAIN_FIXED];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "the chain record")?;
                rec.resize(CHAIN_FIXED + chain_body_len(&rec, start)? + 4, 0);
                self.exact(&mut rec[CHAIN_FIXED..], "the chain record")?;
                Record::Chain(decode_chain_record(&rec, start)?)
            }
            RecordType::Ids => {
                let mut rec = [0u8; IDS_FIXED];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "a page id record")?;
                let IdsFixed { file_id, count } = IdsFixed::decode(&rec, start)?;
                Record::Ids { file_id, count }
            }
            RecordType::Key => return Err(Error::corrupt(start, "key record out of place")),
            RecordType::End => {
                let mut rec = [0u8; END_LEN];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "a file end record")?;
                Record::FileEnd(decode_end_record(&rec, start)?)
            }
            RecordType::Index => {
                let mut rec = [0u8; INDEX_FIXED];
                rec[0] = t[0];
                self.exact(&mut rec[1..], "the index header")?;
                let IndexFixed { count, body_len } = IndexFixed::decode(&rec, start)?;
                let body_off = self.offset;
                let mut body = vec![0u8; body_len as usize];
                self.exact(&mut body, "the index")?;
                let mut c = [0u8; 8];
                self.exact(&mut c, "the index")?;
                let check = u64::from_le_bytes(c);
                let index = if self.locked() {
                    check_index_body(&body, check, body_off)?;
                    Index::default()
                } else {
                    index_from_body(self.key.as_deref(), &body, check, count, body_off, self.header.flags)?
                };
                let record_len = self.offset - start;
                let mut t = [0u8; TRAILER_LEN];
                self.exact(&mut t, "the trailer")?;
                let Trailer { index_offset: toff, index_len: tlen } =
                    Trailer::decode(&t, self.offset - TRAILER_LEN as u64)?;
                if toff != start || tlen != record_len {
                    return Err(Error::corrupt(
                        self.offset - TRAILER_LEN as u64,
                        "trailer does not point at the index",
                    ));
                }
                let mut extra = [0u8; 1];
                if self.inp.read_full(&mut extra)? != 0 {
                    return Err(Error::corrupt(self.offset, "data after the end of the archive"));
                }
                self.done = true;
                Record::Index { index, record_len }
            }
        };
        self.pending_payload = rec.payload_len();
        Ok(Some((start, rec)))
    }
}

impl Record {
    /// Bytes of payload that follow the record's head: a block's stored
    /// payload, a page id record's ids and their check; none for the rest.
    fn payload_len(&self) -> u64 {
        match self {
            Record::Block { header, .. } => u64::from(header.stored_len),
            Record::Ids { count, .. } => u64::from(*count) * PAGE_ID_LEN as u64 + 8,
            _ => 0,
        }
    }
}

/// The index from its body as stored (with its stored check): checked, then
/// opened with the key of an encrypted archive, then decoded.
pub(crate) fn index_from_body(
    key: Option<&ArchiveKey>,
    body: &[u8],
    check: u64,
    count: u32,
    at: u64,
    flags: u16,
) -> Result<Index> {
    match key {
        Some(k) => {
            check_index_body(body, check, at)?;
            Index::decode_body(&k.open_index(count, body, at)?, count, at, flags)
        }
        None => decode_index_body(body, check, count, at, flags),
    }
}

/// read() until the buffer is full or EOF; returns bytes read.
pub fn read_full<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
