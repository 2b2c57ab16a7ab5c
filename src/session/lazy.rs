//! Lazy restore: the process runs at once, its memory arrives on demand.
//!
//! `criu restore --lazy-pages` registers the restored tree's private
//! anonymous memory with userfaultfd and hands each process's userfaultfd to
//! a lazy-pages daemon; criuz is that daemon (`session::pager`), copying
//! pages in from the archive's checked blocks on first touch and filling
//! every other page in the background. CRIU cannot stream a lazy restore,
//! so the metadata images go to a private work directory (0700), with each
//! process's pages image holding only the pages CRIU restores itself (those
//! not marked lazy; the lazy ones are holes in a sparse file, which CRIU
//! skips). Shared memory no descriptor opens gets an empty pagemap: CRIU
//! makes and maps it, and criuz serves its pages as the tree runs, through
//! every process's mappings of it (`shmem::plan_lazy`); any other page
//! images are written whole.
//!
//! The tree runs only once CRIU has handed all of it over and criuz has
//! registered its shared memory in every process ([`Release`]): CRIU leaves
//! a bare tree stopped, and holds a container's (which runc cannot leave
//! stopped) at its pre-resume hook (`session::criu_hook`).
//!
//! Two proofs. The walk of the archive and its parents (do their records
//! make the index the images and pages came from?) runs beside CRIU, and
//! the tree runs only once it is done: a reordered index stops the restore
//! before the tree ran, and the tree does not wait for a walk before CRIU
//! even starts (a container's archive is walked first, as its eager
//! restore needs). The proof of the stored bytes: every stored byte of the
//! archive and its parents is read against its check
//! (`BlockSource::prove_stored`). By default it runs behind the process, so
//! the tree runs as soon as CRIU has restored it, whatever the archive's
//! size; damage it finds kills the tree,
//! as a block that fails mid-fill does (every page copied in comes from a
//! block checked as it is decoded anyway). With `verify_first` it runs
//! before CRIU starts, beside the writing of the images, so damage at rest
//! stops the restore while nothing runs. What the proof cannot see (a
//! compressed payload crafted to match its payload check, a file changed
//! after, an I/O error) is found as the block is decoded.
//!
//! No silent zeros: a page not yet copied reads as zero once every copy of
//! the tree's userfaultfds is closed. A failure criuz finds once the tree
//! runs kills the tree before criuz lets go of them, and a guard process
//! (`proc::guard`) holds copies too and kills the tree if criuz dies.
//!
//! [`LazyRestore`] is the part both callers share: `criuz restore --lazy`
//! runs `criu restore --lazy-pages` and names the tree by its pids;
//! `criuz runc restore` (lazy by default) runs `runc restore
//! --lazy-pages`, whose tree lives in a pid namespace of its own, and names
//! the container's cgroup.

use crate::archive::{Archive, BlockSource};
use crate::codec::Decoder;
use crate::criu::images::{self, PageRun};
use crate::criu::{uffd, Criu};
use crate::error::{Error, IoContext, Result, ResultContext};
use crate::format::{check_entry_name, BlockCodec, FileKind, PAGE_SIZE};
use crate::io::Location;
use crate::proc::guard::{Guard, Victim};
use crate::progress::Meter;
use crate::session::blocks::Blocks;
use crate::session::criu_hook::ActionHook;
use crate::session::criu_run::{
    cannot_run, check_memory_room, check_pids_free, criu_failure, cuda_plan, publish_pidfile, restore_command,
    resume_cuda, RestoreOptions, SharedPages, PIDFILE_FAILED,
};
use crate::session::pager::{Abort, FillGate, LazyProcess, Pager, TOUCHED_MAX};
use crate::session::place::HeldFill;
use crate::session::serve::{pages_images_named_once, zero_plan};
use crate::session::shmem::{self, SharedObject};
use crate::session::workdir::WorkDir;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct LazyReport {
    pub pid: Option<i32>,
    /// CUDA restore and unlock of the restored processes, once they ran.
    pub cuda_resume_seconds: Option<f64>,
    /// Until criuz started CRIU: its own part of the start (opening the
    /// archive, writing CRIU's images).
    pub criu_started_seconds: f64,
    /// Until a placed restore's fill began, CRIU having restored the tree
    /// and handed its memory over: what of `running_seconds` is CRIU's
    /// (and criuz's start); the rest is the fill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill_started_seconds: Option<f64>,
    /// Until the tree runs (CRIU returned; a lazy tree CRIU left stopped
    /// let run; a placed one's pages all in).
    pub running_seconds: f64,
    /// Until every lazy page was in place.
    pub resident_seconds: f64,
    /// Pages restored by CRIU itself (not lazy).
    pub eager_pages: u64,
    /// Zero pages of private anonymous memory left out: they read as zero
    /// without being copied (a lazy restore keeps short runs of them, where
    /// each hole would cost a fault, and maps them: `zero_pages_mapped`).
    pub zero_pages_skipped: u64,
    /// Pages of the working set recorded beside the archive
    /// (`<archive>.touch`) by earlier lazy restores, whose blocks the fill
    /// brought first.
    pub working_set_pages: u64,
    /// Until those pages were in place.
    pub working_set_seconds: Option<f64>,
    /// Where this restore's faults were recorded (none if there were no new
    /// ones, the archive came from a pipe, or its directory is read-only).
    pub working_set_file: Option<String>,
    /// Pages criuz copied in lazily, and the page faults it served (each
    /// answered with the missing rest of the faulted page's block).
    pub lazy_pages: u64,
    /// Of those, pages of shared memory a placed restore copied in or a
    /// lazy one served (`session::shmem`; CRIU restored the rest of it).
    pub shared_pages: u64,
    /// Zero pages the pagemap kept, mapped to the kernel's zero page rather
    /// than copied (no memory of their own until the process writes them).
    pub zero_pages_mapped: u64,
    pub faults: u64,
    /// Restored processes that ended before every page of theirs was in:
    /// `resident_seconds` is then when the last of them ended or was filled.
    pub ended_unfilled: u64,
    pub criu_exit: i32,
    /// Why a lazy restore that was asked for placed the memory instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_lazy: Option<&'static str>,
    /// Private memory the tree's processes shared copy-on-write that a
    /// default restore placed anyway, as a copy in each
    /// (`restore::why_not_placed`; `--fill stream` keeps it shared).
    #[serde(skip_serializing_if = "is_zero")]
    pub copied_apart_bytes: u64,
}

/// Zero runs shorter than this stay in a lazy pagemap (mapped to the zero
/// page with their neighbours, `session::place::ZeroPages`): a page left out
/// is answered alone, one fault at a time, while the fill maps a kept one
/// before the process touches it.
const LAZY_MIN_ZERO_RUN: u64 = 16;

