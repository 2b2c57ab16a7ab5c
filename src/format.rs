//! The criuz archive format, versions 1 and 2 (byte-level spec:
//! `docs/FORMAT.md`). Version 2 adds incremental archives: a chain record
//! naming the parent archives, page ids after each block of a page image, and
//! dedup blocks whose pages may be references into this archive or a parent.
//! An archive that uses none of that is written as version 1.
//!
//! An archive is a header, a stream of records (file begin, block, file end)
//! and an index followed by a fixed-size trailer. It is written append-only in
//! one pass, so it can go to a pipe; it reads sequentially from a pipe; and a
//! seekable archive gives random access through the index that the trailer
//! points at. Blocks of different files may interleave (CRIU streams several
//! image files at once), so every block names its file.
//!
//! Integrity: the header, every record header, the index and the trailer carry
//! their own xxh3 check, and every block carries the xxh3 of its uncompressed
//! bytes, so any single corrupted byte is detected. An encrypted archive
//! (`FLAG_SEALED`) adds a K record of its wrapped key after the header and
//! marks its sealed blocks; the sealing itself is `seal`'s. Room is
//! reserved for what comes next (shards); a reader refuses archives that
//! use it rather than misread them.

use crate::error::{Error, Result};
use std::io::Read;
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 8] = *b"\x89CRIUZ\r\n";
pub const TRAILER_MAGIC: [u8; 8] = *b"CRIUZEND";
/// The newest version this build reads and writes.
pub const VERSION: u16 = 2;
/// The version of archives that use no version 2 feature (header flags 0).
pub const VERSION_PLAIN: u16 = 1;
pub const HEADER_LEN: usize = 64;
pub const TRAILER_LEN: usize = 32;
pub const PAGE_SIZE: usize = 4096;
pub const MIN_BLOCK: usize = 4 << 10;
pub const MAX_BLOCK: usize = 4 << 20;

const REC_FILE: u8 = b'F';
const REC_BLOCK: u8 = b'B';
const REC_END: u8 = b'E';
const REC_INDEX: u8 = b'I';
const REC_CHAIN: u8 = b'C';
const REC_IDS: u8 = b'P';
const REC_KEY: u8 = b'K';

/// Header flag: the archive has parents (a C record follows the header).
pub const FLAG_PARENT: u16 = 1;
/// Header flag: a P record of page ids follows every block of a page image.
pub const FLAG_IDS: u16 = 2;
/// Header flag: the index carries a copy of every block's header (and its P
/// count), so a reader can open the archive from its index alone.
pub const FLAG_TABLE: u16 = 4;
/// Header flag: the archive is encrypted (a K record follows the header;
/// block payloads, file names and the index body are sealed, see `seal`).
pub const FLAG_SEALED: u16 = 8;
/// Header flag: a whole directory tree (see [`EntryMeta`]): names are
/// relative paths, entries may be directories and symbolic links, and every
/// entry carries its mode and mtime.
pub const FLAG_TREE: u16 = 16;
const KNOWN_FLAGS: u16 = FLAG_PARENT | FLAG_IDS | FLAG_TABLE | FLAG_SEALED | FLAG_TREE;
/// Bytes of a page id: BLAKE3 of the page, truncated.
pub const PAGE_ID_LEN: usize = 16;
pub type PageId = [u8; PAGE_ID_LEN];

/// The content id of a page (or of a short last page).
pub fn page_id(page: &[u8]) -> PageId {
    let h = blake3::hash(page);
    h.as_bytes()[..PAGE_ID_LEN].try_into().expect("16 bytes")
}

/// Block flag: a zero-page bitmap follows the fixed block header.
pub const BLOCK_HAS_BITMAP: u16 = 1;
/// Block flag: the payload is sealed (an encrypted archive's blocks all are).
pub const BLOCK_SEALED: u16 = 2;
const KNOWN_BLOCK_FLAGS: u16 = BLOCK_HAS_BITMAP | BLOCK_SEALED;
/// Bytes a sealed payload adds: the AEAD tag and the data check it carries.
pub const SEAL_OVERHEAD: usize = TAG_LEN + 8;
/// Bytes an AEAD tag adds to a sealed name or index body.
pub const TAG_LEN: usize = 16;

/// How a block's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockCodec {
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
    /// Version 2: pages that are references into this archive or a parent,
    /// and literal pages compressed inside (see [`DedupPayload`]).
    Dedup = 3,
}

impl BlockCodec {
    fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(BlockCodec::Raw),
            1 => Ok(BlockCodec::Lz4),
            2 => Ok(BlockCodec::Zstd),
            3 => Ok(BlockCodec::Dedup),
            _ => Err(Error::corrupt(offset, format!("unknown block codec {v}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockCodec::Raw => "raw",
            BlockCodec::Lz4 => "lz4",
            BlockCodec::Zstd => "zstd",
            BlockCodec::Dedup => "dedup",
        }
    }
}

/// What an entry holds; page images get page-aware blocks. Directories
/// and symbolic links occur only in tree archives ([`FLAG_TREE`]): a
/// directory has no blocks, a link's blocks hold its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    Plain = 0,
    Pages = 1,
    Dir = 2,
    Symlink = 3,
}

impl FileKind {
    /// CRIU names page images `pages-<id>.img`; everything else is metadata.
    /// In a tree, the last component of the path decides.
    pub fn for_name(name: &str) -> Self {
        let base = name.rsplit('/').next().unwrap_or(name);
        if base.starts_with("pages-") && base.ends_with(".img") {
            FileKind::Pages
        } else {
            FileKind::Plain
        }
    }

