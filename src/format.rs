//! The criuz archive format, version 1 (byte-level spec: `docs/FORMAT.md`).
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
//! bytes, so any single corrupted byte is detected. Room is reserved for what
//! comes next (block references for dedup, encryption, shards, a parent
//! archive); a v1 reader refuses archives that use it rather than misread them.

use crate::error::{Error, Result};
use std::io::Read;
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 8] = *b"\x89CRIUZ\r\n";
pub const TRAILER_MAGIC: [u8; 8] = *b"CRIUZEND";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 64;
pub const TRAILER_LEN: usize = 32;
pub const PAGE_SIZE: usize = 4096;
pub const MIN_BLOCK: usize = 4 << 10;
pub const MAX_BLOCK: usize = 4 << 20;

const REC_FILE: u8 = b'F';
const REC_BLOCK: u8 = b'B';
const REC_END: u8 = b'E';
const REC_INDEX: u8 = b'I';

/// Block flag: a zero-page bitmap follows the fixed block header.
pub const BLOCK_HAS_BITMAP: u16 = 1;
const KNOWN_BLOCK_FLAGS: u16 = BLOCK_HAS_BITMAP;

/// How a block's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockCodec {
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
    // 3 is reserved for a reference to a block stored elsewhere (dedup).
}

impl BlockCodec {
    fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(BlockCodec::Raw),
            1 => Ok(BlockCodec::Lz4),
            2 => Ok(BlockCodec::Zstd),
            3 => Err(Error::Unsupported { offset, what: "block reference (dedup) codec".into() }),
            _ => Err(Error::corrupt(offset, format!("unknown block codec {v}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockCodec::Raw => "raw",
            BlockCodec::Lz4 => "lz4",
            BlockCodec::Zstd => "zstd",
        }
    }
}

/// What a file holds; page images get page-aware blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    Plain = 0,
    Pages = 1,
}

impl FileKind {
    /// CRIU names page images `pages-<id>.img`; everything else is metadata.
    pub fn for_name(name: &str) -> Self {
        if name.starts_with("pages-") && name.ends_with(".img") {
            FileKind::Pages
        } else {
            FileKind::Plain
        }
    }

    fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(FileKind::Plain),
            1 => Ok(FileKind::Pages),
            _ => Err(Error::corrupt(offset, format!("unknown file kind {v}"))),
        }
    }
}

/// Fixed archive header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub block_size: u32,
    pub archive_id: [u8; 16],
    pub parent_id: [u8; 16],
    pub shard_index: u16,
    pub shard_count: u16,
}

impl Header {
    pub fn new(block_size: usize) -> Self {
        Self::with_id(block_size, random_id())
    }

