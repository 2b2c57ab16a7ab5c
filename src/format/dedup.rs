//! The payload of a dedup block (version 2): extents saying where each
//! stored page comes from, then the literal pages under an inner codec.

use super::{BlockCodec, Cursor, PAGE_SIZE};
use crate::error::{Error, Result};

/// Where the pages of one extent of a dedup block come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The next `count` literal pages of this block's inner payload.
    Literal,
    /// Stored pages `first..first+count` of block `block` of file `file_id`
    /// of archive `source` (0: this archive; k: entry k-1 of the C record).
    Ref { source: u16, file_id: u32, block: u32, first: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub origin: Origin,
    pub count: u32,
}

/// The payload of a dedup block: extents covering the block's stored pages in
/// order, then the literal pages, compressed with an inner codec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DedupPayload {
    pub extents: Vec<Extent>,
    pub inner: BlockCodec,
    /// Bytes of the literal pages, uncompressed.
    pub literal_len: u32,
}

const EXTENT_LEN: usize = 20;
const LITERAL_SOURCE: u16 = u16::MAX;

impl DedupPayload {
    /// Pages the block stores literally (its P record lists their ids).
    pub fn literal_pages(&self) -> u32 {
        self.literal_len / PAGE_SIZE as u32
    }

    /// For each stored page in order: its index among the literal pages, or
    /// `None` for a reference.
    pub fn literal_slots(&self) -> impl Iterator<Item = Option<usize>> + '_ {
        let mut next = 0;
        self.extents.iter().flat_map(|e| std::iter::repeat_n(e.origin, e.count as usize)).map(move |o| {
            (o == Origin::Literal).then(|| {
                next += 1;
                next - 1
            })
        })
    }

    /// Encodes the extents and inner header; the inner payload follows.
    pub fn encode_head(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.extents.len() as u32).to_le_bytes());
        for e in &self.extents {
            let (source, file_id, block, first) = match e.origin {
                Origin::Literal => (LITERAL_SOURCE, 0, 0, 0),
                Origin::Ref { source, file_id, block, first } => (source, file_id, block, first),
            };
            out.extend_from_slice(&source.to_le_bytes());
            out.extend_from_slice(&[0, 0]);
            out.extend_from_slice(&file_id.to_le_bytes());
            out.extend_from_slice(&block.to_le_bytes());
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&e.count.to_le_bytes());
        }
        out.extend_from_slice(&[self.inner as u8, 0, 0, 0]);
        out.extend_from_slice(&self.literal_len.to_le_bytes());
    }

    /// Decodes a dedup payload for a block of `stored_pages` stored pages.
    pub fn decode(payload: &[u8], stored_pages: usize, offset: u64) -> Result<DecodedDedup<'_>> {
        let bad = |what: &str| Error::corrupt(offset, format!("dedup block: {what}"));
        let mut c = Cursor { buf: payload, pos: 0, base: offset };
        let n = c.u32()? as usize;
        if n > stored_pages || n.saturating_mul(EXTENT_LEN) > c.remaining() {
            return Err(bad("impossible extent count"));
        }
        let mut extents = Vec::with_capacity(n);
        let (mut pages, mut literal) = (0usize, 0usize);
        for _ in 0..n {
            let source = c.u16()?;
            if c.u16()? != 0 {
                return Err(bad("reserved extent bytes are not zero"));
            }
            let (file_id, block, first, count) = (c.u32()?, c.u32()?, c.u32()?, c.u32()?);
            if count == 0 {
                return Err(bad("empty extent"));
            }
            let origin = if source == LITERAL_SOURCE {
                if (file_id, block, first) != (0, 0, 0) {
                    return Err(bad("literal extent with a target"));
                }
                literal += count as usize;
                Origin::Literal
            } else {
                Origin::Ref { source, file_id, block, first }
            };
            pages = pages.saturating_add(count as usize);
            extents.push(Extent { origin, count });
        }
        if pages != stored_pages {
            return Err(bad("extents do not cover the block's stored pages"));
        }
        let inner = BlockCodec::from_u8(c.u8()?, c.offset() - 1)?;
        if inner == BlockCodec::Dedup || c.take(3)? != [0, 0, 0] {
            return Err(bad("bad inner codec"));
        }
        let literal_len = c.u32()?;
        if literal_len as usize != literal * PAGE_SIZE {
            return Err(bad("literal length does not match the literal pages"));
        }
        let rest = &payload[c.pos..];
        if inner == BlockCodec::Raw && rest.len() != literal_len as usize {
            return Err(bad("raw literal pages have the wrong length"));
        }
        Ok(DecodedDedup { head: DedupPayload { extents, inner, literal_len }, inner_payload: rest })
    }
}

/// A dedup block's payload as [`DedupPayload::decode`] takes it apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedDedup<'a> {
    /// The extents and the inner codec.
    pub head: DedupPayload,
    /// The literal pages, compressed with `head.inner`.
    pub inner_payload: &'a [u8],
}
