//! The archive side. Byte layout lives in `crate::format`; this module adds
//! I/O and checks.
//!
//! Reading: [`open`](fn@open) is the one way in (`open`: a location and options ->
//! a proven [`Archive`] with its parents). Below it, in the order data
//! flows up: `records` frames records, `check` holds every reading rule,
//! `prove` proves an archive as it is opened (a walk, or its index with the
//! walk behind; `walk_ahead` parses the walk's records ahead on other
//! cores), `fetch` reads a record against that proof, `resolve`
//! pieces dedup blocks together, `block` is the [`BlockSource`] seam every
//! reader reads through, `stored` is the opened archive. `read` decodes
//! whole archives (unpack, verify); `ids` gives a chain's page ids.
//!
//! Writing: `write` (its block buffers in `slab`), `dedup` the write side of
//! incremental archives.

pub mod block;
pub mod check;
pub mod dedup;
mod fetch;
mod held;
pub mod ids;
pub mod open;
mod prove;
pub mod read;
pub mod records;
mod resolve;
pub(crate) mod slab;
mod stored;
mod walk_ahead;
pub mod write;

pub use block::{BlockSource, CheckedBlock, PIN_FACTOR};
pub(crate) use fetch::page_aligned;
pub(crate) use held::most_held;
pub use open::{ancestor_at, open, OpenOptions, ParentSearch, Parents, Proof};
pub use read::{read_sequential, read_source, EntryStart, SeqSink};
pub use stored::Archive;
pub use write::{FileSink, Packer};

use crate::codec::CodecConfig;
use crate::engine;
use crate::error::{Error, Result};
use crate::format::{BlockCodec, BlockHeader, MAX_BLOCK, MIN_BLOCK, PAGE_SIZE};

pub const DEFAULT_BLOCK_SIZE: usize = 256 << 10;

/// Settings shared by everything that writes or reads archives.
#[derive(Clone, Debug)]
pub struct Options {
    pub codec: CodecConfig,
    pub block_size: usize,
    pub threads: usize,
    /// Bytes of block data allowed in flight in the engine.
    pub memory_budget: usize,
    /// Store page ids (format version 2), so the archive can be a parent and
    /// dedups within itself.
    pub ids: bool,
    /// Absorb first (a dump): compress only when the budget is nearly spent,
    /// then with the hurried codec, until [`Packer::capture_done`]; CRIU,
    /// writing a frozen process, keeps the cores meanwhile.
    pub absorb_first: bool,
    /// Encrypt the archive, its key wrapped for these recipients (see
    /// `seal`); a child of an encrypted parent must be, with its parent's key.
    pub seal: Option<std::sync::Arc<crate::seal::keyring::Recipients>>,
    /// Write a tree archive (`FLAG_TREE`): entries are paths with their
    /// mode and mtime, and may be directories and links (`pack`).
    pub tree: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            codec: CodecConfig::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            threads: engine::default_threads(),
            memory_budget: engine::DEFAULT_MEMORY_BUDGET,
            ids: false,
            absorb_first: false,
            seal: None,
            tree: false,
        }
    }
}

impl Options {
    pub fn validate(&self) -> Result<()> {
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&self.block_size) || self.block_size % PAGE_SIZE != 0 {
            return Err(Error::Usage(format!(
                "block size must be a multiple of 4K between 4K and 4M, got {}",
                self.block_size
            )));
        }
        if !(1..=engine::MAX_THREADS).contains(&self.threads) {
            return Err(Error::Usage(format!(
                "thread count must be between 1 and {}, got {}",
                engine::MAX_THREADS,
                self.threads
            )));
        }
        Ok(())
    }

    pub(crate) fn window(&self) -> usize {
        engine::window_for(self.memory_budget, self.block_size, self.threads)
    }
}

