//! Page dedup for incremental archives (format version 2), writer side.
//!
//! Every stored page of a page image gets a content id (BLAKE3, truncated to
//! 128 bits: a collision would take about 2^64 work, and would only make the
//! checkpoint fail its data check on restore, never restore wrong bytes). A
//! page whose id is in the parent chain, or earlier in this archive, becomes a
//! reference to the page that holds those bytes: references always point at
//! the archive that stores the bytes, never at another reference, so restore
//! cost does not grow with chain depth. Runs of references are stored as
//! extents, so a block of unchanged memory is one extent.
//!
//! The lookup is by content only. Looking at the same address in the parent
//! first would find the same pages (an id match is what decides either way)
//! and costs a pagemap parse per process; a hash lookup is ~50 ns a page.

use crate::codec::PageBuf;
use crate::format::{ChainEntry, Extent, Origin, PageId, PAGE_SIZE};
use crate::seal::{ChainKey, PageIds};
use std::collections::HashMap;
use std::sync::Mutex;

/// Where the bytes of a page are stored: stored page `page` of block `block`
/// of file `file_id` of archive `source` (0: the archive being written).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageAt {
    pub source: u16,
    pub file_id: u32,
    pub block: u32,
    pub page: u32,
}

/// What a new archive dedups against.
pub struct DedupIndex {
    /// The parents named in the C record, first the direct parent.
    pub chain: Vec<ChainEntry>,
    /// Pages of the parent chain, by id, each at the archive storing it.
    parents: HashMap<PageId, PageAt>,
    /// Pages stored in this archive so far, by id.
    own: Mutex<HashMap<PageId, PageAt>>,
    /// How ids are made: keyed in an encrypted chain.
    pub page_ids: PageIds,
    /// The parents' chain key when they are encrypted (the child is sealed
    /// with it, so its ids match theirs).
    pub chain_key: Option<ChainKey>,
}

impl DedupIndex {
    /// An index over a parent chain's pages; `chain` empty for an archive
    /// that only dedups within itself.
    pub fn new(chain: Vec<ChainEntry>, parents: HashMap<PageId, PageAt>) -> Self {
        Self::keyed(chain, parents, None)
    }

    /// As [`new`](Self::new), for a chain encrypted with `key` (`None`: not
    /// encrypted): ids are keyed with it.
    pub fn keyed(chain: Vec<ChainEntry>, parents: HashMap<PageId, PageAt>, key: Option<ChainKey>) -> Self {
        let page_ids = key.as_ref().map_or_else(PageIds::plain, |k| k.page_ids());
        DedupIndex { chain, parents, own: Mutex::new(HashMap::new()), page_ids, chain_key: key }
    }
}

/// A page image block cut up for dedup.
pub struct DedupedBlock {
    /// Ids of the pages the block stores literally, in order (its P record):
    /// a later child finds every page of a chain through the P records of
    /// the archive that stores it, so referenced pages need no id again.
    pub ids: Vec<PageId>,
    /// Extents covering the stored pages; `None` when every page is literal.
    pub extents: Option<Vec<Extent>>,
    /// The literal pages, in order (copied onto a page boundary, as the
    /// stored pages they come from lie: see `PageBuf`).
    pub literal: PageBuf,
}

/// Ids for `stored` (the block's non-zero pages, concatenated) and, when
/// the block is whole pages, the references found for them. Pages that stay
/// literal are registered as held by block `block` of `file_id`.
pub fn dedup_block(index: &DedupIndex, file_id: u32, block: u32, stored: &[u8]) -> DedupedBlock {
    let ids: Vec<PageId> = stored.chunks(PAGE_SIZE).map(|p| index.page_ids.id(p)).collect();
    if stored.len() % PAGE_SIZE != 0 {
        // A short last page is never shared: keep the block as it is.
        return DedupedBlock { ids, extents: None, literal: PageBuf::new() };
    }
    let mut extents: Vec<Extent> = Vec::new();
    let mut literal_pages = Vec::new();
    let mut own = index.own.lock().unwrap();
    for (i, id) in ids.iter().enumerate() {
        let found = index.parents.get(id).copied().or_else(|| own.get(id).copied());
        let origin = match found {
            Some(l) => Origin::Ref { source: l.source, file_id: l.file_id, block: l.block, first: l.page },
            None => {
                own.insert(*id, PageAt { source: 0, file_id, block, page: i as u32 });
                literal_pages.push(i);
                Origin::Literal
            }
        };
        push_page(&mut extents, origin);
    }
    drop(own);
    if literal_pages.len() == ids.len() {
        // Nothing found elsewhere (the usual block): no copy of its pages.
        return DedupedBlock { ids, extents: None, literal: PageBuf::new() };
    }
    let mut literal = PageBuf::new();
    literal.reserve(literal_pages.len() * PAGE_SIZE);
    for &i in &literal_pages {
        literal.extend_from_slice(&stored[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
    }
    let literal_ids = literal_pages.iter().map(|&i| ids[i]).collect();
    DedupedBlock { ids: literal_ids, extents: Some(extents), literal }
}

/// Appends one page to the extents, growing the last one when it continues it.
fn push_page(extents: &mut Vec<Extent>, origin: Origin) {
    if let Some(last) = extents.last_mut() {
        let continues = match (last.origin, origin) {
            (Origin::Literal, Origin::Literal) => true,
            (
                Origin::Ref { source: s, file_id: f, block: b, first },
                Origin::Ref { source: s2, file_id: f2, block: b2, first: first2 },
            ) => (s, f, b) == (s2, f2, b2) && first + last.count == first2,
            _ => false,
        };
        if continues {
            last.count += 1;
            return;
        }
    }
    extents.push(Extent { origin, count: 1 });
}