/// A held tree takes no fault before every page is in: every zero page can
/// be left out (it reads as zero, costing no memory, as in a streamed
/// restore).
const HELD_MIN_ZERO_RUN: u64 = 1;

/// No zero run is left out (`--keep-zero-pages`): every zero page is placed
/// as a page of memory.
const KEPT_ZERO_RUN: u64 = u64::MAX;

/// A process's pagemap as written for a lazy restore: its runs with their
/// pages' positions in the archive's image (`first`), and where CRIU finds
/// each run in the pages image written for it.
struct LazyPagemap {
    pid: u32,
    pages_id: u32,
    runs: Vec<(PageRun, u64)>,
    image_pages: u64,
    /// Zero pages left out of the pagemap (they read as zero).
    zero_pages: u64,
}

/// Rewrites a process's pagemap without its long zero runs (those read as
/// zero anyway) and with the lazy flags CRIU should have set
/// (`marked_lazy`); `None` if CRIU's pagemap is not one criuz can rewrite,
/// or flags lazy a page where CRIU registers no userfaultfd
/// (`images::lazy_runs_registered`).
fn lazy_pagemap(
    source: &dyn BlockSource,
    pid: &str,
    pagemap: &[u8],
    min_zero_run: u64,
    named_once: &HashSet<u32>,
) -> Result<Option<(Vec<u8>, LazyPagemap)>> {
    // In address order, as `pagemap_runs` reads only such pagemaps.
    let Some((pages_id, by_vaddr)) = images::pagemap_runs(pagemap) else { return Ok(None) };
    // A pages image of its own, which the archive holds: criuz writes it
    // for CRIU with the eager pages only, and a process whose image it
    // does not write would get no pages at all.
    let held = source.find(&format!("pages-{pages_id}.img")).is_some_and(|f| f.kind == FileKind::Pages);
    if !held || !named_once.contains(&pages_id) {
        return Ok(None);
    }
    let Some(mm) = source.find(&format!("mm-{pid}.img")).map(|f| source.read_file(f)).transpose()? else {
        return Ok(None);
    };
    let plan = zero_plan(source, pid, pagemap, min_zero_run, named_once)?;
    let mut written = plan.as_ref().map_or(pagemap, |p| &p.pagemap[..]).to_vec();
    if let Some(marked) = marked_lazy(source, pid, &mm, &written)? {
        written = marked;
    }
    let Some((_, kept)) = images::pagemap_runs(&written) else { return Ok(None) };
    if !images::lazy_runs_registered(&mm, &kept) {
        return Ok(None);
    }
    let mut runs = Vec::with_capacity(kept.len());
    for k in kept {
        // Each kept run lies inside one original entry: its pages sit
        // together in the archive's image.
        let i = by_vaddr.partition_point(|r| r.vaddr <= k.vaddr).checked_sub(1);
        let o = i.map(|i| by_vaddr[i]).filter(|o| (k.vaddr - o.vaddr) / PAGE_SIZE as u64 + k.nr <= o.nr);
        let Some(o) = o else { return Ok(None) };
        let at = PageRun { first: o.first + (k.vaddr - o.vaddr) / PAGE_SIZE as u64, ..k };
        runs.push((at, k.first));
    }
    let image_pages = runs.iter().map(|(r, _)| r.nr).sum();
    let zero_pages = plan.as_ref().map_or(0, |p| p.skipped_pages);
    let pid = pid.parse().map_err(|_| Error::corrupt(0, format!("pagemap-{pid}.img: not a pid")))?;
    Ok(Some((written, LazyPagemap { pid, pages_id, runs, image_pages, zero_pages })))
}

/// How criuz would place an archive's memory (a held restore): each
/// process's pagemap as rewritten for it, by the pagemap's name, and what
/// CRIU would still restore itself from images written to a work directory
/// first (`eager_bytes`): every pages image that is not a process's private
/// anonymous memory (shared memory, private file mappings) and the pages a
/// process's pagemap does not mark lazy; and what criuz would copy in
/// (`placed_bytes`). Worked out once: deciding whether to place and writing
/// the images both use it.
pub(crate) struct Placement {
    pagemaps: HashMap<String, (Vec<u8>, LazyPagemap)>,
    /// Shared memory criuz fills itself (`session::shmem`).
    shared: Vec<SharedObject>,
    pub eager_bytes: u64,
    pub placed_bytes: u64,
    /// What the work directory takes: `eager_bytes` and every image that
    /// holds no pages.
    pub written_bytes: u64,
}

/// The archive's `Placement`; `None` where criuz cannot place the memory: a
/// process's pagemap is not one it can rewrite for a lazy restore (what CRIU
/// writes; not, say, a pagemap of pages CRIU compressed itself).
pub(crate) fn plan_placement(source: &dyn BlockSource) -> Result<Option<Placement>> {
    let mut pagemaps = HashMap::new();
    let named_once = pages_images_named_once(source)?;
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Plain).filter(|f| f.is_criu_image()) {
        if let Some(pid) = images::process_pagemap_pid(&f.name) {
            let Some(lazy) = lazy_pagemap(source, pid, &source.read_file(f)?, HELD_MIN_ZERO_RUN, &named_once)? else {
                return Ok(None);
            };
            pagemaps.insert(f.name.clone(), lazy);
        }
    }
    let shared = shmem::plan(source, &named_once)?;
    let images: u64 = source.index().files.iter().filter(|f| f.kind == FileKind::Plain).map(|f| f.raw_size).sum();
    let by_image: HashMap<u32, &LazyPagemap> = pagemaps.values().map(|(_, l)| (l.pages_id, l)).collect();
    let shared_by_image: HashMap<u32, &SharedObject> = shared.iter().map(|o| (o.pages_id, o)).collect();
    let mut eager_bytes = 0;
    let mut placed_bytes = 0;
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Pages).filter(|f| f.is_criu_image()) {
        let bytes = |l: &LazyPagemap, lazy: bool| -> u64 {
            l.runs.iter().filter(|(r, _)| r.lazy == lazy).map(|(r, _)| r.nr.saturating_mul(PAGE_SIZE as u64)).sum()
        };
        let id = images::pages_image_id(&f.name);
        match (id.and_then(|id| by_image.get(&id)), id.and_then(|id| shared_by_image.get(&id))) {
            (Some(l), _) => {
                eager_bytes += bytes(l, false);
                placed_bytes += bytes(l, true);
            }
            (None, Some(o)) => placed_bytes += o.pages() * PAGE_SIZE as u64,
            (None, None) => eager_bytes += f.raw_size,
        }
    }
    let written_bytes = eager_bytes.saturating_add(images);
    Ok(Some(Placement { pagemaps, shared, eager_bytes, placed_bytes, written_bytes }))
}