/// What went into an archive.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PackStats {
    pub files: u64,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub zero_pages: u64,
    pub blocks: u64,
    /// Blocks by codec (`blocks_raw`, `blocks_lz4`, ... in JSON).
    #[serde(flatten)]
    pub codecs: CodecCounts,
    /// Blocks compressed with the hurried codec under backlog that the
    /// codec asked for may store smaller (see
    /// [`Encoder::take_worth_redoing`](crate::codec::Encoder::take_worth_redoing)),
    /// and where they lie, for a rewrite that redoes only them (their count
    /// in JSON).
    #[serde(rename = "blocks_hurried")]
    pub hurried: HurriedBlocks,
    /// Blocks stored as an earlier writer encoded them (a rewrite's).
    pub blocks_copied: u64,
    /// Blocks of CRIU's pages held by reference until compressed, not
    /// copied in (see `held`).
    pub blocks_held: u64,
}

/// Where an archive's hurried blocks lie: (file id, the block's number in
/// its file), as the archive's index lists them.
#[derive(Clone, Default)]
pub struct HurriedBlocks(std::collections::HashSet<(u32, u32)>);

impl HurriedBlocks {
    fn insert(&mut self, file_id: u32, block: u32) {
        self.0.insert((file_id, block));
    }

    pub fn contains(&self, file_id: u32, block: usize) -> bool {
        u32::try_from(block).is_ok_and(|b| self.0.contains(&(file_id, b)))
    }

    pub fn len(&self) -> u64 {
        self.0.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl serde::Serialize for HurriedBlocks {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u64(self.len())
    }
}

impl std::fmt::Debug for HurriedBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} blocks", self.0.len())
    }
}

impl PackStats {
    /// Archive bytes per raw byte.
    pub fn ratio(&self) -> f64 {
        self.archive_bytes as f64 / self.raw_bytes.max(1) as f64
    }

    fn add_block(&mut self, h: &BlockHeader) {
        self.blocks += 1;
        self.raw_bytes += u64::from(h.raw_len);
        self.zero_pages += h.zero_pages() as u64;
        self.codecs.add(h.codec);
    }
}

/// Blocks counted by how they are stored: of an archive being written
/// ([`PackStats`]), of each file `inspect` reports and of their total.
/// Serialised flat as `blocks_raw`, `blocks_lz4`, `blocks_zstd` and
/// `blocks_dedup` (with `#[serde(flatten)]` where it is a field).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CodecCounts {
    #[serde(rename = "blocks_raw")]
    pub raw: u64,
    #[serde(rename = "blocks_lz4")]
    pub lz4: u64,
    #[serde(rename = "blocks_zstd")]
    pub zstd: u64,
    #[serde(rename = "blocks_dedup")]
    pub dedup: u64,
    /// Blocks stored as 16-bit byte planes (also counted under their codec).
    #[serde(rename = "blocks_planes")]
    pub planes: u64,
}

impl CodecCounts {
    /// Counts one block stored with `codec`.
    pub fn add(&mut self, codec: BlockCodec) {
        match codec {
            BlockCodec::Raw => self.raw += 1,
            BlockCodec::Lz4 => self.lz4 += 1,
            BlockCodec::Zstd => self.zstd += 1,
            BlockCodec::Dedup => self.dedup += 1,
            BlockCodec::Lz4Planes => self.lz4 += 1,
            BlockCodec::ZstdPlanes => self.zstd += 1,
        }
        self.planes += u64::from(codec.is_planes());
    }
}

impl std::ops::AddAssign for CodecCounts {
    fn add_assign(&mut self, other: CodecCounts) {
        self.raw += other.raw;
        self.lz4 += other.lz4;
        self.zstd += other.zstd;
        self.dedup += other.dedup;
        self.planes += other.planes;
    }
}

/// `len` bytes no codec compresses (xorshift), the same every time.
#[cfg(test)]
pub(crate) fn noise(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_counts_keep_their_json_names() {
        let mut stats = PackStats::default();
        stats.codecs.add(BlockCodec::Lz4);
        stats.codecs += CodecCounts { raw: 2, lz4: 1, zstd: 3, dedup: 4, planes: 5 };
        assert_eq!(
            serde_json::to_string(&stats).unwrap(),
            r#"{"files":0,"raw_bytes":0,"archive_bytes":0,"zero_pages":0,"blocks":0,"blocks_raw":2,"blocks_lz4":2,"#
                .to_string()
                + r#""blocks_zstd":3,"blocks_dedup":4,"blocks_planes":5,"blocks_hurried":0,"blocks_copied":0,"#
                + r#""blocks_held":0}"#
        );
    }
}
