//! Every reading rule of `docs/FORMAT.md` that spans records, in one place.
//!
//! [`CheckedRecords`] is the only way anything reads an archive: it takes
//! records off a [`SeqReader`] and lets one through only once it fits all
//! that came before it. F records must come with ids 0, 1, 2, … and distinct,
//! safe names; a block must belong to a begun, unended file and no larger
//! than the header's block size, and its payload must match its payload
//! check; an E record must match the size and chained check (over the data
//! checks of the file's blocks, in order) computed from the blocks seen; the
//! index must describe exactly the stream it ends. Version 2 adds: the C
//! record (parents) comes first exactly when the header says the archive has
//! parents, and names the header's parent first; with page ids, every block
//! of a page image is followed by the P record of the pages it stores
//! literally (all stored pages of an ordinary block, the literal pages of a
//! dedup block); a dedup block belongs to a page image of an archive with
//! page ids and covers whole pages, and its extents cover its stored pages.
//! A header walk does not read dedup payloads, so there the P count of a
//! dedup block is only bounded, and the block source compares it with the
//! literal pages when it decodes the block. A block's bytes are then
//! proven by its data check when it is decoded (`codec::Decoder`), for a
//! dedup block after its references are resolved (`source`).
//!
//! Of an encrypted archive (`seal`), the rules apply to the blocks as
//! stored (every block sealed, none otherwise); a payload that is read is
//! then opened, which proves it is the block at that place of that file of
//! that archive, and its data check comes from inside the seal.
//!
//! Readers that need random access (restore, later lazy restore, parents,
//! object stores) first walk a seekable archive's record headers through the
//! same checks (`archive::prove`), so a block served by index is one
//! the whole-stream rules have accepted at that position.

use super::records::{Input, Record, SeqReader};
use crate::error::{Error, Result};
use crate::format::{
    check_entry_name, decode_ids_body, parent_path, BlockCodec, BlockHeader, BlockRef, ChainEntry, DedupPayload,
    EntryMeta, FileEnd, FileEntry, FileKind, Header, Index, KeyRecord, PageId, TableEntry, BLOCK_FIXED, FILE_FIXED,
    FLAG_IDS, FLAG_PARENT, FLAG_SEALED, FLAG_TABLE, FLAG_TREE, IDS_FIXED, MAX_LINK_TARGET, META_LEN, PAGE_ID_LEN,
    PAGE_SIZE, SEAL_OVERHEAD, TAG_LEN,
};
use crate::seal::ArchiveKey;
use std::collections::HashMap;
use std::sync::Arc;

/// A record that has passed every check it can be given at its position.
#[derive(Debug)]
pub enum Checked {
    FileBegin {
        file_id: u32,
        name: String,
        kind: FileKind,
        /// Mode and mtime, in a tree archive.
        meta: Option<EntryMeta>,
    },
    /// A block of file `header.file_id` starting at byte `raw_pos` of it.
    /// `payload` is `None` when the caller asked for headers only; of an
    /// encrypted archive, a payload read is opened, and `header` is then the
    /// block as it was before sealing (its data check restored).
    Block {
        header: BlockHeader,
        payload: Option<Vec<u8>>,
        raw_pos: u64,
        record_len: u64,
    },
    FileEnd(FileEnd),
    /// The index, proven to describe the stream that came before it.
    Index(Index),
    /// The parents (version 2), first record of an archive that has them.
    Chain(Vec<ChainEntry>),
    /// Ids of the literal pages of the block before it (version 2); `None`
    /// when the caller did not ask for them.
    Ids {
        file_id: u32,
        count: u32,
        ids: Option<Vec<PageId>>,
    },
}

/// Which payloads a reader wants read (and checked) rather than skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payloads {
    /// Everything (unpack, verify, inspect).
    All,
    /// Record headers only, and page ids (the walk of a seekable archive).
    None,
    /// Page ids and the payloads of dedup blocks (what a child needs of a parent).
    Dedup,
}

/// The cross-record rules as a state machine, fed record by record.
pub struct StreamCheck {
    header: Header,
    files: Vec<SeenFile>,
    /// Kind of every entry so far, by name: names are distinct, and a tree
    /// entry's directory must be an earlier directory entry.
    names: HashMap<String, FileKind>,
    records: u64,
    /// After a block of a page image with ids: what the next record, a P
    /// record, must describe.
    ids_due: Option<IdsDue>,
    /// Whether the block table is rebuilt, to compare with the index's.
    keep_table: bool,
}

