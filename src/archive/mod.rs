//! The archive side: record framing (`records`), every reading rule
//! (`check`), the block source every reader goes through (`source`), the
//! writer (`write`, its block buffers in `slab`) and whole-archive decoding for unpack and verify (`read`).
//! Byte layout lives in `crate::format`; this module adds I/O and checks.

pub mod check;
pub mod dedup;
pub mod parent;
pub mod read;
pub mod records;
pub(crate) mod slab;
pub mod source;
pub mod write;

pub use read::{read_sequential, read_source, EntryStart, SeqSink};
pub use source::{Archive, BlockSource, CheckedBlock};
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