    /// A regular file (its bytes are data, not a link target or nothing).
    pub fn is_file(self) -> bool {
        matches!(self, FileKind::Plain | FileKind::Pages)
    }

    fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(FileKind::Plain),
            1 => Ok(FileKind::Pages),
            2 => Ok(FileKind::Dir),
            3 => Ok(FileKind::Symlink),
            _ => Err(Error::corrupt(offset, format!("unknown file kind {v}"))),
        }
    }
}

/// Longest symbolic link target a tree carries (Linux's PATH_MAX).
pub const MAX_LINK_TARGET: u64 = 4096;
/// Bytes of [`EntryMeta`] in front of a tree entry's path.
pub const META_LEN: usize = 16;

/// What a tree archive keeps of an entry besides its path and bytes: the
/// permission bits and the modification time. Owners are not kept (an
/// unpack makes the files the caller's, as `tar` does for a non-root user).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EntryMeta {
    /// Permission bits (`mode & 0o7777`); the type is the entry's kind.
    pub mode: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
}

impl EntryMeta {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.mode.to_le_bytes());
        out.extend_from_slice(&self.mtime.to_le_bytes());
        out.extend_from_slice(&self.mtime_nsec.to_le_bytes());
    }

    fn decode(b: &[u8], offset: u64) -> Result<Self> {
        let m = EntryMeta { mode: u32le(b), mtime: u64le(&b[4..]) as i64, mtime_nsec: u32le(&b[12..]) };
        if m.mode & !0o7777 != 0 {
            return Err(Error::corrupt(offset, format!("entry mode {:#o} has bits beyond 0o7777", m.mode)));
        }
        if m.mtime_nsec >= 1_000_000_000 {
            return Err(Error::corrupt(offset + 12, "entry mtime nanoseconds out of range"));
        }
        Ok(m)
    }
}

/// An entry's name field as stored: the path, behind its [`EntryMeta`] in
/// a tree archive (`meta` is `Some` exactly then).
pub fn encode_name_field(name: &str, meta: Option<&EntryMeta>) -> Vec<u8> {
    let mut out = Vec::with_capacity(META_LEN + name.len());
    if let Some(m) = meta {
        m.encode(&mut out);
    }
    out.extend_from_slice(name.as_bytes());
    out
}

/// Splits a name field (opened, if sealed) into path and meta; `tree` says
/// whether the archive is a tree. The path is not yet checked as a name.
pub fn decode_name_field(field: Vec<u8>, tree: bool, offset: u64) -> Result<(String, Option<EntryMeta>)> {
    if !tree {
        return Ok((file_name(field, offset)?, None));
    }
    if field.len() <= META_LEN {
        return Err(Error::corrupt(offset, "tree entry name field is too short"));
    }
    let meta = EntryMeta::decode(&field[..META_LEN], offset)?;
    Ok((file_name(field[META_LEN..].to_vec(), offset + META_LEN as u64)?, Some(meta)))
}

/// Fixed archive header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// [`FLAG_PARENT`], [`FLAG_IDS`].
    pub flags: u16,
    pub block_size: u32,
    pub archive_id: [u8; 16],
    pub parent_id: [u8; 16],
    pub shard_index: u16,
    pub shard_count: u16,
}

impl Header {
    /// Whether its page images may hold dedup blocks (only with `IDS`).
    pub fn may_hold_dedup(&self) -> bool {
        self.flags & FLAG_IDS != 0
    }

    pub fn new(block_size: usize) -> Self {
        Self::with_id(block_size, random_id())
    }

    /// A header with a given archive id (tests and golden archives).
    pub fn with_id(block_size: usize, archive_id: [u8; 16]) -> Self {
        Header {
            flags: 0,
            block_size: block_size as u32,
            archive_id,
            parent_id: [0; 16],
            shard_index: 0,
            shard_count: 1,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        let version = if self.flags == 0 { VERSION_PLAIN } else { VERSION };
        b[8..10].copy_from_slice(&version.to_le_bytes());
        b[10..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        b[16..32].copy_from_slice(&self.archive_id);
        b[32..48].copy_from_slice(&self.parent_id);
        b[48..50].copy_from_slice(&self.shard_index.to_le_bytes());
        b[50..52].copy_from_slice(&self.shard_count.to_le_bytes());
        let check = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&check.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self> {
        if b[0..8] != MAGIC {
            if b[1..6] == MAGIC[1..6] {
                return Err(Error::corrupt(0, "damaged archive magic"));
            }
            return Err(Error::corrupt(0, "not a criuz archive (bad magic)"));
        }
        let version = u16le(&b[8..]);
        if !(VERSION_PLAIN..=VERSION).contains(&version) {
            return Err(Error::Unsupported {
                offset: 8,
                what: format!("archive format version {version} (this criuz reads versions 1 and 2)"),
            });
        }
        if xxh3_64(&b[..56]) != u64le(&b[56..]) {
            return Err(Error::corrupt(56, "header checksum mismatch"));
        }
        let flags = u16le(&b[10..]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(Error::Unsupported { offset: 10, what: format!("header flags {flags:#06x}") });
        }
        if (version == VERSION_PLAIN) != (flags == 0) {
            return Err(Error::corrupt(8, format!("version {version} with header flags {flags:#06x}")));
        }
        let h = Header {
            flags,
            block_size: u32le(&b[12..]),
            archive_id: b[16..32].try_into().unwrap(),
            parent_id: b[32..48].try_into().unwrap(),
            shard_index: u16le(&b[48..]),
            shard_count: u16le(&b[50..]),
        };
        if (h.parent_id != [0; 16]) != (flags & FLAG_PARENT != 0) {
            return Err(Error::corrupt(32, "parent id and parent flag disagree"));
        }
        if h.shard_count != 1 || h.shard_index != 0 {
            return Err(Error::Unsupported { offset: 48, what: "sharded archive".into() });
        }
        if u32le(&b[52..]) != 0 {
            return Err(Error::corrupt(52, "reserved header bytes are not zero"));
        }
        let bs = h.block_size as usize;
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&bs) || bs % PAGE_SIZE != 0 {
            return Err(Error::corrupt(12, format!("impossible block size {bs}")));
        }
        Ok(h)
    }
}

fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut id)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        id[..8].copy_from_slice(&xxh3_64(&t.as_nanos().to_le_bytes()).to_le_bytes());
        id[8..].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    }
    id
}

