//! Parents of incremental archives: finding them for a reader, and reading
//! what a new child needs of its parent chain.
//!
//! A child names its parents by archive id in its C record, each with a hint:
//! where it was, relative to the child's directory. A reader looks for each
//! id in the files given with `--parent`, then at the hint, then among the
//! `*.czr` files of each `--parent-dir`; only an archive with the right id is
//! used, and one that is missing or named wrongly is an error before anything
//! is served. Parents are opened (walked) like any archive; a child's
//! references only ever point at pages stored in them, so their own parents
//! are not needed.

use super::check::{Checked, Payloads};
use super::dedup::{DedupIndex, Location};
use super::source::{Archive, BlockSource};
use crate::error::{Error, Result, ResultContext};
use crate::format::{
    BlockCodec, BlockHeader, ChainEntry, DedupPayload, FileKind, Header, PageId, FLAG_IDS, HEADER_LEN, PAGE_SIZE,
};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// Where a reader may find parent archives besides their hints.
#[derive(Clone, Debug, Default)]
pub struct ParentSearch {
    /// Archives named with `--parent`; each must be one the chain needs.
    pub files: Vec<PathBuf>,
    /// Directories named with `--parent-dir`, searched for `*.czr`.
    pub dirs: Vec<PathBuf>,
}

/// The archive id of a file or object, from its header; `None` if it is not
/// an archive.
fn archive_id(path: &Path) -> Option<[u8; 16]> {
    let b: [u8; HEADER_LEN] = crate::io::read_head(path, HEADER_LEN)?.try_into().ok()?;
    Header::decode(&b).ok().map(|h| h.archive_id)
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Opens an archive (a path, or `-` for standard input, spooled up to
/// `spool_cap` bytes) together with the parents its C record names.
pub fn open(spec: &Path, spool_cap: u64, search: &ParentSearch) -> Result<Arc<Archive>> {
    locate_spec(spec, spool_cap, search, false)?.open()
}

/// Finds and opens the parents `archive` names (hints relative to `base`)
/// and attaches them.
pub fn attach(archive: Arc<Archive>, base: &Path, search: &ParentSearch) -> Result<Arc<Archive>> {
    locate(archive, base, search)?.open()
}

/// Like [`open`], but only finds the parents and checks their archive ids
/// (a header read each); [`Located::open`] then walks them. A restore finds
/// a missing or foreign parent before CRIU starts and walks the parents
/// while CRIU starts. With `early`, an object still arriving is opened from
/// its index and proven behind ([`Archive::open_indexed`]): the reader must
/// then wait for [`BlockSource::proven`] before its point of no return.
pub fn locate_spec(spec: &Path, spool_cap: u64, search: &ParentSearch, early: bool) -> Result<Located> {
    let archive = if early { Archive::open_early(spec, spool_cap)? } else { Archive::open_spec(spec, spool_cap)? };
    let base = if crate::io::is_stdio(spec) { PathBuf::from(".") } else { dir_of(spec) };
    locate(archive, &base, search)
}

/// An opened archive whose parents have been found but not yet walked.
pub struct Located {
    archive: Arc<Archive>,
    paths: Vec<(PathBuf, [u8; 16])>,
}

impl Located {
    /// The archive itself (its own files read; references need [`Located::open`]).
    pub fn archive(&self) -> &Archive {
        &self.archive
    }

    /// Walks every parent, on all cores, and attaches them.
    pub fn open(self) -> Result<Arc<Archive>> {
        let Located { archive, paths } = self;
        if paths.is_empty() {
            return Ok(archive);
        }
        // The part of a restore's start that grows with the chain.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(paths.len()).max(1);
        let mut opened: Vec<(usize, Result<Arc<Archive>>)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let paths = &paths;
                    scope.spawn(move || {
                        let mine = paths.iter().enumerate().skip(t).step_by(threads);
                        mine.map(|(i, (path, id))| (i, open_as(path, id))).collect::<Vec<_>>()
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().expect("parent walk thread")).collect()
        });
        // In chain order, so the first failure reported is the nearest parent's.
        opened.sort_by_key(|(i, _)| *i);
        let parents = opened.into_iter().map(|(_, p)| p).collect::<Result<Vec<_>>>()?;
        archive.attach_parents(parents)?;
        Ok(archive)
    }

    /// Like [`Located::open`], but gives the archive back at once and walks
    /// the parents on a thread, whose result says whether they could be
    /// opened. The archive's own files can be read meanwhile; a reader that
    /// meets a reference waits for the walk, and fails as cancelled if the
    /// walk failed. A restore answers CRIU's first requests (its metadata)
    /// while the parents are walked.
    pub fn open_behind(self) -> (Arc<Archive>, std::thread::JoinHandle<Result<()>>) {
        let archive = self.archive.clone();
        archive.expect_parents();
        let walk = std::thread::spawn(move || {
            /// Releases waiting readers however the walk ends (a no-op once
            /// the parents are attached).
            struct Release(Arc<Archive>);
            impl Drop for Release {
                fn drop(&mut self) {
                    self.0.parents_failed();
                }
            }
            let _release = Release(self.archive.clone());
            self.open().map(drop)
        });
        (archive, walk)
    }
}

fn locate(archive: Arc<Archive>, base: &Path, search: &ParentSearch) -> Result<Located> {
    let label = archive.label().to_string();
    if archive.chain().is_empty() {
        if let Some(f) = search.files.first() {
            return Err(Error::Usage(format!("{label}: has no parents, but --parent {} was given", f.display())));
        }
        return Ok(Located { archive, paths: Vec::new() });
    }
    let given: Vec<(PathBuf, Option<[u8; 16]>)> = search.files.iter().map(|f| (f.clone(), archive_id(f))).collect();
    for (f, id) in &given {
        if !id.is_some_and(|id| archive.chain().iter().any(|e| e.archive_id == id)) {
            return Err(Error::Mismatch(format!(
                "{}: is not a parent of {label} (its chain needs {})",
                f.display(),
                chain_ids(&archive)
            )));
        }
    }
    let mut paths = Vec::new();
    for entry in archive.chain() {
        let path = find(entry, base, &given, &search.dirs).ok_or_else(|| {
            Error::NotFound(format!(
                "{label}: parent archive {} not found (looked at {}, --parent and --parent-dir)",
                hex(&entry.archive_id),
                base.join(&entry.hint).display()
            ))
        })?;
        paths.push((path, entry.archive_id));
    }
    Ok(Located { archive, paths })
}

/// Opens (walks) the archive at `path`, which must have archive id `id`.
fn open_as(path: &Path, id: &[u8; 16]) -> Result<Arc<Archive>> {
    let parent = Archive::open(path)?;
    if parent.header().archive_id != *id {
        return Err(Error::Mismatch(format!("{}: changed while it was opened", path.display())));
    }
    Ok(parent)
}

fn chain_ids(a: &Archive) -> String {
    a.chain().iter().map(|e| hex(&e.archive_id)).collect::<Vec<_>>().join(", ")
}

fn find(entry: &ChainEntry, base: &Path, given: &[(PathBuf, Option<[u8; 16]>)], dirs: &[PathBuf]) -> Option<PathBuf> {
    if let Some((f, _)) = given.iter().find(|(_, id)| *id == Some(entry.archive_id)) {
        return Some(f.clone());
    }
    let hinted = base.join(&entry.hint);
    if !entry.hint.is_empty() && archive_id(&hinted) == Some(entry.archive_id) {
        return Some(hinted);
    }
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "czr") && archive_id(&p) == Some(entry.archive_id) {
                return Some(p);
            }
        }
    }
    None
}

