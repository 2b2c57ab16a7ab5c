//! Structured mutation fuzzing of every archive reader, on stable Rust.
//!
//! Byte flips find little in a format where every byte is under a checksum,
//! so the mutators work on records the way a careless or hostile user would:
//! they swap, duplicate, drop and re-point block records and index entries,
//! splice in blocks of other archives, edit header fields, and then (for some
//! cases) recompute the seals, the index check, the E records and the trailer,
//! so that the damage passes every checksum a naive reader would look at.
//!
//! Every case runs through each reader entry point: `verify` (sequential
//! decode), `inspect`, `unpack` into a directory and as a tar (every 16th
//! case), the random-access block source that restore and serve read
//! through (`archive::open`), the pipe path (spooled to a file, then
//! opened), and the index-first open of a restore from an object
//! (`Proof::Behind`: every file read, then the proof waited for, as a
//! restore does before CRIU can finish). The oracle:
//! - no reader panics or hangs;
//! - the readers agree: the block sources (walked, piped, index-first)
//!   accept exactly what `verify` accepts and yield the same files, as do
//!   both unpacks; `inspect` accepts whatever `verify` accepts;
//! - unless the E records and the index were rebuilt too (a consistent,
//!   different archive that only authentication could tell apart), a mutant
//!   is either rejected, with an archive-kind error, or decodes to exactly
//!   the original files: no damaged archive ever yields wrong bytes. For the
//!   encrypted seeds, which have that authentication, this holds even then.

pub mod mutate;
pub use mutate::{mutate, records, reseal, Rec, Reseal, Rng};

use criuz::archive::{open, BlockSource, EntryStart, OpenOptions, Options, Packer, ParentSearch, Proof, SeqSink};
use criuz::codec::{Codec, CodecConfig};
use criuz::format::{EntryMeta, FileKind, HEADER_LEN};
use criuz::io::Location;
use criuz::offline::Reading;
use criuz::Kind;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Decoded files of an archive, by name.
pub type Files = BTreeMap<String, Vec<u8>>;

/// What the readers made of one archive.
#[derive(Debug)]
pub struct Outcome {
    pub verify: Result<Files, Kind>,
    pub source: Result<Files, Kind>,
    pub piped: Result<Files, Kind>,
    pub indexed: Result<Files, Kind>,
    pub inspect: Result<(), Kind>,
    /// `verify`'s check of page ids against the pages (version 2).
    pub page_ids: Result<(), Kind>,
    pub unpack: Option<Result<Files, Kind>>,
    /// `unpack --tar`, read back (with `unpack`).
    pub tar: Option<Result<Files, Kind>>,
}

#[derive(Default)]
struct Collect(BTreeMap<u32, (String, Vec<u8>)>);

impl SeqSink for Collect {
    fn begin(&mut self, e: &EntryStart) -> criuz::Result<()> {
        self.0.insert(e.file_id, (e.name.to_string(), Vec::new()));
        Ok(())
    }
    fn data(&mut self, id: u32, data: &[u8]) -> criuz::Result<()> {
        self.0.get_mut(&id).expect("begun").1.extend_from_slice(data);
        Ok(())
    }
    fn end(&mut self, _: u32, _: u64) -> criuz::Result<()> {
        Ok(())
    }
}

fn read_all(src: &dyn BlockSource) -> criuz::Result<Files> {
    let mut out = Files::new();
    for f in &src.index().files {
        out.insert(f.name.clone(), src.read_file(f)?);
    }
    Ok(out)
}