/// Whether the archive's tree has several processes that shared private
/// pages (`pages_copied_apart`), which CRIU's own restore keeps shared
/// (copy-on-write, as they were) and a restore through userfaultfd copies
/// into each of them. Pages stored by reference inside shared memory's
/// own images are no such sign. Where a pagemap cannot be read, it says
/// they did. Reads the index and the shared memory's pagemaps only.
pub(crate) fn shares_pages(source: &dyn BlockSource) -> bool {
    pages_copied_apart(source).map_or(true, |bytes| bytes > 0)
}

/// The bytes of private memory the archive's processes shared, which a
/// restore through userfaultfd copies into each of them: its process pages
/// images' pages stored by reference (dedup blocks; shared memory's own
/// images are not counted, it stays shared either way). It errs high: a
/// page a process held twice is stored once too. Reads the index and the
/// shared memory's pagemaps only.
pub(crate) fn pages_copied_apart(source: &dyn BlockSource) -> Result<u64> {
    let files = || source.index().files.iter().filter(|f| f.is_criu_image());
    let processes = files().filter(|f| f.kind == FileKind::Plain && images::process_pagemap_pid(&f.name).is_some());
    if processes.count() < 2 {
        return Ok(0);
    }
    let mut shared_memory = HashSet::new();
    for f in files().filter(|f| f.kind == FileKind::Plain && images::shmem_pagemap_id(&f.name).is_some()) {
        shared_memory.extend(images::pagemap_pages_id(&source.read_file(f)?));
    }
    let mut pages = 0u64;
    for f in files().filter(|f| f.kind == FileKind::Pages) {
        if images::pages_image_id(&f.name).is_some_and(|id| shared_memory.contains(&id)) {
            continue;
        }
        let blocks = (0..).map_while(|i| source.block_header(f.file_id, i));
        pages += blocks.filter(|(h, _)| h.codec == BlockCodec::Dedup).map(|(h, _)| h.pages() as u64).sum::<u64>();
    }
    Ok(pages.saturating_mul(PAGE_SIZE as u64))
}

/// `pagemap` with the lazy flags CRIU should have set (`images::mark_lazy`),
/// from the process's VMAs and its threads' stack pointers; `None` where
/// they cannot be read (then CRIU's flags stand).
fn marked_lazy(source: &dyn BlockSource, pid: &str, mm: &[u8], pagemap: &[u8]) -> Result<Option<Vec<u8>>> {
    let read = |name: &str| source.find(name).map(|f| source.read_file(f)).transpose();
    let (Some(pstree), Ok(pid_n)) = (read("pstree.img")?, pid.parse()) else {
        return Ok(None);
    };
    let Some(threads) = images::pstree_threads(&pstree, pid_n) else { return Ok(None) };
    let mut stack_pointers = Vec::with_capacity(threads.len());
    for tid in threads {
        let Some(core) = read(&format!("core-{tid}.img"))? else { return Ok(None) };
        let Some(sp) = images::core_stack_pointer(&core) else { return Ok(None) };
        stack_pointers.push(sp);
    }
    Ok(images::mark_lazy(mm, pagemap, &stack_pointers))
}

/// What `materialize` wrote.
struct Materialized {
    /// The lazily served processes, by pid.
    processes: HashMap<u32, LazyProcess>,
    /// Pages CRIU restores itself.
    eager_pages: u64,
    /// Zero pages left out of the pagemaps.
    zero_pages: u64,
}

/// Writes the archive's files into `dir` for CRIU: every plain file, each
/// process's pagemap without its runs of at least `min_zero_run` zero pages
/// (as `planned` has it already, where given), and its pages image with only
/// the pages that pagemap does not mark lazy, decoded on `threads` threads
/// (`write_eager`). The shared memory criuz fills itself
/// (`session::shmem`), `left_empty` (pagemap name -> pages image id), gets
/// an empty pagemap and pages image.
fn materialize(
    blocks: &Blocks,
    dir: &Path,
    min_zero_run: u64,
    mut planned: Option<Placement>,
    named_once: &HashSet<u32>,
    left_empty: &HashMap<&str, u32>,
    threads: usize,
) -> Result<Materialized> {
    let source = &blocks.source;
    let label = source.label().to_string();
    let files = &source.index().files;
    let mut lazy_images: HashMap<u32, LazyPagemap> = HashMap::new();
    // A placed restore's plan found them already (`plan_placement`; empty
    // `named_once`); a pagemap missing from it finds no image here and is
    // refused.
    let shared_images: HashSet<u32> = left_empty.values().copied().collect();
    let mut zero_pages = 0;
    for f in files.iter().filter(|f| f.kind == FileKind::Plain).filter(|f| f.is_criu_image()) {
        check_entry_name(&f.name, false).map_err(|e| Error::corrupt(0, format!("{}: {e}", f.name)))?;
        let mut bytes = source.read_file(f)?;
        if let Some(&pages_id) = left_empty.get(f.name.as_str()) {
            // CRIU makes and maps the object, and reads none of it.
            bytes = images::PagemapBuilder::new(pages_id).finish();
        } else if let Some(pid) = images::process_pagemap_pid(&f.name) {
            let planned = planned.as_mut().and_then(|p| p.pagemaps.remove(&f.name));
            let (written, lazy) = planned
                .map_or_else(|| lazy_pagemap(&**source, pid, &bytes, min_zero_run, named_once), |p| Ok(Some(p)))
                .context(|| format!("{label}: {}", f.name))?
                .ok_or_else(|| {
                    // A usage error, not a damaged archive: an eager
                    // restore hands the pagemap to CRIU as it is.
                    Error::Usage(format!(
                        "{label}: {}: pagemap not understood: criuz cannot place this memory itself; an eager restore \
                         hands it to CRIU as it is (criuz restore without --lazy or --fill place, criuz runc restore \
                         --eager)",
                        f.name
                    ))
                })?;
            bytes = written;
            zero_pages += lazy.zero_pages;
            lazy_images.insert(lazy.pages_id, lazy);
        }
        let path = dir.join(&f.name);
        std::fs::write(&path, &bytes).at(&path)?;
    }
    let mut processes = HashMap::new();
    let mut eager = 0;
    for f in files.iter().filter(|f| f.kind == FileKind::Pages).filter(|f| f.is_criu_image()) {
        check_entry_name(&f.name, false).map_err(|e| Error::corrupt(0, format!("{}: {e}", f.name)))?;
        let path = dir.join(&f.name);
        let out = std::fs::File::create(&path).at(&path)?;
        let id = images::pages_image_id(&f.name);
        if id.is_some_and(|id| shared_images.contains(&id)) {
            // Left empty: criuz fills the object (`session::shmem`).
            continue;
        }
        let lazy = id.and_then(|id| lazy_images.remove(&id));
        let total_pages = f.raw_size.div_ceil(PAGE_SIZE as u64);
        // Runs CRIU reads itself, (archive page, image page, pages): all of
        // a non-process image, the eager runs of a process's.
        let eager_runs: Vec<EagerRun> = match &lazy {
            Some(l) => l.runs.iter().filter(|(r, _)| !r.lazy).map(|(r, at)| (r.first, *at, r.nr)).collect(),
            None => vec![(0, 0, total_pages)],
        };
        let what = format!("{label}: {}", f.name);
        write_eager(blocks, (f.file_id, &what), &eager_runs, (&out, &path), threads)?;
        eager += eager_runs.iter().map(|&(_, _, nr)| nr).sum::<u64>();
        let image_len = lazy.as_ref().map_or(f.raw_size, |l| l.image_pages * PAGE_SIZE as u64);
        out.set_len(image_len).at(&path)?;
        if let Some(l) = lazy {
            // In address order: those of a pagemap `pagemap_runs` read.
            let runs: Vec<PageRun> = l.runs.into_iter().map(|(r, _)| r).collect();
            processes.insert(l.pid, LazyProcess { pages_file: f.file_id, runs });
        }
    }
    Ok(Materialized { processes, eager_pages: eager, zero_pages })
}

