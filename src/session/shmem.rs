//! Shared memory placed by criuz in a held tree, or served to a lazy one.
//!
//! CRIU restores shared memory itself, reading every page of it in one
//! thread (through its image stream, or from images written out first).
//! For a tree held stopped (`session::place`), criuz gives CRIU an empty
//! pagemap for each object of plain shared memory (anonymous shared memory,
//! which CRIU 4.2 dumps as a memfd where the kernel allows, and memfds:
//! PostgreSQL's shared buffers, nginx's zones), so that CRIU makes the
//! object and maps it everywhere it was mapped, but fills none of it. Once
//! CRIU hands the tree over, criuz registers the object's mappings with the
//! userfaultfd of the process they are in and copies the object's pages in
//! through them, on every core, as it copies private memory: the pages are
//! charged to the process's memory cgroup, as CRIU's copy charged them.
//! Zero pages are not copied: they stay holes, which read as zero and
//! become pages of memory only once the tree touches them (CRIU's restore
//! copied and allocated them all). The check of memory room before a
//! restore still counts them: the tree held them when it was dumped.
//!
//! An object is placed only where its every stored page lies in the object
//! as CRIU sizes it and in a shared mapping of a process CRIU restores, so
//! that each page reaches the object at the offset its pagemap gives it;
//! any other object (System V segments, huge pages, a memfd sealed against
//! writes or mapped only privately or read-only, one no writable mapping
//! shows whole) is left to CRIU.
//! The tree runs only once every page is in, each from a block checked as
//! it was decoded; a page that could not be copied fails the restore, and
//! the tree is killed before it ran.
//!
//! A lazy tree CRIU leaves stopped (`plan_lazy`) is served its shared
//! memory as it runs (`session::pager`): every mapping of an object is
//! registered before the tree runs, read-only ones too, since a hole
//! touched through any of them would be a page of zeros in the object. So
//! only an object no descriptor opens is served: a `read` through one
//! takes no fault.

use crate::archive::BlockSource;
use crate::criu::images::{self, SharedId, SharedMapping};
use crate::criu::uffd::Uffd;
use crate::engine::Crew;
use crate::error::{Error, Result};
use crate::format::{FileKind, PAGE_SIZE};
use crate::progress::Meter;
use crate::session::place::{self, Missing, Target, ZeroPages};
use crate::session::serve::zero_pages_of;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

const PAGE: u64 = PAGE_SIZE as u64;

/// One object of shared memory criuz fills: CRIU gets its pagemap
/// (`pagemap`) with no pages, and an empty pages image (`pages_id`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SharedObject {
    pub pagemap: String,
    pub pages_id: u32,
    /// The archive file of its pages image.
    pub pages_file: u32,
    /// Mappings to register first: (pid, start, end).
    pub mappings: Vec<(u32, u64, u64)>,
    /// Where each run of its pages that are not zero goes, in the order of
    /// its pages image.
    pub ranges: Vec<SharedRange>,
}

/// Pages `[start, end)` of process `pid`, from page `page` of the pages
/// image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SharedRange {
    pub pid: u32,
    pub start: u64,
    pub end: u64,
    pub page: u64,
}

impl SharedObject {
    /// Pages criuz copies in (zero pages are left out).
    pub fn pages(&self) -> u64 {
        self.ranges.iter().map(|r| (r.end - r.start) / PAGE).sum()
    }
}

/// The objects of the archive's shared memory criuz can fill itself, given
/// the pages images one pagemap alone names (`serve::pages_images_named_once`).
pub(crate) fn plan(source: &dyn BlockSource, named_once: &HashSet<u32>) -> Result<Vec<SharedObject>> {
    candidates(source, named_once, |c| {
        // Copies go through writable mappings only (see `SharedMapping`).
        let writable: Vec<(u32, SharedMapping)> = c.mappings.iter().copied().filter(|(_, m)| m.writable).collect();
        let (mappings, ranges) = through_mappings(c.runs, &writable, c.size, c.image_pages, c.is_zero)?;
        Some(SharedObject {
            pagemap: c.pagemap.to_string(),
            pages_id: c.pages_id,
            pages_file: c.pages_file,
            mappings,
            ranges,
        })
    })
}

