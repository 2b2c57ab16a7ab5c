//! The one way in to an archive: [`open`] takes where it is (a
//! [`Location`]) and how to open it ([`OpenOptions`]), proves it (a walk of
//! every record, or its index with the walk behind, see `prove`), finds the
//! parents its C record names and attaches them.
//!
//! A child names its parents by archive id in its C record, each with a
//! hint: where it was, relative to the child's directory. They are looked
//! for in the files given with `--parent`, then at the hint, then among the
//! `*.czr` files of each `--parent-dir`; only an archive with the right id
//! is used, and one that is missing or named wrongly is an error before
//! anything is read. Parents are walked like any archive, on all cores; a
//! child's references only ever point at pages stored in them, so their
//! own parents are not needed. A restore has them walked behind
//! ([`Parents::Behind`]): it answers CRIU's first requests (its metadata)
//! meanwhile, and the first page that needs a parent waits for the walk.

use super::block::BlockSource;
use super::stored::Archive;
use crate::error::{Error, Result, ResultContext};
use crate::format::{ChainEntry, Header, HEADER_LEN};
use crate::io::{Location, SPOOL_CAP};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a reader may find parent archives besides their hints.
#[derive(Clone, Debug, Default)]
pub struct ParentSearch {
    /// Archives named with `--parent`; each must be one the chain needs.
    pub files: Vec<PathBuf>,
    /// Directories named with `--parent-dir`, searched for `*.czr`.
    pub dirs: Vec<PathBuf>,
}

/// When an archive is proven.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Proof {
    /// Every record is walked before `open` returns (every reader but a
    /// restore).
    #[default]
    First,
    /// An object still arriving is opened from its index and proven by a
    /// walk behind (a restore: a file or a spooled pipe is walked in
    /// milliseconds, a download only once it has all arrived); the reader
    /// must wait for [`BlockSource::proven`] before its point of no return.
    BehindIfArriving,
    /// From the index whenever there is a block table, proven behind: the
    /// path an arriving object takes, for any store (tests, the fuzzer).
    Behind,
}

/// When the parents are walked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Parents {
    /// Found, walked and attached before `open` returns.
    #[default]
    Now,
    /// Found and their ids checked before `open` returns (a missing or
    /// foreign parent fails then), walked on a thread behind: a reader that
    /// meets a reference waits for them, and [`Archive::parents_walked`]
    /// says how the walk ended.
    Behind,
}

/// How to open an archive.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Where parents may be found besides their hints.
    pub search: ParentSearch,
    /// Most of an archive arriving on a pipe spooled to a private file.
    pub spool_cap: u64,
    pub proof: Proof,
    pub parents: Parents,
    /// Whether a local file's read-ahead may follow reads from the start.
    /// A restore opens with it held: its first reads are metadata, and a
    /// read-ahead they moved queued the whole archive on the disk ahead of
    /// the reads that came next, CRIU's own among them (a cold 214 MiB
    /// archive: CRIU started 0.1 s later, docs/BENCHMARKS.md, session 88).
    /// The restore resumes it (`BlockSource::read_ahead`) where it reads
    /// the pages. A walk behind (`Proof::Behind`) waits for that too, or
    /// for the first wait for the proof (`archive::stored`).
    pub read_ahead_at_once: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            search: ParentSearch::default(),
            spool_cap: SPOOL_CAP,
            proof: Proof::First,
            parents: Parents::Now,
            read_ahead_at_once: true,
        }
    }
}

/// Opens and proves the archive at `at` with the parents its C record
/// names; errors name the archive.
pub fn open(at: &Location, o: &OpenOptions) -> Result<Arc<Archive>> {
    let label = at.label();
    if at.is_stream() {
        // A stream is spooled whole before it is read at random: what is no
        // archive at all (`-i /dev/zero`) is told from its header, not once
        // --pipe-buffer's worth of it was copied. A stream shorter than a
        // header is left to the reading that follows (truncated).
        if let Some(head) = at.head(HEADER_LEN) {
            let head: [u8; HEADER_LEN] = head.try_into().expect("HEADER_LEN bytes");
            Header::decode(&head).context(|| label.clone())?;
        }
    }
    let store = at.store_reading_ahead(o.spool_cap)?;
    store.read_ahead(o.read_ahead_at_once);
    let from_index = match o.proof {
        Proof::First => false,
        Proof::BehindIfArriving => store.arriving(),
        Proof::Behind => true,
    };
    let archive = if from_index {
        Archive::indexed(store, label.clone(), o.read_ahead_at_once).context(|| label)?
    } else {
        Arc::new(Archive::walked(store, label.clone()).context(|| label)?)
    };
    let found = locate(&archive, at.base_dir().as_deref(), &o.search)?;
    if found.is_empty() {
        return Ok(archive);
    }
    match o.parents {
        Parents::Now => archive.attach_parents(walk_parents(&found)?)?,
        Parents::Behind => {
            archive.expect_parents();
            let behind = archive.clone();
            std::thread::Builder::new()
                .name("criuz-parents".into())
                .spawn(move || {
                    // Waiting readers are released however the walk ends.
                    let walked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        walk_parents(&found).and_then(|p| behind.attach_parents(p))
                    }));
                    if let Err(e) = walked.unwrap_or(Err(Error::Cancelled)) {
                        behind.parents_failed(e);
                    }
                })
                .map_err(|e| Error::thread_not_started("parents' walk", e))?;
        }
    }
    Ok(archive)
}