/// The P record a page image block calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct IdsDue {
    file_id: u32,
    /// Pages it lists: exactly this many, or (a dedup block whose payload
    /// was not read) at most this many.
    pages: u32,
    exact: bool,
}

struct SeenFile {
    entry: FileEntry,
    check: xxhash_rust::xxh3::Xxh3,
    ended: bool,
}

impl StreamCheck {
    pub fn new(header: &Header) -> Self {
        StreamCheck {
            header: header.clone(),
            files: Vec::new(),
            names: HashMap::new(),
            records: 0,
            ids_due: None,
            keep_table: true,
        }
    }

    /// The check of an index against the records it places
    /// ([`check_table`]), fed the index's own block headers: the table it
    /// would rebuild is then the index's own, header for header, so it is
    /// not rebuilt (that cloned every block header of the archive before a
    /// lazy restore could start CRIU). The caller checks the one thing the
    /// rebuild added: a block with no P record after it lists no page ids.
    fn of_index(header: &Header) -> Self {
        StreamCheck { keep_table: false, ..StreamCheck::new(header) }
    }

    /// Called before every record: the rules of position (C first, P right
    /// after its block).
    fn next_record(&mut self, offset: u64, is_chain: bool, ids: Option<(u32, u32)>) -> Result<()> {
        let first = self.records == 0;
        self.records += 1;
        let wants_chain = first && self.header.flags & FLAG_PARENT != 0;
        if is_chain != wants_chain {
            return Err(Error::corrupt(
                offset,
                if wants_chain { "the parent chain record is missing" } else { "chain record out of place" },
            ));
        }
        let why = match (self.ids_due.take(), ids) {
            (None, None) => return Ok(()),
            (Some(due), Some((file_id, count)))
                if due.file_id == file_id && (count == due.pages || !due.exact && count < due.pages) =>
            {
                return Ok(())
            }
            (Some(_), None) => "the page id record of the block before is missing",
            (None, Some(_)) => "page id record out of place",
            _ => "page id record does not match the block before it",
        };
        Err(Error::corrupt(offset, why))
    }

    pub fn chain(&mut self, offset: u64, entries: &[ChainEntry]) -> Result<()> {
        self.next_record(offset, true, None)?;
        if entries[0].archive_id != self.header.parent_id {
            return Err(Error::corrupt(offset, "the chain record does not start with the header's parent"));
        }
        if entries.iter().any(|e| e.archive_id == self.header.archive_id || e.archive_id == [0; 16]) {
            return Err(Error::corrupt(offset, "the chain record names this archive or a null id"));
        }
        if entries.len() >= u16::MAX as usize {
            return Err(Error::corrupt(offset, "the chain record is too long"));
        }
        Ok(())
    }

    pub fn ids(&mut self, offset: u64, file_id: u32, count: u32) -> Result<()> {
        self.next_record(offset, false, Some((file_id, count)))?;
        if let Some(t) = self.files.get_mut(file_id as usize).and_then(|f| f.entry.table.last_mut()) {
            t.ids = count;
        }
        Ok(())
    }

    pub fn file_begin(
        &mut self,
        offset: u64,
        file_id: u32,
        name: &str,
        kind: FileKind,
        meta: Option<EntryMeta>,
    ) -> Result<()> {
        self.next_record(offset, false, None)?;
        if file_id as usize != self.files.len() {
            return Err(Error::corrupt(offset, format!("file id {file_id} out of sequence")));
        }
        let tree = self.header.flags & FLAG_TREE != 0;
        check_entry_name(name, tree).map_err(|why| Error::corrupt(offset, format!("bad file name {name:?}: {why}")))?;
        if !tree && !kind.is_file() {
            return Err(Error::corrupt(offset, format!("{name}: a directory or link outside a tree archive")));
        }
        // Unpack then creates every path under directories it made itself,
        // never through a link or a name it has not checked.
        if let Some(dir) = parent_path(name) {
            if self.names.get(dir) != Some(&FileKind::Dir) {
                return Err(Error::corrupt(offset, format!("{name}: {dir} is not an earlier directory entry")));
            }
        }
        if self.names.insert(name.to_string(), kind).is_some() {
            return Err(Error::corrupt(offset, format!("the archive holds {name} twice")));
        }
        let entry = FileEntry {
            file_id,
            name: name.to_string(),
            meta,
            kind,
            raw_size: 0,
            file_check: 0,
            record_offset: offset,
            blocks: Vec::new(),
            table: Vec::new(),
        };
        self.files.push(SeenFile { entry, check: Default::default(), ended: false });
        Ok(())
    }

