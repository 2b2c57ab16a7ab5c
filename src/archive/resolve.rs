//! The read side of dedup (`dedup` is the write side): a dedup block is
//! resolved into the raw block of its stored pages, pieced together from
//! its own literal pages and the stored pages of the blocks its extents
//! point at (in its own archive or a parent), without copying them where
//! they lie on page boundaries. Its data check, applied when the resolved
//! block is decoded or handed on, proves the result.
//!
//! It reads archives through the small [`Holders`] trait, which the opened
//! archive implements, so this file never imports the archive.

use super::block::{CheckedBlock, Holder};
use super::check::check_payload;
use super::fetch::{page_aligned, page_aligned_share, Fetched};
use crate::codec::Decoder;
use crate::error::{Error, Result};
use crate::format::{BlockCodec, BlockHeader, DecodedDedup, DedupPayload, Origin, PAGE_SIZE};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What resolving needs of an archive.
pub(crate) trait Holders {
    /// Names the archive in messages.
    fn name(&self) -> &Arc<str>;
    /// The record of block `block` of a file, fetched and its header checked
    /// against the opening's proof; `None` past the file's end.
    fn fetch(&self, file_id: u32, block: usize, pieced: bool) -> Result<Option<Fetched>>;
    /// For a dedup block, the literal pages its P record listed.
    fn literal_pages(&self, file_id: u32, block: u32) -> Option<u32>;
    /// Position of a block's first byte in its file.
    fn raw_pos(&self, file_id: u32, block: u32) -> u64;
    /// Whether blocks are sealed (their tags prove every byte).
    fn authenticated(&self) -> bool;
    /// The archive a reference's `source` names: 0 itself, k its k-th parent
    /// (waiting for a walk of the parents under way).
    fn source(&self, k: u16, offset: u64) -> Result<&dyn Holders>;
    /// Its recently decoded holders.
    fn holders(&self) -> &HolderCache;
}

/// Decoded holder blocks of one archive, by (file id, block).
pub(crate) type HolderCache = Mutex<VecDeque<(u32, u32, Arc<Holder>)>>;

/// Decoded holder blocks kept per archive for references to hit again: a
/// child's blocks refer to their parents' blocks in about the same order, so
/// a few per archive suffice, and memory stays bounded along a long chain.
const HOLDER_CACHE: usize = 4;

thread_local! {
    /// A decoder per thread for resolving references (its zstd context is
    /// worth keeping).
    static DECODER: std::cell::RefCell<Decoder> = std::cell::RefCell::new(Decoder::new());
}

/// Decodes `payload` (`expect` bytes once decoded) onto a page boundary.
fn decode_aligned(codec: BlockCodec, payload: &[u8], expect: usize, offset: u64) -> Result<(Arc<Vec<u8>>, usize)> {
    let (mut v, start) = page_aligned(expect);
    DECODER
        .with(|d| d.borrow_mut().decompress_after(codec, payload, expect, &mut v))
        .map_err(|e| Error::corrupt(offset, e))?;
    Ok((Arc::new(v), start))
}

/// The extents and inner payload of dedup block `block` of a file, whose
/// literal pages must be the ones its P record listed.
fn dedup_payload<'b>(
    src: &dyn Holders,
    file_id: u32,
    block: u32,
    header: &BlockHeader,
    payload: &'b [u8],
    offset: u64,
) -> Result<(DedupPayload, &'b [u8])> {
    let stored = header.pages() - header.zero_pages();
    let DecodedDedup { head: dp, inner_payload: inner } = DedupPayload::decode(payload, stored, offset)?;
    let listed = src.literal_pages(file_id, block);
    if listed != Some(dp.literal_pages()) {
        return Err(Error::corrupt(offset, "the page id record does not list the block's literal pages"));
    }
    Ok((dp, inner))
}

