//! `criuz restore`: eagerly with criuz placing the memory itself
//! (`lazy::restore_placed`: the tree held stopped until every page is in,
//! copied on every core), eagerly through CRIU's stream
//! (`checkpoint::restore_opened`), or lazily with criuz as CRIU's lazy-pages daemon
//! (`lazy::restore_lazy`), as the options ask. One call for the command
//! line, one report. An archive holding CUDA processes is placed even when
//! a lazy restore is asked for: their resume reads all their memory at once.
//!
//! The default ([`How::Auto`]) places the memory wherever it can: CRIU's
//! stream reads every page through one pipe on one thread, a copy that
//! does not grow with the cores; placing decodes and copies on all of them
//! (on 2 cores, 1 GiB of text restored with LZ4 in 0.36 s against the
//! stream's 0.73 s, docs/BENCHMARKS.md). It streams where placing cannot
//! work or would cost more: without a kernel userfaultfd, with
//! `--keep-zero-pages` (which asks for every page as CRIU restores it;
//! `--fill place` places them too), for an archive whose pagemaps criuz
//! does not understand, for a tree whose processes share more than an eighth as many private pages as it
//! places (stored once, by reference: CRIU's stream keeps them shared
//! copy-on-write, placing gives each process its own copy; a forked 1 GiB
//! tree on 2 cores held 352 MiB before the dump, 176 MiB streamed, 513 MiB
//! placed, docs/BENCHMARKS.md; fewer are placed, copied apart, and the
//! report says how much), or where CRIU would still restore more than
//! [`PLACE_EAGER_MAX`] itself (the shared memory criuz does not place,
//! private file mappings: placing writes those to `$TMPDIR` first), or
//! more than criuz would place: a copy into `$TMPDIR` that CRIU then reads
//! costs more than the stream's one pipe (200 MiB of shared memory on 2
//! cores: placed 0.28-0.32 s, streamed 0.22-0.25 s, docs/BENCHMARKS.md),
//! or where `$TMPDIR` has no room for what placing writes there.

use crate::archive::{BlockSource, Options};
use crate::criu::{images, options, uffd, Criu};
use crate::error::Result;
use crate::session::checkpoint::{self, RestoreReport};
use crate::session::criu_run::RestoreOptions;
use crate::session::lazy::{self, LazyReport};
use crate::session::placement;
use std::sync::Arc;
use std::time::Instant;

/// How a restore went.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(tag = "fill")]
pub enum Restored {
    /// Through CRIU's stream.
    #[serde(rename = "stream")]
    Eager(RestoreReport),
    #[serde(rename = "place")]
    Placed(LazyReport),
    #[serde(rename = "lazy")]
    Lazy(LazyReport),
}

/// How a tree's memory comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// Placed where that works, streamed otherwise (see the module doc).
    Auto,
    /// Through CRIU's image stream, page by page.
    Stream,
    /// Placed by criuz (userfaultfd copies), the tree held stopped until
    /// every page is in and proven.
    Placed,
    /// The tree runs at once; its memory arrives on demand.
    Lazy,
}

impl Restored {
    /// The restored tree's root: criuz's own child without -d, for
    /// `proc::foreground` to wait for.
    pub fn pid(&self) -> Option<i32> {
        match self {
            Restored::Eager(r) => r.pid,
            Restored::Placed(r) | Restored::Lazy(r) => r.pid,
        }
    }
}

/// What is in the file `path` names, if it is more than a pid: a pid file
/// is replaced by its rename (so a link there is not followed), and what
/// was there is lost. An archive there (the restore's own, a parent), an
/// age identity, any file of data: never worth a pid.
pub(crate) fn not_a_pid_file(path: &std::path::Path) -> Option<&'static str> {
    let head = crate::io::regular_file_head(path, 64)?;
    if head.starts_with(&crate::format::MAGIC) {
        Some("a criuz archive")
    } else if head.iter().all(|b| b.is_ascii_digit() || b.is_ascii_whitespace()) {
        None
    } else {
        Some("something other than a pid")
    }
}

/// The refusal of a pid file `option` that names a file holding `what`.
pub(crate) fn refused_pid_file(option: &str, path: &std::path::Path, what: &str) -> crate::Error {
    crate::Error::Usage(format!("{option} {}: holds {what}, which the pid would replace", path.display()))
}

