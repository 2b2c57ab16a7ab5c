//! The fill of a tree held stopped (`restore --fill place`, the default
//! eager restore): every missing page of every address space copied in by
//! several threads at once; and each step of a running tree's fill.
//!
//! A running tree changes its address spaces under its pager
//! (`session::pager`), which must read a space's events before copying into
//! it again. A held tree runs nothing: no event can come, so that rule holds
//! with any number of copying threads; a running tree's pager reads no event
//! while a step of its fill runs here, so it holds there too. The work is
//! cut by archive block: each thread takes the next block, decodes it once
//! through the checked source into a buffer of its own (still in cache for
//! the copies that follow; no shared cache, no hand-off between threads), and
//! copies the block's pages into the ranges they fill. Decoding and copying
//! both grow with the threads, which a single copying thread fed by decoders
//! could not (on 2 cores, 1 GiB of zstd text restored in 1.07x of `criu
//! restore -D`'s time that way, 0.89x this way: docs/BENCHMARKS.md).
//!
//! Zero pages among the missing ones (a running tree's pagemap keeps short
//! runs of them) are mapped to the kernel's zero page, not copied: they
//! cost the tree no memory until it writes them, as in a placed restore,
//! which leaves them out altogether.
//!
//! In a held tree, memory the kernel would back with transparent huge
//! pages is written through the process's memory instead
//! (`Target::direct`, `proc::huge_pages`): `UFFDIO_COPY` places 4 KiB
//! pages only, and the process would run on small pages where it had huge
//! ones. Those ranges have no userfaultfd to hold a read of a page not yet
//! in, which only a held tree can afford: nothing runs before the fill ends
//! (the pager writes them once CRIU has exited and kills a tree that ran
//! meanwhile instead of letting it run, `Pager::fill_held_back`).
//!
//! Should a copy meet an event (`EAGAIN`: something in the tree ran), the
//! rest of that range goes back to the pager, which reads the events and
//! copies it after them. A block that fails to read or
//! decode stops every thread with its error (the caller kills the tree
//! before it ran): no page is copied from a block that did not check out.

use crate::archive::BlockSource;
use crate::codec::Decoder;
use crate::criu::uffd::{CopiedAll, Uffd};
use crate::engine::Crew;
use crate::error::{Error, Result};
use crate::format::PAGE_SIZE;
use crate::proc::huge_pages;
use crate::progress::Meter;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const PAGE: u64 = PAGE_SIZE as u64;

/// Missing pages of an address space: `[start, end)`, whose first page is
/// page `page` of the space's pages image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Missing {
    pub space: usize,
    pub start: u64,
    pub end: u64,
    pub page: u64,
}

/// An address space to fill: the process (for messages), its userfaultfd
/// and the archive file its pages are in.
pub(crate) struct Target<'a> {
    pub pid: u32,
    pub uffd: &'a Uffd,
    pub file: u32,
    /// Ranges taken off the userfaultfd, in address order, whose pages are
    /// written through the process's memory so that they fault in as huge
    /// pages (`proc::huge_pages`). A held tree's only: nothing runs there
    /// before every page is in, so a page not yet written is never read.
    pub direct: &'a [(u64, u64)],
}

/// Where the part of `[at, end)` that starts at `at` ends, and whether it
/// lies in one of the `direct` ranges.
fn segment(direct: &[(u64, u64)], at: u64, end: u64) -> (u64, bool) {
    let i = direct.partition_point(|&(_, e)| e <= at);
    match direct.get(i) {
        Some(&(s, e)) if s <= at => (e.min(end), true),
        Some(&(s, _)) => (s.min(end), false),
        None => (end, false),
    }
}

/// What a fill does with the zero pages its ranges hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ZeroPages {
    /// Mapped to the kernel's zero page: no memory and no copy. A lazy
    /// pagemap keeps short runs of zero pages (`session::lazy`); copying
    /// them made a lazily restored 1 GiB `mixed` tree hold twice the
    /// memory of a placed one, and its fill copy twice as much.
    Map,
    /// Copied in as pages of memory (`--keep-zero-pages`, and a held
    /// tree's fill, whose ranges hold zero pages only then).
    Copy,
}

/// What a placed restore does with memory the process may have had as
/// transparent huge pages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HugePages {
    /// Places it in 4 KiB pages, through the userfaultfd.
    Off,
    /// Writes it so that it is huge pages again (`Target::direct`); gives
    /// up on the rest, placing it in 4 KiB pages, where the kernel gives
    /// them at fewer than `floor` bytes a second a writing thread (0:
    /// never gives up).
    On { floor: f64 },
}

