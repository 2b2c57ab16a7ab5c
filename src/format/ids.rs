//! P records: the ids of the pages the block before them stores literally.

use super::{check_seal, seal, u32le, u64le, PageId, MAX_BLOCK, PAGE_ID_LEN, PAGE_SIZE, REC_IDS};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

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

/// What the fixed part of a P record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdsFixed {
    pub file_id: u32,
    /// Page ids that follow.
    pub count: u32,
}

impl IdsFixed {
    /// Decodes the fixed part of a P record.
    pub fn decode(rec: &[u8; IDS_FIXED], offset: u64) -> Result<Self> {
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
        Ok(IdsFixed { file_id: u32le(&rec[4..]), count })
    }
}

/// Decodes the ids and their check that follow a P record's fixed part.
pub fn decode_ids_body(body: &[u8], offset: u64) -> Result<Vec<PageId>> {
    let n = body.len() - 8;
    if xxh3_64(&body[..n]) != u64le(&body[n..]) {
        return Err(Error::corrupt(offset, "page id checksum mismatch"));
    }
    Ok(body[..n].chunks_exact(PAGE_ID_LEN).map(|c| c.try_into().expect("16 bytes")).collect())
}
