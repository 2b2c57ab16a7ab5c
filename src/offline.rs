//! Offline commands: pack a CRIU images directory (or any tree: a runc
//! checkpoint with its own files, a podman export as a tar stream), unpack
//! an archive into a directory or a tar stream, verify every checksum, and
//! inspect what an archive holds.

use crate::archive::check::{Checked, CheckedRecords, Payloads};
use crate::archive::dedup::DedupIndex;
use crate::archive::records::StreamInput;
use crate::archive::OpenOptions;
use crate::archive::{
    read_sequential, read_source, Archive, BlockSource, EntryStart, Options, PackStats, Packer, SeqSink,
};
use crate::error::{Error, Result};
use crate::format::{
    BlockCodec, DedupPayload, FileKind, Header, Origin, FLAG_IDS, FLAG_PARENT, FLAG_TABLE, HEADER_LEN, PAGE_SIZE,
};
use crate::io::Location;
use crate::progress::Progress;
pub use crate::tree::dir::UnpackStats;
use crate::tree::{self, dir::DirSink};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

/// Packs the tree under `dir` (files, subdirectories, links, modes,
/// mtimes; see `tree`) into a tree archive written to `out`. `entries` is
/// what [`tree::scan`] found there.
pub fn pack_dir<W: Write + Send + 'static>(
    dir: &Path,
    entries: &[tree::Entry],
    out: W,
    opts: &Options,
    dedup: Option<Arc<DedupIndex>>,
    progress: &mut Progress,
) -> Result<PackStats> {
    let opts = Options { tree: true, ..opts.clone() };
    let packer = Packer::start(out, &opts, dedup)?;
    match tree::feed_dir(&packer, dir, entries, &mut |n| progress.set(n)) {
        Ok(()) => packer.finish().map(|(stats, _)| stats),
        Err(e) => Err(packer.abort().unwrap_or(e)),
    }
}

/// Packs a tar stream (plain, zstd or gzip; e.g. a podman checkpoint
/// export) into a tree archive written to `out`.
pub fn pack_tar<W: Write + Send + 'static>(
    inp: Box<dyn Read + Send>,
    label: &str,
    out: W,
    opts: &Options,
    progress: &mut Progress,
) -> Result<PackStats> {
    let opts = Options { tree: true, ..opts.clone() };
    let packer = Packer::start(out, &opts, None)?;
    match tree::tar::pack_tar(inp, label, &packer, &mut |n| progress.set(n)) {
        Ok(_) => packer.finish().map(|(stats, _)| stats),
        Err(e) => Err(packer.abort().unwrap_or(e)),
    }
}

/// Writes the files of `source` (with its parents attached) into a new,
/// self-contained archive: every reference resolved, every byte checked.
pub fn flatten<W: Write + Send + 'static>(source: Arc<Archive>, out: W, opts: &Options) -> Result<PackStats> {
    rewrite(source, out, opts, &|_, _| false)
}

/// [`flatten`], storing the blocks `keep` accepts (given a block's file id
/// and its number in the file) as they are, not decoded, not
/// compressed again, and re-encoding the others: a dump's rewrite of the
/// blocks it compressed in a hurry touches only those. For archives
/// without page ids (a block's ids come from its data) whose block size is
/// `opts`'s; others are flattened. The data checks of the blocks kept
/// travel with them.
pub fn recode<W: Write + Send + 'static>(
    source: Arc<Archive>,
    out: W,
    opts: &Options,
    keep: &dyn Fn(u32, usize) -> bool,
) -> Result<PackStats> {
    let header = source.header();
    if opts.ids || header.flags & (FLAG_IDS | FLAG_PARENT) != 0 || header.block_size as usize != opts.block_size {
        return flatten(source, out, opts);
    }
    rewrite(source, out, opts, keep)
}

/// Every file of `source` into a new archive: the blocks `keep` accepts as
/// they are stored, the others decoded and written again.
fn rewrite<W: Write + Send + 'static>(
    source: Arc<Archive>,
    out: W,
    opts: &Options,
    keep: &dyn Fn(u32, usize) -> bool,
) -> Result<PackStats> {
    let packer = Packer::start(out, opts, None)?;
    let fed = (|| -> Result<()> {
        let mut dec = crate::codec::Decoder::new();
        let mut data = Vec::new();
        for entry in &source.index().files {
            let mut sink = packer.begin_file(&entry.name)?;
            let mut i = 0;
            while let Some(b) = source.block(entry.file_id, i)? {
                let as_is = !b.is_resolved() && !b.header.sealed && sink.pending_len() == 0 && keep(entry.file_id, i);
                if as_is {
                    sink.write_encoded(b.header.clone(), b.payload().to_vec())?;
                } else {
                    b.decode(&mut dec, &mut data)?;
                    sink.write(&data)?;
                }
                i += 1;
            }
            sink.finish()?;
        }
        Ok(())
    })();
    match fed {
        Ok(()) => packer.finish().map(|(stats, _)| stats),
        Err(e) => Err(packer.abort().unwrap_or(e)),
    }
}

