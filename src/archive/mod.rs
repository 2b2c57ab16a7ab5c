//! The archive side. Byte layout lives in `crate::format`; this module adds
//! I/O and checks.
//!
//! Reading: [`open`] is the one way in (`open`: a location and options ->
//! a proven [`Archive`] with its parents). Below it, in the order data
//! flows up: `records` frames records, `check` holds every reading rule,
//! `prove` proves an archive as it is opened (a walk, or its index with the
//! walk behind), `fetch` reads a record against that proof, `resolve`
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
pub mod ids;
pub mod open;
mod prove;
pub mod read;
pub mod records;
mod resolve;
pub(crate) mod slab;
mod stored;
pub mod write;

pub use block::{BlockSource, CheckedBlock, PIN_FACTOR};
pub use open::{open, OpenOptions, ParentSearch, Parents, Proof};
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
        if self.threads == 0 {
            return Err(Error::Usage("thread count must be at least 1".into()));
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
    pub blocks_raw: u64,
    pub blocks_lz4: u64,
    pub blocks_zstd: u64,
    pub blocks_dedup: u64,
    /// Blocks compressed with the hurried codec under backlog.
    pub blocks_hurried: u64,
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
        match h.codec {
            BlockCodec::Raw => self.blocks_raw += 1,
            BlockCodec::Lz4 => self.blocks_lz4 += 1,
            BlockCodec::Zstd => self.blocks_zstd += 1,
            BlockCodec::Dedup => self.blocks_dedup += 1,
        }
    }
}
