//! Huge-page memory: which mappings of a process are hugetlb (private or
//! shared) and with what page size, and which memfds are. CRIU's image
//! stream cannot restore private huge-page memory, and huge pages come from
//! the system's pool, which a restore checks for room before it starts.
use super::pagemap::*;
use super::proto::*;
use prost::Message;

/// Whether a process (`mm-<pid>.img`) has private memory of huge pages
/// (`MAP_HUGETLB` without `MAP_SHARED`). CRIU restores such memory in its
/// restorer, reading the pages image at random (`preadv`), which its image
/// stream cannot do: a streamed restore of it fails "Can't read pages data
/// (-29)" (criu/pie/restorer.c, v4.2). `None` if the image is not as
/// expected.
pub fn private_huge_pages(mm: &[u8]) -> Option<bool> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    Some(mm.vmas.iter().any(|v| is_huge(v) && v.flags & libc::MAP_SHARED as u32 == 0))
}

/// Whether a VMA is a mapping of huge pages (`MAP_HUGETLB`).
fn is_huge(v: &VmaEntry) -> bool {
    v.status & VMA_AREA_REGULAR != 0 && v.flags & libc::MAP_HUGETLB as u32 != 0
}

/// The huge page size that mmap or memfd_create `flags` name: log2 of it
/// from [`MAP_HUGE_SHIFT`] (the same bits for both), 0 for the system's
/// `default` size. `None` for a size past 64 bits.
fn huge_page_size(flags: u32, default: u64) -> Option<u64> {
    match (flags >> MAP_HUGE_SHIFT) & 0x3f {
        0 => Some(default),
        shift => 1u64.checked_shl(shift),
    }
}

/// Where a huge-page mapping's flags hold log2 of its page size (0: the
/// system's default size), as mmap takes it (`MAP_HUGE_SHIFT`).
pub(super) const MAP_HUGE_SHIFT: u32 = 26;

/// What a process's images hold of huge-page memory (`MAP_HUGETLB`). It
/// comes back from the system's pool of huge pages (vm.nr_hugepages), not
/// from the memory a cgroup limits or `MemAvailable` counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HugeMemory {
    /// The pages of the process's pages image in private huge-page
    /// mappings, as ranges [first, end) of page numbers in that image.
    pub private_pages: Vec<(u64, u64)>,
    /// Huge pages those pages fill, as (page size in bytes, count): one
    /// per aligned huge page holding a dumped page.
    pub private_huge: Vec<(u64, u64)>,
    /// The shared memory of huge pages the process maps: its id (CRIU's
    /// `pagemap-shmem-<id>.img`) and page size.
    pub shared: Vec<(u64, u64)>,
}

/// The huge-page memory of a process, from its `mm-<pid>.img` and
/// `pagemap-<pid>.img`; `default_size` is the system's huge page size, for a
/// mapping that names none. `None` if an image is not as expected.
pub fn huge_memory(mm: &[u8], pagemap: &[u8], default_size: u64) -> Option<HugeMemory> {
    let mm = MmEntry::decode(*objects(mm, MM_MAGIC)?.first()?).ok()?;
    let mut out = HugeMemory::default();
    let mut private: Vec<(u64, u64, u64)> = Vec::new();
    for v in mm.vmas.iter().filter(|v| is_huge(v)) {
        let size = huge_page_size(v.flags, default_size)?.max(crate::format::PAGE_SIZE as u64);
        if v.flags & libc::MAP_SHARED as u32 != 0 {
            // Shared memory of huge pages is, where the kernel has memfds
            // of huge pages, a memfd ([`huge_memfds`]); else shared memory
            // of its own.
            if v.status & VMA_ANON_SHARED != 0 && !out.shared.iter().any(|&(id, _)| id == v.shmid) {
                out.shared.push((v.shmid, size));
            }
        } else {
            private.push((v.start, v.end, size));
        }
    }
    if private.is_empty() {
        return Some(out);
    }
    private.sort_unstable();
    let (_, runs) = pagemap_runs(pagemap)?;
    // The last huge page counted, by size: runs come in address order.
    let mut counted: Vec<(u64, u64, u64)> = Vec::new();
    for r in &runs {
        let (start, end) = (r.vaddr, r.vaddr + r.nr * 4096);
        // The mappings are apart, so in order of their ends too.
        let after = private.partition_point(|&(_, e, _)| e <= start);
        for &(s, e, size) in private[after..].iter().take_while(|&&(s, ..)| s < end).filter(|&&(_, e, _)| start < e) {
            let (from, to) = (start.max(s), end.min(e));
            if from >= to {
                continue;
            }
            let first = r.first + (from - start) / 4096;
            let last = first + (to - from) / 4096;
            match out.private_pages.last_mut() {
                Some((_, at)) if *at == first => *at = last,
                _ => out.private_pages.push((first, last)),
            }
            let (lo, hi) = (from / size, (to - 1) / size);
            match counted.iter_mut().find(|(z, ..)| *z == size) {
                Some((_, seen, n)) => {
                    *n += hi - lo + 1 - u64::from(*seen == lo);
                    *seen = hi;
                }
                None => counted.push((size, hi, hi - lo + 1)),
            }
        }
    }
    out.private_huge = counted.into_iter().map(|(size, _, n)| (size, n)).collect();
    Some(out)
}

/// The memfds of huge pages in a tree's memfd.img (`memfd_inode_entry`s
/// with `MFD_HUGETLB`): the id of each one's contents (CRIU's
/// `pagemap-shmem-<id>.img`) and its page size. CRIU dumps this way every
/// shared mapping of huge pages, and every hugetlbfs file, not only
/// memfds. `None` if the image is not as expected.
pub fn huge_memfds(memfd: &[u8], default_size: u64) -> Option<Vec<(u64, u64)>> {
    const MFD_HUGETLB: u32 = 4;
    let mut out = Vec::new();
    for obj in objects(memfd, MEMFD_INODE_MAGIC)? {
        let e = MemfdInodeEntry::decode(obj).ok()?;
        let Some(flag) = e.hugetlb_flag.filter(|f| f & MFD_HUGETLB != 0) else { continue };
        out.push((u64::from(e.shmid), huge_page_size(flag, default_size)?));
    }
    Some(out)
}

/// Huge pages of `size` bytes that the pages of a shared memory's pagemap
/// (`pagemap-shmem-<id>.img`) fill: one per aligned huge page holding a
/// dumped page. `None` if the image is not as expected.
pub fn shared_huge_pages(pagemap: &[u8], size: u64) -> Option<(u32, u64)> {
    let (pages_id, runs) = pagemap_runs(pagemap)?;
    let size = size.max(crate::format::PAGE_SIZE as u64);
    let mut last = None;
    let mut n = 0;
    for r in runs.iter().filter(|r| r.nr > 0) {
        let (first, end) = (r.vaddr / size, (r.vaddr + r.nr * 4096 - 1) / size);
        n += end - first + 1 - u64::from(last == Some(first));
        last = Some(end);
    }
    Some((pages_id, n))
}