    /// A header with a given archive id (tests and golden archives).
    pub fn with_id(block_size: usize, archive_id: [u8; 16]) -> Self {
        Header { block_size: block_size as u32, archive_id, parent_id: [0; 16], shard_index: 0, shard_count: 1 }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        // 10..12: flags, all reserved in v1 (encryption, parent).
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
        if version != VERSION {
            return Err(Error::Unsupported {
                offset: 8,
                what: format!("archive format version {version} (this criuz reads version {VERSION})"),
            });
        }
        if xxh3_64(&b[..56]) != u64le(&b[56..]) {
            return Err(Error::corrupt(56, "header checksum mismatch"));
        }
        let flags = u16le(&b[10..]);
        if flags != 0 {
            return Err(Error::Unsupported { offset: 10, what: format!("header flags {flags:#06x}") });
        }
        let h = Header {
            block_size: u32le(&b[12..]),
            archive_id: b[16..32].try_into().unwrap(),
            parent_id: b[32..48].try_into().unwrap(),
            shard_index: u16le(&b[48..]),
            shard_count: u16le(&b[50..]),
        };
        if h.parent_id != [0; 16] {
            return Err(Error::Unsupported { offset: 32, what: "parent archive (incremental)".into() });
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

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.push(REC_BLOCK);
        out.push(self.codec as u8);
        let flags = if self.zero_bitmap.is_empty() { 0 } else { BLOCK_HAS_BITMAP };
        out.extend_from_slice(&flags.to_le_bytes());
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

/// Index entry of one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    pub file_id: u32,
    pub name: String,
    pub kind: FileKind,
    pub raw_size: u64,
    /// xxh3-64 over the little-endian data checks of the file's blocks, in order.
    pub file_check: u64,
    pub record_offset: u64,
    pub blocks: Vec<BlockRef>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index {
    pub files: Vec<FileEntry>,
}

impl Index {
    pub fn find(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    fn encode_body(&self) -> Vec<u8> {
        let mut b = Vec::new();
        for f in &self.files {
            b.extend_from_slice(&f.file_id.to_le_bytes());
            b.push(f.kind as u8);
            b.push(0);
            b.extend_from_slice(&(f.name.len() as u16).to_le_bytes());
            b.extend_from_slice(f.name.as_bytes());
            b.extend_from_slice(&f.raw_size.to_le_bytes());
            b.extend_from_slice(&f.file_check.to_le_bytes());
            b.extend_from_slice(&f.record_offset.to_le_bytes());
            b.extend_from_slice(&(f.blocks.len() as u32).to_le_bytes());
            for blk in &f.blocks {
                b.extend_from_slice(&blk.offset.to_le_bytes());
                b.extend_from_slice(&blk.raw_len.to_le_bytes());
                b.extend_from_slice(&blk.record_len.to_le_bytes());
            }
        }
        b
    }

    fn decode_body(body: &[u8], count: u32, base: u64) -> Result<Self> {
        let mut c = Cursor { buf: body, pos: 0, base };
        let mut files = Vec::with_capacity(count.min(1 << 16) as usize);
        for _ in 0..count {
            let file_id = c.u32()?;
            let kind = FileKind::from_u8(c.u8()?, c.offset() - 1)?;
            if c.u8()? != 0 {
                return Err(Error::corrupt(c.offset() - 1, "reserved index byte is not zero"));
            }
            let name_len = c.u16()? as usize;
            let name_off = c.offset();
            let name = String::from_utf8(c.take(name_len)?.to_vec())
                .map_err(|_| Error::corrupt(name_off, "file name is not UTF-8"))?;
            let raw_size = c.u64()?;
            let file_check = c.u64()?;
            let record_offset = c.u64()?;
            let nblocks = c.u32()? as usize;
            if nblocks > c.remaining() / 16 {
                return Err(Error::corrupt(c.offset() - 4, "index block count exceeds index size"));
            }
            let mut blocks = Vec::with_capacity(nblocks);
            for _ in 0..nblocks {
                blocks.push(BlockRef { offset: c.u64()?, raw_len: c.u32()?, record_len: c.u32()? });
            }
            files.push(FileEntry { file_id, name, kind, raw_size, file_check, record_offset, blocks });
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

/// Checks a file name taken from an archive before it is used as a path.
pub fn check_entry_name(name: &str) -> std::result::Result<(), &'static str> {
    if name.is_empty() || name == "." || name == ".." {
        Err("empty or dot name")
    } else if name.contains('/') || name.contains('\0') {
        Err("name contains '/' or NUL")
    } else if name.len() > u16::MAX as usize {
        Err("name too long")
    } else {
        Ok(())
    }
}

/// Encodes an F record (file begin).
pub fn encode_file_record(file_id: u32, name: &str, kind: FileKind, out: &mut Vec<u8>) {
    let start = out.len();
    out.push(REC_FILE);
    out.push(kind as u8);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(&file_id.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    seal(out, start);
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

/// Decodes a whole F record (fixed part, name, seal): (file id, name, kind).
pub fn decode_file_record(rec: &[u8], offset: u64) -> Result<(u32, String, FileKind)> {
    let n = rec.len().checked_sub(FILE_FIXED + 4).ok_or_else(|| Error::corrupt(offset, "file record is too short"))?;
    if rec[0] != REC_FILE || file_record_name_len(rec) != n {
        return Err(Error::corrupt(offset, "not a file record"));
    }
    check_seal(rec, offset, "file record")?;
    let kind = FileKind::from_u8(rec[1], offset + 1)?;
    let name = String::from_utf8(rec[FILE_FIXED..FILE_FIXED + n].to_vec())
        .map_err(|_| Error::corrupt(offset + 8, "file name is not UTF-8"))?;
    Ok((u32le(&rec[4..]), name, kind))
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
pub fn encode_index_and_trailer(index: &Index, index_offset: u64) -> Vec<u8> {
    let body = index.encode_body();
    let mut rec = Vec::with_capacity(body.len() + 64);
    rec.push(REC_INDEX);
    rec.extend_from_slice(&[0, 0, 0]);
    rec.extend_from_slice(&(index.files.len() as u32).to_le_bytes());
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

/// Decodes an index body and checks it against its stored check.
pub fn decode_index_body(body: &[u8], check: u64, count: u32, body_offset: u64) -> Result<Index> {
    if xxh3_64(body) != check {
        return Err(Error::corrupt(body_offset, "index checksum mismatch"));
    }
    Index::decode_body(body, count, body_offset)
}

/// The type byte that starts each record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordType {
    File,
    Block,
    End,
    Index,
}

impl RecordType {
    pub fn from_byte(b: u8, offset: u64) -> Result<Self> {
        match b {
            REC_FILE => Ok(RecordType::File),
            REC_BLOCK => Ok(RecordType::Block),
            REC_END => Ok(RecordType::End),
            REC_INDEX => Ok(RecordType::Index),
            other => Err(Error::corrupt(offset, format!("unknown record type {other:#04x}"))),
        }
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
    let stored_len = u32le(&fixed[12..]);
    if raw_len as usize > MAX_BLOCK || stored_len > raw_len {
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
    };
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
