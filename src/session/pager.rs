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

use crate::codec::Decoder;
use crate::criu::images::PageRun;
use crate::criu::uffd::{self, Handover};
use crate::error::{Error, Result};
use crate::format::PAGE_SIZE;
use crate::proc::cgroup::cgroup_kill_of;
use crate::proc::guard::{Guard, Victim};
use crate::session::blocks::Blocks;
use crate::session::place::{HeldFill, SlowHugePages, ZeroPages};
use crate::session::shmem::{LazyShared, SharedObject};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

mod events;
mod faults;
mod fill;
mod space;
mod wake;

use space::{ServedObject, Space, View};
pub(crate) use wake::{Abort, Gate, Gated};

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
    /// Bytes of a held tree's ranges written as huge pages may be
    /// (`place::Target::direct`).
    pub huge_page_bytes: u64,
    /// Huge pages given up on, the kernel giving them too slowly.
    pub slow_huge_pages: Option<SlowHugePages>,
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
    /// (`session::place`); the fill starts once (`held_fill_started`), and
    /// the pages it held back are written the same way.
    held_fill: Option<HeldFill>,
    /// For a held tree: opened once CRIU has exited having restored it;
    /// pages that may be huge pages wait for it (`fill_held_back`).
    criu_restored: Option<&'a Gate>,
    /// The held tree's thread runtimes, taken before the pages held back
    /// were written: the same when it is let run, or it ran meanwhile.
    held_runtimes: Option<Vec<(i32, u64)>>,
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

/// Why a held tree is killed: something outside criuz continued it while
/// pages without a userfaultfd behind them were written.
fn ran_held() -> Error {
    Error::Criu(
        "something outside criuz continued the restored tree (SIGCONT) before its memory was all in: it may have \
         read zeros, so it was killed"
            .into(),
    )
}

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
            criu_restored: None,
            held_runtimes: None,
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

    /// Writes a held tree's memory that may be transparent huge pages
    /// (`HeldFill::huge_pages`) once `criu_restored` opens: CRIU has exited
    /// having restored the tree and left it stopped.
    pub(crate) fn writing_huge_pages_after(mut self, criu_restored: &'a Gate) -> Pager<'a> {
        self.criu_restored = Some(criu_restored);
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
    /// the fill waits for its gate (see [`Gate`]).
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
            // Pages held back to be huge pages wait for CRIU's exit.
            let held_back = self.criu_restored.filter(|_| self.held_fill.is_some() && self.holds_back());
            let criu_running = held_back.filter(|g| !g.is_open());
            let write_held_back = held_back.is_some() && criu_running.is_none();
            let busy = !self.faults.is_empty()
                || (filling
                    && (self.spaces.iter().any(|s| !s.missing.is_empty()) || self.served_missing() || write_held_back));
            if filling && !busy && held_back.is_none() {
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
            fds.push(libc::pollfd { fd: criu_running.map_or(-1, |g| g.fd()), events: libc::POLLIN, revents: 0 });
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
                match &self.held_fill {
                    Some(how) if self.report.held_fill_started.is_none() => self.fill_held(&how.clone())?,
                    _ if !private_left && write_held_back => self.fill_held_back()?,
                    _ if !private_left => self.fill_served_step()?,
                    _ if self.fill_threads > 1 && self.working_set.is_empty() => self.fill_step()?,
                    _ => self.fill_one()?,
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

    /// An error if the held tree ran since criuz took its runtimes, before
    /// it wrote the pages held back to be huge pages (`fill_held_back`):
    /// those had no userfaultfd behind them while they were written (a
    /// read of a page not in yet read zeros there, where elsewhere it waits
    /// for its page), so a tree something outside criuz continued meanwhile
    /// is killed, even one stopped again since.
    pub(crate) fn ran_while_held(&self) -> Result<()> {
        match &self.held_runtimes {
            Some(before) if crate::proc::tree::stopped_runtimes(self.tree()).as_ref() != Some(before) => {
                Err(ran_held())
            }
            _ => Ok(()),
        }
    }

    /// The restored tree's pids (none for a container, never held).
    fn tree(&self) -> &[i32] {
        match self.victim {
            Victim::Tree(pids) => pids,
            Victim::Cgroup(_) => &[],
        }
    }

    /// Whether pages are held back to be written as huge pages.
    fn holds_back(&self) -> bool {
        self.spaces.iter().any(|s| !s.held_back.is_empty())
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
                self.spaces.push(Space::new(pid, uffd, file, missing, Vec::new()));
                // Read while the process lives: one that has exited reads
                // as in the root group.
                self.oom_kills_before.insert(pid, crate::proc::memory::oom_kills_of(pid as i32));
            }
        }
        Ok(())
    }
}