/// An archive opened to be decoded whole: streamed front to back (version 1,
/// even from a pipe), or through its block source with its parents (version
/// 2: dedup blocks refer to other blocks).
pub enum Reading {
    Stream(String, Box<dyn Read + Send>),
    Source(Arc<Archive>),
    /// A self-contained archive given `--parent` in vain: read whole into
    /// nothing, then refused as a usage error if it checks out. A damaged
    /// archive under a parentless header (a child's records behind another
    /// archive's header) is damaged first (exit 3), as without `--parent`.
    ParentInVain(String, Box<dyn Read + Send>),
}

impl Reading {
    /// Opens the archive at `at` as its header asks: a self-contained
    /// archive is streamed (from a pipe too, without spooling it), one with
    /// page ids or parents is opened through [`crate::archive::open`](fn@crate::archive::open).
    pub fn new(at: &Location, o: &OpenOptions) -> Result<Reading> {
        let header = at.head(HEADER_LEN).and_then(|head| Header::decode(head[..].try_into().ok()?).ok());
        if header.as_ref().is_some_and(|h| h.flags & (FLAG_PARENT | FLAG_IDS) != 0) {
            return Ok(Reading::Source(crate::archive::open(at, o)?));
        }
        // What is not an archive is streamed, so the reader says what is
        // wrong with it (exit 3), not that `--parent` was given in vain.
        if header.is_some() && !o.search.files.is_empty() {
            return Ok(Reading::ParentInVain(at.label(), at.reader()?));
        }
        Ok(Reading::Stream(at.label(), at.reader()?))
    }

    /// [`new`](Self::new) for a tar: an archive that is no stream (a file,
    /// an object) is read through its index, file by file with each size
    /// known before its bytes, so each goes straight out after its header;
    /// read as a stream, every file is spooled to `$TMPDIR` first (a tar
    /// header needs the size), as much again as the memory it holds.
    pub fn for_tar(at: &Location, o: &OpenOptions) -> Result<Reading> {
        if at.is_stream() {
            // Where its files will be spooled, checked before it is read.
            crate::io::temp_dir()?;
            return Reading::new(at, o);
        }
        let header = at.head(HEADER_LEN).and_then(|head| Header::decode(head[..].try_into().ok()?).ok());
        let parent_in_vain = header.as_ref().is_some_and(|h| h.flags & FLAG_PARENT == 0) && !o.search.files.is_empty();
        if header.is_none() || parent_in_vain {
            return Reading::new(at, o);
        }
        Ok(Reading::Source(crate::archive::open(at, o)?))
    }

    /// Decodes every file into `sink`.
    pub fn decode(self, opts: &Options, sink: &mut dyn SeqSink) -> Result<()> {
        match self {
            Reading::Stream(label, r) => read_sequential(r, opts, sink).map(drop).map_err(|e| e.from_archive(label)),
            Reading::ParentInVain(label, r) => {
                let mut nothing = CountSink { files: 0, bytes: 0, progress: Progress::hidden() };
                read_sequential(r, opts, &mut nothing).map_err(|e| e.from_archive(label.clone()))?;
                Err(Error::Usage(format!("{label}: has no parents, but --parent was given")))
            }
            Reading::Source(a) => {
                let label = a.label().to_string();
                read_source(a, opts, sink).map(drop).map_err(|e| e.from_archive(label))
            }
        }
    }
}

/// Unpacks an archive into `dir` (created if missing). Nothing appears in
/// `dir` unless the whole archive checks out.
pub fn unpack(inp: Reading, dir: &Path, force: bool, opts: &Options, progress: Progress) -> Result<UnpackStats> {
    let mut sink = DirSink::create(dir, force, progress)?;
    let result = inp.decode(opts, &mut sink).and_then(|_| sink.publish());
    sink.progress.finish();
    result
}

/// Unpacks an archive as a tar stream into `out` (for `podman container
/// restore --import`); returns (entries, bytes). The caller publishes `out`
/// only on success: a tar cut short must not look whole.
pub fn unpack_tar<W: Write>(inp: Reading, out: W, opts: &Options) -> Result<(usize, u64, W)> {
    unpack_tar_noting(inp, out, opts, &mut |_, _| {})
}

