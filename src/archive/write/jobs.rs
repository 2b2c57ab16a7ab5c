//! What flows through the writer's pool: a file's start, its blocks (copied
//! or still held in CRIU's pipe, or already encoded) and its end, in
//! submission order; what a worker makes of each job ([`encode_job`]:
//! zero pages out, dedup, codec, seal) and how the writer thread writes the
//! results, in order, into the archive ([`write_results`]).

use crate::archive::dedup::{dedup_block, DedupIndex};
use crate::archive::held::HeldPipe;
use crate::archive::records::ArchiveWriter;
use crate::archive::slab::SlabBuf;
use crate::archive::PackStats;
use crate::codec::{zero_bitmap, EncodedBlock, Encoder, PageBuf};
use crate::engine;
use crate::error::{Error, Result};
use crate::format::{BlockCodec, DedupPayload, EntryMeta, FileKind, Index};
use crate::progress::Meter;
use crate::seal::ArchiveKey;
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// A file's start, passed through the workers in order.
pub(super) struct FileStart {
    pub(super) key: u64,
    pub(super) name: String,
    pub(super) kind: FileKind,
    pub(super) meta: Option<EntryMeta>,
}

pub(super) enum PackJob {
    Begin(FileStart),
    Block {
        key: u64,
        data: BlockData,
        page_aware: bool,
        block: u32,
    },
    /// A block already encoded (by an earlier writer): stored as it is,
    /// sealed again for this archive if it is encrypted.
    Encoded {
        key: u64,
        encoded: EncodedBlock,
        block: u32,
    },
    End {
        key: u64,
    },
}

/// A block's bytes as they wait for a worker.
pub(super) enum BlockData {
    /// Copied into memory of ours.
    Copied(SlabBuf),
    /// Still CRIU's, referenced from a pipe (see `held`).
    Held(HeldPipe),
}

pub(super) enum PackResult {
    Begin(FileStart),
    /// `number`: the block's place in its file; `copied`: stored as an
    /// earlier writer encoded it; `held`: its bytes were held by reference.
    Block {
        key: u64,
        block: EncodedBlock,
        number: u32,
        hurried: bool,
        copied: bool,
        held: bool,
    },
    End {
        key: u64,
    },
    /// A held block could not be read back (its pipe failed).
    Failed(Error),
}

/// The writer's error, kept for those it refuses afterwards: once it has
/// stopped, a submit fails only with `Cancelled`, and a caller that writes a
/// file after the pages (CRIU's stats) would report "cancelled" for what was
/// a full disk.
pub(super) type Failure = Arc<OnceLock<Error>>;

/// What a worker makes of one job: a block encoded (after its pages are
/// taken from CRIU's pipe, where they were held), its duplicate
/// pages stored by reference where the archive dedups, sealed where it is
/// encrypted; an already encoded block sealed; a file's start and end
/// passed on. `backlog`: the absorb budget, whose state says whether to
/// hurry.
pub(super) fn encode_job(
    job: PackJob,
    enc: &mut Encoder,
    taken: &mut PageBuf,
    backlog: &engine::Hold,
    dedup: Option<&DedupIndex>,
    block_key: Option<&ArchiveKey>,
) -> PackResult {
    match job {
        PackJob::Begin(start) => PackResult::Begin(start),
        PackJob::Block { key, data, page_aware, block } => {
            let held = matches!(data, BlockData::Held(_));
            // Keeps a copied block's buffer alive while `data` borrows it.
            let buffer;
            let data: &[u8] = match data {
                BlockData::Copied(buf) => {
                    buffer = buf;
                    &buffer
                }
                BlockData::Held(pipe) => {
                    taken.clear();
                    if let Err(e) = pipe.read_into(taken) {
                        return PackResult::Failed(Error::Io(e));
                    }
                    taken
                }
            };
            // A held worker runs only when the budget is nearly spent:
            // catch up fast rather than stall CRIU.
            let hurried = backlog.hurried();
            enc.hurry(hurried);
            let mut encoded = match (dedup, page_aware) {
                (Some(d), true) => encode_deduped(enc, d, key as u32, block, data),
                _ => enc.encode(0, data, page_aware),
            };
            // Counted as hurried only where the rewrite may gain.
            let hurried = enc.take_worth_redoing() && hurried;
            if let Some(k) = block_key {
                // The seal binds the file id: a file's key is its id.
                encoded.header.file_id = key as u32;
                encoded.payload = k.seal_block(&mut encoded.header, block, &encoded.payload);
            }
            PackResult::Block { key, block: encoded, number: block, hurried, copied: false, held }
        }
        PackJob::Encoded { key, mut encoded, block } => {
            if let Some(k) = block_key {
                encoded.header.file_id = key as u32;
                encoded.payload = k.seal_block(&mut encoded.header, block, &encoded.payload);
            }
            PackResult::Block { key, block: encoded, number: block, hurried: false, copied: true, held: false }
        }
        PackJob::End { key } => PackResult::End { key },
    }
}