/// The header of one block record, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub codec: BlockCodec,
    pub file_id: u32,
    pub raw_len: u32,
    pub stored_len: u32,
    /// xxh3-64 of the block's stored pages, uncompressed: the whole block
    /// without its zero pages (which the bitmap, under the seal, rebuilds).
    pub data_check: u64,
    /// Low 32 bits of xxh3-64 of the stored payload: a payload can be damaged
    /// in ways that still decode to the same bytes, and those must be caught too.
    pub payload_check: u32,
    /// One bit per 4 KiB page (LSB first): set = all-zero page, not stored.
    /// Empty for blocks of plain files.
    pub zero_bitmap: Vec<u8>,
    /// The payload is sealed ([`BLOCK_SEALED`]): stored_len counts
    /// [`SEAL_OVERHEAD`] more bytes, and the data check travels inside, so
    /// the header's is 0.
    pub sealed: bool,
}

impl BlockHeader {
    pub fn pages(&self) -> usize {
        (self.raw_len as usize).div_ceil(PAGE_SIZE)
    }

    pub fn is_zero_page(&self, page: usize) -> bool {
        !self.zero_bitmap.is_empty() && self.zero_bitmap[page / 8] & (1 << (page % 8)) != 0
    }

    pub fn zero_pages(&self) -> usize {
        self.zero_bitmap.iter().map(|b| b.count_ones() as usize).sum()
    }

    /// Length of the bytes the payload decompresses to (zero pages left out).
    pub fn stored_raw_len(&self) -> usize {
        let mut len = self.raw_len as usize;
        for p in 0..self.pages() {
            if self.is_zero_page(p) {
                len -= PAGE_SIZE.min(self.raw_len as usize - p * PAGE_SIZE);
            }
        }
        len
    }

    /// The flags field as stored.
    pub fn flags(&self) -> u16 {
        let bitmap = if self.zero_bitmap.is_empty() { 0 } else { BLOCK_HAS_BITMAP };
        bitmap | if self.sealed { BLOCK_SEALED } else { 0 }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.push(REC_BLOCK);
        out.push(self.codec as u8);
        out.extend_from_slice(&self.flags().to_le_bytes());
        out.extend_from_slice(&self.file_id.to_le_bytes());
        out.extend_from_slice(&self.raw_len.to_le_bytes());
        out.extend_from_slice(&self.stored_len.to_le_bytes());
        out.extend_from_slice(&self.data_check.to_le_bytes());
        out.extend_from_slice(&self.payload_check.to_le_bytes());
        out.extend_from_slice(&self.zero_bitmap);
        seal(out, start);
    }
}

/// Append the 32-bit record check over `out[start..]`.
fn seal(out: &mut Vec<u8>, start: usize) {
    let check = xxh3_64(&out[start..]) as u32;
    out.extend_from_slice(&check.to_le_bytes());
}

/// Where one block of a file lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRef {
    /// Offset of the block record in the archive.
    pub offset: u64,
    pub raw_len: u32,
    /// Total bytes of the record: header, bitmap, check and payload.
    pub record_len: u32,
}

/// What the block table (`FLAG_TABLE`) says of one block: its header as its
/// B record holds it, and with `FLAG_IDS` the page count of its P record (0
/// for blocks of plain files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableEntry {
    pub header: BlockHeader,
    pub ids: u32,
}

/// Index entry of one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    pub file_id: u32,
    pub name: String,
    /// Mode and mtime, in a tree archive ([`FLAG_TREE`]) only.
    pub meta: Option<EntryMeta>,
    pub kind: FileKind,
    pub raw_size: u64,
    /// xxh3-64 over the little-endian data checks of the file's blocks, in order.
    pub file_check: u64,
    pub record_offset: u64,
    pub blocks: Vec<BlockRef>,
    /// With `FLAG_TABLE`, one entry per block, else empty.
    pub table: Vec<TableEntry>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index {
    pub files: Vec<FileEntry>,
}

