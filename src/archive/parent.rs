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

use super::check::{Checked, CheckedRecords, Payloads};
use super::dedup::{DedupIndex, Location};
use super::records::read_full;
use super::source::StoreInput;
use super::source::{Archive, BlockSource};
use crate::error::{Error, IoContext, Result, ResultContext};
use crate::format::{
    page_id, BlockCodec, BlockHeader, ChainEntry, DedupPayload, FileKind, Header, Origin, PageId, FLAG_IDS, HEADER_LEN,
    PAGE_SIZE,
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

/// The archive id of a file, from its header; `None` if it is not an archive.
fn archive_id(path: &Path) -> Option<[u8; 16]> {
    let mut f = std::fs::File::open(path).ok()?;
    let mut b = [0u8; HEADER_LEN];
    (read_full(&mut f, &mut b).ok()? == HEADER_LEN).then_some(())?;
    Header::decode(&b).ok().map(|h| h.archive_id)
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Opens an archive (a path, or `-` for standard input, spooled up to
/// `spool_cap` bytes) together with the parents its C record names.
pub fn open(spec: &Path, spool_cap: u64, search: &ParentSearch) -> Result<Arc<Archive>> {
    let archive = Archive::open_spec(spec, spool_cap)?;
    let base = if crate::io::is_stdio(spec) { PathBuf::from(".") } else { dir_of(spec) };
    attach(archive, &base, search)
}

/// Finds and opens the parents `archive` names (hints relative to `base`)
/// and attaches them.
pub fn attach(archive: Arc<Archive>, base: &Path, search: &ParentSearch) -> Result<Arc<Archive>> {
    let label = archive.label().to_string();
    if archive.chain().is_empty() {
        if let Some(f) = search.files.first() {
            return Err(Error::Usage(format!("{label}: has no parents, but --parent {} was given", f.display())));
        }
        return Ok(archive);
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
    let mut parents = Vec::new();
    for entry in archive.chain() {
        let path = find(entry, base, &given, &search.dirs).ok_or_else(|| {
            Error::NotFound(format!(
                "{label}: parent archive {} not found (looked at {}, --parent and --parent-dir)",
                hex(&entry.archive_id),
                base.join(&entry.hint).display()
            ))
        })?;
        let parent = Archive::open(&path)?;
        if parent.header().archive_id != entry.archive_id {
            return Err(Error::Mismatch(format!("{}: changed while it was opened", path.display())));
        }
        parents.push(parent);
    }
    archive.attach_parents(parents)?;
    Ok(archive)
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

/// What a child written to `child` (a path, or `-`) dedups against: the
/// pages of `parent` and of the archives it refers to, each at the archive
/// that stores its bytes.
pub fn dedup_index(parent_path: &Path, child: &Path) -> Result<DedupIndex> {
    let parent = Archive::open(parent_path)?;
    let child_dir = if crate::io::is_stdio(child) { PathBuf::from(".") } else { dir_of(child) };
    let parent_dir = dir_of(parent_path);
    // The child's chain: the parent, then every archive the parent refers to
    // (a parent's source k is the child's source k + 1).
    let mut chain =
        vec![ChainEntry { archive_id: parent.header().archive_id, hint: relative(parent_path, &child_dir) }];
    for e in parent.chain() {
        chain.push(ChainEntry { archive_id: e.archive_id, hint: relative(&parent_dir.join(&e.hint), &child_dir) });
    }
    let label = parent_path.display().to_string();
    let pages = if parent.header().flags & FLAG_IDS != 0 {
        stored_ids(parent_path).context(|| label.clone())?
    } else {
        computed_ids(&parent).context(|| label.clone())?
    };
    Ok(DedupIndex::new(chain, pages))
}

/// Reads a parent's page ids and dedup extents: each page at the archive
/// that stores it, as the child will name it.
fn stored_ids(path: &Path) -> Result<HashMap<PageId, Location>> {
    // Read by position: the payloads of ordinary blocks (most of the
    // archive) are skipped, not read.
    let file = std::fs::File::open(path).at(path)?;
    let mut records = CheckedRecords::new(StoreInput::new(&file), Payloads::Dedup)?;
    let mut map = HashMap::new();
    let mut kinds: Vec<FileKind> = Vec::new();
    let mut block_no: Vec<u32> = Vec::new();
    let mut last: Option<(BlockHeader, Option<Vec<u8>>)> = None;
    while let Some((offset, rec)) = records.next_record()? {
        match rec {
            Checked::FileBegin { kind, .. } => {
                kinds.push(kind);
                block_no.push(0);
            }
            Checked::Block { header, payload, .. } => {
                block_no[header.file_id as usize] += 1;
                last = Some((header, payload));
            }
            Checked::Ids { file_id, ids } => {
                let (header, payload) = last.take().expect("ids follow their block");
                let block = block_no[file_id as usize] - 1;
                let here = |page: u32| Location { source: 1, file_id, block, page };
                let mut origins: Vec<Location> = Vec::new();
                if header.codec == BlockCodec::Dedup {
                    let stored = header.pages() - header.zero_pages();
                    let payload = payload.expect("dedup payloads are read");
                    let (dp, _) = DedupPayload::decode(&payload, stored, offset)?;
                    for e in &dp.extents {
                        for k in 0..e.count {
                            origins.push(match e.origin {
                                Origin::Literal => here(origins.len() as u32),
                                Origin::Ref { source, file_id, block, first } => {
                                    Location { source: source + 1, file_id, block, page: first + k }
                                }
                            });
                        }
                    }
                } else {
                    origins = (0..header.pages() - header.zero_pages()).map(|p| here(p as u32)).collect();
                }
                let whole = header.raw_len as usize % PAGE_SIZE == 0;
                for (id, loc) in ids.expect("ids are read").into_iter().zip(origins) {
                    if whole {
                        map.entry(id).or_insert(loc);
                    }
                }
            }
            Checked::Chain(_) | Checked::FileEnd(_) | Checked::Index(_) => {}
        }
    }
    Ok(map)
}

/// A parent without page ids (a full archive written without `--ids`):
/// decodes its page images and hashes every stored page.
fn computed_ids(parent: &Archive) -> Result<HashMap<PageId, Location>> {
    let mut map = HashMap::new();
    let mut dec = crate::codec::Decoder::new();
    let mut stored = Vec::new();
    for f in parent.index().files.iter().filter(|f| f.kind == FileKind::Pages) {
        let mut i = 0;
        while let Some(b) = parent.block(f.file_id, i)? {
            if b.header.raw_len as usize % PAGE_SIZE == 0 {
                b.decode_stored(&mut dec, &mut stored)?;
                for (p, page) in stored.chunks(PAGE_SIZE).enumerate() {
                    let loc = Location { source: 1, file_id: f.file_id, block: i as u32, page: p as u32 };
                    map.entry(page_id(page)).or_insert(loc);
                }
            }
            i += 1;
        }
    }
    Ok(map)
}