/// Runs every reader on `bytes`; an incremental archive gets the archive
/// at `parent` (if any) as its parent, as `--parent FILE` would give it.
pub fn run_readers(bytes: &[u8], parent: Option<&Path>, unpack: bool) -> Outcome {
    let opts = Options { threads: 2, ..Options::default() };
    // A parent that cannot be found is how a reader rejects a damaged chain
    // record; for the oracle that is a rejection of the archive like any other.
    // So is "give the identity" for a K record that names a key this process
    // does not hold (its key id rewritten, its seal recomputed): the fuzzer
    // holds its seeds' chain keys and no identity, and a user with the
    // identity is told of damage (the key unwrapped is not the one named).
    // The same holds for a damaged parent of an intact child.
    let names_unheld = |b: &[u8]| {
        b.len() >= HEADER_LEN + 24
            && b[10] & criuz::format::FLAG_SEALED as u8 != 0
            && !criuz::seal::keyring::holds(b[HEADER_LEN + 8..HEADER_LEN + 24].try_into().expect("16 bytes"))
    };
    let names_unheld_key =
        names_unheld(bytes) || parent.and_then(|p| std::fs::read(p).ok()).is_some_and(|b| names_unheld(&b));
    let kind = |e: criuz::Error| match e.root() {
        criuz::Error::NotFound(_) => Kind::Archive,
        criuz::Error::KeyNeeded(_) if names_unheld_key => Kind::Archive,
        _ => e.kind(),
    };
    let search = ParentSearch { files: parent.map(Path::to_path_buf).into_iter().collect(), dirs: Vec::new() };
    // In memory an archive is nowhere: its parents come from `--parent` alone.
    let memory = || Location::memory("fuzz", bytes.to_vec());
    let how = |proof| OpenOptions { search: search.clone(), proof, ..OpenOptions::default() };
    // verify and unpack as users run them: streamed for version 1, through
    // the block source (with parents) for version 2.
    let reading = || Reading::new(&memory(), &how(Proof::First));
    let verify = {
        let mut c = Collect::default();
        reading().and_then(|r| r.decode(&opts, &mut c)).map(|_| c.0.into_values().collect::<Files>()).map_err(kind)
    };
    let source = open(&memory(), &how(Proof::First)).and_then(|a| read_all(&*a)).map_err(kind);
    // A pipe is spooled to a private file and opened from there.
    let piped = {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("pipe.czr");
        std::fs::write(&path, bytes).expect("spool");
        open(&Location::File(path), &how(Proof::First)).and_then(|a| read_all(&*a)).map_err(kind)
    };
    let indexed = open(&memory(), &how(Proof::Behind))
        .and_then(|a| {
            let files = read_all(&*a)?;
            a.proven().map(|()| files)
        })
        .map_err(kind);
    let inspect = criuz::offline::inspect(bytes).map(drop).map_err(kind);
    let page_ids =
        open(&memory(), &OpenOptions::default()).and_then(|a| criuz::archive::ids::check_page_ids(&a)).map_err(kind);
    let unpack_dir = unpack.then(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let dest = dir.path().join("out");
        let r = reading()
            .and_then(|inp| criuz::offline::unpack(inp, &dest, false, &opts, criuz::progress::Progress::hidden()));
        match r {
            Ok(_) => {
                let mut files = Files::new();
                read_tree(&dest, &dest, &mut files);
                Ok(files)
            }
            Err(e) => {
                let left = std::fs::read_dir(&dest).map(|d| d.count()).unwrap_or(0);
                assert_eq!(left, 0, "a failed unpack left files behind");
                Err(kind(e))
            }
        }
    });
    let tar = unpack.then(|| {
        reading()
            .and_then(|inp| criuz::offline::unpack_tar(inp, Vec::new(), &opts))
            .map(|(_, _, out)| read_tar(&out))
            .map_err(kind)
    });
    Outcome { verify, source, piped, indexed, inspect, page_ids, unpack: unpack_dir, tar }
}

/// What `unpack --tar` wrote, as [`read_tree`] reads a directory.
fn read_tar(bytes: &[u8]) -> Files {
    let mut files = Files::new();
    for e in tar::Archive::new(bytes).entries().expect("tar written") {
        let mut e = e.expect("tar entry");
        let name = e.path().expect("path").to_string_lossy().trim_end_matches('/').to_string();
        let data = match e.header().entry_type() {
            tar::EntryType::Symlink => e.link_name_bytes().expect("target").into_owned(),
            _ => {
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut data).expect("tar data");
                data
            }
        };
        assert!(files.insert(name.clone(), data).is_none(), "{name} twice in the tar");
    }
    files
}

/// What an unpack wrote, as the readers see entries: a file's bytes, a
/// link's target, a directory's nothing, by path.
fn read_tree(root: &Path, dir: &Path, files: &mut Files) {
    for e in std::fs::read_dir(dir).expect("unpacked dir").flatten() {
        let path = e.path();
        let rel = path.strip_prefix(root).expect("inside").to_string_lossy().into_owned();
        let ft = e.file_type().expect("file type");
        if ft.is_symlink() {
            let target = std::fs::read_link(&path).expect("link");
            files.insert(rel, std::os::unix::ffi::OsStrExt::as_bytes(target.as_os_str()).to_vec());
        } else if ft.is_dir() {
            files.insert(rel, Vec::new());
            read_tree(root, &path, files);
        } else {
            files.insert(rel, std::fs::read(&path).expect("unpacked file"));
        }
    }
}