impl Index {
    pub fn find(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// The index body as stored unsealed (an encrypted archive seals it).
    pub fn encode_body(&self, flags: u16) -> Vec<u8> {
        let mut b = Vec::new();
        let table = flags & FLAG_TABLE != 0;
        for f in &self.files {
            b.extend_from_slice(&f.file_id.to_le_bytes());
            b.push(f.kind as u8);
            b.push(0);
            let field = encode_name_field(&f.name, f.meta.as_ref());
            b.extend_from_slice(&(field.len() as u16).to_le_bytes());
            b.extend_from_slice(&field);
            b.extend_from_slice(&f.raw_size.to_le_bytes());
            b.extend_from_slice(&f.file_check.to_le_bytes());
            b.extend_from_slice(&f.record_offset.to_le_bytes());
            b.extend_from_slice(&(f.blocks.len() as u32).to_le_bytes());
            for (i, blk) in f.blocks.iter().enumerate() {
                b.extend_from_slice(&blk.offset.to_le_bytes());
                b.extend_from_slice(&blk.raw_len.to_le_bytes());
                b.extend_from_slice(&blk.record_len.to_le_bytes());
                if table {
                    let t = &f.table[i];
                    t.header.encode(&mut b);
                    if flags & FLAG_IDS != 0 {
                        b.extend_from_slice(&t.ids.to_le_bytes());
                    }
                }
            }
        }
        b
    }

    /// Decodes an unsealed (or opened) index body whose check was checked.
    pub fn decode_body(body: &[u8], count: u32, base: u64, flags: u16) -> Result<Self> {
        let mut c = Cursor { buf: body, pos: 0, base };
        let table = flags & FLAG_TABLE != 0;
        // A block's entry: its reference, and with the table its header
        // (at least the fixed part and seal) and P count.
        let min_entry = 16 + if table { BLOCK_FIXED + 4 + 4 * usize::from(flags & FLAG_IDS != 0) } else { 0 };
        let mut files = Vec::with_capacity(count.min(1 << 16) as usize);
        for _ in 0..count {
            let file_id = c.u32()?;
            let kind = FileKind::from_u8(c.u8()?, c.offset() - 1)?;
            if c.u8()? != 0 {
                return Err(Error::corrupt(c.offset() - 1, "reserved index byte is not zero"));
            }
            let name_len = c.u16()? as usize;
            let name_off = c.offset();
            let (name, meta) = decode_name_field(c.take(name_len)?.to_vec(), flags & FLAG_TREE != 0, name_off)?;
            let raw_size = c.u64()?;
            let file_check = c.u64()?;
            let record_offset = c.u64()?;
            let nblocks = c.u32()? as usize;
            if nblocks > c.remaining() / min_entry {
                return Err(Error::corrupt(c.offset() - 4, "index block count exceeds index size"));
            }
            let mut blocks = Vec::with_capacity(nblocks);
            let mut entries = Vec::with_capacity(if table { nblocks } else { 0 });
            for _ in 0..nblocks {
                blocks.push(BlockRef { offset: c.u64()?, raw_len: c.u32()?, record_len: c.u32()? });
                if table {
                    let at = c.offset();
                    let rest = &c.buf[c.pos..];
                    if rest.len() < BLOCK_FIXED {
                        return Err(Error::corrupt(at, "index entry runs past the end of the index"));
                    }
                    let len = block_header_len(rest, at)? + 4;
                    let (header, _) = decode_block_header(c.take(len)?, at).map_err(|e| match e {
                        Error::Corrupt { what, .. } => Error::corrupt(at, format!("block table: {what}")),
                        e => e,
                    })?;
                    let ids = if flags & FLAG_IDS != 0 { c.u32()? } else { 0 };
                    entries.push(TableEntry { header, ids });
                }
            }
            files.push(FileEntry {
                file_id,
                name,
                meta,
                kind,
                raw_size,
                file_check,
                record_offset,
                blocks,
                table: entries,
            });
        }
        if c.remaining() != 0 {
            return Err(Error::corrupt(c.offset(), "trailing bytes in index"));
        }
        Ok(Index { files })
    }
}

/// A bounds-checked little-endian reader over an in-memory record.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    base: u64,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.remaining() < n {
            return Err(Error::corrupt(self.offset(), "index entry runs past the end of the index"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16le(self.take(2)?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32le(self.take(4)?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64le(self.take(8)?))
    }
}

pub(crate) fn u16le(b: &[u8]) -> u16 {
    u16::from_le_bytes(b[..2].try_into().unwrap())
}
pub(crate) fn u32le(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap())
}
pub(crate) fn u64le(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

/// Checks a name taken from an archive before it is used as a path: one
/// plain file name, or in a tree (`tree`) a relative path of such names
/// joined by `/`. Neither can leave the directory it is unpacked into.
pub fn check_entry_name(name: &str, tree: bool) -> std::result::Result<(), &'static str> {
    let limit = if tree { u16::MAX as usize - META_LEN } else { u16::MAX as usize };
    if name.len() > limit {
        return Err("name too long");
    }
    if !tree && name.contains('/') {
        return Err("name contains '/'");
    }
    for part in name.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err("empty or dot path component");
        }
        if part.contains('\0') {
            return Err("name contains NUL");
        }
    }
    Ok(())
}

/// The directory a tree entry sits in (`None` at the top).
pub fn parent_path(name: &str) -> Option<&str> {
    name.rsplit_once('/').map(|(dir, _)| dir)
}

/// Fixed part of an F record, before the name.
pub const FILE_FIXED: usize = 8;
/// Length of an E record.
pub const END_LEN: usize = 28;
/// Fixed part of an I record, before the body (header and seal).
pub const INDEX_FIXED: usize = 20;

/// Name length of an F record from its fixed part.
pub fn file_record_name_len(fixed: &[u8]) -> usize {
    u16le(&fixed[2..]) as usize
}

