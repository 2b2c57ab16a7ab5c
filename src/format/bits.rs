//! Sets of pages, one bit per page.

/// A set of pages, one bit per page, least significant bit first in each
/// byte: a block's zero-page bitmap exactly as stored, and the page sets
/// built from such bitmaps (the zero pages of a whole image, the pages a
/// zero-page plan leaves out). A page past the end is not in the set.
///
/// Testing and setting a bit cost what indexing a byte slice does: the
/// zero-page bitmap is read and written once per page of every block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageBits(Vec<u8>);

impl PageBits {
    /// An empty set with room for no page (a block of a plain file, which
    /// has no bitmap).
    pub const fn new() -> Self {
        PageBits(Vec::new())
    }

    /// Room for `pages` pages, none in the set.
    pub fn with_pages(pages: usize) -> Self {
        PageBits(vec![0; pages.div_ceil(8)])
    }

    /// The set the bytes of a stored bitmap hold.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        PageBits(bytes)
    }

    /// The bytes as stored.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Bytes it takes as stored.
    pub fn byte_len(&self) -> usize {
        self.0.len()
    }

    /// Whether it has room for no page at all (as opposed to holding none).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `page` is in the set.
    #[inline]
    pub fn contains(&self, page: usize) -> bool {
        self.0.get(page / 8).is_some_and(|b| b & (1 << (page % 8)) != 0)
    }

    /// Puts `page` in the set, which must have room for it.
    #[inline]
    pub fn insert(&mut self, page: usize) {
        self.0[page / 8] |= 1 << (page % 8);
    }

    /// Puts `page` in the set, making room for it first if need be.
    pub fn insert_growing(&mut self, page: usize) {
        if self.0.len() <= page / 8 {
            self.0.resize(page / 8 + 1, 0);
        }
        self.insert(page);
    }

    /// How many pages are in the set.
    pub fn count(&self) -> usize {
        self.0.iter().map(|b| b.count_ones() as usize).sum()
    }
}
