//! The pager of a lazy restore: criuz in the place of CRIU's lazy-pages
//! daemon, putting pages into the restored tree through the userfaultfds
//! CRIU hands over (`criu::uffd`).
//!
//! Why not CRIU's daemon with criuz as its page server: the daemon asks for a
//! faulted page alone and fills in the background only while no request is
//! in flight, so a process that keeps faulting (a JVM walking its heap)
//! starves the fill and pays a round trip per page (a full read of 1 GiB took
//! over a minute). Here one thread does both, in turn: every waiting fault
//! first, each answered with the rest of its block still missing (up to 64
//! pages for one decode), then one step of the fill: first around the pages
//! an earlier lazy restore saw faulted (the working set, in that order, a
//! block at a time), then in address order, a few blocks for each core, each
//! decoded and copied in by the thread that took it (`session::place`),
//! while this thread waits. A fault waits for at most one step, and the
//! fill never stops.
//!
//! Shared memory (`shmem::LazyShared`) is served the same way, by its
//! offset in the object rather than by address: its pages not yet in are
//! the object's, and a page copied through one process's mapping is in for
//! every mapping of it. Each mapping is registered once CRIU has handed the
//! whole tree over, before the tree may run, so that no page of it reads
//! as zero first; the fill brings it once every private page is in. A
//! mapping moved or a range discarded (`madvise`) while pages of its object
//! are missing fails the restore, which kills the tree: the event does not
//! say how far a moved mapping grew, nor whether a discarded page is gone
//! from the object (`MADV_REMOVE`) or only from the mapping
//! (`MADV_DONTNEED`).
//!
//! Only this thread changes the address spaces' bookkeeping, and it reads a
//! space's events only between steps, before copying into that space again,
//! so a copy never lands in a range the process has since dropped or moved
//! (the kernel refuses copies, `EAGAIN`, while an event is unread: what a
//! step could not copy stays missing for the next). Every page comes from a
//! checked block; a block that fails ends the pager with the error, and the
//! caller kills the tree before any copy of the userfaultfds closes.

use crate::codec::{self, Decoder};
use crate::criu::images::PageRun;
use crate::criu::uffd::{self, Copied, CopiedAll, Event, Handover};
use crate::engine::Crew;
use crate::error::{Error, Result, ResultContext};
use crate::format::PAGE_SIZE;
use crate::proc::cgroup::cgroup_kill_of;
use crate::proc::guard::{Guard, Victim};
use crate::session::blocks::Blocks;
use crate::session::place::{self, HeldFill, Missing, Target, ZeroPages};
use crate::session::shmem::{self, LazyShared, SharedObject};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

mod space;
mod wake;

use space::{missing_at, take_range, ServedObject, Space, View};
pub(crate) use wake::{Abort, FillGate, Gated};

const PAGE: u64 = PAGE_SIZE as u64;

/// One process's lazily restored memory as the archive has it.
pub(crate) struct LazyProcess {
    /// The pages image its lazy pages are in.
    pub pages_file: u32,
    /// Its pagemap runs, sorted by address; `first` is the run's first page
    /// in the archive's pages image.
    pub runs: Vec<PageRun>,
}

/// What the pager did.
#[derive(Default)]
pub(crate) struct PagerReport {
    /// Pages copied in, zero pages mapped, and faults served.
    pub pages: u64,
    pub zero_pages: u64,
    pub faults: u64,
    /// Faulted pages (first touches), in order, for the working set.
    pub touched: Vec<(u32, u64)>,
    /// When the last lazy page was in place (`None`: stopped before).
    pub resident: Option<Instant>,
    /// Processes that ended before every page of theirs was in (nothing
    /// more to copy there, so `resident` came early).
    pub ended_unfilled: u64,
    /// When the recorded working set was in place (`None`: there was none,
    /// or the pager stopped before).
    pub working_set_in: Option<Instant>,
    /// When a held tree's fill began: CRIU had handed every address space
    /// over (`None`: a running tree's fill, or none).
    pub held_fill_started: Option<Instant>,
    /// Pages of shared memory placed in a held tree or served to a lazy
    /// one (also in `pages`).
    pub shared_pages: u64,
}

/// How many faulted pages are kept for the working set record.
pub(crate) const TOUCHED_MAX: usize = 1 << 20;