/// Decodes a whole F record (fixed part, name field, seal): (file id, name
/// field, kind). The name field is the sealed one in an encrypted archive;
/// [`decode_name_field`] takes it apart.
pub fn decode_file_record_bytes(rec: &[u8], offset: u64) -> Result<(u32, &[u8], FileKind)> {
    let n = rec.len().checked_sub(FILE_FIXED + 4).ok_or_else(|| Error::corrupt(offset, "file record is too short"))?;
    if rec[0] != REC_FILE || file_record_name_len(rec) != n {
        return Err(Error::corrupt(offset, "not a file record"));
    }
    check_seal(rec, offset, "file record")?;
    let kind = FileKind::from_u8(rec[1], offset + 1)?;
    Ok((u32le(&rec[4..]), &rec[FILE_FIXED..FILE_FIXED + n], kind))
}

/// A file name from its bytes, which must be UTF-8.
pub fn file_name(bytes: Vec<u8>, offset: u64) -> Result<String> {
    String::from_utf8(bytes).map_err(|_| Error::corrupt(offset, "file name is not UTF-8"))
}

/// Encodes an F record around a name field ([`encode_name_field`], sealed
/// in an encrypted archive).
pub fn encode_file_record_bytes(file_id: u32, name: &[u8], kind: FileKind, out: &mut Vec<u8>) {
    let start = out.len();
    out.push(REC_FILE);
    out.push(kind as u8);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(&file_id.to_le_bytes());
    out.extend_from_slice(name);
    seal(out, start);
}

/// What an E record (file end) says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileEnd {
    pub file_id: u32,
    pub raw_size: u64,
    pub file_check: u64,
}

pub fn encode_end_record(e: &FileEnd, out: &mut Vec<u8>) {
    let start = out.len();
    out.push(REC_END);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&e.file_id.to_le_bytes());
    out.extend_from_slice(&e.raw_size.to_le_bytes());
    out.extend_from_slice(&e.file_check.to_le_bytes());
    seal(out, start);
}

pub fn decode_end_record(rec: &[u8; END_LEN], offset: u64) -> Result<FileEnd> {
    if rec[0] != REC_END {
        return Err(Error::corrupt(offset, "not a file end record"));
    }
    check_seal(rec, offset, "file end record")?;
    if rec[1..4] != [0, 0, 0] {
        return Err(Error::corrupt(offset + 1, "reserved file end bytes are not zero"));
    }
    Ok(FileEnd { file_id: u32le(&rec[4..]), raw_size: u64le(&rec[8..]), file_check: u64le(&rec[16..]) })
}

/// Encodes the I record and the trailer that ends the archive, for an index
/// record starting at `index_offset`.
pub fn encode_index_and_trailer(index: &Index, index_offset: u64, flags: u16) -> Vec<u8> {
    encode_index_body_and_trailer(index.encode_body(flags), index.files.len() as u32, index_offset)
}

/// Encodes the I record around `body` (as stored: an encrypted archive's is
/// sealed) listing `count` files, and the trailer.
pub fn encode_index_body_and_trailer(body: Vec<u8>, count: u32, index_offset: u64) -> Vec<u8> {
    let mut rec = Vec::with_capacity(body.len() + 64);
    rec.push(REC_INDEX);
    rec.extend_from_slice(&[0, 0, 0]);
    rec.extend_from_slice(&count.to_le_bytes());
    rec.extend_from_slice(&(body.len() as u64).to_le_bytes());
    seal(&mut rec, 0);
    rec.extend_from_slice(&body);
    rec.extend_from_slice(&xxh3_64(&body).to_le_bytes());
    let mut t = [0u8; TRAILER_LEN];
    t[0..8].copy_from_slice(&TRAILER_MAGIC);
    t[8..16].copy_from_slice(&index_offset.to_le_bytes());
    t[16..24].copy_from_slice(&(rec.len() as u64).to_le_bytes());
    let check = xxh3_64(&t[..24]);
    t[24..32].copy_from_slice(&check.to_le_bytes());
    rec.extend_from_slice(&t);
    rec
}

/// Decodes the fixed part of an I record: (file count, body length).
pub fn decode_index_fixed(rec: &[u8; INDEX_FIXED], offset: u64) -> Result<(u32, u64)> {
    if rec[0] != REC_INDEX {
        return Err(Error::corrupt(offset, "not an index record"));
    }
    check_seal(rec, offset, "index header")?;
    if rec[1..4] != [0, 0, 0] {
        return Err(Error::corrupt(offset + 1, "reserved index header bytes are not zero"));
    }
    let body_len = u64le(&rec[8..]);
    if body_len >= 1 << 32 {
        return Err(Error::corrupt(offset + 8, "index length is impossible"));
    }
    Ok((u32le(&rec[4..]), body_len))
}

/// Decodes an index body (of an archive with header flags `flags`) and
/// checks it against its stored check.
pub fn decode_index_body(body: &[u8], check: u64, count: u32, body_offset: u64, flags: u16) -> Result<Index> {
    check_index_body(body, check, body_offset)?;
    Index::decode_body(body, count, body_offset, flags)
}

/// Checks an index body as stored (sealed or not) against its stored check.
pub fn check_index_body(body: &[u8], check: u64, body_offset: u64) -> Result<()> {
    if xxh3_64(body) != check {
        return Err(Error::corrupt(body_offset, "index checksum mismatch"));
    }
    Ok(())
}

/// The type byte that starts each record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordType {
    File,
    Block,
    End,
    Index,
    Chain,
    Ids,
    Key,
}

impl RecordType {
    pub fn from_byte(b: u8, offset: u64) -> Result<Self> {
        match b {
            REC_FILE => Ok(RecordType::File),
            REC_BLOCK => Ok(RecordType::Block),
            REC_END => Ok(RecordType::End),
            REC_INDEX => Ok(RecordType::Index),
            REC_CHAIN => Ok(RecordType::Chain),
            REC_IDS => Ok(RecordType::Ids),
            REC_KEY => Ok(RecordType::Key),
            other => Err(Error::corrupt(offset, format!("unknown record type {other:#04x}"))),
        }
    }
}

