//! The fill, between faults: a running tree's in steps (the recorded
//! working set first, then address order, a few blocks a thread, on a
//! pool made at the first step), a held tree's all at once on every
//! granted thread before it runs, and served shared memory once every
//! private page is in.

use super::space::{take_range, Space, View};
use super::{Pager, Step, PAGE};
use crate::engine::Crew;
use crate::error::Result;
use crate::proc::huge_pages;
use crate::session::place::{self, HeldFill, HugePages, Missing, SlowHugePages, Target, ZeroPages};
use crate::session::shmem;
use std::time::Instant;

/// Blocks each thread of a running tree's fill takes in one step: a fault
/// that arrives meanwhile waits for the step, so a step is short; two
/// blocks a thread even out blocks that take longer than others.
const STEP_BLOCKS: u64 = 2;

impl<'a> Pager<'a> {
    /// One step of the fill of served shared memory, once every private
    /// page is in: the next missing pages of each object, through the first
    /// space with a view that shows them (a process CRIU handed over comes
    /// before the children it forked), on the fill's threads
    /// (`session::place`). Pages no view of any process shows any more
    /// (every mapping gone) are dropped: nothing can read them.
    pub(super) fn fill_served_step(&mut self) -> Result<()> {
        let block_pages = (u64::from(self.blocks.source.header().block_size) / PAGE).max(1);
        let budget = self.fill_threads.max(1) as u64 * STEP_BLOCKS * block_pages;
        // Per target: (space, view); ranges are in the view's addresses.
        let mut routes: Vec<(usize, View)> = Vec::new();
        let mut ranges: Vec<Missing> = Vec::new();
        let mut unseen: Vec<(usize, u64, u64)> = Vec::new();
        let mut pages = 0;
        'objects: for (o, object) in self.served.iter().enumerate() {
            for (&start, &(end, page)) in &object.missing {
                let mut offset = start;
                while offset < end {
                    if pages == budget {
                        break 'objects;
                    }
                    let views = self.spaces.iter().enumerate().flat_map(|(i, s)| s.views.iter().map(move |v| (i, *v)));
                    let views = views.filter(|(_, v)| v.object == o);
                    let Some((i, v)) = views.clone().find(|(_, v)| v.shows(offset)) else {
                        let next = views.map(|(_, v)| v.pgoff).filter(|&p| p > offset).min().unwrap_or(end).min(end);
                        unseen.push((o, offset, next));
                        offset = next;
                        continue;
                    };
                    let n = ((end.min(v.pgend()) - offset) / PAGE).min(budget - pages);
                    let target = match routes.iter().position(|r| *r == (i, v)) {
                        Some(t) => t,
                        None => {
                            routes.push((i, v));
                            routes.len() - 1
                        }
                    };
                    let at = v.start + (offset - v.pgoff);
                    ranges.push(Missing {
                        space: target,
                        start: at,
                        end: at + n * PAGE,
                        page: page + (offset - start) / PAGE,
                    });
                    offset += n * PAGE;
                    pages += n;
                }
            }
        }
        for (o, from, to) in unseen {
            take_range(&mut self.served[o].missing, from, to);
        }
        if ranges.is_empty() {
            return Ok(());
        }
        self.pool();
        let crew = self.crew.as_ref().map_or(Crew::Spawn(1), Crew::Pool);
        let (spaces, served) = (&self.spaces, &self.served);
        let targets: Vec<Target> = routes
            .iter()
            .map(|&(i, v)| Target {
                pid: spaces[i].pid,
                uffd: &spaces[i].uffd,
                file: served[v.object].pages_file,
                direct: &[],
            })
            .collect();
        let blocks = self.blocks;
        let starts = |file| blocks.starts(file);
        let filled = place::fill(&*blocks.source, &starts, &targets, &ranges, crew, ZeroPages::Copy, None)?;
        self.report.pages += filled.pages;
        self.report.shared_pages += filled.pages;
        // Back to offsets in the object, through the view each range used.
        let offsets = |m: &Missing| {
            let v = routes[m.space].1;
            (v.object, v.pgoff + (m.start - v.start), v.pgoff + (m.end - v.start))
        };
        for r in &ranges {
            let (o, from, to) = offsets(r);
            take_range(&mut self.served[o].missing, from, to);
        }
        // A process gone: what was for it goes through another view (a page
        // it took before it went is then found there, and skipped).
        let back = filled.left.iter().filter(|m| !filled.gone.contains(&m.space));
        for m in back.chain(ranges.iter().filter(|r| filled.gone.contains(&r.space))) {
            let (o, from, to) = offsets(m);
            self.served[o].missing.insert(from, (to, m.page));
        }
        for t in filled.gone {
            self.ended(routes[t].0)?;
        }
        Ok(())
    }

    /// Copies one block's worth: around the next page of the recorded
    /// working set still missing, else of the first missing range of the
    /// next space that has one.
    pub(super) fn fill_one(&mut self) -> Result<()> {
        // Private memory only: brought first, a block at a time, shared
        // memory's recorded pages delayed the fill on every core behind
        // them (1 GiB of `text` in shared memory, every page read at once:
        // 1.19 s against 0.92-0.95 s; docs/BENCHMARKS.md, session 67).
        while let Some((pid, addr)) = self.working_set.pop_front() {
            let Some(i) = self.spaces.iter().position(|s| s.pid == pid) else { continue };
            if let Some(range) = self.spaces[i].missing_at(addr) {
                if let Step::Changing = self.put_block_around(i, addr, range)? {
                    self.working_set.push_front((pid, addr));
                }
                return Ok(());
            }
        }
        self.working_set_done();
        let n = self.spaces.len();
        for k in 0..n {
            let i = (self.fill_next + k) % n;
            let Some((&start, &(end, page))) = self.spaces[i].missing.iter().next() else { continue };
            self.fill_next = i;
            let (block, first) = self.block(i, page, true)?;
            let off = (page * PAGE - first) as usize;
            let pages = ((block.len() - off) as u64 / PAGE).min((end - start) / PAGE);
            self.put(i, start, &block[off..off + (pages * PAGE) as usize])?;
            return Ok(());
        }
        Ok(())
    }

    /// Notes when the recorded working set was all in (once the fill has
    /// moved past it).
    pub(super) fn working_set_done(&mut self) {
        if self.report.working_set_in.is_none() && self.had_working_set {
            self.report.working_set_in = Some(Instant::now());
        }
    }

    /// One step of a running tree's fill on the threads of a pool: the next
    /// missing pages, [`STEP_BLOCKS`] blocks a thread, each block decoded
    /// once and copied in by the thread that took it (`session::place`),
    /// while this thread waits. No event is read during a step, just as none
    /// is read between `fill_one`'s look at the missing ranges and its copy:
    /// a copy that meets an unread event is refused (`EAGAIN`), and the rest
    /// of its range stays missing for a step after this thread has read the
    /// events. With one thread copying (decoders ahead of it), a lazy
    /// restore of 4 GiB on 16 cores had every page in after 1.5-1.7 s, where
    /// a placed restore, filled on every core, took 0.4-0.5 s in all
    /// (docs/BENCHMARKS.md, sessions 27-31).
    pub(super) fn fill_step(&mut self) -> Result<()> {
        self.working_set_done();
        if self.pool().is_none() {
            return self.fill_one();
        }
        let block_pages = (u64::from(self.blocks.source.header().block_size) / PAGE).max(1);
        let budget = self.fill_threads as u64 * STEP_BLOCKS * block_pages;
        let (mut ranges, mut pages) = (Vec::new(), 0);
        let n = self.spaces.len();
        'spaces: for k in 0..n {
            let i = (self.fill_next + k) % n;
            for (&start, &(end, page)) in &self.spaces[i].missing {
                let take = ((end - start) / PAGE).min(budget - pages);
                ranges.push(Missing { space: i, start, end: start + take * PAGE, page });
                pages += take;
                if pages == budget {
                    self.fill_next = i;
                    break 'spaces;
                }
            }
        }
        if ranges.is_empty() {
            return Ok(());
        }
        let targets: Vec<Target> =
            self.spaces.iter().map(|s| Target { pid: s.pid, uffd: &s.uffd, file: s.file, direct: &[] }).collect();
        let blocks = self.blocks;
        let crew = Crew::Pool(self.crew.as_ref().expect("made by `pool`"));
        let filled =
            place::fill(&*blocks.source, &|file| blocks.starts(file), &targets, &ranges, crew, self.zeros, None)?;
        self.note_filled(&ranges, filled)
    }

    /// The fill's thread pool, made at its first step; `None` where the fill
    /// has one thread, or no threads were to be had (a task limit): this
    /// thread then fills alone rather than failing the restore.
    pub(super) fn pool(&mut self) -> Option<&rayon::ThreadPool> {
        if self.crew.is_none() && self.fill_threads > 1 {
            match fill_pool(self.fill_threads) {
                Some(pool) => self.crew = Some(pool),
                None => self.fill_threads = 1,
            }
        }
        self.crew.as_ref()
    }

    /// Takes what a fill of `ranges` copied out of the missing ranges: all
    /// of them but what an event kept out, and every range of a space whose
    /// process has gone.
    pub(super) fn note_filled(&mut self, ranges: &[Missing], filled: place::Filled) -> Result<()> {
        self.report.pages += filled.pages;
        self.report.zero_pages += filled.zero_pages;
        for r in ranges {
            self.spaces[r.space].drop_range(r.start, r.end);
        }
        for m in filled.left {
            self.spaces[m.space].missing.insert(m.start, (m.end, m.page));
        }
        for i in filled.gone {
            self.ended(i)?;
        }
        Ok(())
    }

    /// Fills every space at once, on several threads (the tree is held:
    /// nothing in it runs, see `session::place`); what an event kept out is
    /// left missing, for `fill_one`. Pages that may be huge pages are held
    /// back, still on the userfaultfd, for `fill_held_back`.
    pub(super) fn fill_held(&mut self, how: &HeldFill) -> Result<()> {
        self.report.held_fill_started = Some(Instant::now());
        // Paused while CRIU restored the tree (`LazyRestore::run`).
        self.blocks.source.read_ahead(true);
        if how.huge_pages != HugePages::Off && self.criu_restored.is_some() {
            for s in &mut self.spaces {
                let spans = huge_spans(s);
                s.hold_back(spans);
            }
        }
        self.fill_all_missing(how, Crew::Spawn(how.threads))?;
        if self.shared.is_empty() {
            return Ok(());
        }
        let blocks = self.blocks;
        let spaces = &self.spaces;
        let uffd_of = |pid| spaces.iter().find(|s| s.pid == pid).map(|s| &s.uffd);
        let starts = |file| blocks.starts(file);
        let crew = Crew::Spawn(how.threads);
        let filled = shmem::fill(&*blocks.source, &starts, self.shared, uffd_of, crew, how.meter.as_deref())?;
        self.report.pages += filled.pages;
        self.report.shared_pages = filled.pages;
        for pid in filled.gone {
            if let Some(i) = self.spaces.iter().position(|s| s.pid == pid) {
                self.ended(i)?;
            }
        }
        Ok(())
    }

    /// Writes the pages held back to be huge pages, once CRIU has exited
    /// having restored the tree: through the process's memory, each span
    /// taken off the userfaultfd first, so that each 2 MiB piece faults in
    /// as a huge page, as it was in the process. A span that cannot be
    /// taken off stays with the userfaultfd, in 4 KiB pages.
    ///
    /// The spans go `HUGE_STEP_A_THREAD` a thread at a time, each step
    /// timed (`HugePace`): where the kernel gives huge pages too slowly to
    /// be worth their wait (a VM whose host takes freed memory back zeroes
    /// each at a small fraction of memory's speed), the rest stays on the
    /// userfaultfd and is placed in 4 KiB pages, and the report says how
    /// much.
    ///
    /// With no userfaultfd there, a read of a page not written yet reads
    /// zeros, so the tree must not run until they are all in. Its runtimes
    /// are taken first, every thread stopped and settled (one that is not
    /// was continued from outside: it is killed), and must be the same when
    /// it is let run (`ran_while_held`). Until then the pages stayed on the
    /// userfaultfd, where a read waits for its page: a tree continued and
    /// stopped again before then read nothing wrong.
    pub(super) fn fill_held_back(&mut self) -> Result<()> {
        let how = self.held_fill.clone().expect("a held tree's fill");
        let runtimes = crate::proc::tree::settled_runtimes(self.tree(), 1_000);
        self.held_runtimes = Some(runtimes.ok_or_else(super::ran_held)?);
        let eligible: u64 = self.spaces.iter().flat_map(|s| &s.huge_spans).map(|(start, end)| end - start).sum();
        let floor = match how.huge_pages {
            HugePages::On { floor } => floor,
            HugePages::Off => 0.0,
        };
        let mut pace = HugePace { floor, slow: None };
        let step = HUGE_STEP_A_THREAD * how.threads.max(1) as u64;
        // Kept across the steps, as are its threads' decoders and buffers.
        let pool = fill_pool(how.threads);
        let crew = || pool.as_ref().map_or(Crew::Spawn(how.threads), Crew::Pool);
        'spaces: for i in 0..self.spaces.len() {
            for (start, end) in std::mem::take(&mut self.spaces[i].huge_spans) {
                for at in (start..end).step_by(step as usize) {
                    if pace.slow.is_some() {
                        break 'spaces;
                    }
                    let to = (at + step).min(end);
                    let s = &mut self.spaces[i];
                    if s.uffd.unregister(at, to - at).is_err() {
                        continue;
                    }
                    let mut pieces = take_range(&mut s.held_back, at, to);
                    pieces.sort_unstable();
                    let ranges: Vec<Missing> =
                        pieces.into_iter().map(|(start, end, page)| Missing { space: i, start, end, page }).collect();
                    let mut direct = vec![Vec::new(); self.spaces.len()];
                    direct[i].push((at, to));
                    let filled = self.place(&how, &ranges, &direct, crew())?;
                    self.report.huge_page_bytes += to - at;
                    pace.step(filled.direct_bytes, filled.direct_seconds);
                    self.note_filled(&ranges, filled)?;
                }
            }
        }
        // What a slow kernel, or a span that stayed registered, left: 4 KiB
        // pages through the userfaultfd.
        for s in &mut self.spaces {
            s.release_held_back();
        }
        if let Some(bytes_per_second) = pace.slow {
            let small_page_bytes = eligible.saturating_sub(self.report.huge_page_bytes);
            self.report.slow_huge_pages = Some(SlowHugePages { bytes_per_second, small_page_bytes });
        }
        self.fill_all_missing(&how, crew())
    }

    /// Fills every missing private page at once (`session::place`) through
    /// the userfaultfds.
    fn fill_all_missing(&mut self, how: &HeldFill, crew: Crew) -> Result<()> {
        let mut ranges = Vec::new();
        for (i, s) in self.spaces.iter().enumerate() {
            ranges.extend(s.missing.iter().map(|(&start, &(end, page))| Missing { space: i, start, end, page }));
        }
        let filled = self.place(how, &ranges, &vec![Vec::new(); self.spaces.len()], crew)?;
        self.note_filled(&ranges, filled)
    }

    /// Fills `ranges` (in each space's address order) at once, writing each
    /// space's `direct` ranges through its process's memory.
    fn place(
        &self,
        how: &HeldFill,
        ranges: &[Missing],
        direct: &[Vec<(u64, u64)>],
        crew: Crew,
    ) -> Result<place::Filled> {
        let targets: Vec<Target> = (self.spaces.iter().zip(direct))
            .map(|(s, direct)| Target { pid: s.pid, uffd: &s.uffd, file: s.file, direct })
            .collect();
        let blocks = self.blocks;
        place::fill(
            &*blocks.source,
            &|file| blocks.starts(file),
            &targets,
            ranges,
            crew,
            self.zeros,
            how.meter.as_deref(),
        )
    }
}