impl HugePages {
    /// Below this, per thread writing, huge pages cost more than they give
    /// back. On the 2-core VM, steps of 1 GiB of `thp` memory (half of it
    /// zero pages the kernel zeroes too) ran at 0.8-1.6 GB/s a thread while
    /// the huge pages the kernel had at hand lasted, then at 0.05-0.07 GB/s,
    /// as its host backed memory handed back to it again (session 96,
    /// docs/usage.md), while 4 KiB pages kept their pace: 0.15 GB/s lies
    /// clear of both.
    pub const DEFAULT_FLOOR: f64 = 0.15e9;
}

impl Default for HugePages {
    fn default() -> HugePages {
        HugePages::On { floor: HugePages::DEFAULT_FLOOR }
    }
}

/// How a held tree is filled.
#[derive(Clone)]
pub(crate) struct HeldFill {
    pub threads: usize,
    pub huge_pages: HugePages,
    /// Counts the bytes copied in, for a progress line.
    pub meter: Option<Arc<Meter>>,
}

/// Huge pages a held tree's fill gave up on: the kernel gave them at
/// `bytes_per_second` (per writing thread, zeroing and copy together), too
/// slowly to be worth the wait, and `small_page_bytes` of the memory that
/// could have been huge pages was placed in 4 KiB pages instead
/// (`Pager::fill_held_back`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct SlowHugePages {
    pub bytes_per_second: f64,
    pub small_page_bytes: u64,
}

/// What a fill did.
#[derive(Debug, Default)]
pub(crate) struct Filled {
    /// Pages copied in.
    pub pages: u64,
    /// Zero pages mapped (`ZeroPages::Map`).
    pub zero_pages: u64,
    /// Ranges an event kept from being copied: the pager's to finish.
    pub left: Vec<Missing>,
    /// Spaces whose process has gone (nothing more to copy there).
    pub gone: Vec<usize>,
    /// Bytes written through the processes' memory (`Target::direct`), and
    /// the time the threads spent writing them, added up: how fast the
    /// kernel gave those pages (`Pager::fill_held_back`).
    pub direct_bytes: u64,
    pub direct_seconds: f64,
}

/// One block's share of the work: the block, and the pieces of missing
/// ranges that its pages fill.
struct Unit {
    file: u32,
    block: usize,
    /// Where its data starts in the image (bytes).
    block_start: u64,
    pieces: Vec<Missing>,
}

/// Hands out the missing ranges block by block, in the order given (each
/// space's ranges by address, which is the order of their pages in its
/// image: a block is then taken once).
struct Cursor<'r> {
    ranges: &'r [Missing],
    next: usize,
    /// Pages of `ranges[next]` already handed out.
    taken: u64,
}

impl Cursor<'_> {
    fn next_unit(&mut self, targets: &[Target], starts: &dyn Fn(u32) -> Arc<Vec<u64>>) -> Result<Option<Unit>> {
        let Some(first) = self.ranges.get(self.next) else { return Ok(None) };
        let file = targets[first.space].file;
        let starts = starts(file);
        let at = (first.page + self.taken) * PAGE;
        let block = starts
            .partition_point(|&s| s <= at)
            .checked_sub(1)
            .ok_or_else(|| Error::corrupt(0, format!("page {} lies before the first block", at / PAGE)))?;
        let block_start = starts[block];
        let block_end = starts.get(block + 1).copied().unwrap_or(u64::MAX);
        let mut unit = Unit { file, block, block_start, pieces: Vec::new() };
        while let Some(r) = self.ranges.get(self.next) {
            let page = r.page + self.taken;
            if targets[r.space].file != file || page * PAGE < block_start || page * PAGE >= block_end {
                break;
            }
            let left = (r.end - r.start) / PAGE - self.taken;
            let fits = ((block_end - page * PAGE) / PAGE).min(left);
            let start = r.start + self.taken * PAGE;
            unit.pieces.push(Missing { space: r.space, start, end: start + fits * PAGE, page });
            if fits == left {
                self.next += 1;
                self.taken = 0;
            } else {
                self.taken += fits;
                break;
            }
        }
        Ok(Some(unit))
    }
}

thread_local! {
    /// A fill thread's decoder and block buffer: kept across the steps of a
    /// running tree's fill, whose pool threads run many short fills (a zstd
    /// context and a block's buffer made anew for each would be work and
    /// page faults every step).
    static WORKSPACE: std::cell::RefCell<(Decoder, Vec<u8>)> = std::cell::RefCell::new((Decoder::new(), Vec::new()));
}