pub(crate) struct Pager<'a> {
    blocks: &'a Blocks,
    lazy: &'a HashMap<u32, LazyProcess>,
    /// Shared memory a held tree's fill places too (`session::shmem`).
    shared: &'a [SharedObject],
    /// Shared memory a lazy tree is served (`shmem::LazyShared`).
    served: Vec<ServedObject>,
    /// Its mappings by pid, until they are registered: once CRIU has
    /// handed the whole tree over (it maps shared memory last), before the
    /// tree may run.
    views_to_register: HashMap<u32, Vec<View>>,
    guard: &'a Guard,
    victim: &'a Victim,
    spaces: Vec<Space>,
    faults: VecDeque<(usize, u64)>,
    /// Pages a lazy restore of this archive saw faulted before, in order:
    /// the fill brings their blocks first.
    working_set: VecDeque<(u32, u64)>,
    had_working_set: bool,
    dec: Decoder,
    finished: bool,
    fill_next: usize,
    /// For a held tree: how to fill it once every space is here
    /// (`session::place`); taken when that fill starts.
    held_fill: Option<HeldFill>,
    /// Threads that fill a running tree in steps (`fill_step`); with one,
    /// this thread fills a block at a time (`fill_one`).
    fill_threads: usize,
    /// Their pool, made when the first step starts.
    crew: Option<rayon::ThreadPool>,
    /// A running tree's pagemap keeps short runs of zero pages, which are
    /// mapped; a held tree's ranges hold zero pages only when every one
    /// must be a page of memory (`--keep-zero-pages`).
    zeros: ZeroPages,
    report: PagerReport,
    /// Each process's memory cgroups (its own, those above it) and the OOM
    /// kills they had counted when it was handed over, to tell an OOM kill
    /// from another end.
    oom_kills_before: HashMap<u32, Vec<(std::path::PathBuf, u64)>>,
}

/// A fault in served shared memory: the view it hit, the offset it shows
/// there, and the object's missing range holding that offset.
type SharedAt = (View, u64, (u64, u64, u64));

/// Why a lazy restore with shared memory not all in cannot go on.
fn shared_changed(pid: u32, how: &str, at: u64) -> Error {
    Error::Criu(format!(
        "restored process {pid} {how} shared memory at {at:#x} before all of it was in: a lazy restore cannot \
         tell what it should read there (restore it without --lazy)"
    ))
}

/// Blocks each thread of a running tree's fill takes in one step: a fault
/// that arrives meanwhile waits for the step, so a step is short; two
/// blocks a thread even out blocks that take longer than others.
const STEP_BLOCKS: u64 = 2;

/// Whether a copy or a whole step got through.
enum Step {
    Done,
    /// An event waits on this space: read it first.
    Changing,
}