/// Pages CRIU restores itself: (page in the archive's image, page in the
/// image written for CRIU, pages).
type EagerRun = (u64, u64, u64);

/// Blocks each thread of [`write_eager`] decodes at least: a thread more
/// pays only where there are several blocks for it. The two blocks of a
/// 1 GiB `mixed` process's eager pages took 0.41-0.52 ms on the calling
/// thread, and 0.5-4.2 ms shared with a second one, which waited for a core
/// behind the archive's walk (2 cores, 8 restores each way, session 47).
const EAGER_BLOCKS_PER_THREAD: usize = 8;

/// Writes `runs` of archive image `file` (`what`, for errors) into `out` at
/// `path`, one archive block at a time on `threads` threads: each decodes
/// its block once and writes every piece of a run that lies in it. CRIU
/// starts only once they are written, so only the archive's walk runs
/// meanwhile: on 2 cores, 200 MiB of shared memory restored in 0.30-0.36 s
/// instead of 0.36-0.48 (docs/BENCHMARKS.md). The first error stops every
/// thread.
fn write_eager(
    blocks: &Blocks,
    (file, what): (u32, &str),
    runs: &[EagerRun],
    (out, path): (&std::fs::File, &Path),
    threads: usize,
) -> Result<()> {
    let starts = blocks.starts(file);
    // Pieces of runs cut at block ends, grouped by block: (block, pieces).
    let mut by_block: Vec<(usize, Vec<EagerRun>)> = Vec::new();
    for &(first, at, nr) in runs {
        let mut done = 0;
        while done < nr {
            let page = first.saturating_add(done);
            let byte = page.saturating_mul(PAGE_SIZE as u64);
            let block = starts
                .partition_point(|&s| s <= byte)
                .checked_sub(1)
                .ok_or_else(|| Error::corrupt(0, format!("{what}: page {page} lies before the first block")))?;
            let end = starts.get(block + 1).map_or(u64::MAX, |&e| e / PAGE_SIZE as u64);
            let take = (nr - done).min(end.saturating_sub(page)).max(1);
            match by_block.last_mut() {
                Some((b, pieces)) if *b == block => pieces.push((page, at + done, take)),
                _ => by_block.push((block, vec![(page, at + done, take)])),
            }
            done += take;
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let step = |dec: &mut Decoder| -> Result<bool> {
        let Some((_, pieces)) = by_block.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) else {
            return Ok(false);
        };
        let first = pieces.first().map_or(0, |&(page, _, _)| page);
        let (block, base) = blocks.block_at(dec, file, first, false).context(|| what.to_string())?;
        for &(page, at, nr) in pieces {
            let page_bytes = |n: u64| usize::try_from(n.checked_mul(PAGE_SIZE as u64)?).ok();
            let from = page_bytes(page).and_then(|b| b.checked_sub(base as usize));
            let range = from.zip(page_bytes(nr)).and_then(|(f, len)| Some(f..f.checked_add(len)?));
            let bytes = range
                .and_then(|r| block.get(r))
                .ok_or_else(|| Error::corrupt(0, format!("{what}: page {page} is not stored whole in its block")))?;
            out.write_all_at(bytes, at * PAGE_SIZE as u64).at(path)?;
        }
        Ok(true)
    };
    let helpers_worth_it = (by_block.len() / EAGER_BLOCKS_PER_THREAD).max(1);
    crate::engine::until_done_or_failed(threads.clamp(1, helpers_worth_it), Decoder::new, step)
}

/// Pages by pid that a lazy restore saw faulted (first touches, in order),
/// kept beside the archive as `<archive>.touch`: the next lazy restore's
/// fill brings their blocks first, in that order, so the working set
/// arrives before the rest while the process already runs. Only a hint: a
/// wrong one changes the order pages arrive in, never their bytes, which
/// always come from checked blocks. The record's first line:
const TOUCH_HEADER: &str = "criuz working set 1";

fn touch_path(input: &Location) -> Option<std::path::PathBuf> {
    input.path().map(|path| {
        let mut p = path.as_os_str().to_owned();
        p.push(".touch");
        p.into()
    })
}

/// The recorded faults, in order; empty if there is no usable record. Only
/// a regular file is read, and only as much as a record can hold: anyone
/// who may write beside the archive could have put a FIFO there (the
/// restore waited on it for good) or a link to `/dev/zero` (read until
/// memory ran out).
fn load_touches(path: Option<&Path>) -> Vec<(u32, u64)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // A line is a pid, a space, an address in hex and a newline.
    const MOST_BYTES: u64 = TOUCH_HEADER.len() as u64 + 1 + TOUCHED_MAX as u64 * 28;
    let read = |p: &Path| -> std::io::Result<String> {
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW).open(p)?;
        if !file.metadata()?.is_file() {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        let mut text = String::new();
        file.take(MOST_BYTES).read_to_string(&mut text)?;
        Ok(text)
    };
    let Some(text) = path.and_then(|p| read(p).ok()) else { return Vec::new() };
    let mut lines = text.lines();
    if lines.next() != Some(TOUCH_HEADER) {
        return Vec::new();
    }
    lines
        .filter_map(|l| {
            let (pid, vaddr) = l.split_once(' ')?;
            Some((pid.parse().ok()?, u64::from_str_radix(vaddr, 16).ok()?))
        })
        .take(TOUCHED_MAX)
        .collect()
}