/// An object of shared memory a lazy restore serves (`session::pager`):
/// every mapping of it is registered before the tree runs, a fault in any
/// copies the faulted page's block in, and the fill brings the rest. Only
/// an object no descriptor of the tree opens (anonymous shared memory,
/// which CRIU 4.2 dumps as a memfd, or a memfd whose descriptors were
/// closed): a mapping is then the only way to its pages, while a `read` of
/// a page not yet in would give zeros, which no fault announces.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LazyShared {
    pub pagemap: String,
    pub pages_id: u32,
    pub pages_file: u32,
    /// Every mapping of it, read-only ones too: (pid, mapping).
    pub mappings: Vec<(u32, SharedMapping)>,
    /// Its pages that are not zero, by offset: (offset, end offset, page of
    /// the pages image at offset).
    pub runs: Vec<(u64, u64, u64)>,
}

/// The objects of shared memory a lazy restore can serve itself (see
/// [`LazyShared`]): each stored run lies in the object as CRIU sizes it,
/// and each page that is not zero is shown by some mapping (one no mapping
/// shows could be reached by none; CRIU restores such an object).
pub(crate) fn plan_lazy(source: &dyn BlockSource, named_once: &HashSet<u32>) -> Result<Vec<LazyShared>> {
    let opened = opened_files(source)?;
    candidates(source, named_once, |c| {
        // A memfd's read-only mapping may come from a descriptor opened
        // read-only, which the kernel lets register no userfaultfd (no
        // `VM_MAYWRITE`); anonymous shared memory's always can.
        let unservable = |m: &SharedMapping| match m.object {
            SharedId::Anon(_) => false,
            SharedId::MemfdFile(file) => !m.writable || opened.as_ref().is_none_or(|o| o.contains(&file)),
        };
        if c.mappings.iter().any(|(_, m)| unservable(m)) {
            return None;
        }
        let runs = served_runs(c.runs, c.mappings, c.size, c.image_pages, c.is_zero)?;
        Some(LazyShared {
            pagemap: c.pagemap.to_string(),
            pages_id: c.pages_id,
            pages_file: c.pages_file,
            mappings: c.mappings.to_vec(),
            runs,
        })
    })
}

/// The pages of `runs` (an object's pagemap, offsets in the object) that
/// are not zero, merged into runs of (offset, end offset, image page of
/// offset) in offset order; `None` if a run is not stored whole in the
/// image's `image_pages`, lies past the object's `size`, or holds a page
/// that is not zero where no mapping shows it, or the runs are not in
/// offset order (CRIU's go up).
fn served_runs(
    runs: &[images::PageRun],
    mappings: &[(u32, SharedMapping)],
    size: u64,
    image_pages: u64,
    is_zero: impl Fn(u64) -> bool,
) -> Option<Vec<(u64, u64, u64)>> {
    let mut served: Vec<(u64, u64, u64)> = Vec::new();
    for r in runs {
        let end = r.vaddr.checked_add(r.nr.checked_mul(PAGE)?)?;
        if r.first.checked_add(r.nr)? > image_pages || end > size || r.vaddr % PAGE != 0 {
            return None;
        }
        for i in (0..r.nr).filter(|&i| !is_zero(r.first + i)) {
            let offset = r.vaddr + i * PAGE;
            mappings.iter().find_map(|(_, m)| m.address_of(offset))?;
            match served.last_mut() {
                Some((s, e, p)) if *e == offset && *p + (*e - *s) / PAGE == r.first + i => *e += PAGE,
                _ => served.push((offset, offset + PAGE, r.first + i)),
            }
        }
    }
    served.windows(2).all(|w| w[0].1 <= w[1].0).then_some(served)
}

/// The file ids the tree's descriptors open (`fdinfo-*.img`); `None` where
/// that cannot be told: an image not as expected, or descriptors in flight
/// in socket queues (`sk-queues.img`, whose entries criuz does not read).
fn opened_files(source: &dyn BlockSource) -> Result<Option<HashSet<u64>>> {
    let mut opened = HashSet::new();
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Plain && f.is_criu_image()) {
        if f.name == "sk-queues.img" {
            return Ok(None);
        }
        if f.name.starts_with("fdinfo-") {
            let Some(ids) = images::fd_file_ids(&source.read_file(f)?) else { return Ok(None) };
            opened.extend(ids);
        }
    }
    Ok(Some(opened))
}