/// One entry of the C record: a parent archive this one refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainEntry {
    pub archive_id: [u8; 16],
    /// Where it was, relative to this archive's directory (a hint only: the
    /// id decides).
    pub hint: String,
}

/// Fixed part of a C record.
pub const CHAIN_FIXED: usize = 12;

/// Encodes the C record: fixed part (type, reserved, count, body length),
/// entries (id, u16 hint length, hint), seal over everything.
pub fn encode_chain_record(entries: &[ChainEntry]) -> Vec<u8> {
    let mut body = Vec::new();
    for e in entries {
        body.extend_from_slice(&e.archive_id);
        let hint = &e.hint.as_bytes()[..e.hint.len().min(u16::MAX as usize)];
        body.extend_from_slice(&(hint.len() as u16).to_le_bytes());
        body.extend_from_slice(hint);
    }
    let mut out = vec![REC_CHAIN, 0, 0, 0];
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    seal(&mut out, 0);
    out
}

/// Body length of a C record from its fixed part (checked before reading it).
pub fn chain_body_len(fixed: &[u8], offset: u64) -> Result<usize> {
    let n = u32le(&fixed[8..]) as usize;
    if n > 1 << 20 {
        return Err(Error::corrupt(offset, "chain record is impossibly long"));
    }
    Ok(n)
}

/// Decodes a whole C record (fixed part, body, seal).
pub fn decode_chain_record(rec: &[u8], offset: u64) -> Result<Vec<ChainEntry>> {
    if rec.len() < CHAIN_FIXED + 4 || rec[0] != REC_CHAIN {
        return Err(Error::corrupt(offset, "not a chain record"));
    }
    check_seal(rec, offset, "chain record")?;
    if rec[1..4] != [0, 0, 0] || rec[6..8] != [0, 0] {
        return Err(Error::corrupt(offset + 1, "reserved chain record bytes are not zero"));
    }
    let count = u16le(&rec[4..]) as usize;
    let body = &rec[CHAIN_FIXED..rec.len() - 4];
    let mut c = Cursor { buf: body, pos: 0, base: offset + CHAIN_FIXED as u64 };
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let archive_id: [u8; 16] = c.take(16)?.try_into().expect("16 bytes");
        let n = c.u16()? as usize;
        let at = c.offset();
        let hint =
            String::from_utf8(c.take(n)?.to_vec()).map_err(|_| Error::corrupt(at, "parent hint is not UTF-8"))?;
        out.push(ChainEntry { archive_id, hint });
    }
    if c.remaining() != 0 || out.is_empty() {
        return Err(Error::corrupt(offset, "chain record entries do not fill it"));
    }
    Ok(out)
}

/// Fixed part of a P record (type, reserved, file id, count, seal).
pub const IDS_FIXED: usize = 16;

/// Encodes a P record: the ids of the pages the block before it stores
/// literally (all its stored pages unless it is a dedup block).
pub fn encode_ids_record(file_id: u32, ids: &[PageId], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[REC_IDS, 0, 0, 0]);
    out.extend_from_slice(&file_id.to_le_bytes());
    out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    seal(out, start);
    let body = out.len();
    for id in ids {
        out.extend_from_slice(id);
    }
    let check = xxh3_64(&out[body..]);
    out.extend_from_slice(&check.to_le_bytes());
}

/// Decodes the fixed part of a P record: (file id, id count).
pub fn decode_ids_fixed(rec: &[u8; IDS_FIXED], offset: u64) -> Result<(u32, u32)> {
    if rec[0] != REC_IDS {
        return Err(Error::corrupt(offset, "not a page id record"));
    }
    check_seal(rec, offset, "page id record")?;
    if rec[1..4] != [0, 0, 0] {
        return Err(Error::corrupt(offset + 1, "reserved page id bytes are not zero"));
    }
    let count = u32le(&rec[8..]);
    if count as usize > MAX_BLOCK / PAGE_SIZE {
        return Err(Error::corrupt(offset + 8, "more page ids than a block has pages"));
    }
    Ok((u32le(&rec[4..]), count))
}

/// Decodes the ids and their check that follow a P record's fixed part.
pub fn decode_ids_body(body: &[u8], offset: u64) -> Result<Vec<PageId>> {
    let n = body.len() - 8;
    if xxh3_64(&body[..n]) != u64le(&body[n..]) {
        return Err(Error::corrupt(offset, "page id checksum mismatch"));
    }
    Ok(body[..n].chunks_exact(PAGE_ID_LEN).map(|c| c.try_into().expect("16 bytes")).collect())
}

/// Where the pages of one extent of a dedup block come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The next `count` literal pages of this block's inner payload.
    Literal,
    /// Stored pages `first..first+count` of block `block` of file `file_id`
    /// of archive `source` (0: this archive; k: entry k-1 of the C record).
    Ref { source: u16, file_id: u32, block: u32, first: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub origin: Origin,
    pub count: u32,
}

/// The payload of a dedup block: extents covering the block's stored pages in
/// order, then the literal pages, compressed with an inner codec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DedupPayload {
    pub extents: Vec<Extent>,
    pub inner: BlockCodec,
    /// Bytes of the literal pages, uncompressed.
    pub literal_len: u32,
}

const EXTENT_LEN: usize = 20;
const LITERAL_SOURCE: u16 = u16::MAX;

