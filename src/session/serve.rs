//! Serve: answers CRIU's restore requests from a [`BlockSource`].
//!
//! Any file, in any order, any number of times: CRIU reads images in a
//! different order than it wrote them, and may open one twice. Metadata images
//! are decoded and checked whole before CRIU sees a byte of them (a protobuf
//! image cut short could parse as a shorter, valid one). Page images stream,
//! decoded ahead of CRIU on the worker pool and handed over with vmsplice;
//! CRIU reads them by exact length, so a block that fails its check closes the
//! pipe and the connection, and CRIU aborts the restore before the process
//! runs. The source has proven the archive's structure (see
//! `archive::open`), so what is served is what the index says, in its order;
//! a source opened from its index proves the rest while CRIU reads, and the
//! last block of each page image waits for that proof, so a failed one stops
//! CRIU before the process runs.
//!
//! With `skip_zero_pages`, a process's pagemap is rewritten to leave out zero
//! pages of its private anonymous memory, and those pages are not sent
//! (`criu::images`).

use crate::archive::{BlockSource, CheckedBlock};
use crate::codec::Decoder;
use crate::criu::images::{self, ZeroPlan};
use crate::criu::scm;
use crate::criu::splice::{write_pipe, Chunk, SplicePipe};
use crate::criu::streamer::{grow_pipe, read_request, send_reply, Listener};
use crate::engine;
use crate::error::{Error, Result, ResultContext};
use crate::format::{BlockCodec, FileEntry, FileKind, PageBits, PAGE_SIZE};
use crate::progress::Meter;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Decoded page bytes each page image is prepared ahead of CRIU. A shallower
/// window (2 MiB) restored raw pages about 10% faster, a deeper one decoded
/// zstd about 10% faster (1 GiB, eight and five alternating restores); the
/// bench decides the default.
pub const PREFETCH_BYTES: usize = 16 << 20;

/// Settings for serving.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Counts the page bytes handed to CRIU (a progress line reads it).
    pub meter: Arc<Meter>,
    pub threads: usize,
    /// Decoded bytes each file may prefetch ahead of CRIU.
    pub prefetch_bytes: usize,
    /// Leave zero pages of private anonymous memory out of what CRIU reads.
    pub skip_zero_pages: bool,
}

#[derive(Debug, Default)]
pub struct ServeReport {
    pub served: Vec<String>,
    pub missing: Vec<String>,
    pub bytes: u64,
    pub zero_pages_skipped: u64,
}

/// Answers CRIU's requests from `source` until CRIU closes the connection.
/// Returns `None` if `stop` was set before CRIU connected. A damaged block
/// fails the whole serve: the connection is shut so CRIU aborts the restore.
pub fn serve(
    listener: &Listener,
    source: Arc<dyn BlockSource>,
    opts: ServeOptions,
    stop: &AtomicBool,
) -> Result<Option<ServeReport>> {
    let Some(mut sock) = listener.accept(stop)? else { return Ok(None) };
    let mut report = ServeReport::default();
    let mut plans: HashMap<u32, Arc<ZeroPlan>> = HashMap::new();
    // Where CRIU's reads of each process's pages image end, by pages id.
    let mut read_ends: HashMap<u32, Vec<u64>> = HashMap::new();
    let named_once = if opts.skip_zero_pages { pages_images_named_once(&*source)? } else { HashSet::new() };
    let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    let label = source.label().to_string();
    let result = (|| -> Result<()> {
        while let Some(name) = read_request(&mut sock)? {
            if let Some(e) = failed.lock().unwrap().take() {
                return Err(e);
            }
            // CRIU asks for image files; a tree's directories and links are not.
            let Some(entry) = source.find(&name).filter(|e| e.kind.is_file()).cloned() else {
                send_reply(&mut sock, false)?;
                report.missing.push(name);
                continue;
            };
            // Page images are streamed block by block below; the rest whole.
            let mut whole = match entry.kind {
                FileKind::Pages => None,
                _ => Some(source.read_file(&entry)?),
            };
            let mut plan = None;
            if opts.skip_zero_pages {
                if let (Some(pid), Some(pagemap)) = (images::process_pagemap_pid(&name), whole.as_ref()) {
                    if let Some(p) =
                        zero_plan(&*source, pid, pagemap, 1, &named_once).context(|| format!("{label}: {name}"))?
                    {
                        whole = Some(p.pagemap.clone());
                        plans.insert(p.pages_id, Arc::new(p));
                    }
                }
                if let Some(id) = images::pages_image_id(&name) {
                    plan = plans.get(&id).cloned();
                    if let Some(p) = &plan {
                        report.zero_pages_skipped += p.skipped_pages;
                    }
                }
            }
            if let (Some(_), Some(pagemap)) = (images::process_pagemap_pid(&name), whole.as_ref()) {
                if let Some((pages_id, ends)) = pagemap_read_ends(pagemap) {
                    read_ends.insert(pages_id, ends);
                }
            }
            let ends = images::pages_image_id(&name).and_then(|id| read_ends.remove(&id)).unwrap_or_default();
            send_reply(&mut sock, true)?;
            let fd = scm::recv_fd(&sock, "the pipe")?;
            grow_pipe(&fd);
            report.served.push(name.clone());
            let (failed, bytes, source, opts) = (failed.clone(), bytes.clone(), source.clone(), opts.clone());
            let shutdown = sock.try_clone()?;
            let context = format!("{label}: {name}");
            // One writer a file CRIU opens, on a thread used again
            // (`threads`: a new one would take a pid the tree may need).
            writers.push(
                crate::threads::spawn("criuz-serve", move || {
                    let mut pipe = std::fs::File::from(fd);
                    let r = match whole {
                        Some(data) => write_pipe(&mut pipe, &data).map(|_| data.len() as u64),
                        None => stream_pages(source, &entry, pipe, opts, plan, ends),
                    };
                    match r {
                        Ok(n) => {
                            bytes.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            let _ = shutdown.shutdown(std::net::Shutdown::Both);
                            failed.lock().unwrap().get_or_insert(e.context(context));
                        }
                    }
                })
                .map_err(|e| Error::thread_not_started("image writer", e))?,
            );
        }
        Ok(())
    })();
    for w in writers {
        let _ = w.join();
    }
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(e);
    }
    result?;
    // A tree that took no pages never met the wait above.
    source.proven()?;
    report.bytes = bytes.load(Ordering::Relaxed);
    Ok(Some(report))
}

