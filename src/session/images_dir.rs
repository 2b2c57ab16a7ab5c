//! Images for a CRIU restore that reads a directory (runc, podman): the
//! archive unpacked (`tree::dir`, every check), except that each process's
//! pagemap is rewritten to leave out the zero pages of its private anonymous
//! memory and its pages image is written without them, the rule `serve`
//! applies to a streamed restore (`criu::images::plan`). CRIU then neither
//! reads those pages nor maps them, and they read as zero, as they were; the
//! directory holds only the pages that carry data.

use crate::archive::{read_source, Archive, BlockSource, EntryStart, Options, SeqSink};
use crate::criu::images::{self, ZeroPlan};
use crate::error::Result;
use crate::format::PAGE_SIZE;
use crate::progress::Progress;
use crate::session::serve::{pages_images_named_once, zero_plan};
use crate::tree::dir::{DirSink, UnpackStats};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// What to do with one file's bytes on the way to the directory.
enum Rewrite {
    /// A pagemap: the planned one replaces it.
    Pagemap(Vec<u8>),
    /// A pages image: pages the plan skips are left out.
    Pages(Arc<ZeroPlan>),
}

struct Skipping<'a> {
    inner: &'a mut DirSink,
    rewrites: HashMap<String, Rewrite>,
    /// The file being written (a top-level name, when it has a rewrite)
    /// and its bytes seen so far.
    current: Option<(String, u64)>,
    skipped_pages: u64,
}

impl SeqSink for Skipping<'_> {
    fn begin(&mut self, e: &EntryStart) -> Result<()> {
        self.current = self.rewrites.contains_key(e.name).then(|| (e.name.to_string(), 0));
        self.inner.begin(e)
    }

    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()> {
        let Some((name, pos)) = self.current.as_mut() else { return self.inner.data(file_id, data) };
        let first = *pos / PAGE_SIZE as u64;
        *pos += data.len() as u64;
        match self.rewrites.get(name.as_str()) {
            Some(Rewrite::Pages(plan)) => {
                // Blocks are whole pages (the block size is a multiple of
                // the page size), so each call starts on a page.
                let mut run: Option<usize> = None;
                let pages = data.len().div_ceil(PAGE_SIZE);
                for i in 0..=pages {
                    let skip = i == pages || plan.is_skipped(first + i as u64);
                    match (skip, run) {
                        (true, Some(r)) => {
                            self.inner.data(file_id, &data[r * PAGE_SIZE..(i * PAGE_SIZE).min(data.len())])?;
                            run = None;
                        }
                        (false, None) => run = Some(i),
                        _ => {}
                    }
                    self.skipped_pages += u64::from(skip && i < pages);
                }
                Ok(())
            }
            Some(Rewrite::Pagemap(_)) => Ok(()),
            None => self.inner.data(file_id, data),
        }
    }

    fn end(&mut self, file_id: u32, raw_size: u64) -> Result<()> {
        if let Some((name, _)) = self.current.take() {
            if let Some(Rewrite::Pagemap(planned)) = self.rewrites.get(&name) {
                self.inner.data(file_id, planned)?;
            }
        }
        self.inner.end(file_id, raw_size)
    }
}

/// Writes the archive's entries into `dir` for a CRIU restore, without the
/// zero pages CRIU need not read. Returns what was written and the pages
/// left out.
pub fn write_images(archive: Arc<Archive>, dir: &Path, opts: &Options) -> Result<(UnpackStats, u64)> {
    let mut rewrites = HashMap::new();
    let named_once = pages_images_named_once(&*archive)?;
    for f in archive.index().files.iter().filter(|f| f.is_criu_image()) {
        let Some(pid) = images::process_pagemap_pid(&f.name) else { continue };
        let pagemap = archive.read_file(f)?;
        if let Some(plan) = zero_plan(&*archive, pid, &pagemap, 1, &named_once)? {
            rewrites.insert(f.name.clone(), Rewrite::Pagemap(plan.pagemap.clone()));
            rewrites.insert(format!("pages-{}.img", plan.pages_id), Rewrite::Pages(Arc::new(plan)));
        }
    }
    let mut sink = DirSink::create(dir, false, Progress::hidden())?;
    let mut skipping = Skipping { inner: &mut sink, rewrites, current: None, skipped_pages: 0 };
    read_source(archive, opts, &mut skipping)?;
    let skipped = skipping.skipped_pages;
    drop(skipping);
    Ok((sink.publish()?, skipped))
}
