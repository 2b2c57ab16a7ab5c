//! Pagemaps and pages images: a pagemap's runs of pages in address order
//! with their flags, the names CRIU gives these images, and a builder for
//! the pagemaps criuz writes.

use super::proto::*;
use prost::Message;

/// A run of pages a pagemap lists: `nr` pages from `vaddr`, stored from
/// page `first` of its pages image; `lazy` if CRIU may fetch them on demand
/// (`PE_LAZY`: private anonymous memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    pub vaddr: u64,
    pub nr: u64,
    pub first: u64,
    pub lazy: bool,
}

/// The pages image id and the runs of a process's pagemap, in its order;
/// `None` if anything is not as expected (entries in a parent, unknown flags).
pub fn pagemap_runs(pagemap: &[u8]) -> Option<(u32, Vec<PageRun>)> {
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = PagemapHead::decode(*objs.first()?).ok()?;
    let mut runs = Vec::new();
    let mut first = 0u64;
    let mut after = 0u64;
    for obj in &objs[1..] {
        let e = PagemapEntry::decode(*obj).ok()?;
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        let flags = entry_flags(&e);
        if flags & !(PE_PRESENT | PE_LAZY) != 0 || flags & PE_PRESENT == 0 {
            return None;
        }
        after = ascending(after, e.vaddr, nr)?;
        runs.push(PageRun { vaddr: e.vaddr, nr, first, lazy: flags & PE_LAZY != 0 });
        first = first.checked_add(nr)?;
        // Every page's byte offset in the pages image must fit too: readers
        // compute it as page * 4096.
        first.checked_mul(4096)?;
    }
    Some((head.pages_id, runs))
}

/// A pagemap of `runs` (pages image `pages_id`, in address order, as
/// [`pagemap_runs`] reads them) with every run that continues the one
/// before it (the next page, the same flags) joined to it, as criuz hands
/// a rewritten pagemap to CRIU. CRIU ends a dump's runs where its page
/// pipes end (1 MiB at the default `fs.pipe-max-size`), and its restore
/// walks every entry: 4,113 for 4 GiB of memory where its VMAs need a few
/// dozen. Pages stay where they were in the pages image (its runs are in
/// address order), and CRIU reads a run that crosses VMAs one VMA at a
/// time (`restore_priv_vma_content`, criu/mem.c, v4.2), as its own dumps
/// make such runs. Built from runs already read, into room taken at once:
/// a placed restore's pagemap has about one run per two pages of `mixed`
/// memory, and the image must not regrow.
pub fn joined_pagemap(pages_id: u32, runs: &[PageRun]) -> Vec<u8> {
    // An entry takes at most 40 bytes (a 4-byte length, then a tag and a
    // varint for each of its four fields), so the image never regrows.
    let mut joined = PagemapBuilder::with_capacity(pages_id, 64 + runs.len() * 40);
    for r in runs {
        joined.push(r.vaddr, r.nr, if r.lazy { PE_PRESENT | PE_LAZY } else { PE_PRESENT });
    }
    joined.finish()
}

/// An entry's flags as CRIU reads them (`init_compat_pagemap_entry`,
/// criu/pagemap.c, v4.2): `in_parent` adds `PE_PARENT` whatever the flags
/// say, and an entry without flags is present.
pub(super) fn entry_flags(e: &PagemapEntry) -> u32 {
    let flags = e.flags.unwrap_or(if e.in_parent == Some(true) { 0 } else { PE_PRESENT });
    if e.in_parent == Some(true) {
        flags | PE_PARENT
    } else {
        flags
    }
}

/// The end of an entry of `nr` pages at `vaddr` that starts at or after
/// `after`, the previous entry's end; `None` if it starts before it or ends
/// past the address space. CRIU writes a pagemap in address order, one entry
/// per run. Out of order or overlapping (an archive crafted with every check
/// recomputed), its meaning would be whatever each reader made of it: CRIU
/// restores the last copy of a page written twice, where a copy by
/// userfaultfd keeps the first, and skipping a zero copy would unmask an
/// earlier one. Such a pagemap is left to CRIU's own reading, never placed
/// nor rewritten.
pub(super) fn ascending(after: u64, vaddr: u64, nr: u64) -> Option<u64> {
    (vaddr >= after).then_some(())?;
    vaddr.checked_add(nr.checked_mul(4096)?)
}

