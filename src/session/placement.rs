//! The images a lazy or placed restore writes for CRIU, and whether criuz
//! can place an archive's memory itself. Each process's pagemap is
//! rewritten: its long zero runs left out (they read as zero) and the lazy
//! flags CRIU should have set, and its pages image holds only the pages
//! CRIU restores itself (the lazy ones are holes in a sparse file, which
//! CRIU skips); criuz copies the rest in through userfaultfd
//! (`session::pager`). Shared memory criuz fills itself gets an empty
//! pagemap; any other pages image is written whole, decoded on several
//! threads. A pagemap criuz cannot rewrite (one not written by CRIU)
//! refuses placing, as a usage error: an eager restore hands it to CRIU as
//! it is. Trade-off: private pages the tree's processes shared
//! copy-on-write are copied into each ([`pages_copied_apart`]), where
//! CRIU's own restore keeps them shared.

use crate::archive::BlockSource;
use crate::codec::Decoder;
use crate::criu::images::{self, PageRun};
use crate::error::{Error, IoContext, Result, ResultContext};
use crate::format::{check_entry_name, BlockCodec, FileKind, PAGE_SIZE};
use crate::session::blocks::Blocks;
use crate::session::pager::LazyProcess;
use crate::session::serve::{pages_images_named_once, zero_plan};
use crate::session::shmem::{self, SharedObject};
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Zero runs shorter than this stay in a lazy pagemap (mapped to the zero
/// page with their neighbours, `session::place::ZeroPages`): a page left out
/// is answered alone, one fault at a time, while the fill maps a kept one
/// before the process touches it.
pub(super) const LAZY_MIN_ZERO_RUN: u64 = 16;

/// A held tree takes no fault before every page is in: every zero page can
/// be left out (it reads as zero, costing no memory, as in a streamed
/// restore).
pub(super) const HELD_MIN_ZERO_RUN: u64 = 1;

/// No zero run is left out (`--keep-zero-pages`): every zero page is placed
/// as a page of memory.
pub(super) const KEPT_ZERO_RUN: u64 = u64::MAX;

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
    let Some((written_id, kept)) = images::pagemap_runs(&written) else { return Ok(None) };
    // Written again, joined, below.
    drop(written);
    if !images::lazy_runs_registered(&mm, &kept) {
        return Ok(None);
    }
    let mut runs = Vec::with_capacity(kept.len());
    for k in &kept {
        // Each kept run lies inside one original entry: its pages sit
        // together in the archive's image.
        let i = by_vaddr.partition_point(|r| r.vaddr <= k.vaddr).checked_sub(1);
        let o = i.map(|i| by_vaddr[i]).filter(|o| (k.vaddr - o.vaddr) / PAGE_SIZE as u64 + k.nr <= o.nr);
        let Some(o) = o else { return Ok(None) };
        let at = PageRun { first: o.first + (k.vaddr - o.vaddr) / PAGE_SIZE as u64, ..*k };
        runs.push((at, k.first));
    }
    // CRIU is handed its runs joined (fewer entries for its restore to
    // walk); criuz's own runs above stay within CRIU's original entries.
    let written = images::joined_pagemap(written_id, &kept);
    drop(kept);
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
    pub(super) shared: Vec<SharedObject>,
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
pub(super) struct Materialized {
    /// The lazily served processes, by pid.
    pub processes: HashMap<u32, LazyProcess>,
    /// Pages CRIU restores itself.
    pub eager_pages: u64,
    /// Zero pages left out of the pagemaps.
    pub zero_pages: u64,
}

/// Writes the archive's files into `dir` for CRIU: every plain file, each
/// process's pagemap without its runs of at least `min_zero_run` zero pages
/// (as `planned` has it already, where given), and its pages image with only
/// the pages that pagemap does not mark lazy, decoded on `threads` threads
/// (`write_eager`). The shared memory criuz fills itself
/// (`session::shmem`), `left_empty` (pagemap name -> pages image id), gets
/// an empty pagemap and pages image.
pub(super) fn materialize(
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
