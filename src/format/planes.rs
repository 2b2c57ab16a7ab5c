//! The payload of a byte-planes block (version 3, block codecs 4 and 5): an
//! 8-byte prefix, then the block's low plane and its high plane (the bytes
//! at even and at odd offsets of its stored pages), each stored raw or
//! compressed with the block's codec. The low plane of 16-bit floats is
//! mostly noise and is usually stored raw: only the high plane costs
//! compression work.
//!
//! ```text
//! u32 LE  low_len   bytes of the low plane as stored
//! u8      how       bit 0: low plane compressed, bit 1: high plane compressed
//! 3 x u8  zero
//! ```

use crate::error::DecodeError;

/// Bytes before the planes.
pub const PLANES_PREFIX: usize = 8;
const LOW_COMPRESSED: u8 = 1;
const HIGH_COMPRESSED: u8 = 2;

/// How the two planes of a block are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanesPrefix {
    pub low_len: u32,
    pub low_compressed: bool,
    pub high_compressed: bool,
}

impl PlanesPrefix {
    pub fn encode(&self) -> [u8; PLANES_PREFIX] {
        let mut b = [0u8; PLANES_PREFIX];
        b[..4].copy_from_slice(&self.low_len.to_le_bytes());
        b[4] = (u8::from(self.low_compressed) * LOW_COMPRESSED) | (u8::from(self.high_compressed) * HIGH_COMPRESSED);
        b
    }

    /// Splits a planes payload into its prefix, the stored low plane and
    /// the stored high plane.
    pub fn decode(payload: &[u8]) -> Result<(Self, &[u8], &[u8]), DecodeError> {
        if payload.len() < PLANES_PREFIX {
            return Err(DecodeError::Planes("payload shorter than its prefix"));
        }
        let low_len = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes"));
        let how = payload[4];
        if how & !(LOW_COMPRESSED | HIGH_COMPRESSED) != 0 || payload[5..8] != [0, 0, 0] {
            return Err(DecodeError::Planes("unknown bits in the prefix"));
        }
        let rest = &payload[PLANES_PREFIX..];
        if low_len as usize > rest.len() {
            return Err(DecodeError::Planes("low plane runs past the payload"));
        }
        let (low, high) = rest.split_at(low_len as usize);
        let prefix = PlanesPrefix {
            low_len,
            low_compressed: how & LOW_COMPRESSED != 0,
            high_compressed: how & HIGH_COMPRESSED != 0,
        };
        Ok((prefix, low, high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_round_trips_and_refuses_what_it_does_not_know() {
        let p = PlanesPrefix { low_len: 3, low_compressed: false, high_compressed: true };
        let mut payload = p.encode().to_vec();
        payload.extend_from_slice(b"abcde");
        let (back, low, high) = PlanesPrefix::decode(&payload).unwrap();
        assert_eq!((back, low, high), (p, &b"abc"[..], &b"de"[..]));
        payload[4] |= 4;
        assert!(PlanesPrefix::decode(&payload).is_err());
        payload[4] = 0;
        payload[0] = 9;
        assert!(PlanesPrefix::decode(&payload).is_err());
        assert!(PlanesPrefix::decode(&payload[..7]).is_err());
    }
}
