//! A reusable byte buffer whose bytes start on a page boundary.
//!
//! A worker copies whole pages between its buffers (the stored pages of a
//! block gathered for the codec, a held block read out of its pipe). glibc
//! copies 4 KiB with `rep movsb`, and on the AMD EPYC VMs we run on that
//! copy crawls when the destination sits a few bytes past the source modulo
//! 4 KiB: every load then aliases a store just made. Two heap `Vec`s of one
//! worker land just so (measured in 512 MiB `mixed` dumps: source and
//! destination 0x40010 apart, 70-85 µs of CPU to gather a block against 7-9
//! µs in a worker whose buffers were 0xa1440 or 0x64030 apart; the slow
//! worker's gathers took about a tenth of the dump's CPU). Buffers that start on a page boundary
//! are copied between at the same offset, and page-aligned sources (carved
//! slabs, the kernel's pages) stay a page apart from them.
//!
//! The bytes live in a `Vec<u8>` a page longer than asked, kept initialised,
//! so no allocator or `unsafe` of our own is needed; it only grows.

use crate::format::PAGE_SIZE;

/// Bytes starting on a page boundary; dereferences to the filled ones.
#[derive(Default)]
pub struct PageBuf {
    raw: Vec<u8>,
    /// Where the page-aligned bytes start in `raw`.
    start: usize,
    len: usize,
}

impl PageBuf {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `bytes`, growing the buffer if needed.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let at = self.spare(bytes.len());
        at[..bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// Makes room for at least `more` bytes after the filled ones.
    pub fn reserve(&mut self, more: usize) {
        let need = self.len + more;
        if self.raw.len() - self.start < need {
            self.grow(need);
        }
    }

    /// Room for at least `want` more bytes after the filled ones (holding
    /// whatever was there before): fill a prefix, then [`filled`](Self::filled).
    pub fn spare(&mut self, want: usize) -> &mut [u8] {
        self.reserve(want);
        &mut self.raw[self.start + self.len..]
    }

    /// Marks `n` more bytes of [`spare`](Self::spare) as filled.
    pub fn filled(&mut self, n: usize) {
        assert!(self.start + self.len + n <= self.raw.len(), "filled past the buffer's room");
        self.len += n;
    }

    fn grow(&mut self, need: usize) {
        let room = need.max(2 * self.len).next_multiple_of(PAGE_SIZE);
        // Zeroed memory this large comes from calloc: pages the kernel
        // hands over zeroed, so the initialisation is free.
        let mut raw = vec![0u8; room + PAGE_SIZE];
        let start = (PAGE_SIZE - raw.as_ptr() as usize % PAGE_SIZE) % PAGE_SIZE;
        raw[start..start + self.len].copy_from_slice(self);
        self.raw = raw;
        self.start = start;
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_start_on_a_page_and_survive_growth() {
        let mut b = PageBuf::new();
        assert!(b.is_empty());
        let pattern: Vec<u8> = (0..3 * PAGE_SIZE + 100).map(|i| (i * 7 % 251) as u8).collect();
        for piece in pattern.chunks(1000) {
            b.extend_from_slice(piece);
            assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        }
        assert_eq!(&b[..], &pattern[..]);
        let spare = b.spare(10);
        spare[..3].copy_from_slice(&[1, 2, 3]);
        b.filled(3);
        assert_eq!(&b[pattern.len()..], &[1, 2, 3]);
        b.clear();
        assert!(b.is_empty());
        b.extend_from_slice(&[9; 5]);
        assert_eq!(&b[..], &[9; 5]);
        assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
    }

    #[test]
    #[should_panic(expected = "filled past")]
    fn filling_past_the_room_is_refused() {
        let mut b = PageBuf::new();
        let room = b.spare(10).len();
        b.filled(room + 1);
    }
}