/// Writes the old record followed by the new faults (complete or not at all,
/// 0600: it maps the process's memory).
fn save_touches(path: &Path, old: &[(u32, u64)], new: &[(u32, u64)]) -> Result<()> {
    let mut seen = HashSet::new();
    let mut text = format!("{TOUCH_HEADER}\n");
    for &(pid, vaddr) in old.iter().chain(new).take(TOUCHED_MAX) {
        if seen.insert((pid, vaddr)) {
            text.push_str(&format!("{pid} {vaddr:x}\n"));
        }
    }
    crate::io::replace_small_file(path, 0o600, text.as_bytes())
}

/// A lazy restore ready to run: the archive, the directory CRIU reads its
/// images from, CRIU's work directory (where its lazy-pages socket goes),
/// and what is killed should the pages be unable to all arrive. Bare trees
/// (`restore_lazy`) and containers (`container::runc_restore`) both run
/// through it.
pub(crate) struct LazyRestore<'a> {
    pub source: Arc<dyn BlockSource>,
    /// The archive as named (its working-set record goes beside it).
    pub input: &'a Location,
    pub images: &'a Path,
    pub work: &'a Path,
    pub victim: &'a Victim,
    /// Prove the stored bytes before CRIU starts, not behind the process.
    pub verify_first: bool,
    pub fill: Fill,
    /// Shared memory a held tree's fill places (`session::shmem`).
    pub shared: Vec<SharedObject>,
    /// How a lazy tree is let run.
    pub release: Release<'a>,
    /// Threads that fill a held tree, or (less one, for the tree) decode
    /// ahead of a running tree's fill.
    pub threads: usize,
    /// Counts the bytes a held tree's fill copies in, for a progress line.
    pub meter: Option<Arc<Meter>>,
    /// CRIU returns once the tree is restored (a bare restore's always,
    /// `criu_run::restore_command`; runc's with `--detach`), so a failure it
    /// reports is the restore's. Without (a runc in the foreground), it
    /// waits for the tree as long as it runs (and may be killed meanwhile).
    pub detached: bool,
    /// The processes of a tree held stopped that were stopped when dumped,
    /// with the signal that had stopped them (`stopped_at_dump`): letting
    /// the tree run leaves them stopped, as CRIU's own restore does.
    pub dumped_stopped: &'a [(i32, i32)],
}

/// How a lazy tree CRIU restored stopped is let run.
pub(crate) enum Release<'a> {
    /// CRIU leaves it stopped (`--leave-stopped`) and exits; criuz
    /// continues it (a bare tree).
    Continued,
    /// CRIU waits at its pre-resume hook with the tree stopped and resumes
    /// it once criuz answers (a container: runc cannot leave a tree
    /// stopped).
    AtPreResume(&'a ActionHook),
}

/// When the restored tree runs, against when its memory is in.
pub(crate) enum Fill {
    /// At once: its pages arrive on demand, the rest in the background.
    /// CRIU restores the tree stopped (see [`Release`]), and it runs once
    /// CRIU has handed all of it over, criuz has registered its shared
    /// memory in every process, and the walks of the archive and its
    /// parents, which ran beside CRIU's restore, have proven them; what
    /// they find stops the restore before the tree ran.
    Lazy,
    /// Held stopped (CRIU's `--leave-stopped`) until every page is in, then
    /// let run: an eager restore whose memory criuz places itself, on
    /// `threads` threads (`session::place`). A bare tree only. `planned`:
    /// its pagemaps, where already worked out (`plan_placement`, which
    /// leaves zero pages out). `keep_zero_pages`: every zero page placed
    /// too, as a page of memory (as CRIU's own restore writes them).
    Held { planned: Option<Placement>, keep_zero_pages: bool },
}