/// An object of shared memory as the archive stores it, for `plan` and
/// `plan_lazy` to take or leave.
struct Candidate<'c> {
    pagemap: &'c str,
    pages_id: u32,
    pages_file: u32,
    /// Where CRIU stops reading it.
    size: u64,
    /// Its mappings in every process CRIU restores with memory, root first.
    mappings: &'c [(u32, SharedMapping)],
    /// Its pagemap's runs (offsets in the object).
    runs: &'c [images::PageRun],
    image_pages: u64,
    is_zero: &'c dyn Fn(u64) -> bool,
}

/// `take` of each object of plain shared memory whose pages image one
/// pagemap alone names, none of it lazy, that no mapping shows some other
/// way (System V, huge pages, privately) and that is named one way only.
fn candidates<T>(
    source: &dyn BlockSource,
    named_once: &HashSet<u32>,
    mut take: impl FnMut(Candidate) -> Option<T>,
) -> Result<Vec<T>> {
    let read =
        |name: &str| source.find(name).filter(|f| f.kind == FileKind::Plain).map(|f| source.read_file(f)).transpose();
    let Some(pids) = read("pstree.img")?.and_then(|p| images::pstree_pids(&p)) else { return Ok(Vec::new()) };
    // A memfd's mappings name its file; its pages are the memfd's.
    let memfds = match (read("files.img")?, read("memfd.img")?) {
        (Some(files), Some(memfd)) => images::memfds(&files, &memfd).unwrap_or_default(),
        _ => HashMap::new(),
    };
    let page_up = |size: u64| size.checked_next_multiple_of(PAGE);
    // By pagemap id: the object's size where CRIU takes it from the image
    // (a memfd's), and its mappings in every process CRIU restores with
    // memory (a zombie has no mm image), root first: tried first.
    let mut by_object: HashMap<u64, Mapped> = HashMap::new();
    let mut left_to_criu = HashSet::new();
    let pagemap_of = |id: SharedId| match id {
        SharedId::Anon(shmid) => Some((shmid, None)),
        SharedId::MemfdFile(file) => memfds.get(&file).map(|m| (m.shmid, page_up(m.size).filter(|_| m.writable))),
    };
    for pid in pids {
        let Some(mm) = read(&format!("mm-{pid}.img"))? else { continue };
        let Some((plain, other)) = images::shared_mappings(&mm) else { return Ok(Vec::new()) };
        left_to_criu.extend(other.into_iter().filter_map(|o| Some(pagemap_of(o)?.0)));
        for m in plain {
            let Some((id, size)) = pagemap_of(m.object) else { continue };
            let memfd = matches!(m.object, SharedId::MemfdFile(_));
            if memfd && size.is_none() {
                left_to_criu.insert(id);
            }
            let entry = by_object.entry(id).or_insert_with(|| Mapped { size, mappings: Vec::new() });
            let kind_of = |(_, o): &(u32, SharedMapping)| matches!(o.object, SharedId::MemfdFile(_));
            if entry.size != size || entry.mappings.first().is_some_and(|f| kind_of(f) != memfd) {
                // One object named two ways: not one CRIU wrote.
                left_to_criu.insert(id);
            }
            entry.mappings.push((pid, m));
        }
    }
    let mut objects = Vec::new();
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Plain && f.is_criu_image()) {
        let Some(id) = images::shmem_pagemap_id(&f.name) else { continue };
        let Some(Mapped { size, mappings }) = by_object.get(&id).filter(|_| !left_to_criu.contains(&id)) else {
            continue;
        };
        let Some((pages_id, runs)) = images::pagemap_runs(&source.read_file(f)?) else { continue };
        if !named_once.contains(&pages_id) || runs.iter().any(|r| r.lazy) {
            continue;
        }
        let Some(pages) = source.find(&format!("pages-{pages_id}.img")).filter(|p| p.kind == FileKind::Pages) else {
            continue;
        };
        let Some(zero) = zero_pages_of(source, pages) else { continue };
        // Anonymous shared memory: as far as its furthest mapping reaches,
        // as CRIU sizes it.
        let Some(size) = size.or_else(|| mappings.iter().map(|(_, m)| m.pgoff + (m.end - m.start)).max()) else {
            continue;
        };
        let is_zero = |page: u64| usize::try_from(page).is_ok_and(|p| zero.contains(p));
        let candidate = Candidate {
            pagemap: &f.name,
            pages_id,
            pages_file: pages.file_id,
            size,
            mappings,
            runs: &runs,
            image_pages: pages.raw_size / PAGE,
            is_zero: &is_zero,
        };
        objects.extend(take(candidate));
    }
    Ok(objects)
}