/// A pool of `threads` fill threads, for fills cut into many calls; `None`
/// for one thread (the calling thread fills alone) or where no threads were
/// to be had (a task limit).
fn fill_pool(threads: usize) -> Option<rayon::ThreadPool> {
    if threads <= 1 {
        return None;
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("criuz-fill-{i}"));
    pool.build().ok()
}

/// A held space's spans that may be huge pages (`proc::huge_pages`) where
/// criuz may write the process's memory. Best effort: a span that cannot
/// be read stays with the userfaultfd, in 4 KiB pages.
fn huge_spans(s: &Space) -> Vec<(u64, u64)> {
    if !huge_pages::may_write_memory(s.pid) {
        return Vec::new();
    }
    huge_pages::eligible_spans(s.pid).unwrap_or_default()
}

/// How much of a held tree's huge-page memory `fill_held_back` writes in
/// one step, for each of its threads, before it looks at how fast the
/// kernel gave it: 64 blocks of the default size a thread keep them all
/// busy to the step's end, and at a slow host's pace (0.05-0.07 GB/s a
/// thread) a step takes about a quarter of a second. 32 MiB steps on 2
/// cores restored 1 GiB of `thp` memory, on a VM whose huge pages turned
/// slow, in 0.47-0.65 s; 64 MiB steps in 0.63-0.66 s; with no steps it
/// took 2.0-2.2 s.
const HUGE_STEP_A_THREAD: u64 = 16 << 20;

