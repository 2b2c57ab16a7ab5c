//! The K record of an encrypted archive: its chain key, wrapped.

use super::{check_seal, seal, u32le, REC_KEY};
use crate::error::{Error, Result};

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
