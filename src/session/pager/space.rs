//! The pager's bookkeeping of what is still missing: each address space
//! being filled (a restored process, or a child it forked before every
//! page was in), its missing pages by address, and its mappings ("views")
//! of the shared memory the pager serves, whose missing pages are the
//! object's, by offset. Only the pager's thread changes it, between steps:
//! dropped, moved and unmapped ranges are taken out as the process's
//! userfaultfd events report them.

use crate::criu::uffd::Uffd;
use std::collections::BTreeMap;

const PAGE: u64 = crate::format::PAGE_SIZE as u64;

/// Pages not in place yet: first address (or offset in a shared memory
/// object) -> (end, the first one's page in the archive's image).
pub(super) type MissingPages = BTreeMap<u64, (u64, u64)>;

/// The missing range holding `at`.
pub(super) fn missing_at(missing: &MissingPages, at: u64) -> Option<(u64, u64, u64)> {
    let (&start, &(end, page)) = missing.range(..=at).next_back()?;
    (at < end).then_some((start, end, page))
}

/// Takes `[from, to)` out of the missing ranges; returns the pieces that
/// were inside, as (start, end, archive page of start).
pub(super) fn take_range(missing: &mut MissingPages, from: u64, to: u64) -> Vec<(u64, u64, u64)> {
    let hit: Vec<(u64, u64, u64)> =
        missing.range(..to).rev().take_while(|(_, &(end, _))| end > from).map(|(&s, &(e, p))| (s, e, p)).collect();
    let mut inside = Vec::with_capacity(hit.len());
    for (start, end, page) in hit {
        missing.remove(&start);
        if start < from {
            missing.insert(start, (from, page));
        }
        if end > to {
            missing.insert(to, (end, page + (to - start) / PAGE));
        }
        let (s, e) = (start.max(from), end.min(to));
        inside.push((s, e, page + (s - start) / PAGE));
    }
    inside
}

/// An address space being filled: a restored process, or a child it forked
/// before every page was in place (which misses the same pages).
pub(super) struct Space {
    pub(super) pid: u32,
    pub(super) uffd: Uffd,
    pub(super) file: u32,
    /// Lazy private pages not in place yet, by address.
    pub(super) missing: MissingPages,
    /// Its mappings of shared memory the pager serves, registered.
    pub(super) views: Vec<View>,
    /// A held tree's missing pages in spans that may be huge pages, kept
    /// out of the fill (still on the userfaultfd) until they can be written
    /// so (`Pager::fill_held_back`); and those spans, in address order.
    pub(super) held_back: MissingPages,
    pub(super) huge_spans: Vec<(u64, u64)>,
}

/// A mapping of served shared memory: `[start, end)` shows object `object`
/// (of `Pager::served`) from byte `pgoff` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct View {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) pgoff: u64,
    pub(super) object: usize,
}

impl View {
    pub(super) fn shows(&self, offset: u64) -> bool {
        offset >= self.pgoff && offset - self.pgoff < self.end - self.start
    }

    /// The object's offset one past the last byte it shows.
    pub(super) fn pgend(&self) -> u64 {
        self.pgoff + (self.end - self.start)
    }
}

/// Shared memory a lazy restore serves (`shmem::LazyShared`): its pages
/// not in yet, by offset in the object. A page copied in
/// through one process's mapping is in for every mapping of it.
pub(super) struct ServedObject {
    pub(super) pages_file: u32,
    pub(super) missing: MissingPages,
}

impl Space {
    pub(super) fn new(pid: u32, uffd: Uffd, file: u32, missing: MissingPages, views: Vec<View>) -> Space {
        Space { pid, uffd, file, missing, views, held_back: MissingPages::new(), huge_spans: Vec::new() }
    }

    /// Moves the missing pages inside `spans` out of the fill into
    /// `held_back`; keeps the spans that hold any.
    pub(super) fn hold_back(&mut self, spans: Vec<(u64, u64)>) {
        for (start, end) in spans {
            let inside = take_range(&mut self.missing, start, end);
            if !inside.is_empty() {
                self.held_back.extend(inside.into_iter().map(|(s, e, p)| (s, (e, p))));
                self.huge_spans.push((start, end));
            }
        }
    }

    /// Puts the pages held back among the missing ones again; returns the
    /// spans they lay in.
    pub(super) fn release_held_back(&mut self) -> Vec<(u64, u64)> {
        self.missing.append(&mut self.held_back);
        std::mem::take(&mut self.huge_spans)
    }

    /// The missing range holding `addr`.
    pub(super) fn missing_at(&self, addr: u64) -> Option<(u64, u64, u64)> {
        missing_at(&self.missing, addr)
    }