/// Restores the tree of `o.input` as `how` says; `archive.threads` decode
/// a streamed restore's blocks, or fill a placed one.
pub fn restore(o: &RestoreOptions, how: How, archive: &Options, criu: &Criu) -> Result<Restored> {
    let started = Instant::now();
    options::check_extra(&o.extra, options::Action::Restore)?;
    // Refused before anything is restored: found only once the tree runs,
    // a pidfile that cannot be written fails the restore and kills the tree
    // (a supervisor told the restore failed must not find it running).
    if let Some(p) = &o.pidfile {
        if p.is_dir() {
            return Err(crate::Error::Usage(format!("--pidfile {}: is a directory", p.display())));
        }
        // The pid replaces what is there: an archive there (this restore's
        // own, a parent, another checkpoint) would be lost for a pid.
        if let Some(what) = not_a_pid_file(p) {
            return Err(refused_pid_file("--pidfile", p, what));
        }
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if !dir.is_dir() {
            return Err(crate::Error::Usage(format!(
                "--pidfile {}: {} is not a directory",
                p.display(),
                dir.display()
            )));
        }
    }
    // Should criuz be interrupted once the tree runs, before the pidfile is
    // published, the interruption writes it (`proc::interrupt`).
    crate::proc::restored::note_restored_pidfile(o.pidfile.as_deref());
    let placed = |source, planned| {
        lazy::restore_placed(o, source, started, criu, archive.threads, planned).map(Restored::Placed)
    };
    let streamed = |source: Arc<crate::archive::Archive>, not_placed| {
        checkpoint::restore_opened(o, source, started, archive, criu)
            .map(|r| Restored::Eager(RestoreReport { not_placed, ..r }))
    };
    match how {
        How::Stream => {
            let source = checkpoint::open_for_restore(o)?;
            if let Some(pid) = private_huge_pages(&*source)? {
                return Err(crate::Error::Usage(format!(
                    "--fill stream: process {pid} of {} has private huge-page memory (MAP_HUGETLB), which CRIU's \
                     image stream cannot restore: restore it placed (--fill place, the default)",
                    source.label()
                )));
            }
            streamed(source, None)
        }
        How::Placed => placed(checkpoint::open_for_restore(o)?, None),
        How::Lazy => {
            let source = checkpoint::open_for_restore(o)?;
            if source.find(crate::cuda::RECORD_FILE).is_some() {
                // A CUDA process's resume copies all of its device memory
                // back from host memory at once: lazily, every page of it
                // faults in one at a time (a 21.7 GB image on 16 cores: first
                // answer 14.3-15.3 s lazily, 8.9 s placed; BENCHMARKS.md).
                let why = "its CUDA processes read all their memory as they resume: placed before the tree ran, \
                           not lazily";
                lazy::restore_placed(o, source, started, criu, archive.threads, None)
                    .map(|r| Restored::Placed(LazyReport { not_lazy: Some(why), ..r }))
            } else {
                lazy::restore_lazy(o, source, started, criu, archive.threads).map(Restored::Lazy)
            }
        }
        How::Auto => {
            let source = checkpoint::open_for_restore(o)?;
            // What CRIU's stream cannot restore is placed, whatever else
            // would stream it.
            let huge = private_huge_pages(&*source)?;
            if let Some(pid) = huge.as_ref().filter(|_| !uffd::lazy_restore_available()) {
                return Err(crate::Error::Criu(format!(
                    "cannot restore {}: process {pid} has private huge-page memory (MAP_HUGETLB), which CRIU's image \
                     stream cannot restore, and this kernel has no userfaultfd for criuz to place it: criuz unpack \
                     it, then criu restore -D",
                    source.label()
                )));
            }
            if huge.is_some() {
                return placed(source, None);
            }
            if !placing_suits(o) {
                return streamed(source, None);
            }
            let plan = placement::plan_placement(&*source)?;
            let holds_cuda = source.find(crate::cuda::RECORD_FILE).is_some();
            let sizes = plan.as_ref().map(|p| (p.eager_bytes, p.placed_bytes));
            let copied_apart = if holds_cuda { 0 } else { placement::pages_copied_apart(&*source)? };
            let not_placed = why_not_placed(sizes, copied_apart).or_else(|| {
                let written = plan.as_ref().map_or(0, |p| p.written_bytes);
                let free = crate::io::free_bytes(&crate::io::temp_root());
                free.is_some_and(|free| free < written.saturating_add(TMPDIR_SPARE)).then_some(NO_ROOM)
            });
            match (plan, not_placed) {
                (Some(plan), None) => lazy::restore_placed(o, source, started, criu, archive.threads, Some(plan))
                    .map(|r| Restored::Placed(LazyReport { copied_apart_bytes: copied_apart, ..r })),
                _ => streamed(source, not_placed),
            }
        }
    }
}

/// The first process of the archive with private huge-page memory, which
/// CRIU's stream cannot restore (`images::private_huge_pages`).
fn private_huge_pages(source: &dyn BlockSource) -> Result<Option<String>> {
    for f in source.index().files.iter().filter(|f| f.is_criu_image()) {
        let Some(pid) = f.name.strip_prefix("mm-").and_then(|n| n.strip_suffix(".img")) else { continue };
        if images::private_huge_pages(&source.read_file(f)?) == Some(true) {
            return Ok(Some(pid.to_string()));
        }
    }
    Ok(None)
}