/// Steps of written huge-page memory smaller than this say too little to
/// judge by (a span's last few pages).
const HUGE_SAMPLE: u64 = 8 << 20;

/// The pace of a held tree's huge-page writes, step by step: `slow` once a
/// step of them ran below `floor` (`HugePages::On`; its rate, bytes a
/// second per writing thread).
struct HugePace {
    floor: f64,
    slow: Option<f64>,
}

impl HugePace {
    fn step(&mut self, bytes: u64, seconds: f64) {
        if bytes < HUGE_SAMPLE || seconds <= 0.0 {
            return;
        }
        let rate = bytes as f64 / seconds;
        if rate < self.floor {
            self.slow = Some(rate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_are_given_up_on_a_step_well_below_memory_s_pace_only() {
        let mut pace = HugePace { floor: HugePages::DEFAULT_FLOOR, slow: None };
        pace.step(64 << 20, 0.05);
        pace.step(1 << 20, 1.0);
        assert_eq!(pace.slow, None, "1.3 GB/s, and a sample too small to judge by");
        pace.step(64 << 20, 1.0);
        assert_eq!(pace.slow, Some((64 << 20) as f64));
        let mut never = HugePace { floor: 0.0, slow: None };
        never.step(64 << 20, 100.0);
        assert_eq!(never.slow, None, "a floor of 0 never gives up");
    }
}