/// Walks every parent found, on all cores: the part of a restore's start
/// that grows with the chain.
fn walk_parents(found: &[(PathBuf, [u8; 16])]) -> Result<Vec<Arc<Archive>>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(found.len()).max(1);
    let mut opened: Vec<(usize, Result<Arc<Archive>>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mine = found.iter().enumerate().skip(t).step_by(threads);
                    mine.map(|(i, (path, id))| (i, open_as(path, id))).collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("parent walk thread")).collect()
    });
    // In chain order, so the first failure reported is the nearest parent's.
    opened.sort_by_key(|(i, _)| *i);
    opened.into_iter().map(|(_, p)| p).collect()
}

/// Opens (walks) the archive at `path`, which must have archive id `id`.
fn open_as(path: &Path, id: &[u8; 16]) -> Result<Arc<Archive>> {
    let at = Location::parse(path)?;
    let label = at.label();
    let parent = Archive::walked(at.store(0)?, label.clone()).context(|| label)?;
    if parent.header().archive_id != *id {
        return Err(Error::Mismatch(format!("{}: changed while it was opened", path.display())));
    }
    Ok(Arc::new(parent))
}

/// The archive id of a file or object, from its header; `None` if it is not
/// an archive.
fn archive_id(path: &Path) -> Option<[u8; 16]> {
    // A stream's head, once read, is gone from it: a parent is a file.
    let at = Location::parse(path).ok().filter(|at| !at.is_stream())?;
    let b: [u8; HEADER_LEN] = at.head(HEADER_LEN)?.try_into().ok()?;
    Header::decode(&b).ok().map(|h| h.archive_id)
}

pub(crate) fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where each parent `archive` names is (hints relative to `base`), with
/// its archive id; empty for an archive without parents.
fn locate(archive: &Archive, base: Option<&Path>, search: &ParentSearch) -> Result<Vec<(PathBuf, [u8; 16])>> {
    let label = archive.label().to_string();
    if archive.chain().is_empty() {
        if let Some(f) = search.files.first() {
            return Err(Error::Usage(format!("{label}: has no parents, but --parent {} was given", f.display())));
        }
        return Ok(Vec::new());
    }
    for f in &search.files {
        // What the user named wrongly is a bad argument (exit 2), as any
        // named input is; a file that is there but no parent of this one
        // is told below.
        let at = Location::parse(f)?;
        if at.is_stream() {
            return Err(Error::Usage(format!(
                "--parent {}: a stream (a pipe, a device, an open descriptor); a parent is read at random, so name its file",
                f.display()
            )));
        }
        if let Some(path) = at.path() {
            crate::io::named_file(path).map_err(|e| e.context("--parent"))?;
        }
    }
    let given: Vec<(PathBuf, Option<[u8; 16]>)> = search.files.iter().map(|f| (f.clone(), archive_id(f))).collect();
    for (f, id) in &given {
        if !id.is_some_and(|id| archive.chain().iter().any(|e| e.archive_id == id)) {
            return Err(Error::Mismatch(format!(
                "{}: is not a parent of {label} (its chain needs {})",
                f.display(),
                chain_ids(archive)
            )));
        }
    }
    let mut paths = Vec::new();
    for entry in archive.chain() {
        let path = find(entry, base, &given, &search.dirs).ok_or_else(|| {
            // Not found, where a --parent-dir was named wrongly: that, the
            // likelier cause, is what is said (a bad argument, exit 2).
            if let Some(e) = search.dirs.iter().find_map(|d| crate::io::named_dir(d).err()) {
                return e.context("--parent-dir");
            }
            Error::NotFound(format!(
                "{label}: parent archive {} not found (looked at {}, --parent and --parent-dir)",
                hex(&entry.archive_id),
                base.map_or_else(|| entry.hint.clone(), |b| b.join(&entry.hint).display().to_string())
            ))
        })?;
        paths.push((path, entry.archive_id));
    }
    Ok(paths)
}

/// The archive of `archive`'s chain (opened from `at`, its parents found
/// with `search`) that is found at `path`'s directory entry, if one is: an
/// archive written there would leave the chain without it.
pub fn ancestor_at(archive: &Archive, at: &Location, search: &ParentSearch, path: &Path) -> Result<Option<PathBuf>> {
    let found = locate(archive, at.base_dir().as_deref(), search)?;
    Ok(found.into_iter().map(|(p, _)| p).find(|p| same_entry(p, path)))
}

/// Whether `a` and `b` name one directory entry (see [`entry_name`]).
pub(super) fn same_entry(a: &Path, b: &Path) -> bool {
    entry_name(a).is_some_and(|a| Some(a) == entry_name(b))
}

/// The directory entry `path` names, its directory resolved: two paths to
/// the same name compare equal, while a link is its own entry (writing an
/// archive there replaces the link, not what it points to). `None` if the
/// directory cannot be resolved.
fn entry_name(path: &Path) -> Option<PathBuf> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
}

fn chain_ids(a: &Archive) -> String {
    a.chain().iter().map(|e| hex(&e.archive_id)).collect::<Vec<_>>().join(", ")
}

fn find(
    entry: &ChainEntry,
    base: Option<&Path>,
    given: &[(PathBuf, Option<[u8; 16]>)],
    dirs: &[PathBuf],
) -> Option<PathBuf> {
    if let Some((f, _)) = given.iter().find(|(_, id)| *id == Some(entry.archive_id)) {
        return Some(f.clone());
    }
    if let Some(hinted) = base.filter(|_| !entry.hint.is_empty()).map(|b| b.join(&entry.hint)) {
        if archive_id(&hinted) == Some(entry.archive_id) {
            return Some(hinted);
        }
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
