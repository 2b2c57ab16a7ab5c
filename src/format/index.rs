//! The I record (the index: an entry per file, and with `FLAG_TABLE` a
//! copy of every block header) and the trailer that points at it.

use super::{
    block_header_len, check_seal, encode_name_field, seal, u32le, u64le, BlockHeader, Cursor, EntryMeta, FileKind,
    NameField, BLOCK_FIXED, FLAG_IDS, FLAG_TABLE, FLAG_TREE, REC_INDEX, TRAILER_LEN, TRAILER_MAGIC,
};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

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

impl FileEntry {
    /// Whether this is one of CRIU's images: a file at the top of the
    /// archive (a tree archive, runc's checkpoint, keeps its own files
    /// beside them, and nothing CRIU reads below).
    pub fn is_criu_image(&self) -> bool {
        !self.name.contains('/')
    }
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
            let NameField { name, meta } =
                NameField::decode(c.take(name_len)?.to_vec(), flags & FLAG_TREE != 0, name_off)?;
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
                    let header = BlockHeader::decode(c.take(len)?, at)
                        .map_err(|e| match e {
                            Error::Corrupt { why, .. } => Error::corrupt(at, format!("block table: {why}")),
                            e => e,
                        })?
                        .header;
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

/// Fixed part of an I record, before the body (header and seal).
pub const INDEX_FIXED: usize = 20;

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
    let trailer = Trailer { index_offset, index_len: rec.len() as u64 };
    rec.extend_from_slice(&trailer.encode());
    rec
}

/// What the fixed part of an I record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexFixed {
    /// Files the index lists.
    pub count: u32,
    /// Bytes of the body as stored (sealed, in an encrypted archive).
    pub body_len: u64,
}

impl IndexFixed {
    /// Decodes the fixed part of an I record.
    pub fn decode(rec: &[u8; INDEX_FIXED], offset: u64) -> Result<Self> {
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
        Ok(IndexFixed { count: u32le(&rec[4..]), body_len })
    }
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

/// What the trailer says: where the I record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trailer {
    /// Offset of the I record.
    pub index_offset: u64,
    /// Bytes of the I record: fixed part, body and body check.
    pub index_len: u64,
}

impl Trailer {
    pub fn encode(&self) -> [u8; TRAILER_LEN] {
        let mut t = [0u8; TRAILER_LEN];
        t[0..8].copy_from_slice(&TRAILER_MAGIC);
        t[8..16].copy_from_slice(&self.index_offset.to_le_bytes());
        t[16..24].copy_from_slice(&self.index_len.to_le_bytes());
        let check = xxh3_64(&t[..24]);
        t[24..32].copy_from_slice(&check.to_le_bytes());
        t
    }

    /// Checks a trailer (which starts at offset `at`) and decodes it.
    pub fn decode(t: &[u8; TRAILER_LEN], at: u64) -> Result<Self> {
        if t[0..8] != TRAILER_MAGIC {
            return Err(Error::corrupt(at, "bad trailer magic (archive incomplete or damaged)"));
        }
        if xxh3_64(&t[..24]) != u64le(&t[24..]) {
            return Err(Error::corrupt(at + 24, "trailer checksum mismatch"));
        }
        Ok(Trailer { index_offset: u64le(&t[8..]), index_len: u64le(&t[16..]) })
    }
}
