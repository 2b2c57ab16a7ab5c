//! Block buffers carved from larger anonymous mappings, each faulted in
//! before CRIU's bytes are read into it.
//!
//! A dump takes in what CRIU writes while the process is frozen, so the
//! cost of taking a block in is frozen time (the process's own pages are
//! mostly held by reference instead, `held`; these buffers take the rest). read(2) copies out of a pipe under the
//! pipe's lock; into fresh memory, the copy takes a page fault every 4 KiB
//! and holds the lock through them, while CRIU, splicing the next pages in,
//! spins on it (one-off diagnosis, not the bench: a perf profile of a 1 GiB
//! dump had CRIU 23% in `mutex_spin_on_owner`, frozen 1.07-2.34 s against
//! 0.61-0.85 s into tmpfs).
//! Faulting each buffer in whole when it is carved (`MADV_POPULATE_WRITE`,
//! which wants page-aligned ranges, hence the mappings) leaves the copy
//! alone under the lock: frozen 0.73-0.93 s against 0.68-0.86 s, five
//! dumps each, alternating (`mixed`, 1 GiB); the bench's frozen column
//! (docs/BENCHMARKS.md) is the reproducible figure. Transparent huge pages
//! were slower in a one-off C test of the same read loop, so they are not
//! asked for.
//!
//! When the last block carved from a mapping is dropped, the mapping goes
//! to a small pool (at most [`POOL_BYTES`]) to be carved again, still
//! faulted in, and only beyond that back to the kernel: fresh memory costs a
//! zeroing fault per page and an unmap, which for a tmpfs-followed runc
//! checkpoint was most of criuz's system time (`perf`: `clear_page_erms`,
//! LRU and unmap work about 15% of a 1 GiB pack). Blocks leave the pipeline
//! about in the order they were carved, so the memory held beyond the blocks
//! alive is at most one mapping per file being written, plus the pool.

use std::ptr::NonNull;
use std::sync::Arc;

/// Blocks carved from one mapping.
const BLOCKS_PER_SLAB: usize = 16;
/// Most memory kept in the pool of mappings waiting to be carved again.
pub const POOL_BYTES: usize = 64 << 20;

struct Mapping {
    base: NonNull<u8>,
    len: usize,
    /// Never carved before: its pages still need faulting in.
    fresh: bool,
}

/// Mappings no block uses any more, faulted in: (address, length).
static POOL: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

// SAFETY: the mapping is plain memory owned by this value; the buffers
// carved from it are disjoint and each is used by one thread at a time.
unsafe impl Send for Mapping {}
// SAFETY: as above; a shared `Mapping` is only unmapped on drop.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> Option<Mapping> {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.iter().position(|&(_, l)| l == len) {
            let (addr, len) = pool.swap_remove(i);
            return Some(Mapping { base: NonNull::new(addr as *mut u8)?, len, fresh: false });
        }
        drop(pool);
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(Mapping { base: NonNull::new(p.cast())?, len, fresh: true })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if pool.iter().map(|&(_, l)| l).sum::<usize>() + self.len <= POOL_BYTES {
            // No buffer into it is alive: it can be carved again as is.
            pool.push((self.base.as_ptr() as usize, self.len));
            return;
        }
        drop(pool);
        // SAFETY: `base..base+len` is the mapping made in `new`, and no
        // buffer into it is alive (each holds an `Arc` of this mapping).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A fixed-capacity byte buffer inside a mapping (or on the heap when no
/// mapping could be made). Dereferences to its filled bytes.
pub struct SlabBuf {
    mem: Memory,
    len: usize,
}

enum Memory {
    Carved { _mapping: Arc<Mapping>, ptr: NonNull<u8>, cap: usize },
    Heap(Vec<u8>),
}

// SAFETY: a carved buffer is the only user of its bytes of the mapping,
// which lives as long as the buffer (it holds an `Arc` of it).
unsafe impl Send for SlabBuf {}

impl SlabBuf {
    /// An empty heap buffer (nothing carved yet).
    pub fn empty() -> SlabBuf {
        SlabBuf { mem: Memory::Heap(Vec::new()), len: 0 }
    }