impl LazyRestore<'_> {
    /// Writes the images, then runs `cmd` (a restore told `--lazy-pages`,
    /// with `work` as its work directory) while serving its pages;
    /// `on_running` runs once `cmd` succeeded, as the pages still arrive.
    /// Returns once every page is in place (or the restore failed), with
    /// `cmd`'s status; an error if the pages could not all be served (the
    /// victim is then dead), `cmd` could not run, or `on_running` failed.
    pub(crate) fn run(
        self,
        mut cmd: Command,
        started: Instant,
        on_running: impl FnOnce() -> Result<()>,
    ) -> Result<(ExitStatus, LazyReport)> {
        // `gated`: a lazy tree CRIU restores stopped, let run by the walks.
        let (hold, gated, planned, keep_zeros) = match self.fill {
            Fill::Held { planned, keep_zero_pages } => {
                (true, false, planned.filter(|_| !keep_zero_pages), keep_zero_pages)
            }
            Fill::Lazy => (false, true, None, false),
        };
        let blocks = Blocks::new(self.source.clone());
        // Until CRIU has restored the tree, what CRIU reads comes first: from
        // a cold cache the archive's read-ahead beside it made CRIU's part of
        // a 1 GiB lazy restore 0.17 s instead of 0.03, and a placed restore
        // 0.71 s instead of 0.47 (docs/BENCHMARKS.md). It resumes when the
        // tree runs (lazy) or the held fill starts (`Pager::fill_held`).
        self.source.read_ahead(false);
        // A held tree never runs before every page is in: no working set to
        // learn from, nor to bring first.
        let touch = if hold { None } else { touch_path(self.input) };
        let recorded = load_touches(touch.as_deref());
        // Found once: the lazy plan of shared memory and the images below
        // both ask which pages images one pagemap alone names. A placed
        // restore's plan found them already.
        let named_once = if planned.is_some() { HashSet::new() } else { pages_images_named_once(&*self.source)? };
        // A lazy tree's shared memory that no descriptor opens: served as
        // it runs, like its private memory.
        let served_shared = if gated { shmem::plan_lazy(&*self.source, &named_once)? } else { Vec::new() };
        let placed = self.shared.iter().map(|o| (o.pagemap.as_str(), o.pages_id));
        let left_empty: HashMap<&str, u32> =
            placed.chain(served_shared.iter().map(|o| (o.pagemap.as_str(), o.pages_id))).collect();
        // With `verify_first`, every stored byte is proven before the tree
        // may run, beside the images being written (which decode and prove
        // their own blocks); otherwise behind the running tree, below.
        let (proven, materialized) = std::thread::scope(|s| {
            let proving = self.verify_first.then(|| s.spawn(|| self.source.prove_stored()));
            let min_zero_run = match (keep_zeros, hold) {
                (true, _) => KEPT_ZERO_RUN,
                (false, true) => HELD_MIN_ZERO_RUN,
                (false, false) => LAZY_MIN_ZERO_RUN,
            };
            let materialized =
                materialize(&blocks, self.images, min_zero_run, planned, &named_once, &left_empty, self.threads);
            (proving.map_or(Ok(()), |p| p.join().unwrap_or(Err(Error::Cancelled))), materialized)
        });
        proven?;
        let Materialized { processes, eager_pages, zero_pages } = materialized?;
        blocks.reset_cursor();

        let listener = uffd::listen(self.work).at(self.work.join(uffd::LAZY_SOCKET))?;
        let guard = Guard::start_for(self.victim)?;
        let (stop_tx, stop_rx) = UnixStream::pair()?;
        let abort = Abort::new()?;
        let victim = self.victim;
        let held_fill = hold.then(|| HeldFill { threads: self.threads, meter: self.meter.clone() });
        // A running tree is filled in steps on every core (`Pager::fill_step`),
        // each thread decoding the blocks it copies; on one core, by the
        // pager's thread a block at a time, decoded ahead.
        let fill_threads = if hold { 0 } else { self.threads };
        let mut pager = Pager::new(&blocks, &processes, &guard, victim, &recorded, held_fill, fill_threads)
            .placing_shared(&self.shared)
            .serving_shared(&served_shared);
        // The proof behind a running tree. A held tree needs none: it runs
        // only once every page is in, each from a block checked as it was
        // decoded, which is what a streamed restore promises too.
        let prove_behind = !self.verify_first && !hold;
        let resumed: OnceLock<Instant> = OnceLock::new();
        let source = &*self.source;
        let fill_gate = if gated { Some(FillGate::new()?) } else { None };
        let (finished_tx, finished) = std::sync::mpsc::channel::<()>();
        // Whether CRIU exited having restored the tree: a held tree, or a
        // lazy one CRIU left stopped, is let run only then. CRIU says the
        // restore finished (and a held fill starts) before it lets the
        // tasks out of its restorer: a CRIU that died in between (killed,
        // or with a criuz killed once the guard was told the tree is whole)
        // left them waiting there for good, every signal blocked, where a
        // SIGCONT could not reach them.
        let (criu_ended_tx, criu_ended) = std::sync::mpsc::channel::<bool>();
        let (mut gate_waits, held_waits) = if gated { (Some(criu_ended), None) } else { (None, Some(criu_ended)) };
        // Set once the command has returned: a pre-resume hook CRIU has not
        // run by then it never runs.
        let command_ended = AtomicBool::new(false);
        // Decoders for a fill one block at a time (one core): where zstd
        // blocks dominate, decoding is slower than copying, so every core but
        // one (left to the tree) decodes; LZ4 and raw blocks decode faster
        // than one thread copies them in (2 cores: lz4 restores took
        // 0.33-0.52 s with one decoder, 0.46-0.56 s with two; zstd 0.41-1.10 s
        // with one, 0.49-0.84 s with two), so one decoder keeps up. A fill in
        // steps, or of a held tree, needs none: its threads decode their own
        // blocks (`session::place`).
        let decoders = if hold || fill_threads > 1 {
            0
        } else if mostly_zstd(&*self.source) {
            self.threads.saturating_sub(1).max(1)
        } else {
            1
        };
        let mut criu_started = 0.0;
        let (paged, proof, status, running, published, ran) = std::thread::scope(|s| {
            for _ in 0..decoders {
                s.spawn(|| blocks.decode_ahead());
            }
            // Started once the tree runs, so as not to hold CRIU's reads
            // back either.
            let prove = || {
                s.spawn(|| {
                    let proving = std::panic::AssertUnwindSafe(|| self.source.prove_stored());
                    let proven = std::panic::catch_unwind(proving).unwrap_or(Err(Error::Cancelled));
                    if let Err(e) = &proven {
                        // The pager fails with it, killing the tree.
                        abort.fail(e.duplicate());
                    }
                    proven
                })
            };
            let mut proving = None;
            // A lazy tree runs once CRIU has handed over its memory (and the
            // pager has registered its shared memory in every process) and
            // the walks behind have proven the index its images and pages
            // came from, which a reordered index with every check
            // recomputed would not be: what the walks find fails the pager,
            // which kills the tree before it ran. The pager serves faults
            // meanwhile but fills nothing in (`FillGate`).
            let releasing = fill_gate.as_ref().map(|gate| {
                let (resumed, abort, command_ended) = (&resumed, &abort, &command_ended);
                let criu_ended = gate_waits.take();
                let release = &self.release;
                s.spawn(move || {
                    // An error from the pager (it ended before CRIU handed
                    // the tree over) kills the tree itself.
                    let proven = finished.recv().is_ok()
                        && match source.proven().and_then(|()| source.parents_walked()) {
                            Ok(()) => true,
                            Err(e) => {
                                abort.fail(e);
                                false
                            }
                        };
                    let released = match release {
                        // Let run only once CRIU exited having restored it (above).
                        Release::Continued => {
                            let restored = proven && criu_ended.is_some_and(|e| e.recv().unwrap_or(false));
                            if restored {
                                victim.resume(self.dumped_stopped);
                            }
                            restored
                        }
                        // CRIU waits at its hook whatever criuz found, so it
                        // is answered either way; told to fail, the hook
                        // kills the tree before CRIU would let it run.
                        Release::AtPreResume(hook) => match hook.wait_asked(command_ended) {
                            Ok(Some(asked)) => {
                                asked.answer(proven);
                                proven
                            }
                            Ok(None) | Err(_) => false,
                        },
                    };
                    if released {
                        let _ = resumed.set(Instant::now());
                        gate.open();
                    }
                    released
                })
            });
            let gated = fill_gate.as_ref().map(|g| (g, finished_tx));
            let paging = s.spawn(|| {
                let criu_ended = held_waits;
                let mut r = pager.run(&listener, &stop_rx, &abort, gated);
                if hold && r.is_ok() && pager.all_in() {
                    // Letting a held tree run is the point of no return: an
                    // archive opened while it still arrived must be proven
                    // whole first (as a streamed restore's last page waits),
                    // and every process must still be there.
                    r = self.source.proven().and_then(|()| pager.killed_while_held());
                }
                blocks.finish();
                // A held tree is told whole, and let run, only once CRIU has
                // exited having restored it (above).
                let criu_restored = || !hold || criu_ended.as_ref().is_some_and(|e| e.recv().unwrap_or(false));
                if r.is_err() {
                    // Before the pager's copies of the userfaultfds close.
                    victim.kill();
                } else if pager.all_in() && criu_restored() {
                    // Every page is in: the userfaultfds (ours and the
                    // guard's copies) are let go, so that pages left out as
                    // zero read as zero from now on (a runc in the
                    // foreground waits for the tree, and the tree must not
                    // wait for us). Done whole, uninterrupted; and a held
                    // tree's guard is told it is whole first and released
                    // only once it runs, so that a criuz killed in between
                    // leaves the guard to let it run (released first, it
                    // left the tree stopped for good).
                    crate::io::unfinished::uninterrupted(|| {
                        if hold {
                            // A guard that cannot be told is gone already.
                            let _ = guard.whole(self.dumped_stopped);
                        }
                        pager.let_go();
                        if !hold {
                            guard.release();
                        }
                        // Not where a lazy tree's proof behind may still
                        // kill it by its pids and criuz returns once that is
                        // done: until then they stay criuz's to hold (and
                        // without -d, `proc::foreground` lets go after).
                        if hold || !self.detached {
                            let root = match victim {
                                Victim::Tree(pids) => pids.first().copied(),
                                Victim::Cgroup(_) => None,
                            };
                            crate::proc::restored::let_go_of_restored_tree(root);
                        }
                        if hold {
                            let _ = resumed.set(Instant::now());
                            victim.resume(self.dumped_stopped);
                            guard.release();
                        }
                    });
                }
                let whole = r.is_ok() && pager.all_in();
                (r, whole)
            });
            let keep: &[i32] = match victim {
                Victim::Tree(pids) => pids,
                Victim::Cgroup(_) => &[],
            };
            // CRIU forks the tree. Should criuz die meanwhile, the guard
            // notices before CRIU does (criuz's descriptors close before its
            // children are told it died), kills the tree, and CRIU may fork
            // more of it: the guard kills again once CRIU has ended. (A
            // container's cgroup kill takes what joins it later anyway.)
            let told = matches!(victim, Victim::Tree(_)).then_some(&guard);
            criu_started = started.elapsed().as_secs_f64();
            let status = crate::session::criu_run::run_criu_told(&mut cmd, keep, told);
            command_ended.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = criu_ended_tx.send(status.as_ref().is_ok_and(|s| s.success()));
            let mut running = started.elapsed().as_secs_f64();
            let mut published = Ok(());
            let mut paging = Some(paging);
            let mut paged = None;
            let join = |p: Option<std::thread::ScopedJoinHandle<'_, (Result<()>, bool)>>| {
                p.map_or((Err(Error::Cancelled), false), |p| p.join().unwrap_or((Err(Error::Cancelled), false)))
            };
            let ran = if status.as_ref().is_ok_and(|s| s.success()) {
                if hold {
                    // Restored, held stopped: it runs once the pager is done.
                    paged = Some(join(paging.take()).0);
                    resumed.get().is_some()
                } else {
                    // The tree runs (once released, where CRIU left it
                    // stopped) while its pages still arrive.
                    releasing.is_none_or(|r| r.join().unwrap_or(false))
                }
            } else {
                // The restore failed, or, under a runc in the foreground,
                // CRIU failed or was killed while the tree ran (by an
                // interrupted criuz among others): nothing more will fault.
                let _ = stop_tx.shutdown(std::net::Shutdown::Both);
                let (r, whole) = join(paging.take());
                paged = Some(r);
                // A tree let run with every page in is whole: how CRIU ended
                // after that is no failed restore, and the tree (and what it
                // forked) is not criuz's to kill. Behind a lazy tree the
                // proof still runs, as after a CRIU that succeeded.
                whole && resumed.get().is_some() && !self.detached
            };
            if ran {
                running = resumed.get().map_or(running, |t| (*t - started).as_secs_f64());
                // Said first: on 2 cores, the proof's and the read-ahead's
                // threads, started before it, delayed the pidfile of a
                // tree that already ran.
                published = on_running();
                // A held tree's fill resumed the read-ahead already, and it
                // has no proof behind.
                self.source.read_ahead(true);
                proving = prove_behind.then(prove);
            }
            let proof = proving.map_or(Ok(()), |p| p.join().unwrap_or(Err(Error::Cancelled)));
            let paged = paged.unwrap_or_else(|| join(paging).0);
            (paged, proof, status, running, published, ran)
        });
        let mut ended = String::new();
        if paged.is_err() || proof.is_err() || published.is_err() {
            // Again, now that the restore has returned: the tree may not have
            // existed at the first kill, and it must be dead before the pager's
            // and the guard's copies of its userfaultfds close.
            victim.kill();
            ended = victim.wait_gone();
        }
        let report = pager.into_report();
        guard.release();
        let whole = ran && paged.is_ok() && proof.is_ok();
        if let (true, Victim::Tree(pids)) = (whole, victim) {
            // Whole and unguarded: a lazy tree's proof behind is done, and
            // from here an interruption leaves the tree running, or passes
            // on to it in the foreground (`proc::interrupt`).
            crate::proc::restored::let_go_of_restored_tree(pids.first().copied());
        }
        if !whole && (paged.is_err() || proof.is_err() || !status.as_ref().is_ok_and(|s| s.success())) {
            // What CRIU abandoned, whether criuz learned of it or not.
            crate::proc::restored::end_orphans();
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        let status = status.map_err(|e| cannot_run(&program, e))?;
        let resident = report.resident.map_or(started.elapsed(), |t| t - started).as_secs_f64();
        let failed = if ran {
            "lazy restore failed, restored tree killed"
        } else {
            "restore failed before the restored tree ran"
        };
        let failed = if ended.is_empty() { failed.to_string() } else { format!("{failed}: {ended}") };
        paged.and(proof).map_err(|e| e.context(failed))?;
        // Its error says the tree was killed (`PIDFILE_FAILED`, or the CUDA
        // resume's).
        published?;
        // Beside the archive, where the archive's directory allows it: a
        // read-only place costs the next restore its head start, not this one.
        let faults = &report.touched;
        let known: HashSet<&(u32, u64)> = recorded.iter().collect();
        let new_faults = faults.iter().any(|f| !known.contains(f));
        let working_set_file =
            touch.filter(|t| new_faults && save_touches(t, &recorded, faults).is_ok()).map(|t| t.display().to_string());
        Ok((
            status,
            LazyReport {
                pid: None,
                cuda_resume_seconds: None,
                criu_started_seconds: criu_started,
                fill_started_seconds: report.held_fill_started.map(|t| (t - started).as_secs_f64()),
                running_seconds: running,
                resident_seconds: resident,
                eager_pages,
                zero_pages_skipped: zero_pages,
                working_set_pages: recorded.len() as u64,
                working_set_seconds: report.working_set_in.map(|t| (t - started).as_secs_f64()),
                working_set_file,
                lazy_pages: report.pages,
                shared_pages: report.shared_pages,
                zero_pages_mapped: report.zero_pages,
                faults: report.faults,
                ended_unfilled: report.ended_unfilled,
                criu_exit: status.code().unwrap_or(-1),
                not_lazy: None,
                copied_apart_bytes: 0,
            },
        ))
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Whether most page blocks of the archive are zstd blocks.
fn mostly_zstd(source: &dyn BlockSource) -> bool {
    let (mut zstd, mut all) = (0usize, 0usize);
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Pages) {
        let mut i = 0;
        while let Some((h, _)) = source.block_header(f.file_id, i) {
            zstd += usize::from(h.codec.without_planes() == crate::format::BlockCodec::Zstd);
            all += 1;
            i += 1;
        }
    }
    zstd * 2 > all
}