/// [`unpack_tar`], telling `note` each file's name and size as it ends
/// (what a podman checkpoint holds, learnt as it is unpacked).
pub fn unpack_tar_noting<W: Write>(
    inp: Reading,
    out: W,
    opts: &Options,
    note: &mut dyn FnMut(&str, u64),
) -> Result<(usize, u64, W)> {
    let mut sink = Noting { inner: tree::tar::TarSink::new(out), names: HashMap::new(), note };
    inp.decode(opts, &mut sink)?;
    let sink = sink.inner;
    let (entries, bytes) = (sink.entries, sink.bytes);
    let mut out = sink.finish()?;
    out.flush()?;
    Ok((entries, bytes, out))
}

/// A sink that tells each file's name and size as it ends, then passes it on.
struct Noting<'a, S> {
    inner: S,
    names: HashMap<u32, String>,
    note: &'a mut dyn FnMut(&str, u64),
}

impl<S: SeqSink> SeqSink for Noting<'_, S> {
    fn begin(&mut self, e: &EntryStart) -> Result<()> {
        if e.kind.is_file() {
            self.names.insert(e.file_id, e.name.to_string());
        }
        self.inner.begin(e)
    }
    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()> {
        self.inner.data(file_id, data)
    }
    fn end(&mut self, file_id: u32, raw_size: u64) -> Result<()> {
        if let Some(name) = self.names.remove(&file_id) {
            (self.note)(&name, raw_size);
        }
        self.inner.end(file_id, raw_size)
    }
}

struct CountSink {
    files: usize,
    bytes: u64,
    progress: Progress,
}

impl SeqSink for CountSink {
    fn begin(&mut self, e: &EntryStart) -> Result<()> {
        self.files += usize::from(e.kind.is_file());
        Ok(())
    }
    fn data(&mut self, _: u32, data: &[u8]) -> Result<()> {
        self.bytes += data.len() as u64;
        self.progress.set(self.bytes);
        Ok(())
    }
    fn end(&mut self, _: u32, _: u64) -> Result<()> {
        Ok(())
    }
}

/// Decodes everything and checks every checksum, and that the page ids of
/// the archive and its parents name their pages; returns (files, raw bytes).
pub fn verify(inp: Reading, opts: &Options, progress: Progress) -> Result<(usize, u64)> {
    let mut sink = CountSink { files: 0, bytes: 0, progress };
    if let Reading::Source(archive) = &inp {
        for a in std::iter::once(archive).chain(archive.parents()) {
            crate::archive::ids::check_page_ids(a)?;
        }
    }
    inp.decode(opts, &mut sink)?;
    sink.progress.finish();
    Ok((sink.files, sink.bytes))
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FileReport {
    pub name: String,
    pub kind: String,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub ratio: f64,
    pub pages: u64,
    pub zero_pages: u64,
    #[serde(flatten)]
    pub codecs: crate::archive::CodecCounts,
    /// Bytes of pages stored as references (to a parent or elsewhere in this archive).
    pub referenced_bytes: u64,
}

/// A parent an archive refers to.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ParentReport {
    pub archive_id: String,
    /// Where it was, relative to this archive.
    pub hint: String,
    /// Bytes of this archive's pages stored in that parent.
    pub referenced_bytes: u64,
}

/// What an encrypted archive says of its encryption without its key.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct EncryptionReport {
    pub algorithm: String,
    /// Id of the chain key (the same in every archive of a chain).
    pub key_id: String,
    /// The kind of each recipient the key is wrapped for (`X25519`, or
    /// `scrypt` for a passphrase).
    pub wrapped_for: Vec<String>,
    /// Whether no key given opened it: names are then `#<file id>`, and
    /// what only the contents tell (references) is not counted.
    pub locked: bool,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct InspectReport {
    pub version: u16,
    /// Present for an encrypted archive.
    pub encryption: Option<EncryptionReport>,
    pub block_size: u32,
    pub archive_id: String,
    pub archive_bytes: u64,
    /// Whether the archive carries page ids (it can be a parent cheaply).
    pub page_ids: bool,
    /// Whether the index carries the block table (a restore from an object
    /// store can start from the index).
    pub block_table: bool,
    /// Bytes of P records (ids of the pages this archive stores).
    pub page_id_bytes: u64,
    /// Parents, the direct parent first (empty for a full archive).
    pub chain: Vec<ParentReport>,
    pub files: Vec<FileReport>,
    pub total: FileReport,
    /// Referenced bytes / raw bytes.
    pub dedup_ratio: f64,
    /// Bytes of pages that refer to pages stored elsewhere in this archive.
    pub internal_referenced_bytes: u64,
}

fn ratio(stored: u64, raw: u64) -> f64 {
    if raw == 0 {
        0.0
    } else {
        stored as f64 / raw as f64
    }
}

