//! The criuz archive format, versions 1 to 3 (byte-level spec:
//! `docs/FORMAT.md`). Version 2 adds incremental archives: a chain record
//! naming the parent archives, page ids after each block of a page image, and
//! dedup blocks whose pages may be references into this archive or a parent.
//! An archive that uses none of that is written as version 1. Version 3
//! adds blocks stored as 16-bit byte planes (codecs 4 and 5, `FLAG_PLANES`).
//!
//! An archive is a header, a stream of records (file begin, block, file end)
//! and an index followed by a fixed-size trailer. It is written append-only in
//! one pass, so it can go to a pipe; it reads sequentially from a pipe; and a
//! seekable archive gives random access through the index that the trailer
//! points at. Blocks of different files may interleave (CRIU streams several
//! image files at once), so every block names its file.
//!
//! ```text
//! Header   64 bytes                                     header.rs
//! [K]      wrapped key (FLAG_SEALED)                    key.rs
//! [C]      parent archives (FLAG_PARENT)                chain.rs
//! { F      file begin: id, kind, name field             file.rs, name.rs
//!   B      block: header, zero bitmap, seal, payload    block.rs, bits.rs
//!   [P]    ids of the block's pages (FLAG_IDS)          ids.rs
//!   E      file end: size and check                     file.rs
//! }*       records of different files interleave
//! I        index: a file entry per file (and with       index.rs
//!          FLAG_TABLE a copy of every block header)
//! Trailer  32 bytes: where I is                         index.rs
//! ```
//!
//! A dedup block's payload (version 2) is extents, then literal pages under
//! an inner codec (dedup.rs).
//!
//! Integrity: the header, every record header, the index and the trailer carry
//! their own xxh3 check, and every block carries the xxh3 of its uncompressed
//! bytes, so any single corrupted byte is detected. An encrypted archive
//! (`FLAG_SEALED`) adds a K record of its wrapped key after the header and
//! marks its sealed blocks; the sealing itself is `seal`'s. Room is
//! reserved for what comes next (shards); a reader refuses archives that
//! use it rather than misread them.
//!
//! Everything here is pure encoding and decoding: no I/O (a new header's
//! random archive id is the one thing taken from outside).

mod bits;
mod block;
mod chain;
mod dedup;
mod file;
mod header;
mod ids;
mod index;
mod key;
mod name;
mod planes;
#[cfg(test)]
mod tests;

pub use bits::PageBits;
pub use block::{
    block_header_len, BlockCodec, BlockHeader, DecodedBlockHeader, BLOCK_FIXED, BLOCK_HAS_BITMAP, BLOCK_SEALED,
    SEAL_OVERHEAD, TAG_LEN,
};
pub use chain::{chain_body_len, decode_chain_record, encode_chain_record, ChainEntry, CHAIN_FIXED};
pub use dedup::{DecodedDedup, DedupPayload, Extent, Origin};
pub use file::{
    decode_end_record, encode_end_record, encode_file_record_bytes, file_record_name_len, FileEnd, FileKind,
    FileRecord, END_LEN, FILE_FIXED,
};
pub use header::{Header, FLAG_IDS, FLAG_PARENT, FLAG_PLANES, FLAG_SEALED, FLAG_TABLE, FLAG_TREE};
pub use ids::{decode_ids_body, encode_ids_record, IdsFixed, IDS_FIXED};
pub use index::{
    check_index_body, decode_index_body, encode_index_and_trailer, encode_index_body_and_trailer, BlockRef, FileEntry,
    Index, IndexFixed, TableEntry, Trailer, INDEX_FIXED,
};
pub use key::{
    decode_key_record, encode_key_record, key_record_len, KeyRecord, AEAD_AES_256_GCM, KEY_FIXED, MAX_WRAPPED_KEY,
};
pub use name::{
    check_entry_name, encode_name_field, file_name, parent_path, EntryMeta, NameField, MAX_LINK_TARGET, META_LEN,
};
pub use planes::{PlanesPrefix, PLANES_PREFIX};

use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: [u8; 8] = *b"\x89CRIUZ\r\n";
pub const TRAILER_MAGIC: [u8; 8] = *b"CRIUZEND";
/// The newest version this build reads and writes: version 3 adds blocks of
/// 16-bit byte planes ([`FLAG_PLANES`]).
pub const VERSION: u16 = 3;
/// The version of archives with header flags but no byte planes.
pub const VERSION_FLAGS: u16 = 2;
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

/// Bytes of a page id: BLAKE3 of the page, truncated.
pub const PAGE_ID_LEN: usize = 16;
pub type PageId = [u8; PAGE_ID_LEN];

/// The content id of a page (or of a short last page).
pub fn page_id(page: &[u8]) -> PageId {
    let h = blake3::hash(page);
    h.as_bytes()[..PAGE_ID_LEN].try_into().expect("16 bytes")
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

/// Append the 32-bit record check over `out[start..]`.
fn seal(out: &mut Vec<u8>, start: usize) {
    let check = xxh3_64(&out[start..]) as u32;
    out.extend_from_slice(&check.to_le_bytes());
}

/// Checks the 32-bit seal that follows `rec[..len-4]`.
fn check_seal(rec: &[u8], offset: u64, what: &str) -> Result<()> {
    let n = rec.len() - 4;
    if xxh3_64(&rec[..n]) as u32 != u32le(&rec[n..]) {
        return Err(Error::corrupt(offset, format!("{what} checksum mismatch")));
    }
    Ok(())
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

fn u16le(b: &[u8]) -> u16 {
    u16::from_le_bytes(b[..2].try_into().unwrap())
}
fn u32le(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap())
}
fn u64le(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}