/// Restores `archive` lazily (see the module documentation), opened as
/// every restore opens it (`checkpoint::open_for_restore`: from its index,
/// the archive and its parents walked behind). CRIU restores the tree
/// stopped while the walks run, and the tree runs once they have proven the
/// index its images and pages came from: an archive whose records disagree
/// with its index (reordered entries with every check recomputed pass each
/// block's own checks) stops the restore while nothing runs. The proof of
/// the stored bytes runs behind the tree (first with `verify_first`).
pub fn restore_lazy(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    threads: usize,
) -> Result<LazyReport> {
    let walked = archive.clone();
    parents_say_why(&walked, restore_through_pager(o, archive, started, criu, Fill::Lazy, threads))
}

/// Restores eagerly, criuz placing the memory: CRIU restores the tree with
/// lazy pages and leaves it stopped; criuz copies every page in on `threads`
/// threads (never through CRIU's pipe), each page from a block checked as it
/// is decoded, and only then lets the tree run. No process runs with a page
/// missing or unproven; a failure kills the tree before it ran. `archive`
/// opened as a streamed restore opens it (`checkpoint::open_for_restore`:
/// parents walked behind, an arriving object proven behind): the tree runs
/// only once both are done. `planned`: the archive's `plan_placement`, where
/// the caller worked it out already.
pub(crate) fn restore_placed(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    threads: usize,
    planned: Option<Placement>,
) -> Result<LazyReport> {
    let walked = archive.clone();
    parents_say_why(
        &walked,
        restore_through_pager(
            o,
            archive,
            started,
            criu,
            Fill::Held { planned, keep_zero_pages: o.keep_zero_pages },
            threads,
        ),
    )
}