    pub(super) fn drop_range(&mut self, from: u64, to: u64) {
        take_range(&mut self.missing, from, to);
    }

    /// The view showing `addr`, and the offset it shows there.
    pub(super) fn view_at(&self, addr: u64) -> Option<(View, u64)> {
        self.views.iter().find(|v| v.start <= addr && addr < v.end).map(|v| (*v, v.pgoff + (addr - v.start)))
    }

    /// Takes `[from, to)` out of its views (unmapped, or no longer served).
    pub(super) fn cut_views(&mut self, from: u64, to: u64) {
        let mut kept = Vec::with_capacity(self.views.len());
        for v in self.views.drain(..) {
            if v.end <= from || v.start >= to {
                kept.push(v);
                continue;
            }
            if v.start < from {
                kept.push(View { end: from, ..v });
            }
            if v.end > to {
                kept.push(View { start: to, pgoff: v.pgoff + (to - v.start), ..v });
            }
        }
        self.views = kept;
    }

    /// `mremap` moved `[from, from + len)` to `to`.
    pub(super) fn remap(&mut self, from: u64, to: u64, len: u64) {
        for (s, e, p) in take_range(&mut self.missing, from, from + len) {
            self.missing.insert(s - from + to, (e - from + to, p));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(ranges: &[(u64, u64, u64)]) -> BTreeMap<u64, (u64, u64)> {
        ranges.iter().map(|&(s, e, p)| (s * PAGE, (e * PAGE, p))).collect()
    }

    fn with(missing: BTreeMap<u64, (u64, u64)>) -> Space {
        let fd = std::fs::File::open("/dev/null").expect("/dev/null");
        Space::new(1, Uffd(fd.into()), 0, missing, Vec::new())
    }

    #[test]
    fn dropping_splits_and_keeps_archive_pages() {
        let mut s = with(space(&[(10, 20, 100), (30, 40, 200)]));
        s.drop_range(12 * PAGE, 35 * PAGE);
        assert_eq!(s.missing, space(&[(10, 12, 100), (35, 40, 205)]));
        assert_eq!(s.missing_at(36 * PAGE), Some((35 * PAGE, 40 * PAGE, 205)));
        assert_eq!(s.missing_at(12 * PAGE), None);
    }

    #[test]
    fn unmapping_cuts_views_of_shared_memory_and_keeps_their_offsets() {
        let mut s = with(BTreeMap::new());
        let view = |start: u64, end: u64, pgoff: u64| View {
            start: start * PAGE,
            end: end * PAGE,
            pgoff: pgoff * PAGE,
            object: 0,
        };
        s.views = vec![view(10, 20, 0), view(30, 34, 100)];
        s.cut_views(12 * PAGE, 15 * PAGE);
        assert_eq!(s.views, vec![view(10, 12, 0), view(15, 20, 5), view(30, 34, 100)]);
        assert_eq!(s.view_at(16 * PAGE + 5), Some((view(15, 20, 5), 6 * PAGE + 5)));
        assert_eq!(s.view_at(13 * PAGE), None, "unmapped");
        s.cut_views(0, 40 * PAGE);
        assert!(s.views.is_empty());
    }

    #[test]
    fn pages_held_back_leave_the_fill_and_come_back_whole() {
        let mut s = with(space(&[(10, 20, 100), (30, 40, 200)]));
        s.hold_back(vec![(0, 12), (16, 32), (50, 60)].into_iter().map(|(a, b)| (a * PAGE, b * PAGE)).collect());
        assert_eq!(s.missing, space(&[(12, 16, 102), (32, 40, 202)]));
        assert_eq!(s.held_back, space(&[(10, 12, 100), (16, 20, 106), (30, 32, 200)]));
        assert_eq!(
            s.huge_spans,
            vec![(0, 12 * PAGE), (16 * PAGE, 32 * PAGE)],
            "a span holding no missing page is dropped"
        );
        assert_eq!(s.release_held_back(), vec![(0, 12 * PAGE), (16 * PAGE, 32 * PAGE)]);
        let pieces = space(&[(10, 12, 100), (12, 16, 102), (16, 20, 106), (30, 32, 200), (32, 40, 202)]);
        assert_eq!(s.missing, pieces);
        assert!(s.held_back.is_empty() && s.huge_spans.is_empty());
    }

    #[test]
    fn remapping_moves_pages_with_their_source() {
        let mut s = with(space(&[(10, 20, 100)]));
        s.remap(15 * PAGE, 50 * PAGE, 10 * PAGE);
        assert_eq!(s.missing, space(&[(10, 15, 100), (50, 55, 105)]));
    }
}
