//! The C record: the parent archives an incremental archive refers to.

use super::{check_seal, seal, u16le, u32le, Cursor, REC_CHAIN};
use crate::error::{Error, Result};

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