impl DedupPayload {
    /// Pages the block stores literally (its P record lists their ids).
    pub fn literal_pages(&self) -> u32 {
        self.literal_len / PAGE_SIZE as u32
    }

    /// For each stored page in order: its index among the literal pages, or
    /// `None` for a reference.
    pub fn literal_slots(&self) -> impl Iterator<Item = Option<usize>> + '_ {
        let mut next = 0;
        self.extents.iter().flat_map(|e| std::iter::repeat_n(e.origin, e.count as usize)).map(move |o| {
            (o == Origin::Literal).then(|| {
                next += 1;
                next - 1
            })
        })
    }

    /// Encodes the extents and inner header; the inner payload follows.
    pub fn encode_head(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.extents.len() as u32).to_le_bytes());
        for e in &self.extents {
            let (source, file_id, block, first) = match e.origin {
                Origin::Literal => (LITERAL_SOURCE, 0, 0, 0),
                Origin::Ref { source, file_id, block, first } => (source, file_id, block, first),
            };
            out.extend_from_slice(&source.to_le_bytes());
            out.extend_from_slice(&[0, 0]);
            out.extend_from_slice(&file_id.to_le_bytes());
            out.extend_from_slice(&block.to_le_bytes());
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&e.count.to_le_bytes());
        }
        out.extend_from_slice(&[self.inner as u8, 0, 0, 0]);
        out.extend_from_slice(&self.literal_len.to_le_bytes());
    }

    /// Decodes a dedup payload for a block of `stored_pages` stored pages;
    /// returns it and the inner payload.
    pub fn decode(payload: &[u8], stored_pages: usize, offset: u64) -> Result<(DedupPayload, &[u8])> {
        let bad = |what: &str| Error::corrupt(offset, format!("dedup block: {what}"));
        let mut c = Cursor { buf: payload, pos: 0, base: offset };
        let n = c.u32()? as usize;
        if n > stored_pages || n.saturating_mul(EXTENT_LEN) > c.remaining() {
            return Err(bad("impossible extent count"));
        }
        let mut extents = Vec::with_capacity(n);
        let (mut pages, mut literal) = (0usize, 0usize);
        for _ in 0..n {
            let source = c.u16()?;
            if c.u16()? != 0 {
                return Err(bad("reserved extent bytes are not zero"));
            }
            let (file_id, block, first, count) = (c.u32()?, c.u32()?, c.u32()?, c.u32()?);
            if count == 0 {
                return Err(bad("empty extent"));
            }
            let origin = if source == LITERAL_SOURCE {
                if (file_id, block, first) != (0, 0, 0) {
                    return Err(bad("literal extent with a target"));
                }
                literal += count as usize;
                Origin::Literal
            } else {
                Origin::Ref { source, file_id, block, first }
            };
            pages = pages.saturating_add(count as usize);
            extents.push(Extent { origin, count });
        }
        if pages != stored_pages {
            return Err(bad("extents do not cover the block's stored pages"));
        }
        let inner = BlockCodec::from_u8(c.u8()?, c.offset() - 1)?;
        if inner == BlockCodec::Dedup || c.take(3)? != [0, 0, 0] {
            return Err(bad("bad inner codec"));
        }
        let literal_len = c.u32()?;
        if literal_len as usize != literal * PAGE_SIZE {
            return Err(bad("literal length does not match the literal pages"));
        }
        let rest = &payload[c.pos..];
        if inner == BlockCodec::Raw && rest.len() != literal_len as usize {
            return Err(bad("raw literal pages have the wrong length"));
        }
        Ok((DedupPayload { extents, inner, literal_len }, rest))
    }
}

/// Checks the 32-bit seal that follows `rec[..len-4]`.
fn check_seal(rec: &[u8], offset: u64, what: &str) -> Result<()> {
    let n = rec.len() - 4;
    if xxh3_64(&rec[..n]) as u32 != u32le(&rec[n..]) {
        return Err(Error::corrupt(offset, format!("{what} checksum mismatch")));
    }
    Ok(())
}

/// Checks the trailer and returns (index offset, index record length).
pub fn decode_trailer(t: &[u8; TRAILER_LEN], at: u64) -> Result<(u64, u64)> {
    if t[0..8] != TRAILER_MAGIC {
        return Err(Error::corrupt(at, "bad trailer magic (archive incomplete or damaged)"));
    }
    if xxh3_64(&t[..24]) != u64le(&t[24..]) {
        return Err(Error::corrupt(at + 24, "trailer checksum mismatch"));
    }
    Ok((u64le(&t[8..]), u64le(&t[16..])))
}

/// Parses the header of a block record from its first bytes (at least the
/// header and seal; the payload may follow). Returns the header and the
/// length of header plus seal.
pub fn decode_block_header(rec: &[u8], offset: u64) -> Result<(BlockHeader, usize)> {
    if rec.len() < BLOCK_FIXED + 4 || rec[0] != REC_BLOCK {
        return Err(Error::corrupt(offset, "index points at something that is not a block"));
    }
    let hdr_len = BLOCK_FIXED + block_bitmap_len(rec, offset)?;
    if rec.len() < hdr_len + 4 {
        return Err(Error::corrupt(offset, "block record is shorter than its header"));
    }
    if xxh3_64(&rec[..hdr_len]) as u32 != u32le(&rec[hdr_len..]) {
        return Err(Error::corrupt(offset, "block header checksum mismatch"));
    }
    Ok((parse_block_header(&rec[..hdr_len], offset)?, hdr_len + 4))
}

/// Fixed part of a block header, before the bitmap.
pub const BLOCK_FIXED: usize = 28;

