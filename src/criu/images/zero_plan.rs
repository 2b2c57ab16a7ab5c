//! The plan that leaves zero pages of private anonymous memory out of a
//! pagemap (the module doc of `criu::images` says why that is safe), and
//! tells the page server which pages of the pages image to skip.

use super::pagemap::*;
use super::proto::*;
use crate::format::PageBits;
use prost::Message;

/// Which pages of one pages image CRIU will not be sent.
#[derive(Clone, Debug)]
pub struct ZeroPlan {
    pub pages_id: u32,
    /// The rewritten pagemap image.
    pub pagemap: Vec<u8>,
    /// The pages of the pages image left out.
    skipped: PageBits,
    pub skipped_pages: u64,
}

impl ZeroPlan {
    pub fn is_skipped(&self, page: u64) -> bool {
        self.skipped.contains(page as usize)
    }
}

/// Plans the rewrite; `zero` holds the pages of the pages image that are
/// all zero. `None` when anything is not as expected.
pub fn plan(mm: &[u8], pagemap: &[u8], zero: &PageBits) -> Option<ZeroPlan> {
    plan_runs(mm, pagemap, zero, 1)
}

/// As `plan`, leaving out only runs of at least `min_run` zero pages: a lazy
/// restore fetches each gap-free range in requests of its own, so scattered
/// holes would multiply the requests. Where an entry lies in one VMA, the
/// runs long enough are found 64 pages at a time (`PageBits::next_run`):
/// page by page, a plan of 1 GiB took 4-6 ms, most of a lazy restore's own
/// start.
pub fn plan_runs(mm: &[u8], pagemap: &[u8], zero: &PageBits, min_run: u64) -> Option<ZeroPlan> {
    let anon = anon_vmas(mm, 0)?;
    let in_anon = |addr: u64| in_ranges(&anon, addr);

    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = decode_exact::<PagemapHead>(objs.first()?)?;
    let mut out = pagemap[..8].to_vec();
    push_object(&mut out, &head.encode_to_vec());
    let mut skipped = PageBits::new();
    let mut skipped_pages = 0u64;
    let mut page = 0u64; // next page of the pages image
    let mut after = 0u64;
    for obj in &objs[1..] {
        let e = decode_exact::<PagemapEntry>(obj)?;
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        // Pages in a parent image (a pre-dump chain packed as it was): where
        // CRIU's reading of the pages image goes on after them is its own
        // business (it moves on when it skips them, not when it reads them).
        let flags = entry_flags(&e);
        if flags & !(PE_PRESENT | PE_LAZY) != 0 {
            return None;
        }
        after = ascending(after, e.vaddr, nr)?;
        // CRIU marks anonymous pages PE_LAZY as well as PE_PRESENT; only a
        // lazy-pages restore acts on it, and a page left out is zero there too.
        if flags & PE_PRESENT == 0 {
            push_object(&mut out, obj);
            continue;
        }
        let end_addr = e.vaddr.checked_add(nr.checked_mul(4096)?)?;
        let first = usize::try_from(page).ok()?;
        let pages = usize::try_from(nr).ok()?;
        first.checked_add(pages)?;
        // Which pages may be left out: zero ones of private anonymous memory.
        let vma = anon.get(anon.partition_point(|&(s, _)| s <= e.vaddr).wrapping_sub(1));
        let whole = vma.is_some_and(|&(s, end)| s <= e.vaddr && end_addr <= end);
        let none = !whole && !anon.iter().any(|&(s, end)| s < end_addr && e.vaddr < end);
        // The first page from `i` that may be left out (`want`) or not, else nr.
        let next = |i: usize, want: bool| -> usize {
            if whole {
                zero.next(first + i, first + pages, want) - first
            } else if none {
                if want {
                    pages
                } else {
                    i
                }
            } else {
                (i..pages)
                    .find(|&k| (zero.contains(first + k) && in_anon(e.vaddr + k as u64 * 4096)) == want)
                    .unwrap_or(pages)
            }
        };
        // Kept runs, merged across zero runs too short to leave out.
        let min_run = usize::try_from(min_run).unwrap_or(usize::MAX);
        let mut kept_from = 0;
        let mut i = 0;
        while i < pages {
            // Inside one VMA, straight to the next run long enough.
            let z = if whole { zero.next_run(first + i, first + pages, min_run) - first } else { next(i, true) };
            if z >= pages {
                break;
            }
            let after = next(z, false);
            if after - z >= min_run {
                if z > kept_from {
                    push_entry(&mut out, &e, e.vaddr + kept_from as u64 * 4096, (z - kept_from) as u64);
                }
                skipped.insert_range(first + z, first + after);
                skipped_pages += (after - z) as u64;
                kept_from = after;
            }
            i = after;
        }
        if pages > kept_from {
            push_entry(&mut out, &e, e.vaddr + kept_from as u64 * 4096, (pages - kept_from) as u64);
        }
        page += nr;
    }
    Some(ZeroPlan { pages_id: head.pages_id, pagemap: out, skipped, skipped_pages })
}

/// The VMAs of plain private anonymous memory (`mm-<pid>.img`), sorted, none
/// of whose flags has any of the bits in `not`.
pub(super) fn anon_vmas(mm: &[u8], not: u32) -> Option<Vec<(u64, u64)>> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut anon: Vec<(u64, u64)> = mm
        .vmas
        .iter()
        .filter(|v| {
            v.status & VMA_AREA_REGULAR != 0
                && v.status & VMA_ANON_PRIVATE != 0
                && v.status & VMA_SPECIAL == 0
                && v.flags & (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32
                    == (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32
                && v.flags & (libc::MAP_SHARED as u32 | not) == 0
        })
        .map(|v| (v.start, v.end))
        .collect();
    anon.sort_unstable();
    Some(anon)
}