/// Checks the oracle; `original` is given when the mutant's checks were not
/// recomputed, so whatever a reader accepts must be exactly it.
pub fn judge(o: &Outcome, original: Option<&Files>) -> Result<(), String> {
    let same = |a: &Result<Files, Kind>, b: &Result<Files, Kind>| match (a, b) {
        (Ok(x), Ok(y)) => x == y,
        (Err(_), Err(_)) => true,
        _ => false,
    };
    if !same(&o.verify, &o.source) {
        return Err(format!("verify and the block source disagree: {:?} vs {:?}", brief(&o.verify), brief(&o.source)));
    }
    if !same(&o.source, &o.piped) {
        return Err(format!("file and pipe sources disagree: {:?} vs {:?}", brief(&o.source), brief(&o.piped)));
    }
    if !same(&o.source, &o.indexed) {
        return Err(format!(
            "walked and index-first sources disagree: {:?} vs {:?}",
            brief(&o.source),
            brief(&o.indexed)
        ));
    }
    if let Some(u) = &o.unpack {
        if !same(u, &o.verify) {
            return Err(format!("unpack and verify disagree: {:?} vs {:?}", brief(u), brief(&o.verify)));
        }
    }
    if let Some(t) = &o.tar {
        if !same(t, &o.verify) {
            return Err(format!("unpack --tar and verify disagree: {:?} vs {:?}", brief(t), brief(&o.verify)));
        }
    }
    if o.verify.is_ok() && o.inspect.is_err() {
        return Err("inspect rejects what verify accepts".into());
    }
    for r in [&o.verify, &o.source, &o.piped, &o.indexed] {
        if let Err(k) = r {
            if *k != Kind::Archive {
                return Err(format!("a damaged archive gave a {k:?} error, not an archive error"));
            }
        }
    }
    if let Err(k) = &o.page_ids {
        if *k != Kind::Archive {
            return Err(format!("the page id check gave a {k:?} error, not an archive error"));
        }
    }
    if let (Some(orig), Ok(got)) = (original, &o.source) {
        if got != orig {
            return Err("a damaged archive was accepted with different content".into());
        }
    }
    Ok(())
}

fn brief(r: &Result<Files, Kind>) -> String {
    match r {
        Ok(f) => format!("ok ({} files)", f.len()),
        Err(k) => format!("{k:?}"),
    }
}

/// A seed archive, and for an incremental one its parent.
#[derive(Clone)]
pub struct Seed {
    pub bytes: Vec<u8>,
    pub parent: Option<Vec<u8>>,
}

fn pack(files: &[(&str, Vec<u8>)], opts: &Options, dedup: Option<Arc<criuz::archive::dedup::DedupIndex>>) -> Vec<u8> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let packer = Packer::start(SharedVec(buf.clone()), opts, dedup).expect("packer");
    for (name, data) in files {
        let mut sink = packer.begin_file(name).expect("begin");
        sink.write(data).expect("write");
        sink.finish().expect("finish");
    }
    packer.finish().expect("pack");
    let bytes = buf.lock().unwrap().clone();
    bytes
}

/// [`pack`] with every file begun before any ends, each written in two
/// halves: the first halves in order, then the second halves.
fn pack_interleaved(files: &[(&str, Vec<u8>)], opts: &Options) -> Vec<u8> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let packer = Packer::start(SharedVec(buf.clone()), opts, None).expect("packer");
    let mut sinks: Vec<_> = files
        .iter()
        .map(|(name, data)| {
            let mut sink = packer.begin_file(name).expect("begin");
            sink.write(&data[..data.len() / 2]).expect("write");
            sink
        })
        .collect();
    for ((_, data), sink) in files.iter().zip(&mut sinks) {
        sink.write(&data[data.len() / 2..]).expect("write");
    }
    for sink in sinks {
        sink.finish().expect("finish");
    }
    packer.finish().expect("pack");
    let bytes = buf.lock().unwrap().clone();
    bytes
}

