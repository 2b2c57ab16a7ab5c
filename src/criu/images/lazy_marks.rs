//! Which pages a lazy restore leaves to criuz: the lazy flags CRIU should
//! have set (its stack test misfires on a page-aligned stack pointer, and
//! then nothing is lazy), given back to plain private anonymous memory,
//! and the check that every page flagged lazy lies where CRIU registers a
//! userfaultfd (elsewhere nobody could copy it in).

use super::pagemap::*;
use super::proto::*;
use super::zero_plan::*;
use prost::Message;

/// The VMAs (`mm-<pid>.img`) a lazy restore's CRIU registers with
/// userfaultfd, sorted: private anonymous memory neither locked nor huge,
/// other than the vDSO, its data and vsyscall (`vma_entry_can_be_lazy` in
/// criu/include/vma.h, v4.2).
/// `None` too where the VMAs overlap or are out of address order, which
/// CRIU never writes: which of two mappings a page lands in would then be
/// a matter of the order they are mapped in.
fn registered_vmas(mm: &[u8]) -> Option<Vec<(u64, u64)>> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut after = 0;
    for v in &mm.vmas {
        (v.start >= after && v.end > v.start).then_some(())?;
        after = v.end;
    }
    let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32;
    let pinned = (libc::MAP_LOCKED | libc::MAP_HUGETLB) as u32;
    let mut vmas: Vec<(u64, u64)> = mm
        .vmas
        .iter()
        .filter(|v| v.flags & anon == anon && v.flags & pinned == 0 && v.status & VMA_KERNEL == 0)
        .map(|v| (v.start, v.end))
        .collect();
    vmas.sort_unstable();
    Some(vmas)
}

/// Whether every run of `runs` flagged lazy lies in memory a lazy restore's
/// CRIU registers with userfaultfd (`registered_vmas` of `mm-<pid>.img`);
/// false if the image is not as expected. CRIU leaves each page flagged
/// lazy to the page server, whatever memory it is in: one where no
/// userfaultfd is registered would be copied by nobody (a copy there
/// fails), and the process would read the file's bytes or zeros where the
/// archive holds others. CRIU flags no such page; an archive crafted so is
/// not placed.
pub fn lazy_runs_registered(mm: &[u8], runs: &[PageRun]) -> bool {
    let Some(vmas) = registered_vmas(mm) else { return false };
    runs.iter().filter(|r| r.lazy).all(|r| {
        // A run may go on across adjacent VMAs (CRIU merges the pages of
        // neighbours into one entry).
        let (mut at, end) = (r.vaddr, r.vaddr.saturating_add(r.nr.saturating_mul(4096)));
        while at < end {
            match vmas.partition_point(|&(s, _)| s <= at).checked_sub(1).map(|i| vmas[i]) {
                Some((_, vma_end)) if at < vma_end => at = vma_end,
                _ => return false,
            }
        }
        true
    })
}

/// Marks lazy (`PE_LAZY`) the present pages CRIU should have marked.
///
/// CRIU marks lazy the pages of the memory a lazy restore registers with
/// userfaultfd (private anonymous, not locked, not huge), except the page
/// holding a thread's stack pointer. But its test for that page (`is_stack`
/// in criu/mem.c, v4.2) compares only the offset within a page, so when a
/// thread's stack pointer is page-aligned (about one dump in 256) every
/// page is "the stack", nothing is lazy, and a lazy restore has CRIU copy
/// every page before the tree runs. This gives the flag back to present
/// pages of plain private anonymous memory (`anon_vmas`, no stricter than
/// CRIU's rule), neither locked nor huge, other than the pages at and just
/// below each of `stack_pointers`. It only ever adds the flag, so a dump
/// CRIU marked right comes back unchanged. `None` if anything is not as
/// expected.
pub fn mark_lazy(mm: &[u8], pagemap: &[u8], stack_pointers: &[u64]) -> Option<Vec<u8>> {
    let vmas = anon_vmas(mm, (libc::MAP_LOCKED | libc::MAP_HUGETLB) as u32)?;
    let page = !(crate::format::PAGE_SIZE as u64 - 1);
    let near_stack =
        |vaddr: u64| stack_pointers.iter().any(|&sp| vaddr == sp & page || vaddr == (sp & page).wrapping_sub(4096));
    let may_be_lazy = |vaddr: u64| in_ranges(&vmas, vaddr) && !near_stack(vaddr);
    let objs = objects(pagemap, PAGEMAP_MAGIC)?;
    let head = decode_exact::<PagemapHead>(objs.first()?)?;
    let mut out = pagemap[..8].to_vec();
    push_object(&mut out, &head.encode_to_vec());
    for obj in &objs[1..] {
        let e = decode_exact::<PagemapEntry>(obj)?;
        if e.flags != Some(PE_PRESENT) || entry_flags(&e) != PE_PRESENT {
            push_object(&mut out, obj);
            continue;
        }
        let nr = e.nr_pages64.unwrap_or(u64::from(e.nr_pages));
        let at = |i: u64| e.vaddr.checked_add(i.checked_mul(4096)?);
        let mut i = 0;
        while i < nr {
            let lazy = may_be_lazy(at(i)?);
            let mut j = i + 1;
            while j < nr && may_be_lazy(at(j)?) == lazy {
                j += 1;
            }
            let flags = if lazy { PE_PRESENT | PE_LAZY } else { PE_PRESENT };
            push_entry(&mut out, &PagemapEntry { flags: Some(flags), ..e.clone() }, at(i)?, j - i);
            i = j;
        }
    }
    Some(out)
}