/// The writer's loop: every result, in order, into the archive `w`, then
/// its index and trailer; the archive's figures and index. `stop`: the
/// packer was aborted (nothing more is written); `stored` counts the raw
/// bytes written, for a progress line.
pub(super) fn write_results<W: Write>(
    mut w: ArchiveWriter<W>,
    collector: &mut engine::Collector<PackResult>,
    stop: &AtomicBool,
    stored: &Meter,
) -> Result<(PackStats, Index)> {
    let mut ids: HashMap<u64, u32> = HashMap::new();
    let mut stats = PackStats::default();
    for r in collector.by_ref() {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::Cancelled);
        }
        match r {
            PackResult::Begin(FileStart { key, name, kind, meta }) => {
                ids.insert(key, w.begin_file(&name, kind, meta)?);
                // Files, as unpack and verify count them: a tree's
                // directories and links are entries, not files (`packed
                // 50050 files` then `unpacked 50000` read as 50 lost).
                stats.files += u64::from(kind.is_file());
            }
            PackResult::Block { key, mut block, number, hurried, copied, held } => {
                debug_assert!(!block.header.sealed || block.header.file_id == ids[&key]);
                block.header.file_id = ids[&key];
                if hurried {
                    stats.hurried.insert(block.header.file_id, number);
                }
                stats.blocks_copied += u64::from(copied);
                stats.blocks_held += u64::from(held);
                w.write_block(&block.header, &block.payload)?;
                if let Some(page_ids) = &block.ids {
                    w.write_ids(block.header.file_id, page_ids)?;
                }
                stats.add_block(&block.header);
                stored.stored.fetch_add(u64::from(block.header.raw_len), Ordering::Relaxed);
            }
            PackResult::End { key } => w.end_file(ids.remove(&key).expect("file begun"))?,
            PackResult::Failed(e) => return Err(e),
        }
    }
    if stop.load(Ordering::Relaxed) {
        return Err(Error::Cancelled);
    }
    let (mut out, index, len) = w.finish()?;
    out.flush()?;
    stats.archive_bytes = len;
    Ok((stats, index))
}

/// `e`, or the writer's own error where `e` only says the writer is gone.
pub(super) fn cause(failure: &Failure, e: Error) -> Error {
    match (&e, failure.get()) {
        (Error::Cancelled, Some(first)) => first.duplicate(),
        _ => e,
    }
}

/// A page image block of an archive with page ids: ids for its stored pages,
/// and a dedup block when some of them are found elsewhere.
fn encode_deduped(enc: &mut Encoder, index: &DedupIndex, file_id: u32, block: u32, data: &[u8]) -> EncodedBlock {
    let bitmap = zero_bitmap(data);
    // A block without zero pages is its own stored bytes (no copy: a block
    // of floats, or of a dense heap, has none).
    let gathered = (bitmap.count() > 0).then(|| enc.gather(data, &bitmap));
    let stored = gathered.as_deref().unwrap_or(data);
    let d = dedup_block(index, file_id, block, stored);
    let mut encoded = match d.extents {
        None => {
            let (codec, payload) = enc.compress(stored);
            EncodedBlock::new(codec, 0, data.len(), bitmap, stored, payload)
        }
        Some(extents) => {
            let (inner, literal) = enc.compress(&d.literal);
            let mut payload = Vec::with_capacity(literal.len() + 16 + extents.len() * 20);
            DedupPayload { extents, inner, literal_len: d.literal.len() as u32 }.encode_head(&mut payload);
            payload.extend_from_slice(&literal);
            EncodedBlock::new(BlockCodec::Dedup, 0, data.len(), bitmap, stored, payload)
        }
    };
    if let Some(g) = gathered {
        enc.recycle(g);
    }
    encoded.ids = Some(d.ids);
    encoded
}