    /// Accepts a block header; returns the position of its first byte in
    /// its file and its index among the file's blocks.
    pub fn block(&mut self, offset: u64, header: &BlockHeader, record_len: u64) -> Result<(u64, u32)> {
        self.next_record(offset, false, None)?;
        if header.raw_len > self.header.block_size {
            return Err(Error::corrupt(offset, "block is larger than the archive's block size"));
        }
        if header.sealed != (self.header.flags & FLAG_SEALED != 0) {
            return Err(Error::corrupt(offset, "a block is sealed exactly when its archive is encrypted"));
        }
        let with_ids = self.header.flags & FLAG_IDS != 0;
        let rebuild_table = self.header.flags & FLAG_TABLE != 0 && self.keep_table;
        let f = self.open_file(header.file_id, offset)?;
        let pages = f.entry.kind == FileKind::Pages;
        match f.entry.kind {
            FileKind::Dir => return Err(Error::corrupt(offset, format!("directory {} has a block", f.entry.name))),
            FileKind::Symlink if f.entry.raw_size + u64::from(header.raw_len) > MAX_LINK_TARGET => {
                return Err(Error::corrupt(offset, format!("link {} has a target over 4096 bytes", f.entry.name)))
            }
            _ => {}
        }
        if header.codec == BlockCodec::Dedup
            && (!pages || !with_ids || header.raw_len as usize % PAGE_SIZE != 0 || header.zero_bitmap.is_empty())
        {
            return Err(Error::corrupt(offset, "dedup block outside a page image with page ids"));
        }
        let raw_pos = f.entry.raw_size;
        f.entry.raw_size += u64::from(header.raw_len);
        f.check.update(&header.data_check.to_le_bytes());
        let record_len =
            u32::try_from(record_len).map_err(|_| Error::corrupt(offset, "block record is impossibly long"))?;
        f.entry.blocks.push(BlockRef { offset, raw_len: header.raw_len, record_len });
        let index = f.entry.blocks.len() as u32 - 1;
        if rebuild_table {
            f.entry.table.push(TableEntry { header: header.clone(), ids: 0 });
        }
        if pages && with_ids {
            let stored = (header.pages() - header.zero_pages()) as u32;
            let exact = header.codec != BlockCodec::Dedup;
            self.ids_due = Some(IdsDue { file_id: header.file_id, pages: stored, exact });
        }
        Ok((raw_pos, index))
    }

    /// The dedup block just accepted stores `n` pages literally (known once
    /// its payload is read): its P record must list exactly those.
    fn literal_pages(&mut self, n: u32) {
        if let Some(due) = &mut self.ids_due {
            due.pages = n;
            due.exact = true;
        }
    }

    pub fn file_end(&mut self, offset: u64, end: &FileEnd) -> Result<()> {
        self.next_record(offset, false, None)?;
        let f = self.open_file(end.file_id, offset)?;
        f.entry.file_check = f.check.digest();
        if f.entry.raw_size != end.raw_size || f.entry.file_check != end.file_check {
            return Err(Error::corrupt(offset, format!("file {} does not match its end record", f.entry.name)));
        }
        if f.entry.kind == FileKind::Symlink && f.entry.raw_size == 0 {
            return Err(Error::corrupt(offset, format!("link {} has an empty target", f.entry.name)));
        }
        f.ended = true;
        Ok(())
    }

    /// The index must list exactly the files and blocks the stream held.
    pub fn index(&mut self, offset: u64, index: &Index) -> Result<()> {
        self.next_record(offset, false, None)?;
        if index.files.len() != self.files.len() {
            return Err(Error::corrupt(offset, "index lists a different number of files than the archive holds"));
        }
        for (e, f) in index.files.iter().zip(&self.files) {
            let same = if self.keep_table { *e == f.entry } else { same_but_table(e, &f.entry) };
            if !f.ended || !same {
                return Err(Error::corrupt(offset, format!("index entry for {} does not match the archive", e.name)));
            }
        }
        Ok(())
    }

    fn open_file(&mut self, file_id: u32, offset: u64) -> Result<&mut SeenFile> {
        match self.files.get_mut(file_id as usize) {
            Some(f) if !f.ended => Ok(f),
            _ => Err(Error::corrupt(offset, format!("record for unknown or ended file {file_id}"))),
        }
    }
}

/// `a == b`, block tables aside.
fn same_but_table(a: &FileEntry, b: &FileEntry) -> bool {
    // Every field named: a new one must be compared here too.
    let FileEntry { file_id, name, meta, kind, raw_size, file_check, record_offset, blocks, table: _ } = a;
    *file_id == b.file_id
        && *name == b.name
        && *meta == b.meta
        && *kind == b.kind
        && *raw_size == b.raw_size
        && *file_check == b.file_check
        && *record_offset == b.record_offset
        && *blocks == b.blocks
}