/// The processes of the archive's tree (`pids`) that were stopped when it
/// was dumped (a job a shell had stopped, a process paused with SIGSTOP),
/// with the signal that had stopped each, from their core images. CRIU
/// restores those stopped; a tree CRIU leaves stopped for criuz
/// (`--leave-stopped`) must be let run without them, or they would come
/// back running.
fn stopped_at_dump(source: &dyn BlockSource, pids: &[i32]) -> Result<Vec<(i32, i32)>> {
    let mut stopped = Vec::new();
    for &pid in pids {
        let Some(entry) = source.find(&format!("core-{pid}.img")) else { continue };
        if let Some(sig) = images::core_stopped_by(&source.read_file(entry)?) {
            stopped.push((pid, sig));
        }
    }
    Ok(stopped)
}

/// What a restore through the pager ended with. Its archive's parents are
/// walked behind (`checkpoint::open_for_restore`): pages that needed them
/// fail as cancelled, and the walk says why.
fn parents_say_why(archive: &Archive, restored: Result<LazyReport>) -> Result<LazyReport> {
    restored.map_err(|e| match archive.parents_walked() {
        Err(why) => why,
        Ok(()) => e,
    })
}

fn restore_through_pager(
    o: &RestoreOptions,
    archive: Arc<Archive>,
    started: Instant,
    criu: &Criu,
    fill: Fill,
    threads: usize,
) -> Result<LazyReport> {
    let pids = check_pids_free(&*archive)?;
    // Shared memory's zero pages count: those criuz leaves holes
    // (`session::shmem`) are pages of memory again once the tree reads
    // them, as they were when it was dumped.
    check_memory_room(&*archive, SharedPages::CopiedToEach, o)?;
    // The shared memory criuz places itself: a held tree's, planned once.
    let mut fill = fill;
    let shared = match &mut fill {
        Fill::Held { keep_zero_pages: true, .. } | Fill::Lazy => Vec::new(),
        Fill::Held { planned: Some(p), .. } => std::mem::take(&mut p.shared),
        Fill::Held { planned: None, .. } => shmem::plan(&*archive, &pages_images_named_once(&*archive)?)?,
    };
    let cuda = cuda_plan(&*archive, &o.gpu_map, true)?;
    crate::proc::restored::become_subreaper();
    let source: Arc<dyn BlockSource> = archive;
    let work = WorkDir::new("criuz-lazy-")?;
    let pidfile = work.path().join("restored.pid");
    let mut cmd = restore_command(criu, o, &*source, "--lazy-pages", work.path(), &pidfile);
    // Held until every page is in (placed), or until the walks behind have
    // proven the archive (lazy).
    cmd.arg("--leave-stopped");
    let dumped_stopped = stopped_at_dump(&*source, &pids)?;
    let victim = Victim::Tree(pids);
    let lazy = LazyRestore {
        source,
        input: &o.input,
        images: work.path(),
        work: work.path(),
        victim: &victim,
        verify_first: o.verify_first,
        fill,
        shared,
        release: Release::Continued,
        threads,
        meter: o.meter.clone(),
        // With or without -d (`restore_command`).
        detached: true,
        dumped_stopped: &dumped_stopped,
    };
    let cuda_resumed = std::cell::Cell::new(None);
    let (status, mut report) = lazy.run(cmd, started, || {
        // The tree runs (its CUDA calls wait for the unlock) while its
        // pages still arrive; a held tree runs once every page is in.
        let resumed = resume_cuda(cuda.as_ref(), &pidfile).map_err(|e| {
            victim.kill();
            e.context("CUDA resume failed, restored tree killed")
        })?;
        cuda_resumed.set(resumed);
        publish_pidfile(&pidfile, o.pidfile.as_deref()).map_err(|e| e.context(PIDFILE_FAILED))
    })?;
    report.cuda_resume_seconds = cuda_resumed.get();
    if !status.success() {
        return Err(criu_failure("criu restore", status, &work.save_log("restore.log")));
    }
    report.pid = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A working-set record is read only from a regular file, and only as
    /// much as a record holds: a FIFO or a link to `/dev/zero` in its place
    /// (found by hand: the restore waited on the FIFO for good) reads as no
    /// record, at once.
    #[test]
    fn only_a_regular_file_is_read_as_a_working_set_record() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("a.czr.touch");
        save_touches(&record, &[(7, 0x1000)], &[(7, 0x3000), (8, 0x2000)]).unwrap();
        assert_eq!(load_touches(Some(&record)), vec![(7, 0x1000), (7, 0x3000), (8, 0x2000)]);
        let fifo = dir.path().join("fifo.touch");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let zero = dir.path().join("zero.touch");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for path in [&fifo, &zero, &dir.path().join("none.touch")] {
            assert_eq!(load_touches(Some(path)), Vec::new(), "{}", path.display());
        }
    }
}
