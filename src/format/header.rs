//! The fixed 64-byte archive header and its flags.

use super::{
    u16le, u32le, u64le, HEADER_LEN, MAGIC, MAX_BLOCK, MIN_BLOCK, PAGE_SIZE, VERSION, VERSION_FLAGS, VERSION_PLAIN,
};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

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
/// Header flag: a whole directory tree (see
/// [`EntryMeta`](super::EntryMeta)): names are relative paths, entries may
/// be directories and symbolic links, and every entry carries its mode and
/// mtime.
pub const FLAG_TREE: u16 = 16;
/// Header flag (version 3): blocks may hold 16-bit byte planes (block
/// codecs 4 and 5). Readers of versions 1 and 2 refuse such an archive by
/// its version rather than misread its blocks.
pub const FLAG_PLANES: u16 = 32;
const KNOWN_FLAGS: u16 = FLAG_PARENT | FLAG_IDS | FLAG_TABLE | FLAG_SEALED | FLAG_TREE | FLAG_PLANES;

/// The version an archive with header flags `flags` is written as: the
/// oldest that knows every flag.
fn version_for(flags: u16) -> u16 {
    match flags {
        0 => VERSION_PLAIN,
        f if f & FLAG_PLANES != 0 => VERSION,
        _ => VERSION_FLAGS,
    }
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

    /// A header for a new archive, with a random archive id.
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
        let version = version_for(self.flags);
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
                what: format!("archive format version {version} (this criuz reads versions 1 to {VERSION})"),
            });
        }
        if xxh3_64(&b[..56]) != u64le(&b[56..]) {
            return Err(Error::corrupt(56, "header checksum mismatch"));
        }
        let flags = u16le(&b[10..]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(Error::Unsupported { offset: 10, what: format!("header flags {flags:#06x}") });
        }
        if version != version_for(flags) {
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

/// A fresh archive id from the system's random generator (`ring`). Should
/// that ever fail, the time and process id still tell archives apart.
fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        id[..8].copy_from_slice(&xxh3_64(&t.as_nanos().to_le_bytes()).to_le_bytes());
        id[8..].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    }
    id
}