/// The pages images that exactly one of the archive's pagemaps CRIU opens
/// (a process's or shared memory's) names. CRIU reads each pagemap's pages
/// from the start of the image it names, so two may name one image (an
/// archive crafted so; CRIU never writes one): an image rewritten for one
/// reader (its zero pages left out, or only its eager pages kept) would
/// give the other wrong bytes. Only these images are rewritten or placed.
pub(crate) fn pages_images_named_once(source: &dyn BlockSource) -> Result<HashSet<u32>> {
    let (mut once, mut more) = (HashSet::new(), HashSet::new());
    for f in source.index().files.iter().filter(|f| f.kind == FileKind::Plain && f.is_criu_image()) {
        if !images::pagemap_criu_opens(&f.name) {
            continue;
        }
        if let Some(id) = images::pagemap_pages_id(&source.read_file(f)?) {
            if !once.insert(id) {
                more.insert(id);
            }
        }
    }
    Ok(&once - &more)
}

/// Plans the zero-page rewrite for process `pid`: needs its mm image and the
/// proven block headers of the pages image its pagemap names, which no other
/// pagemap may name (`named_once`, [`pages_images_named_once`]). Only runs
/// of at least `min_run` zero pages are left out.
pub(crate) fn zero_plan(
    source: &dyn BlockSource,
    pid: &str,
    pagemap: &[u8],
    min_run: u64,
    named_once: &HashSet<u32>,
) -> Result<Option<ZeroPlan>> {
    let Some(pages_id) = images::pagemap_pages_id(pagemap) else { return Ok(None) };
    if !named_once.contains(&pages_id) {
        return Ok(None);
    }
    let (Some(mm), Some(pages)) =
        (source.find(&format!("mm-{pid}.img")), source.find(&format!("pages-{pages_id}.img")))
    else {
        return Ok(None);
    };
    if pages.kind != FileKind::Pages {
        return Ok(None);
    }
    let mm = source.read_file(mm)?;
    let Some(zero) = zero_pages_of(source, pages) else { return Ok(None) };
    Ok(images::plan_runs(&mm, pagemap, &zero, min_run))
}

/// The zero pages of pages image `pages`, from its proven block headers;
/// `None` if a block does not start on a page.
pub(crate) fn zero_pages_of(source: &dyn BlockSource, pages: &FileEntry) -> Option<PageBits> {
    // Sized once: grown block by block, it was copied over and over.
    let mut zero = PageBits::with_pages(usize::try_from(pages.raw_size.div_ceil(PAGE_SIZE as u64)).unwrap_or(0));
    let mut i = 0;
    while let Some((h, raw_pos)) = source.block_header(pages.file_id, i) {
        if raw_pos % PAGE_SIZE as u64 != 0 {
            return None;
        }
        if !h.zero_bitmap.is_empty() {
            zero.insert_shifted(&h.zero_bitmap, (raw_pos / PAGE_SIZE as u64) as usize, h.pages());
        }
        i += 1;
    }
    Some(zero)
}

