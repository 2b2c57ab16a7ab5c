//! Sets of pages, one bit per page.

use smallvec::SmallVec;

/// A set of pages, one bit per page, least significant bit first in each
/// byte: a block's zero-page bitmap exactly as stored, and the page sets
/// built from such bitmaps (the zero pages of a whole image, the pages a
/// zero-page plan leaves out). A page past the end is not in the set.
///
/// Testing and setting a bit cost what indexing a byte slice does: the
/// zero-page bitmap is read and written once per page of every block.
///
/// A block's bitmap (8 bytes at the default 256 KiB blocks, 16 up to
/// 512 KiB) lives inside the value, not on the heap: an archive's index holds
/// one per block, and a lazy restore's start decodes and checks them all
/// (16,384 heap bitmaps for a 4 GiB image, each allocated and first touched
/// on the way).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageBits(SmallVec<[u8; 16]>);

impl PageBits {
    /// An empty set with room for no page (a block of a plain file, which
    /// has no bitmap).
    pub fn new() -> Self {
        PageBits(SmallVec::new())
    }

    /// Room for `pages` pages, none in the set.
    pub fn with_pages(pages: usize) -> Self {
        PageBits(SmallVec::from_elem(0, pages.div_ceil(8)))
    }

    /// The set the bytes of a stored bitmap hold.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        PageBits(SmallVec::from_vec(bytes))
    }

    /// The set a stored bitmap holds, copied from where it is stored.
    pub fn from_slice(bytes: &[u8]) -> Self {
        PageBits(SmallVec::from_slice(bytes))
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

    /// Puts pages `start..end` in the set, making room first if need be.
    pub fn insert_range(&mut self, start: usize, end: usize) {
        if start >= end {
            return;
        }
        if self.0.len() < end.div_ceil(8) {
            self.0.resize(end.div_ceil(8), 0);
        }
        let mut p = start;
        while p < end {
            if p % 8 == 0 && end - p >= 8 {
                // Whole bytes at once: a run of pages costs a memset.
                let bytes = (end - p) / 8;
                self.0[p / 8..p / 8 + bytes].fill(0xff);
                p += bytes * 8;
            } else {
                self.insert(p);
                p += 1;
            }
        }
    }

    /// Puts page `at + p` in the set for every page `p < pages` of `other`
    /// (a block's bitmap into its image's), making room first if need be.
    pub fn insert_shifted(&mut self, other: &PageBits, at: usize, pages: usize) {
        if self.0.len() < (at + pages).div_ceil(8) {
            self.0.resize((at + pages).div_ceil(8), 0);
        }
        if at % 8 == 0 {
            // Byte-aligned (blocks of whole bytes of pages): OR the bytes.
            for (k, &b) in other.0.iter().take(pages.div_ceil(8)).enumerate() {
                let kept = pages - k * 8;
                let mask = if kept >= 8 { 0xff } else { (1u8 << kept) - 1 };
                self.0[at / 8 + k] |= b & mask;
            }
        } else {
            for p in (0..pages).filter(|&p| other.contains(p)) {
                self.insert(at + p);
            }
        }
    }

    /// The first page in `from..end` that is in the set (`want`) or not in
    /// it, else `end`. Looks at up to 64 pages at once (a plan of 1 GiB of
    /// pages, zero and not alternating page by page, spent 2.6 ms here a
    /// byte at a time, most of a lazy restore's own start).
    pub fn next(&self, from: usize, end: usize, want: bool) -> usize {
        let mut p = from;
        while p < end {
            let byte = p / 8;
            if byte >= self.0.len() {
                // Past the bitmap every page is out of the set.
                return if want { end } else { p };
            }
            // The 64 pages from the byte holding `p`; bytes past the bitmap
            // read as pages out of the set.
            let mut word = [0u8; 8];
            let n = (self.0.len() - byte).min(8);
            word[..n].copy_from_slice(&self.0[byte..byte + n]);
            let word = u64::from_le_bytes(word);
            let sought = if want { word } else { !word } >> (p % 8);
            if sought != 0 {
                return (p + sought.trailing_zeros() as usize).min(end);
            }
            p += 64 - p % 8;
        }
        end
    }

    /// The first page `p` in `from..end` such that pages `p..p + min_run`
    /// are all in the set and before `end`, else `end`. A lazy restore
    /// leaves out only runs of at least 16 zero pages; found run by run with
    /// [`next`](Self::next), those of a 4 GiB `mixed` image (zero and not
    /// alternating every two pages or so) took 2.9 ms of the restore's start
    /// (perf, 2 cores). Here a 64-page window is tested at once: each AND of
    /// the window with itself shifted doubles the length of run a bit
    /// stands for.
    pub fn next_run(&self, from: usize, end: usize, min_run: usize) -> usize {
        if min_run > end.saturating_sub(from) {
            return end;
        }
        if min_run <= 1 {
            return self.next(from, end, true);
        }
        if min_run > MAX_WINDOW_RUN {
            let mut p = from;
            while p < end {
                let start = self.next(p, end, true);
                let after = self.next(start, end, false);
                if after - start >= min_run {
                    return start;
                }
                p = after;
            }
            return end;
        }
        // Windows overlap by `min_run - 1` pages at least, so that a run
        // cut by one window's end starts in the next; they start on bytes.
        let step = (64 + 1 - min_run) / 8 * 8;
        let mut base = from / 8 * 8;
        while base + min_run <= end {
            let byte = base / 8;
            if byte >= self.0.len() {
                break;
            }
            let mut word = [0u8; 8];
            let n = (self.0.len() - byte).min(8);
            word[..n].copy_from_slice(&self.0[byte..byte + n]);
            let mut runs = u64::from_le_bytes(word);
            if end - base < 64 {
                runs &= (1u64 << (end - base)) - 1;
            }
            // Bit i set: pages base + i .. base + i + len all in the set.
            let mut len = 1;
            while len < min_run {
                let shift = len.min(min_run - len);
                runs &= runs >> shift;
                len += shift;
            }
            if from > base {
                runs &= u64::MAX << (from - base);
            }
            if runs != 0 {
                return base + runs.trailing_zeros() as usize;
            }
            base += step;
        }
        end
    }
}