/// Copies every range of `ranges` (in the order of `Cursor`) into its
/// space, on the threads of `crew`. `starts(file)`: where each block of a
/// pages image starts. An error is the first block or copy that failed.
pub(crate) fn fill(
    source: &dyn BlockSource,
    starts: &(dyn Fn(u32) -> Arc<Vec<u64>> + Sync),
    targets: &[Target],
    ranges: &[Missing],
    crew: Crew<'_>,
    zeros: ZeroPages,
    meter: Option<&Meter>,
) -> Result<Filled> {
    let cursor = Mutex::new(Cursor { ranges, next: 0, taken: 0 });
    let pages = AtomicU64::new(0);
    let zero_pages = AtomicU64::new(0);
    let shared = Shared {
        source,
        targets,
        zeros,
        gone: targets.iter().map(|_| AtomicBool::new(false)).collect(),
        left: Mutex::new(Vec::new()),
        direct_bytes: AtomicU64::new(0),
        direct_nanos: AtomicU64::new(0),
    };
    let step = |_: &mut ()| -> Result<bool> {
        let Some(unit) = cursor.lock().expect("fill cursor").next_unit(targets, starts)? else { return Ok(false) };
        let placed = WORKSPACE.with_borrow_mut(|(dec, data)| place_unit(&shared, &unit, dec, data));
        let (n, z) = placed.map_err(|e| {
            let pid = unit.pieces.first().map_or(0, |p| targets[p.space].pid);
            e.context(format!("{}: pages of restored process {pid}", source.label()))
        })?;
        pages.fetch_add(n, Ordering::Relaxed);
        zero_pages.fetch_add(z, Ordering::Relaxed);
        if let Some(m) = meter {
            m.taken.fetch_add((n + z) * PAGE, Ordering::Relaxed);
        }
        Ok(true)
    };
    crate::engine::until_done_or_failed_on(crew, || (), step)?;
    let Shared { gone, left, direct_bytes, direct_nanos, .. } = shared;
    let gone = gone.iter().enumerate().filter(|(_, g)| g.load(Ordering::Relaxed)).map(|(i, _)| i).collect();
    Ok(Filled {
        pages: pages.into_inner(),
        zero_pages: zero_pages.into_inner(),
        left: left.into_inner().expect("fill leftovers"),
        gone,
        direct_bytes: direct_bytes.into_inner(),
        direct_seconds: direct_nanos.into_inner() as f64 / 1e9,
    })
}

/// What every thread of a fill works from, and what it leaves behind.
struct Shared<'a> {
    source: &'a dyn BlockSource,
    targets: &'a [Target<'a>],
    zeros: ZeroPages,
    /// Per target: its process has gone.
    gone: Vec<AtomicBool>,
    /// Ranges an event kept out.
    left: Mutex<Vec<Missing>>,
    /// `Filled::direct_bytes`, and the nanoseconds behind `direct_seconds`.
    direct_bytes: AtomicU64,
    direct_nanos: AtomicU64,
}