/// Reads every record through the checks (payload checks included, no
/// decompression) and reports sizes per file.
pub fn inspect<R: std::io::Read + Send>(inp: R) -> Result<InspectReport> {
    let mut r = CheckedRecords::new_or_locked(StreamInput(inp), Payloads::All)?;
    let hex = |id: &[u8; 16]| id.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let encryption = r.key_record().map(|k| EncryptionReport {
        algorithm: "AES-256-GCM".into(),
        key_id: hex(&k.key_id),
        wrapped_for: age_stanzas(&k.wrapped),
        locked: r.locked(),
    });
    let mut rep = InspectReport {
        version: if r.header().flags == 0 { crate::format::VERSION_PLAIN } else { crate::format::VERSION },
        page_ids: r.header().flags & FLAG_IDS != 0,
        block_table: r.header().flags & FLAG_TABLE != 0,
        block_size: r.header().block_size,
        archive_id: hex(&r.header().archive_id),
        encryption,
        ..Default::default()
    };
    let mut start = r.offset();
    // Referenced bytes by source: 0 this archive, k entry k of the chain.
    let mut by_source: Vec<u64> = vec![0];
    while let Some((offset, rec)) = r.next_record()? {
        let len = r.offset() - start;
        match rec {
            Checked::FileBegin { name, kind, .. } => {
                let kind = match kind {
                    FileKind::Pages => "pages",
                    FileKind::Plain => "plain",
                    FileKind::Dir => "dir",
                    FileKind::Symlink => "symlink",
                };
                rep.files.push(FileReport { name, kind: kind.into(), stored_bytes: len, ..Default::default() });
            }
            Checked::Block { header, payload, .. } => {
                let f = &mut rep.files[header.file_id as usize];
                // Without the key of an encrypted archive payloads are not
                // read: what a dedup block refers to is then not counted.
                if let (BlockCodec::Dedup, Some(payload)) = (header.codec, payload) {
                    let stored = header.pages() - header.zero_pages();
                    let dp = DedupPayload::decode(&payload, stored, offset)?.head;
                    for e in &dp.extents {
                        if let Origin::Ref { source, .. } = e.origin {
                            let bytes = u64::from(e.count) * PAGE_SIZE as u64;
                            f.referenced_bytes += bytes;
                            if by_source.len() <= source as usize {
                                by_source.resize(source as usize + 1, 0);
                            }
                            by_source[source as usize] += bytes;
                        }
                    }
                }
                f.raw_bytes += u64::from(header.raw_len);
                f.stored_bytes += len;
                if !header.zero_bitmap.is_empty() {
                    f.pages += header.pages() as u64;
                    f.zero_pages += header.zero_pages() as u64;
                }
                f.codecs.add(header.codec);
            }
            Checked::Chain(entries) => {
                rep.chain = entries
                    .iter()
                    .map(|e| ParentReport { archive_id: hex(&e.archive_id), hint: e.hint.clone(), referenced_bytes: 0 })
                    .collect();
            }
            Checked::Ids { file_id, .. } => {
                rep.files[file_id as usize].stored_bytes += len;
                rep.page_id_bytes += len;
            }
            Checked::FileEnd(end) => rep.files[end.file_id as usize].stored_bytes += len,
            Checked::Index(_) => {}
        }
        start = r.offset();
    }
    rep.archive_bytes = r.offset();
    let mut t = FileReport { name: "total".into(), kind: String::new(), ..Default::default() };
    for f in &mut rep.files {
        f.ratio = ratio(f.stored_bytes, f.raw_bytes);
        t.raw_bytes += f.raw_bytes;
        t.stored_bytes += f.stored_bytes;
        t.pages += f.pages;
        t.zero_pages += f.zero_pages;
        t.codecs += f.codecs;
        t.referenced_bytes += f.referenced_bytes;
    }
    t.stored_bytes = rep.archive_bytes;
    t.ratio = ratio(t.stored_bytes, t.raw_bytes);
    rep.dedup_ratio = ratio(t.referenced_bytes, t.raw_bytes);
    rep.internal_referenced_bytes = by_source[0];
    for (i, p) in rep.chain.iter_mut().enumerate() {
        p.referenced_bytes = by_source.get(i + 1).copied().unwrap_or(0);
    }
    rep.total = t;
    Ok(rep)
}

/// The recipient types an age file's header lists (its `-> TYPE ...` lines).
fn age_stanzas(wrapped: &[u8]) -> Vec<String> {
    let head = wrapped.split(|&b| b == b'\n').take_while(|l| !l.starts_with(b"---"));
    head.filter_map(|l| l.strip_prefix(b"-> "))
        .filter_map(|l| l.split(|&b| b == b' ').next())
        .map(|t| String::from_utf8_lossy(t).into_owned())
        // age adds a random "grease" stanza that nothing opens.
        .filter(|t| !t.ends_with("-grease"))
        .collect()
}