/// Seed archives made in memory: CRIU-like images in several block sizes
/// and codecs, with zero pages, raw and compressed blocks, empty files; with
/// page ids and pages shared between files (version 2); with 16-bit words
/// stored as byte planes (version 3); and a child of one of them with dedup
/// references into it.
pub fn synthetic_seeds() -> Vec<Seed> {
    let mut rng = Rng::new(7);
    let mut pages = Vec::new();
    for p in 0..40 {
        match p % 4 {
            0 => pages.extend_from_slice(&[0u8; 4096]),
            1 => pages.extend((0..4096).map(|_| rng.next_u64() as u8)),
            _ => pages.extend((0..4096).map(|i| b"criuz page text "[(i + p) % 16])),
        }
    }
    // 16-bit floats: a high byte of few values, a noisy low byte (stored as
    // byte planes, version 3, in blocks of 8 pages or more).
    let words: Vec<u8> =
        (0..16 * 2048).flat_map(|_| [rng.next_u64() as u8, 0x3C + (rng.next_u64() % 3) as u8]).collect();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("inventory.img", b"inventory".repeat(3)),
        ("pagemap-1.img", (0..700u32).flat_map(|i| i.to_le_bytes()).collect()),
        ("pages-1.img", pages.clone()),
        ("pages-2.img", pages[..3 * 4096 + 100].to_vec()),
        ("pages-3.img", pages[8 * 4096..24 * 4096].to_vec()),
        ("empty.img", Vec::new()),
        ("pages-4.img", words),
    ];
    let opts = |block, codec, ids| Options {
        codec: CodecConfig::new(codec, None).expect("codec"),
        block_size: block,
        threads: 1,
        ids,
        ..Options::default()
    };
    let mut seeds = Vec::new();
    for (block, codec) in
        [(4096, Codec::Lz4), (8192, Codec::Zstd), (16384, Codec::None), (65536, Codec::Lz4), (65536, Codec::Zstd)]
    {
        seeds.push(Seed { bytes: pack(&files, &opts(block, codec, false), None), parent: None });
    }
    seeds.push(Seed { bytes: pack(&files, &opts(8192, Codec::Lz4, true), None), parent: None });
    // Files written at once, as a dump writes its pages images alongside
    // the others: their blocks interleave in the archive.
    seeds.push(Seed { bytes: pack_interleaved(&files, &opts(4096, Codec::Lz4, false)), parent: None });
    // A child: some pages rewritten, some moved, the rest as in the parent.
    let parent = pack(&files, &opts(16384, Codec::Zstd, true), None);
    let dir = tempfile::tempdir().expect("temp dir");
    let parent_path = dir.path().join("parent.czr");
    std::fs::write(&parent_path, &parent).expect("parent");
    let mut changed = pages.clone();
    for p in [5usize, 6, 17, 30] {
        changed[p * 4096..(p + 1) * 4096].iter_mut().for_each(|b| *b = rng.next_u64() as u8);
    }
    changed.rotate_left(4 * 4096);
    let child_files: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(n, d)| (*n, if *n == "pages-1.img" { changed.clone() } else { d.clone() })).collect();
    let index =
        criuz::archive::ids::dedup_index(&parent_path, &Location::File(dir.path().join("child.czr"))).expect("dedup");
    let child = pack(&child_files, &opts(8192, Codec::Lz4, false), Some(Arc::new(index)));
    seeds.push(Seed { bytes: child, parent: Some(parent) });
    // Encrypted: a full archive with ids and its child. This process keeps
    // their chain key (the writer remembers it), so readers open them as a
    // user's would; a mutated K record names a key no one here has, which
    // must be refused as an archive error like any other damage.
    let (_, public) = criuz::seal::keyring::generate();
    let recipients =
        criuz::seal::keyring::Recipients::from_args(&[public], &[], None).expect("recipient").expect("one");
    let sealed = |block, codec, ids| Options { seal: Some(Arc::new(recipients.clone())), ..opts(block, codec, ids) };
    seeds.push(Seed { bytes: pack(&files, &sealed(8192, Codec::Zstd, false), None), parent: None });
    let parent = pack(&files, &sealed(16384, Codec::Lz4, true), None);
    std::fs::write(&parent_path, &parent).expect("parent");
    let index =
        criuz::archive::ids::dedup_index(&parent_path, &Location::File(dir.path().join("child.czr"))).expect("dedup");
    let child = pack(&child_files, &sealed(8192, Codec::None, false), Some(Arc::new(index)));
    seeds.push(Seed { bytes: child, parent: Some(parent) });
    // A tree: nested page images, a directory, links (what pack writes of a
    // podman export or a runc checkpoint).
    let meta = |mode| Some(EntryMeta { mode, mtime: 1_700_000_000, mtime_nsec: 5 });
    let tree: Vec<(&str, FileKind, Vec<u8>)> = vec![
        ("checkpoint", FileKind::Dir, Vec::new()),
        ("checkpoint/pages-1.img", FileKind::Pages, pages.clone()),
        ("checkpoint/inventory.img", FileKind::Plain, b"inventory".to_vec()),
        ("checkpoint/parent", FileKind::Symlink, b"../prev".to_vec()),
        ("config.dump", FileKind::Plain, b"{}".to_vec()),
        ("empty", FileKind::Dir, Vec::new()),
    ];
    for (block, codec) in [(4096, Codec::Lz4), (16384, Codec::Zstd)] {
        let o = Options { tree: true, ..opts(block, codec, false) };
        let buf = Arc::new(Mutex::new(Vec::new()));
        let packer = Packer::start(SharedVec(buf.clone()), &o, None).expect("packer");
        for (name, kind, data) in &tree {
            let mut sink = packer.begin_entry(name, *kind, meta(0o640)).expect("begin");
            sink.write(data).expect("write");
            sink.finish().expect("finish");
        }
        packer.finish().expect("pack");
        let bytes = buf.lock().unwrap().clone();
        seeds.push(Seed { bytes, parent: None });
    }
    seeds
}

/// A `Write` into a shared vector (the packer owns its output).
struct SharedVec(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for SharedVec {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