/// Decodes one block and copies its pieces; the pages copied, and the zero
/// pages mapped.
fn place_unit(shared: &Shared, unit: &Unit, dec: &mut Decoder, data: &mut Vec<u8>) -> Result<(u64, u64)> {
    let Shared { source, targets, zeros, gone, left, direct_bytes, direct_nanos } = shared;
    let block = source
        .block(unit.file, unit.block)?
        .ok_or_else(|| Error::corrupt(0, format!("block {} is missing", unit.block)))?;
    block.decode(dec, data)?;
    // The decoded block is checked, zero pages included (`decode` rebuilds
    // them from the bitmap the data check covers).
    let map_zeros = *zeros == ZeroPages::Map && block.header.zero_pages() > 0;
    let (mut copied, mut zero_pages) = (0, 0);
    for p in &unit.pieces {
        let from = (p.page * PAGE - unit.block_start) as usize;
        let len = (p.end - p.start) as usize;
        let bytes = data
            .get(from..from + len)
            .ok_or_else(|| Error::corrupt(block.offset, format!("page {} is not stored whole in its block", p.page)))?;
        if gone[p.space].load(Ordering::Relaxed) {
            continue;
        }
        let t = &targets[p.space];
        let mut at = p.start;
        while at < p.end {
            let (to, direct) = segment(t.direct, at, p.end);
            let skip = (at - p.start) as usize;
            let seg = &bytes[skip..skip + (to - at) as usize];
            if direct {
                let began = Instant::now();
                let written = huge_pages::write_memory(t.pid, at, seg);
                direct_nanos.fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
                match written {
                    Ok(()) => {
                        copied += seg.len() as u64 / PAGE;
                        direct_bytes.fetch_add(seg.len() as u64, Ordering::Relaxed);
                    }
                    Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                        gone[p.space].store(true, Ordering::Relaxed);
                        break;
                    }
                    Err(err) => {
                        return Err(Error::CriuIo { what: format!("memory of restored process {}", t.pid), err })
                    }
                }
                at = to;
                continue;
            }
            let first = (from + skip) / PAGE_SIZE;
            let put = if map_zeros {
                t.uffd.copy_all_mapping_zeros(at, seg, |i| block.header.is_zero_page(first + i))
            } else {
                t.uffd.copy_all(at, seg)
            };
            match put
                .map_err(|err| Error::CriuIo { what: format!("userfaultfd of restored process {}", t.pid), err })?
            {
                CopiedAll::Done { pages, zeros } => {
                    copied += pages;
                    zero_pages += zeros;
                }
                CopiedAll::Changing { done, pages, zeros } => {
                    copied += pages;
                    zero_pages += zeros;
                    let rest = at + done;
                    let page = p.page + (rest - p.start) / PAGE;
                    left.lock().expect("fill leftovers").push(Missing { start: rest, end: to, page, ..*p });
                }
                CopiedAll::Gone => {
                    gone[p.space].store(true, Ordering::Relaxed);
                    break;
                }
            }
            at = to;
        }
    }
    Ok((copied, zero_pages))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(ranges: &[Missing], files: &[u32], starts: &[u64]) -> Vec<(u32, usize, Vec<Missing>)> {
        let nulls: Vec<Uffd> =
            files.iter().map(|_| Uffd(std::fs::File::open("/dev/null").expect("/dev/null").into())).collect();
        let targets: Vec<Target> =
            files.iter().zip(&nulls).map(|(&file, uffd)| Target { pid: 1, uffd, file, direct: &[] }).collect();
        let starts = Arc::new(starts.to_vec());
        let of = |_: u32| starts.clone();
        let mut c = Cursor { ranges, next: 0, taken: 0 };
        let mut out = Vec::new();
        while let Some(u) = c.next_unit(&targets, &of).expect("unit") {
            out.push((u.file, u.block, u.pieces));
        }
        out
    }

    fn m(space: usize, start: u64, end: u64, page: u64) -> Missing {
        Missing { space, start: start * PAGE, end: end * PAGE, page }
    }

    #[test]
    fn ranges_are_cut_at_block_ends_and_grouped_by_block() {
        // Blocks of 4 pages; two ranges in the first block, one across the
        // second and third.
        let starts = [0, 4 * PAGE, 8 * PAGE, 12 * PAGE];
        let ranges = [m(0, 100, 101, 0), m(0, 102, 104, 2), m(0, 200, 206, 5)];
        let got = units(&ranges, &[7], &starts);
        assert_eq!(
            got,
            vec![
                (7, 0, vec![m(0, 100, 101, 0), m(0, 102, 104, 2)]),
                (7, 1, vec![m(0, 200, 203, 5)]),
                (7, 2, vec![m(0, 203, 206, 8)]),
            ]
        );
    }

    #[test]
    fn spaces_with_other_images_start_their_own_blocks() {
        let starts = [0, 4 * PAGE];
        let ranges = [m(0, 10, 12, 0), m(1, 10, 12, 2)];
        let got = units(&ranges, &[1, 2], &starts);
        assert_eq!(got, vec![(1, 0, vec![m(0, 10, 12, 0)]), (2, 0, vec![m(1, 10, 12, 2)])]);
    }

    #[test]
    fn a_piece_is_cut_where_direct_ranges_begin_and_end() {
        let direct = [(10, 20), (30, 40)];
        let mut cuts = Vec::new();
        let mut at = 5;
        while at < 45 {
            let (to, d) = segment(&direct, at, 45);
            cuts.push((at, to, d));
            at = to;
        }
        assert_eq!(cuts, vec![(5, 10, false), (10, 20, true), (20, 30, false), (30, 40, true), (40, 45, false)]);
        assert_eq!(segment(&direct, 12, 15), (15, true));
        assert_eq!(segment(&[], 12, 15), (15, false));
    }

    #[test]
    fn a_page_before_the_first_block_is_damage() {
        let starts = [4 * PAGE];
        let ranges = [m(0, 10, 12, 0)];
        let nul = Uffd(std::fs::File::open("/dev/null").expect("/dev/null").into());
        let targets = [Target { pid: 1, uffd: &nul, file: 0, direct: &[] }];
        let starts = Arc::new(starts.to_vec());
        let of = |_: u32| starts.clone();
        let mut c = Cursor { ranges: &ranges, next: 0, taken: 0 };
        assert!(matches!(c.next_unit(&targets, &of), Err(Error::Corrupt { .. })));
    }
}