impl<'a> Pager<'a> {
    pub(crate) fn new(
        blocks: &'a Blocks,
        lazy: &'a HashMap<u32, LazyProcess>,
        guard: &'a Guard,
        victim: &'a Victim,
        working_set: &[(u32, u64)],
        held_fill: Option<HeldFill>,
        fill_threads: usize,
    ) -> Pager<'a> {
        Pager {
            blocks,
            lazy,
            shared: &[],
            served: Vec::new(),
            views_to_register: HashMap::new(),
            guard,
            victim,
            spaces: Vec::new(),
            faults: VecDeque::new(),
            working_set: working_set.iter().map(|&(pid, addr)| (pid, addr & !(PAGE - 1))).collect(),
            had_working_set: !working_set.is_empty(),
            dec: Decoder::new(),
            finished: false,
            fill_next: 0,
            zeros: if held_fill.is_some() { ZeroPages::Copy } else { ZeroPages::Map },
            held_fill,
            fill_threads,
            crew: None,
            report: PagerReport::default(),
            oom_kills_before: HashMap::new(),
        }
    }

    /// Places `shared` too, once a held tree is handed over.
    pub(crate) fn placing_shared(mut self, shared: &'a [SharedObject]) -> Pager<'a> {
        self.shared = shared;
        self
    }

    /// Serves `objects` too, to a lazy tree CRIU leaves stopped until the
    /// pager says it has every process (`Gated`): each mapping of them is
    /// registered first.
    pub(crate) fn serving_shared(mut self, objects: &[LazyShared]) -> Pager<'a> {
        for (k, o) in objects.iter().enumerate() {
            let missing = o.runs.iter().map(|&(start, end, page)| (start, (end, page))).collect();
            self.served.push(ServedObject { pages_file: o.pages_file, missing });
            for &(pid, m) in &o.mappings {
                let view = View { start: m.start, end: m.end, pgoff: m.pgoff, object: k };
                self.views_to_register.entry(pid).or_default().push(view);
            }
        }
        self
    }

    /// Whether served shared memory still misses pages.
    fn served_missing(&self) -> bool {
        self.served.iter().any(|o| !o.missing.is_empty())
    }

    /// Registers each process's mappings of served shared memory with its
    /// userfaultfd: from then on a page of it not yet in faults, in every
    /// process, rather than reading as zero.
    fn register_views(&mut self) -> Result<()> {
        for (pid, views) in std::mem::take(&mut self.views_to_register) {
            let i = self.spaces.iter().position(|s| s.pid == pid).ok_or_else(|| {
                Error::Mismatch(format!(
                    "restored process {pid} maps shared memory, but CRIU handed no such process over"
                ))
            })?;
            for v in &views {
                self.spaces[i].uffd.register_missing(v.start, v.end - v.start).map_err(|err| Error::CriuIo {
                    what: format!("shared memory of restored process {pid} at {:#x}", v.start),
                    err,
                })?;
            }
            self.spaces[i].views = views;
        }
        Ok(())
    }

    /// Serves the tree until every lazy page is in place, or `stop` becomes
    /// readable (the restore failed: nothing will come), or `abort` says to
    /// fail. The report, also on error, says how far it got. With `gated`,
    /// the fill waits for its gate (see [`FillGate`]).
    pub(crate) fn run(
        &mut self,
        listener: &UnixListener,
        stop: &UnixStream,
        abort: &Abort,
        gated: Option<Gated<'_>>,
    ) -> Result<()> {
        let (gate, mut finished) = gated.unzip();
        let mut criu: Option<UnixStream> = None;
        let mut woken = false;
        loop {
            if let Some(why) = abort.failure().filter(|_| self.finished) {
                return Err(why.duplicate());
            }
            // One look at the gate per turn: should it open after, the poll
            // below sees its wake (level-triggered, for good).
            let gate_shut = gate.filter(|g| !g.is_open());
            let filling = self.finished && gate_shut.is_none();
            let busy = !self.faults.is_empty()
                || (filling && (self.spaces.iter().any(|s| !s.missing.is_empty()) || self.served_missing()));
            if filling && !busy {
                self.oom_killed_any()?;
                self.report.resident = Some(Instant::now());
                if self.had_working_set {
                    self.report.working_set_in.get_or_insert(Instant::now());
                }
                return Ok(());
            }
            let mut fds = vec![libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            fds.push(libc::pollfd { fd: if woken { -1 } else { abort.fd() }, events: libc::POLLIN, revents: 0 });
            // Until the gate opens, its opening wakes the poll.
            fds.push(libc::pollfd { fd: gate_shut.map_or(-1, |g| g.fd()), events: libc::POLLIN, revents: 0 });
            let conn_at = fds.len();
            fds.push(libc::pollfd {
                fd: criu.as_ref().map_or(listener.as_raw_fd(), |c| c.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            });
            if self.finished && criu.is_none() {
                fds[conn_at].fd = -1;
            }
            let spaces_at = fds.len();
            for s in &self.spaces {
                fds.push(libc::pollfd { fd: s.uffd.0.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            }
            // SAFETY: a vector of pollfds we own, its length with it.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, if busy { 0 } else { -1 }) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if fds[0].revents != 0 {
                return Ok(());
            }
            // Seen once: the failure is taken at the top of the loop.
            woken |= fds[1].revents != 0;
            if fds[conn_at].revents != 0 {
                match criu.as_mut() {
                    None => {
                        let (c, _) = listener.accept()?;
                        self.learn_cgroup(&c)?;
                        criu = Some(c);
                    }
                    Some(c) => {
                        let got = uffd::read_handover(c).map_err(|e| Error::Criu(format!("lazy-pages socket: {e}")))?;
                        match got {
                            Some(h) => self.take(h)?,
                            // The restore ended without finishing; its exit
                            // status tells why, and `stop` follows.
                            None => criu = None,
                        }
                    }
                }
            }
            for i in 0..self.spaces.len() {
                if fds.get(spaces_at + i).is_some_and(|f| f.revents != 0) {
                    self.read_events(i)?;
                }
            }
            if self.finished {
                if !self.views_to_register.is_empty() {
                    self.register_views()?;
                }
                if let Some(tx) = finished.take() {
                    let _ = tx.send(());
                }
            }
            self.serve_faults()?;
            if self.faults.is_empty() && filling {
                let private_left = !self.working_set.is_empty() || self.spaces.iter().any(|s| !s.missing.is_empty());
                match self.held_fill.take() {
                    Some(how) => self.fill_held(&how)?,
                    None if !private_left => self.fill_served_step()?,
                    None if self.fill_threads > 1 && self.working_set.is_empty() => self.fill_step()?,
                    None => self.fill_one()?,
                }
            }
        }
    }

    /// A container's cgroup, learnt from the connecting CRIU (runc puts it
    /// in the container's cgroup before the restore) and told to the guard
    /// before any userfaultfd is taken: a container that could not be
    /// killed is not restored lazily.
    fn learn_cgroup(&self, criu: &UnixStream) -> Result<()> {
        let Victim::Cgroup(cell) = self.victim else { return Ok(()) };
        let cred = nix::sys::socket::getsockopt(criu, nix::sys::socket::sockopt::PeerCredentials)
            .map_err(|e| Error::Criu(format!("lazy-pages socket: whose connection: {e}")))?;
        let kill = cgroup_kill_of(cred.pid() as u32, std::process::id()).map_err(|why| {
            Error::Criu(format!(
                "CRIU (pid {}) is in no cgroup v2 group of its own that criuz could kill ({why}): a container is not restored lazily without one",
                cred.pid()
            ))
        })?;
        self.guard.target_cgroup(&kill)?;
        let _ = cell.set(kill);
        Ok(())
    }

    /// Closes its userfaultfds: with every page in place, a page left out
    /// of the lazy pagemap as zero then reads as zero instead of waiting
    /// for a copy that will not come.
    pub(crate) fn let_go(&mut self) {
        self.spaces.clear();
    }

    /// An error if a process of the held tree was killed before it ran: a
    /// tree let run so would say "restored" with a process missing. Nothing
    /// in a held tree runs, so none ends by itself; the OOM killer kills
    /// one as the copies charge its memory cgroup past its limit (one the
    /// tree was restored into, which need not be criuz's), or something
    /// else killed it.
    pub(crate) fn killed_while_held(&self) -> Result<()> {
        let killed = self.spaces.iter().find_map(|s| Some((s.pid, crate::proc::holder::killed(s.pid as i32)?)));
        match killed {
            Some((pid, how)) => Err(self.killed_error(pid, how, self.oom_killed(pid))),
            None => Ok(()),
        }
    }

    /// Whether every lazy page is in place.
    pub(crate) fn all_in(&self) -> bool {
        self.report.resident.is_some()
    }

    pub(crate) fn into_report(self) -> PagerReport {
        self.report
    }

    fn take(&mut self, h: Handover) -> Result<()> {
        match h {
            Handover::Finished => self.finished = true,
            Handover::Zombie { .. } => {}
            Handover::Process { pid, uffd } => {
                self.guard.hold(uffd.0.as_raw_fd())?;
                let pid = pid as u32;
                let mut missing = BTreeMap::new();
                // CRIU hands over every live process it restores, each with
                // its pagemap: one criuz has no pages for would read zeros
                // where its lazy pages belong.
                let p = self.lazy.get(&pid).ok_or_else(|| {
                    Error::Mismatch(format!("restored process {pid} has no pagemap whose pages criuz placed"))
                })?;
                let file = p.pages_file;
                for r in p.runs.iter().filter(|r| r.lazy && r.nr > 0) {
                    missing.insert(r.vaddr, (r.vaddr + r.nr * PAGE, r.first));
                }
                self.spaces.push(Space { pid, uffd, file, missing, views: Vec::new() });
                // Read while the process lives: one that has exited reads
                // as in the root group.
                self.oom_kills_before.insert(pid, crate::proc::memory::oom_kills_of(pid as i32));
            }
        }
        Ok(())
    }

    fn read_events(&mut self, i: usize) -> Result<()> {
        let pid = self.spaces[i].pid;
        let failed =
            |err: std::io::Error| Error::CriuIo { what: format!("userfaultfd of restored process {pid}"), err };
        while let Some(ev) = self.spaces[i].uffd.read_event().map_err(failed)? {
            let s = &mut self.spaces[i];
            match ev {
                Event::Fault { addr } => self.faults.push_back((i, addr & !(PAGE - 1))),
                Event::Fork { child } => {
                    self.guard.hold(child.0.as_raw_fd())?;
                    let (pid, file, missing, views) = (s.pid, s.file, s.missing.clone(), s.views.clone());
                    self.spaces.push(Space { pid, uffd: child, file, missing, views });
                }
                Event::Remap { from, to, len } => {
                    // A moved mapping may grow to show pages the pager
                    // cannot place (the event does not say how far).
                    let moved = |v: &View| v.start < from + len && v.end > from;
                    if let Some(v) = s.views.iter().find(|v| moved(v) && !self.served[v.object].missing.is_empty()) {
                        return Err(shared_changed(pid, "moved", v.start.max(from)));
                    }
                    s.cut_views(from, from + len);
                    s.remap(from, to, len);
                }
                Event::Remove { start, end } => {
                    // A discarded page of shared memory is gone from the
                    // object (`MADV_REMOVE`) or still there
                    // (`MADV_DONTNEED`): one not in yet cannot be told.
                    for v in s.views.iter().filter(|v| v.start < end && v.end > start) {
                        let (from, to) =
                            (v.pgoff + (start.max(v.start) - v.start), v.pgoff + (end.min(v.end) - v.start));
                        if self.served[v.object].missing.range(..to).next_back().is_some_and(|(_, &(e, _))| e > from) {
                            return Err(shared_changed(pid, "discarded", start.max(v.start)));
                        }
                    }
                    s.cut_views(start, end);
                    // Faults there must get zeros, not the archive's pages.
                    s.uffd.unregister(start, end - start).map_err(failed)?;
                    s.drop_range(start, end);
                }
                Event::Unmap { start, end } => {
                    s.cut_views(start, end);
                    s.drop_range(start, end);
                }
            }
        }
        Ok(())
    }

    fn serve_faults(&mut self) -> Result<()> {
        while let Some((i, addr)) = self.faults.pop_front() {
            let s = &self.spaces[i];
            let shared = self.shared_missing_at(i, addr);
            let private = s.missing_at(addr);
            if private.is_some() || shared.is_some() {
                self.report.faults += 1;
                if self.report.touched.len() < TOUCHED_MAX {
                    self.report.touched.push((s.pid, addr));
                }
            }
            let step = match (private, shared) {
                (Some(range), _) => self.put_block_around(i, addr, range)?,
                (None, Some(at)) => self.put_shared_block_around(i, at)?,
                // Not lazy (a zero page, a hole of shared memory), or
                // already copied for another thread's fault: the zero page
                // (a page of zeros in shared memory), or a wake-up.
                (None, None) => match s.uffd.zero_page(addr, PAGE).map_err(|e| self.uffd_failed(i, e))? {
                    Copied::Changing => Step::Changing,
                    _ => Step::Done,
                },
            };
            if let Step::Changing = step {
                self.faults.push_front((i, addr));
                return Ok(());
            }
        }
        Ok(())
    }

    /// Copies the missing rest of the block that holds `addr`, which lies in
    /// the missing range `(start, end, page)`.
    fn put_block_around(&mut self, i: usize, addr: u64, (start, end, page): (u64, u64, u64)) -> Result<Step> {
        let at = page + (addr - start) / PAGE;
        let (block, first) = self.block(i, at, false)?;
        let before = (at * PAGE - first) / PAGE;
        let after = (block.len() as u64 - (at * PAGE - first)) / PAGE;
        // Saturating: a crafted pagemap could put a page lower than the
        // pages before it in its block would reach (CRIU's never do).
        let from = start.max(addr.saturating_sub(before * PAGE));
        let to = end.min(addr + after * PAGE);
        let off = (at * PAGE - first) as usize - (addr - from) as usize;
        self.put(i, from, &block[off..off + (to - from) as usize])
    }

    /// Where `addr` of space `i` shows a page of served shared memory not in
    /// yet.
    fn shared_missing_at(&self, i: usize, addr: u64) -> Option<SharedAt> {
        let (v, offset) = self.spaces[i].view_at(addr)?;
        Some((v, offset, missing_at(&self.served[v.object].missing, offset)?))
    }

    /// Copies the missing rest of the block of served shared memory that
    /// holds `offset`, which view `v` of space `i` shows, and which lies in
    /// the object's missing range `(start, end, page)`: as far as the view
    /// shows it.
    fn put_shared_block_around(&mut self, i: usize, (v, offset, (start, end, page)): SharedAt) -> Result<Step> {
        let file = self.served[v.object].pages_file;
        let at = page + (offset - start) / PAGE;
        let label = self.blocks.source.label();
        let pid = self.spaces[i].pid;
        let (block, first) = self
            .blocks
            .block_at(&mut self.dec, file, at, false)
            .context(|| format!("{label}: shared memory of restored process {pid}"))?;
        let before = (at * PAGE - first) / PAGE;
        let after = (block.len() as u64 - (at * PAGE - first)) / PAGE;
        let from = start.max(offset.saturating_sub(before * PAGE)).max(v.pgoff);
        let to = end.min(offset + after * PAGE).min(v.pgend());
        let skip = (at * PAGE - first - (offset - from)) as usize;
        let data = &block[skip..skip + (to - from) as usize];
        let dst = v.start + (from - v.pgoff);
        let got = self.spaces[i].uffd.copy_all(dst, data).map_err(|e| self.uffd_failed(i, e))?;
        let (done, pages, step) = match got {
            CopiedAll::Done { pages, .. } => (to - from, pages, Step::Done),
            CopiedAll::Changing { done, pages, .. } => (done, pages, Step::Changing),
            CopiedAll::Gone => {
                self.ended(i)?;
                return Ok(Step::Done);
            }
        };
        self.report.pages += pages;
        self.report.shared_pages += pages;
        take_range(&mut self.served[v.object].missing, from, from + done);
        Ok(step)
    }

    /// One step of the fill of served shared memory, once every private
    /// page is in: the next missing pages of each object, through the first
    /// space with a view that shows them (a process CRIU handed over comes
    /// before the children it forked), on the fill's threads
    /// (`session::place`). Pages no view of any process shows any more
    /// (every mapping gone) are dropped: nothing can read them.
    fn fill_served_step(&mut self) -> Result<()> {
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
            .map(|&(i, v)| Target { pid: spaces[i].pid, uffd: &spaces[i].uffd, file: served[v.object].pages_file })
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
    fn fill_one(&mut self) -> Result<()> {
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
    fn working_set_done(&mut self) {
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
    fn fill_step(&mut self) -> Result<()> {
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
            self.spaces.iter().map(|s| Target { pid: s.pid, uffd: &s.uffd, file: s.file }).collect();
        let blocks = self.blocks;
        let crew = Crew::Pool(self.crew.as_ref().expect("made by `pool`"));
        let filled =
            place::fill(&*blocks.source, &|file| blocks.starts(file), &targets, &ranges, crew, self.zeros, None)?;
        self.note_filled(&ranges, filled)
    }

    /// The fill's thread pool, made at its first step; `None` where the fill
    /// has one thread, or no threads were to be had (a task limit): this
    /// thread then fills alone rather than failing the restore.
    fn pool(&mut self) -> Option<&rayon::ThreadPool> {
        if self.crew.is_none() && self.fill_threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(self.fill_threads)
                .thread_name(|i| format!("criuz-fill-{i}"))
                .build();
            match pool {
                Ok(pool) => self.crew = Some(pool),
                Err(_) => self.fill_threads = 1,
            }
        }
        self.crew.as_ref()
    }

    /// The process of space `i` has ended: nothing more to copy there. A
    /// process of a running tree may end by itself; one the OOM killer
    /// killed as its pages came in, or any of a held tree (which runs
    /// nothing), fails the restore.
    fn ended(&mut self, i: usize) -> Result<()> {
        let pid = self.spaces[i].pid;
        let oom = self.oom_killed(pid);
        if oom.is_some() || self.report.held_fill_started.is_some() {
            return Err(self.killed_error(pid, "killed", oom));
        }
        let space = &mut self.spaces[i];
        space.views.clear();
        if !space.missing.is_empty() {
            self.report.ended_unfilled += 1;
            space.missing.clear();
        }
        Ok(())
    }

    /// An error if a process of the tree has ended since it was handed
    /// over and an OOM killer of its memory cgroups killed meanwhile: its
    /// last pages were in when it was killed for the next process's.
    fn oom_killed_any(&self) -> Result<()> {
        for s in &self.spaces {
            let Some(how) = crate::proc::holder::killed(s.pid as i32) else { continue };
            if let Some(oom) = self.oom_killed(s.pid) {
                return Err(self.killed_error(s.pid, how, Some(oom)));
            }
        }
        Ok(())
    }

    /// The memory cgroup of process `pid` (or one above it) whose OOM
    /// killer has killed since the process was handed over, if one has.
    fn oom_killed(&self, pid: u32) -> Option<&std::path::Path> {
        let groups = self.oom_kills_before.get(&pid).map_or(&[][..], |g| &g[..]);
        groups.iter().find(|(dir, before)| crate::proc::memory::oom_kills_in(dir) > *before).map(|(d, _)| d.as_path())
    }

    fn killed_error(&self, pid: u32, how: &str, oom: Option<&std::path::Path>) -> Error {
        let why = match oom {
            Some(dir) => format!(
                "the OOM killer of memory cgroup {} killed it: the group had no room left for the tree",
                dir.display()
            ),
            None => "something outside criuz killed it".to_string(),
        };
        let when = if self.report.held_fill_started.is_some() {
            " before the tree ran, as its memory was placed"
        } else {
            ", as its memory was copied in"
        };
        Error::Criu(format!("restored process {pid} was {how}{when}: {why}"))
    }

    /// Takes what a fill of `ranges` copied out of the missing ranges: all
    /// of them but what an event kept out, and every range of a space whose
    /// process has gone.
    fn note_filled(&mut self, ranges: &[Missing], filled: place::Filled) -> Result<()> {
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
    /// left missing, for `fill_one`.
    fn fill_held(&mut self, how: &HeldFill) -> Result<()> {
        self.report.held_fill_started = Some(Instant::now());
        // Paused while CRIU restored the tree (`LazyRestore::run`).
        self.blocks.source.read_ahead(true);
        let mut ranges = Vec::new();
        for (i, s) in self.spaces.iter().enumerate() {
            ranges.extend(s.missing.iter().map(|(&start, &(end, page))| Missing { space: i, start, end, page }));
        }
        let targets: Vec<Target> =
            self.spaces.iter().map(|s| Target { pid: s.pid, uffd: &s.uffd, file: s.file }).collect();
        let blocks = self.blocks;
        let crew = Crew::Spawn(how.threads);
        let filled = place::fill(
            &*blocks.source,
            &|file| blocks.starts(file),
            &targets,
            &ranges,
            crew,
            self.zeros,
            how.meter.as_deref(),
        )?;
        self.note_filled(&ranges, filled)?;
        if self.shared.is_empty() {
            return Ok(());
        }
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

    fn block(&mut self, i: usize, page: u64, fill: bool) -> Result<(std::sync::Arc<Vec<u8>>, u64)> {
        let s = &self.spaces[i];
        let label = self.blocks.source.label();
        self.blocks
            .block_at(&mut self.dec, s.file, page, fill)
            .context(|| format!("{label}: pages of restored process {}", s.pid))
    }

    fn uffd_failed(&self, i: usize, err: std::io::Error) -> Error {
        Error::CriuIo { what: format!("userfaultfd of restored process {}", self.spaces[i].pid), err }
    }

    /// Copies `data` to `dst` in space `i` (skipping pages already there or
    /// no longer registered) and marks it all in place. Its zero pages are
    /// mapped where [`ZeroPages::Map`] says so: the data is a decoded,
    /// checked block, so a page that reads as zero there is one.
    fn put(&mut self, i: usize, dst: u64, data: &[u8]) -> Result<Step> {
        let uffd = &self.spaces[i].uffd;
        let got = match self.zeros {
            ZeroPages::Map => {
                uffd.copy_all_mapping_zeros(dst, data, |p| codec::is_zero_page(&data[p * PAGE_SIZE..][..PAGE_SIZE]))
            }
            ZeroPages::Copy => uffd.copy_all(dst, data),
        };
        match got.map_err(|e| self.uffd_failed(i, e))? {
            CopiedAll::Done { pages, zeros } => {
                self.report.pages += pages;
                self.report.zero_pages += zeros;
                self.spaces[i].drop_range(dst, dst + data.len() as u64);
                Ok(Step::Done)
            }
            CopiedAll::Changing { done, pages, zeros } => {
                self.report.pages += pages;
                self.report.zero_pages += zeros;
                self.spaces[i].drop_range(dst, dst + done);
                Ok(Step::Changing)
            }
            CopiedAll::Gone => {
                self.ended(i)?;
                Ok(Step::Done)
            }
        }
    }
}