    pub fn capacity(&self) -> usize {
        match &self.mem {
            Memory::Carved { cap, .. } => *cap,
            Memory::Heap(v) => v.capacity(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn base(&mut self) -> *mut u8 {
        match &mut self.mem {
            Memory::Carved { ptr, .. } => ptr.as_ptr(),
            Memory::Heap(v) => v.as_mut_ptr(),
        }
    }

    /// The unfilled capacity, for a read(2) straight into it. Its bytes may
    /// be uninitialised: write them only, then [`filled`](Self::filled).
    pub fn spare(&mut self) -> (*mut u8, usize) {
        let room = self.capacity() - self.len;
        // SAFETY: `len <= capacity`, so the offset stays inside the buffer.
        (unsafe { self.base().add(self.len) }, room)
    }

    /// Marks `n` more bytes after the filled ones as written.
    ///
    /// # Safety
    /// The `n` bytes at [`spare`](Self::spare) must have been initialised, `n <= room`.
    pub unsafe fn filled(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.capacity());
        self.len += n;
        if let Memory::Heap(v) = &mut self.mem {
            // SAFETY: the caller initialised these bytes within capacity.
            unsafe { v.set_len(self.len) };
        }
    }

    /// Appends as much of `data` as fits; returns how much did.
    pub fn extend(&mut self, data: &[u8]) -> usize {
        let (spare, room) = self.spare();
        let n = room.min(data.len());
        // SAFETY: `n` bytes fit in the spare capacity; the source is a
        // separate borrowed slice, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), spare, n);
            self.filled(n);
        }
        n
    }
}

impl super::held::ReadTarget for SlabBuf {
    /// The room it has: a block's buffer does not grow.
    fn room(&mut self, _want: usize) -> (*mut u8, usize) {
        self.spare()
    }

    unsafe fn filled(&mut self, n: usize) {
        // SAFETY: passed on from the caller.
        unsafe { SlabBuf::filled(self, n) }
    }
}

impl std::ops::Deref for SlabBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mem {
            // SAFETY: the first `len` bytes were initialised (`filled`), and
            // the mapping outlives the buffer.
            Memory::Carved { ptr, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.len) },
            Memory::Heap(v) => &v[..self.len],
        }
    }
}

/// Carves buffers of one size, in order, from mappings of
/// [`BLOCKS_PER_SLAB`] buffers.
pub struct Carver {
    block: usize,
    current: Option<Arc<Mapping>>,
    next: usize,
}

impl Carver {
    pub fn new(block: usize) -> Carver {
        Carver { block, current: None, next: BLOCKS_PER_SLAB }
    }

    /// The size of the buffers it carves.
    pub fn block(&self) -> usize {
        self.block
    }

    /// A new empty buffer of the carver's size.
    pub fn carve(&mut self) -> SlabBuf {
        if self.next == BLOCKS_PER_SLAB {
            self.current = Mapping::new(self.block * BLOCKS_PER_SLAB).map(Arc::new);
            self.next = 0;
        }
        let Some(mapping) = &self.current else {
            // Out of address space or mappings: the heap may still serve.
            return SlabBuf { mem: Memory::Heap(Vec::with_capacity(self.block)), len: 0 };
        };
        // SAFETY: `next < BLOCKS_PER_SLAB`, so the buffer lies inside the mapping.
        let ptr = unsafe { NonNull::new_unchecked(mapping.base.as_ptr().add(self.next * self.block)) };
        self.next += 1;
        if mapping.fresh {
            // SAFETY: advice on this buffer's own pages of the mapping; failure
            // (a kernel before 5.14) only leaves them to fault in on first write.
            // (See the module doc for why.)
            unsafe { libc::madvise(ptr.as_ptr().cast(), self.block, libc::MADV_POPULATE_WRITE) };
        }
        SlabBuf { mem: Memory::Carved { _mapping: mapping.clone(), ptr, cap: self.block }, len: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carved_buffers_are_disjoint_and_outlive_their_carver() {
        let mut c = Carver::new(8192);
        let mut bufs: Vec<SlabBuf> = (0..BLOCKS_PER_SLAB * 2 + 3).map(|_| c.carve()).collect();
        drop(c);
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.capacity(), 8192);
            assert_eq!(b.extend(&vec![i as u8; 5000]), 5000);
            assert_eq!(b.extend(&vec![i as u8; 5000]), 3192);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(b.len(), 8192);
            assert!(b.iter().all(|&x| x == i as u8));
        }
    }

    #[test]
    fn an_empty_buffer_has_no_room() {
        let mut b = SlabBuf::empty();
        assert_eq!(b.extend(b"abc"), 0);
        assert!(b.is_empty());
    }
}