/// Records of an archive, each let through only after every check that
/// applies at its position; the last is the proven index.
pub struct CheckedRecords<I: Input> {
    reader: SeqReader<I>,
    check: StreamCheck,
    payloads: Payloads,
    /// Opened without the key of an encrypted archive (`new_locked`).
    locked: bool,
}

impl<I: Input> CheckedRecords<I> {
    /// Payloads not asked for are skipped (over a seekable input, not even read).
    pub fn new(inp: I, payloads: Payloads) -> Result<Self> {
        let reader = SeqReader::new(inp)?;
        let check = StreamCheck::new(&reader.header);
        Ok(CheckedRecords { reader, check, payloads, locked: false })
    }

    /// As [`new`](Self::new), but an encrypted archive that no key given
    /// opens is read without it: every rule that needs no key
    /// is applied (structure, seals, sizes, E records), payloads are skipped,
    /// names are `#<file id>` and the index is not compared. What `inspect`
    /// shows of an archive it cannot open; nothing may be restored this way.
    pub fn new_or_locked(inp: I, payloads: Payloads) -> Result<Self> {
        let reader = SeqReader::new_or_locked(inp)?;
        let check = StreamCheck::new(&reader.header);
        let locked = reader.key().is_none() && reader.header.flags & FLAG_SEALED != 0;
        let payloads = if locked { Payloads::None } else { payloads };
        Ok(CheckedRecords { reader, check, payloads, locked })
    }

    /// Whether it reads an encrypted archive without its key.
    pub fn locked(&self) -> bool {
        self.locked
    }

    pub fn header(&self) -> &Header {
        &self.reader.header
    }

    /// The key an encrypted archive was opened with.
    pub fn key(&self) -> Option<&Arc<ArchiveKey>> {
        self.reader.key()
    }

    /// An encrypted archive's K record.
    pub fn key_record(&self) -> Option<&KeyRecord> {
        self.reader.key_record()
    }

    /// Bytes read so far (the archive's length once the index is returned).
    pub fn offset(&self) -> u64 {
        self.reader.offset()
    }

    /// The next record and its offset; `None` after the index.
    pub fn next_record(&mut self) -> Result<Option<(u64, Checked)>> {
        let Some((offset, rec)) = self.reader.next_head()? else { return Ok(None) };
        let checked = match rec {
            Record::FileBegin { file_id, name, kind, meta } => {
                self.check.file_begin(offset, file_id, &name, kind, meta)?;
                Checked::FileBegin { file_id, name, kind, meta }
            }
            Record::Block { mut header, header_len } => {
                let record_len = header_len as u64 + u64::from(header.stored_len);
                let (raw_pos, index) = self.check.block(offset, &header, record_len)?;
                let wanted = match self.payloads {
                    Payloads::All => true,
                    Payloads::None => false,
                    Payloads::Dedup => header.codec == BlockCodec::Dedup,
                };
                let payload = if wanted {
                    let mut p = self.reader.read_payload()?;
                    let key = self.reader.key();
                    if let Some(k) = key {
                        header = k.open_block(&header, index, &mut p).map_err(|e| Error::corrupt(offset, e))?;
                        p.drain(..SEAL_OVERHEAD);
                    }
                    if let Some(n) = check_payload(&header, &p, offset, key.is_some())? {
                        self.check.literal_pages(n);
                    }
                    Some(p)
                } else {
                    self.reader.skip_payload()?;
                    None
                };
                Checked::Block { header, payload, raw_pos, record_len }
            }
            Record::Chain(entries) => {
                self.check.chain(offset, &entries)?;
                Checked::Chain(entries)
            }
            Record::Ids { file_id, count } => {
                self.check.ids(offset, file_id, count)?;
                // Page ids are read and checked even by a header walk: they
                // are small (16 bytes a page), and `verify` of an archive goes
                // through that walk.
                let ids = decode_ids_body(&self.reader.read_payload()?, offset)?;
                let ids = (self.payloads != Payloads::None).then_some(ids);
                Checked::Ids { file_id, count, ids }
            }
            Record::FileEnd(end) => {
                self.check.file_end(offset, &end)?;
                Checked::FileEnd(end)
            }
            Record::Index { index, .. } => {
                if !self.locked {
                    self.check.index(offset, &index)?;
                }
                Checked::Index(index)
            }
        };
        Ok(Some((offset, checked)))
    }
}