/// Where the pages of `runs` (an object's pagemap, offsets in the object)
/// that are not zero go through `mappings`, the first that shows each, and
/// the mappings used; `None` where [`served_runs`] refuses the runs.
fn through_mappings(
    runs: &[images::PageRun],
    mappings: &[(u32, SharedMapping)],
    size: u64,
    image_pages: u64,
    is_zero: impl Fn(u64) -> bool,
) -> Option<Through> {
    let mut used: Vec<(u32, u64, u64)> = Vec::new();
    let mut ranges = Vec::new();
    for (start, end, page) in served_runs(runs, mappings, size, image_pages, is_zero)? {
        let mut offset = start;
        while offset < end {
            let (pid, m, (addr, room)) = mappings.iter().find_map(|&(pid, m)| Some((pid, m, m.address_of(offset)?)))?;
            let n = room.min(end - offset);
            if !used.contains(&(pid, m.start, m.end)) {
                used.push((pid, m.start, m.end));
            }
            ranges.push(SharedRange { pid, start: addr, end: addr + n, page: page + (offset - start) / PAGE });
            offset += n;
        }
    }
    Some((used, ranges))
}

/// An object's mappings in the tree's processes, and its size where CRIU
/// takes it from the images (a memfd's).
struct Mapped {
    size: Option<u64>,
    mappings: Vec<(u32, SharedMapping)>,
}

/// The mappings a fill registers, (pid, start, end), and its ranges.
type Through = (Vec<(u32, u64, u64)>, Vec<SharedRange>);

/// What [`fill`] did.
pub(crate) struct FilledShared {
    pub pages: u64,
    /// Processes that were gone when their pages were copied.
    pub gone: Vec<u32>,
}