/// Length of a block header without its seal (fixed part and bitmap), from
/// its fixed part, whose lengths are checked first so that a damaged length
/// cannot make a reader allocate gigabytes.
pub fn block_header_len(fixed: &[u8], offset: u64) -> Result<usize> {
    Ok(BLOCK_FIXED + block_bitmap_len(fixed, offset)?)
}

/// Checks a block header's lengths and returns the length of its bitmap.
fn block_bitmap_len(fixed: &[u8], offset: u64) -> Result<usize> {
    let flags = u16le(&fixed[2..]);
    let raw_len = u32le(&fixed[8..]);
    let stored_len = u32le(&fixed[12..]) as usize;
    let room = if flags & BLOCK_SEALED != 0 { SEAL_OVERHEAD } else { 0 };
    if raw_len as usize > MAX_BLOCK || stored_len > raw_len as usize + room {
        return Err(Error::corrupt(offset, "block header has impossible lengths"));
    }
    Ok(if flags & BLOCK_HAS_BITMAP != 0 { (raw_len as usize).div_ceil(PAGE_SIZE).div_ceil(8) } else { 0 })
}

/// Decodes a block header whose seal has been checked.
fn parse_block_header(rec: &[u8], offset: u64) -> Result<BlockHeader> {
    let flags = u16le(&rec[2..]);
    if flags & !KNOWN_BLOCK_FLAGS != 0 {
        return Err(Error::Unsupported { offset: offset + 2, what: format!("block flags {flags:#06x}") });
    }
    let header = BlockHeader {
        codec: BlockCodec::from_u8(rec[1], offset + 1)?,
        file_id: u32le(&rec[4..]),
        raw_len: u32le(&rec[8..]),
        stored_len: u32le(&rec[12..]),
        data_check: u64le(&rec[16..]),
        payload_check: u32le(&rec[24..]),
        zero_bitmap: rec[BLOCK_FIXED..].to_vec(),
        sealed: flags & BLOCK_SEALED != 0,
    };
    if header.sealed && (header.data_check != 0 || (header.stored_len as usize) < SEAL_OVERHEAD) {
        return Err(Error::corrupt(offset, "sealed block with a data check in the clear or no room for its seal"));
    }
    // Only whole pages can be zero pages; every other bit must be clear.
    let whole_pages = header.raw_len as usize / PAGE_SIZE;
    for (i, byte) in header.zero_bitmap.iter().enumerate() {
        let valid =
            if whole_pages >= (i + 1) * 8 { 0xff } else { (1u16 << whole_pages.saturating_sub(i * 8)) as u8 - 1 };
        if byte & !valid != 0 {
            return Err(Error::corrupt(offset + (BLOCK_FIXED + i) as u64, "zero bitmap marks pages the block lacks"));
        }
    }
    Ok(header)
}

/// Fixed part of a K record: type, AEAD, reserved, wrapped key length, key id.
pub const KEY_FIXED: usize = 24;
/// The AEAD of an encrypted archive: AES-256-GCM (the only one so far).
pub const AEAD_AES_256_GCM: u8 = 1;
/// The most a K record's wrapped key may take (an age file, ~200 bytes per
/// recipient).
pub const MAX_WRAPPED_KEY: usize = 1 << 20;

/// What a K record says: the chain key's id and the key wrapped as an age
/// file for the archive's recipients (or passphrase).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub key_id: [u8; 16],
    pub wrapped: Vec<u8>,
}

/// Encodes a K record.
pub fn encode_key_record(k: &KeyRecord) -> Vec<u8> {
    let mut out = vec![REC_KEY, AEAD_AES_256_GCM, 0, 0];
    out.extend_from_slice(&(k.wrapped.len() as u32).to_le_bytes());
    out.extend_from_slice(&k.key_id);
    out.extend_from_slice(&k.wrapped);
    seal(&mut out, 0);
    out
}

/// Length of the wrapped key from a K record's fixed part (checked before
/// reading it).
pub fn key_record_len(fixed: &[u8; KEY_FIXED], offset: u64) -> Result<usize> {
    if fixed[0] != REC_KEY {
        return Err(Error::corrupt(offset, "the key record of an encrypted archive is missing"));
    }
    if fixed[1] != AEAD_AES_256_GCM {
        return Err(Error::Unsupported { offset: offset + 1, what: format!("encryption algorithm {}", fixed[1]) });
    }
    if fixed[2..4] != [0, 0] {
        return Err(Error::corrupt(offset + 2, "reserved key record bytes are not zero"));
    }
    let n = u32le(&fixed[4..]) as usize;
    if n == 0 || n > MAX_WRAPPED_KEY {
        return Err(Error::corrupt(offset + 4, "key record has an impossible length"));
    }
    Ok(n)
}

/// Decodes a whole K record (fixed part, wrapped key, seal).
pub fn decode_key_record(rec: &[u8], offset: u64) -> Result<KeyRecord> {
    let fixed: &[u8; KEY_FIXED] = rec
        .get(..KEY_FIXED)
        .and_then(|f| f.try_into().ok())
        .ok_or_else(|| Error::corrupt(offset, "key record is too short"))?;
    let n = key_record_len(fixed, offset)?;
    if rec.len() != KEY_FIXED + n + 4 {
        return Err(Error::corrupt(offset, "key record is too short"));
    }
    check_seal(rec, offset, "key record")?;
    Ok(KeyRecord { key_id: rec[8..24].try_into().expect("16 bytes"), wrapped: rec[KEY_FIXED..KEY_FIXED + n].to_vec() })
}