/// The pages image a pagemap refers to.
pub fn pagemap_pages_id(pagemap: &[u8]) -> Option<u32> {
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    PagemapHead::decode(*objs.first()?).ok().map(|h| h.pages_id)
}

/// `pagemap-<pid>.img` -> pid (process pagemaps only, not shmem ones).
///
/// Only the name CRIU gives the file (`pagemap-%d.img`): `pagemap-07.img`
/// is a file CRIU never opens, whatever it holds.
pub fn process_pagemap_pid(name: &str) -> Option<&str> {
    let pid = name.strip_prefix("pagemap-")?.strip_suffix(".img")?;
    canonical_number(pid).then_some(pid)
}

/// Whether CRIU opens a pagemap of this name: a process's
/// (`pagemap-%lu.img`) or shared memory's (`pagemap-shmem-%lu.img`).
pub fn pagemap_criu_opens(name: &str) -> bool {
    process_pagemap_pid(name).is_some()
        || name.strip_prefix("pagemap-shmem-").and_then(|n| n.strip_suffix(".img")).is_some_and(canonical_number)
}

/// `pages-<id>.img` -> id; only the name CRIU opens (`pages-%u.img`): an
/// archive crafted to hold `pages-01.img` beside `pages-1.img` must not
/// have criuz take the pages of one for the other.
pub fn pages_image_id(name: &str) -> Option<u32> {
    let id = name.strip_prefix("pages-")?.strip_suffix(".img")?;
    canonical_number(id).then(|| id.parse().ok()).flatten()
}

/// Whether `s` is a decimal number as printf's `%d` writes one: digits, no
/// leading zero but for 0 itself.
fn canonical_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
}

/// `pagemap-shmem-<id>.img` -> id; only the name CRIU opens.
pub fn shmem_pagemap_id(name: &str) -> Option<u64> {
    let id = name.strip_prefix("pagemap-shmem-")?.strip_suffix(".img")?;
    canonical_number(id).then(|| id.parse().ok()).flatten()
}

/// Builds a pagemap image as CRIU writes it: the image magics, the head
/// naming the pages image, then one entry per run of pages (what a page
/// server receiving a dump writes, see `criu::page_server`).
pub struct PagemapBuilder {
    out: Vec<u8>,
    last: Option<(u64, u64, u32)>,
}

impl PagemapBuilder {
    pub fn new(pages_id: u32) -> Self {
        Self::with_capacity(pages_id, 0)
    }

    /// As [`new`](Self::new), with room for `bytes` of entries from the
    /// start (room never written is never touched, so it costs no memory).
    pub fn with_capacity(pages_id: u32, bytes: usize) -> Self {
        let mut out = Vec::with_capacity(bytes);
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
        out.extend_from_slice(&PAGEMAP_MAGIC.to_ne_bytes());
        push_object(&mut out, &PagemapHead { pages_id }.encode_to_vec());
        PagemapBuilder { out, last: None }
    }

    /// Adds `nr` pages at `vaddr` with CRIU's `flags` (`PE_*`); a run that
    /// continues the previous one with the same flags is merged into it.
    pub fn push(&mut self, vaddr: u64, nr: u64, flags: u32) {
        match &mut self.last {
            Some((v, n, f)) if *f == flags && v.checked_add(*n * crate::format::PAGE_SIZE as u64) == Some(vaddr) => {
                *n += nr
            }
            _ => {
                self.flush();
                self.last = Some((vaddr, nr, flags));
            }
        }
    }

    fn flush(&mut self) {
        if let Some((vaddr, nr, flags)) = self.last.take() {
            // Both counts: CRIU >= 4.2 reads field 5, older CRIU field 2.
            let like = PagemapEntry { vaddr, nr_pages: 0, in_parent: None, flags: Some(flags), nr_pages64: Some(0) };
            push_entry(&mut self.out, &like, vaddr, nr);
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.flush();
        self.out
    }
}

/// `PE_PRESENT`, `PE_LAZY` and `PE_PARENT` of a pagemap entry's flags.
pub mod pe {
    pub const PARENT: u32 = super::PE_PARENT;
    pub const LAZY: u32 = super::PE_LAZY;
    pub const PRESENT: u32 = super::PE_PRESENT;
}

/// Whether `addr` lies in one of the `sorted` ranges [start, end), which do
/// not overlap.
pub(crate) fn in_ranges(sorted: &[(u64, u64)], addr: u64) -> bool {
    let i = sorted.partition_point(|&(s, _)| s <= addr);
    i > 0 && addr < sorted[i - 1].1
}