/// Registers each object's mappings with its process's userfaultfd
/// (`uffd_of`) and copies its pages in on `crew`. Every page must be
/// copied: the tree is held, so none is there already and nothing changes
/// its memory; a page that was not copied is an error.
pub(crate) fn fill<'u>(
    source: &dyn BlockSource,
    starts: &(dyn Fn(u32) -> Arc<Vec<u64>> + Sync),
    objects: &[SharedObject],
    uffd_of: impl Fn(u32) -> Option<&'u Uffd>,
    crew: Crew<'_>,
    meter: Option<&Meter>,
) -> Result<FilledShared> {
    let label = source.label();
    let uffd = |pid: u32, what: &str| {
        uffd_of(pid).ok_or_else(|| {
            Error::Mismatch(format!(
                "{label}: {what}: restored process {pid} maps it, but CRIU handed no such process over"
            ))
        })
    };
    let mut targets: Vec<Target> = Vec::new();
    let mut ranges = Vec::new();
    for o in objects {
        for &(pid, start, end) in &o.mappings {
            uffd(pid, &o.pagemap)?.register_missing(start, end - start).map_err(|err| Error::CriuIo {
                what: format!("{label}: {}: shared memory of restored process {pid} at {start:#x}", o.pagemap),
                err,
            })?;
        }
        for r in &o.ranges {
            let at = targets.iter().position(|t| t.pid == r.pid && t.file == o.pages_file);
            let space = match at {
                Some(i) => i,
                None => {
                    targets.push(Target {
                        pid: r.pid,
                        uffd: uffd(r.pid, &o.pagemap)?,
                        file: o.pages_file,
                        direct: &[],
                    });
                    targets.len() - 1
                }
            };
            ranges.push(Missing { space, start: r.start, end: r.end, page: r.page });
        }
    }
    let filled = place::fill(source, starts, &targets, &ranges, crew, ZeroPages::Copy, meter)?;
    let gone: Vec<u32> = filled.gone.iter().map(|&i| targets[i].pid).collect();
    if let Some(m) = filled.left.first() {
        let pid = targets[m.space].pid;
        return Err(Error::Criu(format!("{label}: restored process {pid} changed its memory while held stopped")));
    }
    let expected: u64 = objects.iter().map(SharedObject::pages).sum();
    if gone.is_empty() && filled.pages != expected {
        return Err(Error::Criu(format!(
            "{label}: only {} of the {expected} pages of shared memory could be placed in the restored tree",
            filled.pages
        )));
    }
    Ok(FilledShared { pages: filled.pages, gone })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criu::images::PageRun;

    fn mapping(start: u64, pages: u64, pgoff_pages: u64) -> SharedMapping {
        let end = start + pages * PAGE;
        SharedMapping { start, end, pgoff: pgoff_pages * PAGE, object: SharedId::Anon(9), writable: true }
    }

    fn run(offset_pages: u64, nr: u64, first: u64) -> PageRun {
        PageRun { vaddr: offset_pages * PAGE, nr, first, lazy: false }
    }

    #[test]
    fn pages_go_through_the_first_mapping_that_shows_them_and_zero_pages_stay_holes() {
        // Process 10 maps pages 0..4 of the object at 0x100000; process 11
        // maps pages 2..8 at 0x200000.
        let maps = [(10, mapping(0x100000, 4, 0)), (11, mapping(0x200000, 6, 2))];
        // Object pages 0..8 stored as image pages 0..8; image page 1 is zero.
        let (used, ranges) = through_mappings(&[run(0, 8, 0)], &maps, 8 * PAGE, 8, |p| p == 1).unwrap();
        assert_eq!(used, vec![(10, 0x100000, 0x100000 + 4 * PAGE), (11, 0x200000, 0x200000 + 6 * PAGE)]);
        assert_eq!(
            ranges,
            vec![
                SharedRange { pid: 10, start: 0x100000, end: 0x100000 + PAGE, page: 0 },
                SharedRange { pid: 10, start: 0x100000 + 2 * PAGE, end: 0x100000 + 4 * PAGE, page: 2 },
                SharedRange { pid: 11, start: 0x200000 + 2 * PAGE, end: 0x200000 + 6 * PAGE, page: 4 },
            ]
        );
    }

    #[test]
    fn a_lazy_restore_serves_the_pages_that_are_not_zero_by_offset() {
        // Process 10 maps pages 0..4 read-only, process 11 pages 2..8.
        let read_only = SharedMapping { writable: false, ..mapping(0x100000, 4, 0) };
        let maps = [(10, read_only), (11, mapping(0x200000, 6, 2))];
        // Object pages 0..8 stored as image pages 0..8, then 8..10 as 20..22;
        // image page 3 is zero.
        let runs = [run(0, 8, 0), run(8, 2, 20)];
        let size = 10 * PAGE;
        assert_eq!(served_runs(&runs, &maps, size, 22, |p| p == 3), None, "pages 8 and 9: no mapping shows them");
        let maps = [(10, read_only), (11, mapping(0x200000, 8, 2))];
        assert_eq!(
            served_runs(&runs, &maps, size, 22, |p| p == 3),
            Some(vec![(0, 3 * PAGE, 0), (4 * PAGE, 8 * PAGE, 4), (8 * PAGE, 10 * PAGE, 20)])
        );
        // Past the object, past the image, or out of order: left to CRIU.
        assert_eq!(served_runs(&runs, &maps, 9 * PAGE, 22, |_| false), None);
        assert_eq!(served_runs(&runs, &maps, size, 21, |_| false), None);
        assert_eq!(served_runs(&[run(4, 2, 0), run(0, 2, 2)], &maps, size, 4, |_| false), None);
    }

    #[test]
    fn an_object_no_mapping_shows_whole_is_left_to_criu() {
        let maps = [(10, mapping(0x100000, 2, 0)), (10, mapping(0x300000, 2, 4))];
        // Pages 2..4 of the object lie between the mappings: only CRIU,
        // which maps the object whole, reaches them.
        let size = 6 * PAGE;
        assert_eq!(through_mappings(&[run(0, 6, 0)], &maps, size, 6, |_| false), None);
        // Unless they are zero (holes read as zero).
        assert!(through_mappings(&[run(0, 6, 0)], &maps, size, 6, |p| p == 2 || p == 3).is_some());
        // A run past the object's end (CRIU stops reading there), even of
        // zero pages, or past the pages image's end, is not placed.
        assert_eq!(through_mappings(&[run(4, 4, 0)], &maps, size, 4, |_| true), None);
        assert_eq!(through_mappings(&[run(0, 2, 3)], &maps, size, 4, |_| false), None);
    }
}