/// Where CRIU's reads of the pages image a process's pagemap (as served)
/// names end: one read per entry (`restore_priv_vma_content`, criu/mem.c,
/// v4.2), so at each entry's last byte in the stream. A pagemap criuz
/// cannot read gives none.
fn pagemap_read_ends(pagemap: &[u8]) -> Option<(u32, Vec<u64>)> {
    let (pages_id, runs) = images::pagemap_runs(pagemap)?;
    Some((pages_id, runs.iter().map(|r| (r.first + r.nr) * PAGE_SIZE as u64).collect()))
}

/// One block made ready for CRIU's pipe: the bytes CRIU must read, without
/// the zero pages the plan leaves out, on page boundaries (see
/// `SplicePipe`).
fn prepare(dec: &mut Decoder, b: CheckedBlock, plan: Option<&ZeroPlan>) -> Result<Chunk> {
    let first = b.raw_pos / PAGE_SIZE as u64;
    let omit = |p: usize| plan.is_some_and(|pl| pl.is_skipped(first + p as u64));
    let h = &b.header;
    let zeros = h.zero_pages();
    let stored_is_output = zeros == 0 || (0..h.pages()).filter(|&p| h.is_zero_page(p) && omit(p)).count() == zeros;
    if stored_is_output && b.is_resolved() && b.shares_cheaply() {
        // Pages of parent blocks: check them where they are and hand them over.
        let parts = b.into_pieces_checked()?;
        return Ok(Chunk::parts(parts));
    }
    if stored_is_output && h.codec == BlockCodec::Raw {
        // The payload is the output: check it and hand the record over as is.
        let (buf, range) = b.into_raw_checked(dec)?;
        return Ok(Chunk::range(buf, range));
    }
    let (stored, range) = b.decode_stored_page_aligned(dec)?;
    if stored_is_output {
        return Ok(Chunk::range(stored, range));
    }
    let (mut out, start) = crate::archive::page_aligned(h.raw_len as usize);
    crate::codec::scatter(h, &stored[range], &omit, &mut out);
    let end = out.len();
    Ok(Chunk::range(out, start..end))
}

/// Streams a page image, decoding ahead of CRIU on the worker pool. With a
/// plan, the zero pages it skips are left out.
fn stream_pages(
    source: Arc<dyn BlockSource>,
    entry: &FileEntry,
    pipe: std::fs::File,
    opts: ServeOptions,
    plan: Option<Arc<ZeroPlan>>,
    read_ends: Vec<u64>,
) -> Result<u64> {
    let n = entry.blocks.len();
    let meter = opts.meter.clone();
    let block_size = source.header().block_size as usize;
    // A resolved dedup block may keep up to PIN_FACTOR times its size alive
    // (the blocks its pieces lie in): fewer of them ahead keeps the
    // restore's memory near a full archive's.
    let pinning = if source.header().may_hold_dedup() { crate::archive::PIN_FACTOR } else { 1 };
    let window = (opts.prefetch_bytes / pinning / block_size.max(PAGE_SIZE)).max(2 * opts.threads).max(2);
    let file_id = entry.file_id;
    let (sub, mut results) =
        engine::start(opts.threads.min(n.max(1)), window, Decoder::new, move |dec: &mut Decoder, i: usize| {
            if i + 1 == n {
                // CRIU cannot finish this process without its last pages.
                source.proven()?;
            }
            let b = source.block(file_id, i)?.ok_or_else(|| Error::corrupt(0, format!("block {i} is missing")))?;
            prepare(dec, b, plan.as_deref())
        });
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    crate::threads::spawn("criuz-serve", move || {
        for i in 0..n {
            if stop2.load(Ordering::Relaxed) || sub.submit(i).is_err() {
                break;
            }
        }
    })
    .map_err(|e| Error::thread_not_started("page decoding", e))?;
    let mut out = SplicePipe::new(pipe).with_read_ends(read_ends);
    // Ready chunks are gathered up to the next handover's end and handed over
    // together (see `SplicePipe`); the writer waits for the next one only
    // when none is ready.
    let result = (|| -> Result<u64> {
        let mut written = 0u64;
        while let Some(first) = results.next() {
            let mut next = Some(first);
            while let Some(r) = next.take() {
                let chunk = r?;
                written += chunk.len() as u64;
                meter.taken.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                out.queue(chunk);
                if !out.has_handover() {
                    next = results.try_next();
                }
            }
            if !out.flush()? {
                return Ok(written);
            }
        }
        out.flush_all()?;
        Ok(written)
    })();
    stop.store(true, Ordering::Relaxed);
    let drained = out.finish();
    let written = result?;
    drained.map(|_| written)
}
