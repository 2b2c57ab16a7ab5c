//! What the restored address spaces tell the pager, read only between
//! steps (see the pager's doc): faults queue, a fork adds a space, a moved,
//! discarded or unmapped range leaves the bookkeeping before anything is
//! copied there again; and a process's end, told apart as its own, the OOM
//! killer's (the tree had no room) or another's.

use super::space::{Space, View};
use super::{Pager, PAGE};
use crate::criu::uffd::Event;
use crate::error::{Error, Result};
use std::os::fd::AsRawFd;

/// Why a lazy restore with shared memory not all in cannot go on.
fn shared_changed(pid: u32, how: &str, at: u64) -> Error {
    Error::Criu(format!(
        "restored process {pid} {how} shared memory at {at:#x} before all of it was in: a lazy restore cannot \
         tell what it should read there (restore it without --lazy)"
    ))
}

impl<'a> Pager<'a> {
    pub(super) fn read_events(&mut self, i: usize) -> Result<()> {
        let pid = self.spaces[i].pid;
        let failed =
            |err: std::io::Error| Error::CriuIo { what: format!("userfaultfd of restored process {pid}"), err };
        while let Some(ev) = self.spaces[i].uffd.read_event().map_err(failed)? {
            let s = &mut self.spaces[i];
            // Something in the held tree ran (before criuz took its
            // runtimes, or it is killed): what waited to be written as huge
            // pages is filled through the userfaultfd like the rest, and
            // follows the events.
            s.release_held_back();
            match ev {
                Event::Fault { addr } => self.faults.push_back((i, addr & !(PAGE - 1))),
                Event::Fork { child } => {
                    self.guard.hold(child.0.as_raw_fd())?;
                    let (pid, file, missing, views) = (s.pid, s.file, s.missing.clone(), s.views.clone());
                    self.spaces.push(Space::new(pid, child, file, missing, views));
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

    /// The process of space `i` has ended: nothing more to copy there. A
    /// process of a running tree may end by itself; one the OOM killer
    /// killed as its pages came in, or any of a held tree (which runs
    /// nothing), fails the restore.
    pub(super) fn ended(&mut self, i: usize) -> Result<()> {
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
    pub(super) fn oom_killed_any(&self) -> Result<()> {
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
    pub(super) fn oom_killed(&self, pid: u32) -> Option<&std::path::Path> {
        let groups = self.oom_kills_before.get(&pid).map_or(&[][..], |g| &g[..]);
        groups.iter().find(|(dir, before)| crate::proc::memory::oom_kills_in(dir) > *before).map(|(d, _)| d.as_path())
    }

    pub(super) fn killed_error(&self, pid: u32, how: &str, oom: Option<&std::path::Path>) -> Error {
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
}