/// The directory a path is in (`.` for a bare name).
pub fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `target` relative to directory `from` (both made absolute from the
/// current directory first); a hint, so any correct spelling will do.
fn relative(target: &Path, from: &Path) -> String {
    let abs = |p: &Path| {
        let p = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
        let mut out = PathBuf::new();
        for c in p.components() {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                c => out.push(c),
            }
        }
        out
    };
    let (t, f) = (abs(target), abs(from));
    let common = t.components().zip(f.components()).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in f.components().skip(common) {
        rel.push("..");
    }
    for c in t.components().skip(common) {
        rel.push(c);
    }
    rel.to_string_lossy().into_owned()
}

/// What a child written to `child` (a path, or `-`) dedups against: every
/// page stored in `parent` or in the archives it refers to, at the archive
/// that stores it. Those archives are found as a restore would find them
/// (their hints, or beside the parent).
pub fn dedup_index(parent_path: &Path, child: &Path) -> Result<DedupIndex> {
    let beside = ParentSearch { files: Vec::new(), dirs: vec![dir_of(parent_path)] };
    let parent = open(parent_path, 0, &beside)?;
    let child_dir = if crate::io::is_stdio(child) { PathBuf::from(".") } else { dir_of(child) };
    let parent_dir = dir_of(parent_path);
    // The child's chain: the parent, then every archive the parent refers to
    // (a parent's source k is the child's source k + 1).
    let mut chain =
        vec![ChainEntry { archive_id: parent.header().archive_id, hint: relative(parent_path, &child_dir) }];
    for e in parent.chain() {
        chain.push(ChainEntry { archive_id: e.archive_id, hint: relative(&parent_dir.join(&e.hint), &child_dir) });
    }
    let mut pages = HashMap::new();
    let archives = std::iter::once(&parent).chain(parent.parents());
    for (k, archive) in archives.enumerate() {
        let source = k as u16 + 1;
        let found = if archive.header().flags & FLAG_IDS != 0 {
            stored_ids(archive, source)
        } else {
            computed_ids(archive, source)
        };
        // The nearest archive wins a page stored twice (a root without ids
        // and a child that could not know it had it).
        for (id, loc) in found.context(|| archive.label().to_string())? {
            pages.entry(id).or_insert(loc);
        }
    }
    Ok(DedupIndex::keyed(chain, pages, parent.key().map(|k| k.chain().clone())))
}

