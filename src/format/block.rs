//! B records: a block's header (codec, lengths, checks, zero-page bitmap)
//! and its seal. The payload that follows is `codec`'s, or `dedup`'s.

use super::{seal, u16le, u32le, u64le, PageBits, MAX_BLOCK, PAGE_SIZE, REC_BLOCK};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

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
    /// and literal pages compressed inside (see
    /// [`DedupPayload`](super::DedupPayload)).
    Dedup = 3,
    /// Version 3: LZ4 of the block's 16-bit byte planes (see `planes`).
    #[serde(rename = "lz4-planes")]
    Lz4Planes = 4,
    /// Version 3: zstd of the block's 16-bit byte planes.
    #[serde(rename = "zstd-planes")]
    ZstdPlanes = 5,
}

impl BlockCodec {
    pub(super) fn from_u8(v: u8, offset: u64) -> Result<Self> {
        match v {
            0 => Ok(BlockCodec::Raw),
            1 => Ok(BlockCodec::Lz4),
            2 => Ok(BlockCodec::Zstd),
            3 => Ok(BlockCodec::Dedup),
            4 => Ok(BlockCodec::Lz4Planes),
            5 => Ok(BlockCodec::ZstdPlanes),
            _ => Err(Error::corrupt(offset, format!("unknown block codec {v}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockCodec::Raw => "raw",
            BlockCodec::Lz4 => "lz4",
            BlockCodec::Zstd => "zstd",
            BlockCodec::Dedup => "dedup",
            BlockCodec::Lz4Planes => "lz4-planes",
            BlockCodec::ZstdPlanes => "zstd-planes",
        }
    }

    /// The codec that compresses the planes of a planes codec.
    pub fn without_planes(self) -> BlockCodec {
        match self {
            BlockCodec::Lz4Planes => BlockCodec::Lz4,
            BlockCodec::ZstdPlanes => BlockCodec::Zstd,
            other => other,
        }
    }

    /// Whether the payload holds byte planes.
    pub fn is_planes(self) -> bool {
        matches!(self, BlockCodec::Lz4Planes | BlockCodec::ZstdPlanes)
    }
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
    pub zero_bitmap: PageBits,
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
        self.zero_bitmap.contains(page)
    }

    pub fn zero_pages(&self) -> usize {
        self.zero_bitmap.count()
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

    /// Parses the header of a block record from its first bytes (at least
    /// the header and seal; the payload may follow).
    pub fn decode(rec: &[u8], offset: u64) -> Result<DecodedBlockHeader> {
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
        Ok(DecodedBlockHeader { header: parse_block_header(&rec[..hdr_len], offset)?, len: hdr_len + 4 })
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
        out.extend_from_slice(self.zero_bitmap.as_bytes());
        seal(out, start);
    }
}

/// A block header as [`BlockHeader::decode`] finds it at the start of a
/// record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedBlockHeader {
    pub header: BlockHeader,
    /// Bytes of the header and its seal: where the payload starts.
    pub len: usize,
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
        zero_bitmap: PageBits::from_slice(&rec[BLOCK_FIXED..]),
        sealed: flags & BLOCK_SEALED != 0,
    };
    if header.sealed && (header.data_check != 0 || (header.stored_len as usize) < SEAL_OVERHEAD) {
        return Err(Error::corrupt(offset, "sealed block with a data check in the clear or no room for its seal"));
    }
    // Only whole pages can be zero pages; every other bit must be clear.
    let whole_pages = header.raw_len as usize / PAGE_SIZE;
    for (i, byte) in header.zero_bitmap.as_bytes().iter().enumerate() {
        let valid =
            if whole_pages >= (i + 1) * 8 { 0xff } else { (1u16 << whole_pages.saturating_sub(i * 8)) as u8 - 1 };
        if byte & !valid != 0 {
            return Err(Error::corrupt(offset + (BLOCK_FIXED + i) as u64, "zero bitmap marks pages the block lacks"));
        }
    }
    Ok(header)
}