/// The longest run [`PageBits::next_run`] looks for in 64-page windows that
/// start on a byte: a run starting at any of a window's first 8 pages fits.
const MAX_WINDOW_RUN: usize = 64 - 7;

#[cfg(test)]
mod tests {
    use super::PageBits;

    fn naive(pages: &[usize], len: usize) -> Vec<bool> {
        (0..len).map(|p| pages.contains(&p)).collect()
    }

    #[test]
    fn ranges_shifts_and_searches_agree_with_page_by_page() {
        let mut x = 0x9e37_79b9u64;
        for round in 0..200 {
            let mut rand = |n: usize| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % n as u64) as usize
            };
            // Some sets span many 64-page words, with runs longer than one.
            let len = 1 + rand(if round % 3 == 0 { 2000 } else { 300 });
            // Runs of pages, as zero pages come: some long, some single.
            let mut pages = Vec::new();
            let mut set = PageBits::new();
            for _ in 0..rand(6) {
                let start = rand(len);
                let end = (start + 1 + rand([70, 3, 500][round % 3])).min(len);
                set.insert_range(start, end);
                pages.extend(start..end);
            }
            let want = naive(&pages, len);
            assert!((0..len + 20).all(|p| set.contains(p) == (p < len && want[p])), "insert_range");

            let at = rand(100);
            let mut shifted = PageBits::with_pages(rand(50));
            shifted.insert_shifted(&set, at, len);
            assert!((0..at + len + 20).all(|p| shifted.contains(p) == (p >= at && p < at + len && want[p - at])));

            for _ in 0..20 {
                let (from, end) = (rand(len + 10), rand(len + 40));
                for w in [true, false] {
                    let expect = (from..end).find(|&p| (p < len && want[p]) == w).unwrap_or(end.max(from));
                    assert_eq!(set.next(from, end, w).max(from), expect, "next({from}, {end}, {w})");
                }
                for run in [1, 2, 3, 16, 40, 57, 58, 100] {
                    let whole = |p: usize| p + run <= end && (p..p + run).all(|q| q < len && want[q]);
                    let expect = (from..end).find(|&p| whole(p)).unwrap_or(end);
                    assert_eq!(set.next_run(from, end, run), expect, "next_run({from}, {end}, {run})");
                }
            }
        }
    }

    #[test]
    fn a_shifted_bitmap_keeps_only_its_pages() {
        // A stored bitmap's last byte may hold bits past the block's pages.
        let other = PageBits::from_bytes(vec![0xff, 0xff]);
        let mut set = PageBits::new();
        set.insert_shifted(&other, 8, 10);
        assert_eq!(set.count(), 10);
        assert!(!set.contains(18) && set.contains(17) && !set.contains(7));
    }
}