/// The stored pages of block `block` of a file, for references into it.
///
/// A holder is read without its payload check and decoded without its
/// data check: every byte taken from it ends up in a referring block
/// whose data check proves it (damage anywhere in a holder, including its
/// extents, can only make that check fail, and the error then names the
/// archives involved). Hashing the holders too would double the hashing
/// of a chain restore. Its structure is still checked: the header against
/// the walk, the extents, and the P count of a dedup block.
pub(crate) fn holder(src: &dyn Holders, file_id: u32, block: u32) -> Result<Arc<Holder>> {
    if let Some(h) = src.holders().lock().unwrap().iter().find(|h| (h.0, h.1) == (file_id, block)) {
        return Ok(h.2.clone());
    }
    let Fetched { buf, range, header: h, offset, .. } = src.fetch(file_id, block as usize, true)?.ok_or_else(|| {
        Error::corrupt(0, format!("a reference points at block {block} of file {file_id}, which does not exist"))
    })?;
    let payload = &buf[range.end - h.stored_len as usize..range.end];
    let label = src.name().clone();
    let holder = if h.codec == BlockCodec::Dedup {
        let (dp, inner) = dedup_payload(src, file_id, block, &h, payload, offset)?;
        // Raw literal pages (new random data, the usual case) are the
        // payload's tail.
        let (bytes, start) = match dp.inner {
            BlockCodec::Raw => page_aligned_share(&buf, range.end - inner.len()..range.end),
            codec => decode_aligned(codec, inner, dp.literal_len as usize, offset)?,
        };
        let pages = dp.literal_slots().map(|k| k.map(|k| start + k * PAGE_SIZE)).collect();
        Holder { pages, pinned: range.len().max(dp.literal_len as usize), bytes, archive: label }
    } else {
        if h.codec == BlockCodec::Raw && h.stored_len as usize != h.stored_raw_len() {
            return Err(Error::corrupt(offset, "raw block payload has the wrong length"));
        }
        let (bytes, start) = match h.codec {
            BlockCodec::Raw => page_aligned_share(&buf, range.end - payload.len()..range.end),
            codec => decode_aligned(codec, payload, h.stored_raw_len(), offset)?,
        };
        let pages = (0..h.stored_raw_len() / PAGE_SIZE).map(|p| Some(start + p * PAGE_SIZE)).collect();
        Holder { pages, pinned: range.len().max(h.stored_raw_len()), bytes, archive: label }
    };
    let holder = Arc::new(holder);
    let mut cache = src.holders().lock().unwrap();
    if cache.len() == HOLDER_CACHE {
        cache.pop_front();
    }
    cache.push_back((file_id, block, holder.clone()));
    Ok(holder)
}

/// Resolves a dedup block into the raw block of its stored pages; its
/// data check (applied when it is decoded) then proves the result.
pub(crate) fn resolve(src: &dyn Holders, file_id: u32, block: u32, f: Fetched) -> Result<CheckedBlock> {
    let Fetched { buf, range, header, offset } = f;
    let payload = &buf[range.end - header.stored_len as usize..range.end];
    check_payload(&header, payload, offset, src.authenticated())?;
    let (dp, inner) = dedup_payload(src, file_id, block, &header, payload, offset)?;
    let archive = src.name().clone();
    // Literal pages on a page boundary, as for holders.
    let (bytes, mut lit) = match dp.inner {
        BlockCodec::Raw => page_aligned_share(&buf, range.end - inner.len()..range.end),
        codec => decode_aligned(codec, inner, dp.literal_len as usize, offset)?,
    };
    let literal = Holder { pinned: range.len().max(dp.literal_len as usize), bytes, pages: Vec::new(), archive };
    let literal = Arc::new(literal);
    let mut len = 0;
    let mut pieces: Vec<(Arc<Holder>, Range<usize>)> = Vec::new();
    // The holder the last extent used: consecutive extents mostly point
    // into the same block, and the cache takes a lock.
    let mut last: Option<((u16, u32, u32), Arc<Holder>)> = None;
    let mut push = |holder: &Arc<Holder>, range: Range<usize>| {
        len += range.len();
        match pieces.last_mut() {
            Some((h, r)) if Arc::ptr_eq(h, holder) && r.end == range.start => r.end = range.end,
            _ => pieces.push((holder.clone(), range)),
        }
    };
    for e in &dp.extents {
        let n = e.count as usize;
        match e.origin {
            Origin::Literal => {
                push(&literal, lit..lit + n * PAGE_SIZE);
                lit += n * PAGE_SIZE;
            }
            Origin::Ref { source, file_id, block, first } => {
                let target = src.source(source, offset)?;
                let holder = match &last {
                    Some((key, h)) if *key == (source, file_id, block) => h.clone(),
                    _ => {
                        let h = holder(target, file_id, block).map_err(|e| e.context(target.name().to_string()))?;
                        last = Some(((source, file_id, block), h.clone()));
                        h
                    }
                };
                let missing = || Error::corrupt(offset, "a reference points at a page that is not stored there");
                let mut pages = holder.pages.get(first as usize..first as usize + n).ok_or_else(missing)?;
                // Runs of pages that lie back to back in the holder are one piece.
                while let Some(&start) = pages.first() {
                    let start = start.ok_or_else(missing)?;
                    let run = 1 + pages[1..]
                        .iter()
                        .enumerate()
                        .take_while(|(k, at)| **at == Some(start + (k + 1) * PAGE_SIZE))
                        .count();
                    push(&holder, start..start + run * PAGE_SIZE);
                    pages = &pages[run..];
                }
            }
        }
    }
    let header = BlockHeader { codec: BlockCodec::Raw, stored_len: len as u32, ..header };
    let raw_pos = src.raw_pos(file_id, block);
    Ok(CheckedBlock { header, record: Vec::new(), offset, raw_pos, resolved: true, pieces })
}