/// Why a default restore streams (`None`: it places), given the bytes CRIU
/// would restore itself and those criuz would place (`None`: pagemaps it
/// cannot place), and the private memory its processes shared
/// copy-on-write, which placing copies into each of them
/// (`placement::pages_copied_apart`). A tree whose processes share more than an
/// eighth as much as placing copies in streams, so CRIU keeps it shared (a
/// forked tree of workers); one that shares less is placed, its few shared
/// pages copied apart (PostgreSQL: a postmaster's 2 MiB heap in each of its
/// 5 children, beside 550 MiB of shared buffers whose restore placing
/// halves; the report says how much, `copied_apart_bytes`). A tree holding
/// CUDA state counts none: its resume reads all of its memory at once (the
/// GPU app streamed with its zero pages took 14.8-17.7 s, placed 4.6-5.6 s:
/// BENCHMARKS.md, session 27), and its dump stores page ids whether or not
/// its processes share anything (`criu_run::ids_by_default`), so its
/// references say little about sharing.
fn why_not_placed(sizes: Option<(u64, u64)>, copied_apart: u64) -> Option<&'static str> {
    match sizes {
        None => Some(UNKNOWN_PAGEMAPS),
        Some((_, placed)) if copied_apart > placed / COPIED_APART_SHARE => Some(SHARED_PAGES),
        Some((eager, placed)) if eager > PLACE_EAGER_MAX.min(placed) => Some(MOSTLY_EAGER),
        Some(_) => None,
    }
}

/// A default restore places a tree whose processes shared private pages
/// only where those are at most this share of what it places.
const COPIED_APART_SHARE: u64 = 8;

/// Why a default restore streams (`restore --json`: `not_placed`).
const UNKNOWN_PAGEMAPS: &str = "its pagemaps are not ones criuz can rewrite for placing: streamed through CRIU";
const SHARED_PAGES: &str = "its processes share much of their memory, which CRIU's stream keeps shared: streamed \
                            through CRIU (--fill place is faster, and gives each process a copy of its own)";
const MOSTLY_EAGER: &str = "CRIU would restore much of its memory itself (shared memory, private file mappings): \
                            streamed through CRIU";

const NO_ROOM: &str = "$TMPDIR has no room for the images placing writes there first (CRIU's, and the memory \
                       CRIU restores itself): streamed through CRIU";

/// Room left in `$TMPDIR` beyond a placed restore's images before a default
/// restore streams instead: CRIU's log and the pidfile go there too.
const TMPDIR_SPARE: u64 = 4 << 20;

/// The most an archive placed by default may leave CRIU to restore itself
/// (shared memory, private file mappings), which is written to `$TMPDIR`
/// first: beyond it the stream restores, with no copy on disk, so a restore
/// of much shared memory needs no `$TMPDIR` room for it.
pub const PLACE_EAGER_MAX: u64 = 256 << 20;

/// Whether placing the memory suits this restore, before the archive is
/// read (see the module doc). An object still downloading is placed too: the
/// fill reads each block once its chunk has arrived, as CRIU's stream would,
/// and decodes on every core (1 GiB of `text` from a local S3 server on 2
/// cores: placed 0.74 s, streamed 1.52 s; through a 125 MB/s link both
/// follow the link; docs/BENCHMARKS.md, session 97).
fn placing_suits(o: &RestoreOptions) -> bool {
    !o.keep_zero_pages && uffd::lazy_restore_available()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_restore_places_unless_streaming_suits_better() {
        const MIB: u64 = 1 << 20;
        let private = Some((0, 512 * MIB));
        assert_eq!(why_not_placed(private, 0), None);
        assert_eq!(why_not_placed(None, 0), Some(UNKNOWN_PAGEMAPS));
        // A forked tree of workers sharing most of their memory: streamed.
        assert_eq!(why_not_placed(private, 3 * 512 * MIB), Some(SHARED_PAGES));
        assert_eq!(why_not_placed(private, 65 * MIB), Some(SHARED_PAGES));
        // A few pages shared beside much memory (PostgreSQL's children and
        // its shared buffers): placed, the few copied apart.
        assert_eq!(why_not_placed(private, 12 * MIB), None);
        assert_eq!(why_not_placed(Some((300 * MIB, 512 * MIB)), 0), Some(MOSTLY_EAGER));
        assert_eq!(why_not_placed(Some((100 * MIB, 50 * MIB)), 0), Some(MOSTLY_EAGER));
    }
}