/// The payload rule: a compressed payload must match its payload check (a
/// damaged LZ4 or zstd payload can decode to the same bytes); a raw payload
/// is the stored pages themselves and is proven by the data check instead,
/// so it is not hashed twice. For a dedup block, returns its literal pages.
/// An `authenticated` payload (an encrypted archive's, opened: its AEAD tag
/// proved every byte) is not hashed. A sealed payload is opened first.
pub fn check_payload(header: &BlockHeader, payload: &[u8], offset: u64, authenticated: bool) -> Result<Option<u32>> {
    debug_assert!(!header.sealed, "a sealed payload is opened before its rules apply");
    if payload.len() != header.stored_len as usize {
        return Err(Error::corrupt(offset, "block payload length does not match its header"));
    }
    if header.codec != BlockCodec::Raw
        && !authenticated
        && xxhash_rust::xxh3::xxh3_64(payload) as u32 != header.payload_check
    {
        return Err(Error::corrupt(offset, "block payload checksum mismatch"));
    }
    if header.codec == BlockCodec::Dedup {
        let dp = DedupPayload::decode(payload, header.pages() - header.zero_pages(), offset)?.head;
        return Ok(Some(dp.literal_pages()));
    }
    Ok(None)
}

/// The rules for an archive opened from its index alone (`FLAG_TABLE`, see
/// `archive::open` with the proof behind): the index and its block table must pass
/// every stream rule as if the records lay where the index places them, file
/// after file, and the records it places (F, B, and with page ids P) must lie
/// between the header (and C record) and the index without overlapping, so
/// no two entries can name the same bytes. What this cannot see, the records
/// themselves (E records, page ids, anything between), is proven by the full
/// walk that runs behind such an open; each block read is still checked
/// against its table entry, its payload check and its data check.
pub fn check_table(
    header: &Header,
    chain: &[ChainEntry],
    data_start: u64,
    index: &Index,
    index_offset: u64,
) -> Result<()> {
    let sealed_name = if header.flags & FLAG_SEALED != 0 { TAG_LEN } else { 0 };
    let meta_len = if header.flags & FLAG_TREE != 0 { META_LEN } else { 0 };
    let corrupt = |why: &str| Error::corrupt(index_offset, format!("index: {why}"));
    if header.flags & FLAG_TABLE == 0 {
        return Err(corrupt("the archive has no block table"));
    }
    let mut check = StreamCheck::of_index(header);
    if header.flags & FLAG_PARENT != 0 {
        check.chain(data_start, chain)?;
    }
    let with_ids = header.flags & FLAG_IDS != 0;
    // (offset, length) of every record the index places.
    let blocks: usize = index.files.iter().map(|f| f.blocks.len()).sum();
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(index.files.len() + blocks * if with_ids { 2 } else { 1 });
    for f in &index.files {
        check.file_begin(f.record_offset, f.file_id, &f.name, f.kind, f.meta)?;
        spans.push((f.record_offset, (FILE_FIXED + meta_len + f.name.len() + sealed_name + 4) as u64));
        if f.table.len() != f.blocks.len() {
            return Err(corrupt("the block table does not list every block"));
        }
        for (r, t) in f.blocks.iter().zip(&f.table) {
            let header_len = (BLOCK_FIXED + t.header.zero_bitmap.byte_len() + 4) as u64;
            check.block(r.offset, &t.header, header_len + u64::from(t.header.stored_len))?;
            spans.push((r.offset, u64::from(r.record_len)));
            if with_ids && f.kind == FileKind::Pages {
                let at = r.offset + u64::from(r.record_len);
                check.ids(at, f.file_id, t.ids)?;
                spans.push((at, (IDS_FIXED + PAGE_ID_LEN * t.ids as usize + 8) as u64));
            } else if t.ids != 0 {
                return Err(corrupt("a block with no page id record lists page ids"));
            }
        }
        let end = FileEnd { file_id: f.file_id, raw_size: f.raw_size, file_check: f.file_check };
        check.file_end(index_offset, &end)?;
    }
    check.index(index_offset, index)?;
    spans.sort_unstable();
    let mut end = data_start;
    for (at, len) in spans {
        if at < end {
            return Err(corrupt(&format!("two entries place records over the same bytes at offset {at}")));
        }
        end = at.checked_add(len).ok_or_else(|| corrupt("a record lies past any archive's end"))?;
    }
    if end > index_offset {
        return Err(corrupt("a record it places overlaps the index"));
    }
    Ok(())
}