/// Reads the page ids of an archive with ids: each stored page the P records
/// list, at its place in its block.
fn stored_ids(archive: &Archive, source: u16) -> Result<Vec<(PageId, Location)>> {
    // Read by position: the payloads of ordinary blocks (most of the
    // archive) are skipped, not read.
    let mut records = archive.records(Payloads::Dedup)?;
    let mut out = Vec::new();
    let mut block_no: Vec<u32> = Vec::new();
    let mut last: Option<(BlockHeader, Option<Vec<u8>>)> = None;
    while let Some((offset, rec)) = records.next_record()? {
        match rec {
            Checked::FileBegin { .. } => block_no.push(0),
            Checked::Block { header, payload, .. } => {
                block_no[header.file_id as usize] += 1;
                last = Some((header, payload));
            }
            Checked::Ids { file_id, ids, .. } => {
                let (header, payload) = last.take().expect("ids follow their block");
                if header.raw_len as usize % PAGE_SIZE != 0 {
                    continue; // a short last page is never shared
                }
                let block = block_no[file_id as usize] - 1;
                let stored = header.pages() - header.zero_pages();
                let literal: Vec<u32> = if header.codec == BlockCodec::Dedup {
                    let payload = payload.expect("dedup payloads are read");
                    let dp = DedupPayload::decode(&payload, stored, offset)?.head;
                    let slots = dp.literal_slots().enumerate();
                    slots.filter_map(|(i, k)| k.map(|_| i as u32)).collect()
                } else {
                    (0..stored as u32).collect()
                };
                let ids = ids.expect("ids are read");
                // CheckedRecords proved the P record lists exactly these pages.
                debug_assert_eq!(ids.len(), literal.len());
                for (id, page) in ids.into_iter().zip(literal) {
                    out.push((id, Location { source, file_id, block, page }));
                }
            }
            Checked::Chain(_) | Checked::FileEnd(_) | Checked::Index(_) => {}
        }
    }
    Ok(out)
}

/// An archive without page ids (a full archive written without `--ids`):
/// decodes its page images and hashes every stored page.
fn computed_ids(archive: &Archive, source: u16) -> Result<Vec<(PageId, Location)>> {
    let mut out = Vec::new();
    let mut dec = crate::codec::Decoder::new();
    let mut stored = Vec::new();
    let ids = archive.page_ids();
    for f in archive.index().files.iter().filter(|f| f.kind == FileKind::Pages) {
        let mut i = 0;
        while let Some(b) = archive.block(f.file_id, i)? {
            if b.header.raw_len as usize % PAGE_SIZE == 0 {
                b.decode_stored(&mut dec, &mut stored)?;
                for (p, page) in stored.chunks(PAGE_SIZE).enumerate() {
                    let loc = Location { source, file_id: f.file_id, block: i as u32, page: p as u32 };
                    out.push((ids.id(page), loc));
                }
            }
            i += 1;
        }
    }
    Ok(out)
}

/// Checks that every P record of `archive` names the pages its block stores
/// (`verify`): ids are never used to restore, but a child written against an
/// archive whose ids lie would refer to the wrong pages and fail its own
/// data checks, so that is found before anyone relies on it.
pub fn check_page_ids(archive: &Archive) -> Result<()> {
    if archive.header().flags & FLAG_IDS == 0 {
        return Ok(());
    }
    let label = archive.label().to_string();
    let mut records = archive.records(Payloads::All).context(|| label.clone())?;
    let mut dec = crate::codec::Decoder::new();
    let page_ids = archive.page_ids();
    let (mut literal, mut last) = (Vec::new(), None);
    while let Some((offset, rec)) = records.next_record().context(|| label.clone())? {
        match rec {
            Checked::Block { header, payload, .. } => last = Some((offset, header, payload)),
            Checked::Ids { ids, .. } => {
                let (at, header, payload) = last.take().expect("ids follow their block");
                let payload = payload.expect("payloads are read");
                let done = if header.codec == BlockCodec::Dedup {
                    let stored = header.pages() - header.zero_pages();
                    let crate::format::DecodedDedup { head: dp, inner_payload: inner } =
                        DedupPayload::decode(&payload, stored, at).context(|| label.clone())?;
                    dec.decompress(dp.inner, inner, dp.literal_len as usize, &mut literal)
                } else {
                    dec.decompress(header.codec, &payload, header.stored_raw_len(), &mut literal)
                };
                done.map_err(|e| Error::corrupt(at, e)).context(|| label.clone())?;
                if !literal.chunks(PAGE_SIZE).map(|p| page_ids.id(p)).eq(ids.expect("ids are read")) {
                    return Err(Error::corrupt(offset, "page ids do not match the pages of the block before them"))
                        .context(|| label.clone());
                }
            }
            _ => {}
        }
    }
    Ok(())
}
