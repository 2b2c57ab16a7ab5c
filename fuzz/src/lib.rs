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
//! decode), `inspect`, `unpack` (every 16th case), the random-access block
//! source that restore and serve read through (`Archive::from_store`), and the
//! pipe path (`Archive::from_reader`). The oracle:
//! - no reader panics or hangs;
//! - the readers agree: the block source accepts exactly what `verify`
//!   accepts and yields the same files; `inspect` accepts whatever `verify`
//!   accepts;
//! - unless the E records and the index were rebuilt too (a consistent,
//!   different archive that only authentication could tell apart), a mutant
//!   is either rejected, with an archive-kind error, or decodes to exactly
//!   the original files: no damaged archive ever yields wrong bytes.

use criuz::archive::{read_sequential, Archive, BlockSource, Options, Packer, SeqSink};
use criuz::codec::{Codec, CodecConfig};
use criuz::format::FileKind;
use criuz::Kind;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::xxh3_64;

/// Decoded files of an archive, by name.
pub type Files = BTreeMap<String, Vec<u8>>;

/// A small, fast PRNG (xorshift64*): reproducible cases from a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// One record of an archive, found by a lenient walk (for mutating).
#[derive(Clone, Copy, Debug)]
pub struct Rec {
    pub kind: u8,
    pub start: usize,
    pub len: usize,
    /// For B records: header length without the seal.
    pub header_len: usize,
}

fn u16le(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}
fn u32le(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}
fn u64le(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Walks records without checking anything; stops at the first one that
/// does not fit. The index record, if found, is last.
pub fn records(a: &[u8]) -> Vec<Rec> {
    let mut out = Vec::new();
    let mut pos = 64;
    while pos < a.len() {
        let kind = a[pos];
        let (len, header_len) = match kind {
            b'F' if pos + 8 <= a.len() => (12 + u16le(a, pos + 2), 0),
            b'B' if pos + 28 <= a.len() => {
                let raw = u32le(a, pos + 8);
                let m = if u16le(a, pos + 2) & 1 != 0 { raw.div_ceil(4096).div_ceil(8) } else { 0 };
                (32 + m + u32le(a, pos + 12), 28 + m)
            }
            b'E' => (28, 0),
            b'I' if pos + 16 <= a.len() => {
                let l = u64le(a, pos + 8).min(a.len() as u64) as usize;
                (28 + l, 0)
            }
            _ => break,
        };
        if pos + len > a.len() {
            break;
        }
        out.push(Rec { kind, start: pos, len, header_len });
        pos += len;
        if kind == b'I' {
            break;
        }
    }
    out
}

fn seal_at(a: &mut [u8], start: usize, sealed_len: usize) {
    let s = xxh3_64(&a[start..start + sealed_len]) as u32;
    a[start + sealed_len..start + sealed_len + 4].copy_from_slice(&s.to_le_bytes());
}

/// How much of an archive's checking to redo after a mutation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reseal {
    /// Nothing: the damage stays visible to the checksums.
    None,
    /// Record seals and the header check.
    Seals,
    /// Seals, the index body check and the trailer (a crafted index).
    Index,
    /// Everything, E records and index rebuilt from the stream: a
    /// consistent, different archive (only authentication could tell).
    All,
}

/// Recomputes checks after a mutation, as much as `how` says.
pub fn reseal(a: &mut Vec<u8>, how: Reseal) {
    if how == Reseal::None || a.len() < 64 {
        return;
    }
    let h = xxh3_64(&a[..56]);
    a[56..64].copy_from_slice(&h.to_le_bytes());
    let recs = records(a);
    // Per file id: (raw size, data checks) as the stream has them.
    let mut files: BTreeMap<u32, (u64, Vec<u8>, Vec<(u64, u32, u32)>)> = BTreeMap::new();
    for r in &recs {
        match r.kind {
            b'F' => seal_at(a, r.start, r.len - 4),
            b'B' => {
                seal_at(a, r.start, r.header_len);
                let id = u32le(a, r.start + 4) as u32;
                let raw = u32le(a, r.start + 8) as u32;
                let f = files.entry(id).or_default();
                f.0 += u64::from(raw);
                f.1.extend_from_slice(&a[r.start + 16..r.start + 24]);
                f.2.push((r.start as u64, raw, r.len as u32));
            }
            b'E' => {
                if how == Reseal::All {
                    let id = u32le(a, r.start + 4) as u32;
                    let (size, checks, _) = files.get(&id).cloned().unwrap_or_default();
                    a[r.start + 8..r.start + 16].copy_from_slice(&size.to_le_bytes());
                    a[r.start + 16..r.start + 24].copy_from_slice(&xxh3_64(&checks).to_le_bytes());
                }
                seal_at(a, r.start, 24);
            }
            b'I' => {
                if how == Reseal::All {
                    rebuild_index(a, r, &files);
                } else {
                    seal_at(a, r.start, 16);
                    let body = r.len - 28;
                    let c = xxh3_64(&a[r.start + 20..r.start + 20 + body]);
                    a[r.start + 20 + body..r.start + 28 + body].copy_from_slice(&c.to_le_bytes());
                }
                if matches!(how, Reseal::Index | Reseal::All) {
                    fix_trailer(a, r.start);
                }
            }
            _ => {}
        }
    }
}

type StreamFiles = BTreeMap<u32, (u64, Vec<u8>, Vec<(u64, u32, u32)>)>;

/// Rewrites the block lists, sizes and checks of the index entries as the
/// stream has them (names and kinds stay).
fn rebuild_index(a: &mut Vec<u8>, r: &Rec, files: &StreamFiles) {
    let count = u32le(a, r.start + 4);
    let body = a[r.start + 20..r.start + r.len - 8].to_vec();
    let mut out = Vec::new();
    let mut p = 0;
    for _ in 0..count {
        if p + 8 > body.len() {
            return;
        }
        let id = u32le(&body, p) as u32;
        let n = u16le(&body, p + 6);
        if p + 8 + n + 28 > body.len() {
            return;
        }
        let nb = u32le(&body, p + 8 + n + 24);
        out.extend_from_slice(&body[p..p + 8 + n]);
        let (size, checks, blocks) = files.get(&id).cloned().unwrap_or_default();
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&xxh3_64(&checks).to_le_bytes());
        out.extend_from_slice(&body[p + 8 + n + 16..p + 8 + n + 24]);
        out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
        for (off, raw, len) in blocks {
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&raw.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        p += 8 + n + 28 + nb * 16;
    }
    let mut rec = a[r.start..r.start + 8].to_vec();
    rec.extend_from_slice(&(out.len() as u64).to_le_bytes());
    let s = xxh3_64(&rec) as u32;
    rec.extend_from_slice(&s.to_le_bytes());
    rec.extend_from_slice(&out);
    rec.extend_from_slice(&xxh3_64(&out).to_le_bytes());
    let tail = a.split_off(r.start + r.len);
    a.truncate(r.start);
    a.extend_from_slice(&rec);
    if tail.len() >= 32 {
        a.extend_from_slice(&tail[tail.len() - 32..]);
    } else {
        a.extend_from_slice(&tail);
    }
}

fn fix_trailer(a: &mut [u8], index_start: usize) {
    if a.len() < index_start + 32 {
        return;
    }
    let t = a.len() - 32;
    a[t..t + 8].copy_from_slice(b"CRIUZEND");
    a[t + 8..t + 16].copy_from_slice(&(index_start as u64).to_le_bytes());
    a[t + 16..t + 24].copy_from_slice(&((t - index_start) as u64).to_le_bytes());
    let c = xxh3_64(&a[t..t + 24]);
    a[t + 24..t + 32].copy_from_slice(&c.to_le_bytes());
}

/// Byte offsets of the index's block references: (entry file id, position
/// of the 16-byte reference in the archive).
fn index_refs(a: &[u8]) -> Vec<(u32, usize)> {
    let Some(r) = records(a).into_iter().find(|r| r.kind == b'I') else { return Vec::new() };
    let count = u32le(a, r.start + 4);
    let (body, end) = (r.start + 20, r.start + r.len - 8);
    let mut refs = Vec::new();
    let mut p = body;
    for _ in 0..count {
        if p + 8 > end {
            break;
        }
        let id = u32le(a, p) as u32;
        let n = u16le(a, p + 6);
        if p + 8 + n + 28 > end {
            break;
        }
        let nb = u32le(a, p + 8 + n + 24);
        let first = p + 8 + n + 28;
        for k in 0..nb {
            if first + k * 16 + 16 <= end {
                refs.push((id, first + k * 16));
            }
        }
        p = first + nb * 16;
    }
    refs
}

/// Applies one structured mutation; returns its name.
pub fn mutate(a: &mut Vec<u8>, other: &[u8], rng: &mut Rng) -> &'static str {
    let recs = records(a);
    let blocks: Vec<Rec> = recs.iter().copied().filter(|r| r.kind == b'B').collect();
    let pick = |rng: &mut Rng, v: &[Rec]| v.get(rng.below(v.len())).copied();
    match rng.below(14) {
        0 => {
            let n = 1 + rng.below(3);
            for _ in 0..n {
                let i = rng.below(a.len());
                a[i] ^= 1 << rng.below(8);
            }
            "flip"
        }
        1 => {
            let n = rng.below(a.len());
            a.truncate(n);
            "truncate"
        }
        2 | 3 => {
            // Swap two block records of equal length (same file or not).
            let (Some(x), Some(y)) = (pick(rng, &blocks), pick(rng, &blocks)) else { return "none" };
            if x.len == y.len && x.start != y.start {
                let bx = a[x.start..x.start + x.len].to_vec();
                let by = a[y.start..y.start + y.len].to_vec();
                a[x.start..x.start + x.len].copy_from_slice(&by);
                a[y.start..y.start + y.len].copy_from_slice(&bx);
                "swap-blocks"
            } else {
                // Swap unequal records by rebuilding the stream.
                let (x, y) = if x.start < y.start { (x, y) } else { (y, x) };
                if x.start == y.start {
                    return "none";
                }
                let mut out = a[..x.start].to_vec();
                out.extend_from_slice(&a[y.start..y.start + y.len]);
                out.extend_from_slice(&a[x.start + x.len..y.start]);
                out.extend_from_slice(&a[x.start..x.start + x.len]);
                out.extend_from_slice(&a[y.start + y.len..]);
                *a = out;
                "swap-unequal-blocks"
            }
        }
        4 => {
            // Duplicate a block record over another of the same length.
            let (Some(x), Some(y)) = (pick(rng, &blocks), pick(rng, &blocks)) else { return "none" };
            if x.len != y.len || x.start == y.start {
                return "none";
            }
            let bx = a[x.start..x.start + x.len].to_vec();
            a[y.start..y.start + y.len].copy_from_slice(&bx);
            "duplicate-block"
        }
        5 => {
            // Insert a copy of a record right after itself.
            let Some(x) = pick(rng, &recs) else { return "none" };
            let copy = a[x.start..x.start + x.len].to_vec();
            a.splice(x.start + x.len..x.start + x.len, copy);
            "insert-copy"
        }
        6 => {
            let Some(x) = pick(rng, &recs) else { return "none" };
            a.drain(x.start..x.start + x.len);
            "drop-record"
        }
        7 | 8 => {
            // Re-point an index reference at another block (of any file).
            let refs = index_refs(a);
            let (Some(&(_, at)), Some(y)) = (refs.get(rng.below(refs.len())), pick(rng, &blocks)) else {
                return "none";
            };
            a[at..at + 8].copy_from_slice(&(y.start as u64).to_le_bytes());
            if rng.below(2) == 0 {
                let raw = u32le(a, y.start + 8) as u32;
                a[at + 8..at + 12].copy_from_slice(&raw.to_le_bytes());
                a[at + 12..at + 16].copy_from_slice(&(y.len as u32).to_le_bytes());
            }
            "repoint-index"
        }
        9 => {
            // Swap two index references.
            let refs = index_refs(a);
            if refs.len() < 2 {
                return "none";
            }
            let (i, j) = (refs[rng.below(refs.len())].1, refs[rng.below(refs.len())].1);
            let ri = a[i..i + 16].to_vec();
            let rj = a[j..j + 16].to_vec();
            a[i..i + 16].copy_from_slice(&rj);
            a[j..j + 16].copy_from_slice(&ri);
            "swap-index-refs"
        }
        10 => {
            // A block of another archive in place of one of ours.
            let theirs: Vec<Rec> = records(other).into_iter().filter(|r| r.kind == b'B').collect();
            let (Some(x), Some(y)) = (pick(rng, &blocks), theirs.get(rng.below(theirs.len())).copied()) else {
                return "none";
            };
            let file_id = a[x.start + 4..x.start + 8].to_vec();
            a.splice(x.start..x.start + x.len, other[y.start..y.start + y.len].iter().copied());
            if rng.below(2) == 0 {
                a[x.start + 4..x.start + 8].copy_from_slice(&file_id);
            }
            "splice-foreign-block"
        }
        11 => {
            // Edit a field of a block header: file id, raw_len, stored_len, codec, flags.
            let Some(x) = pick(rng, &blocks) else { return "none" };
            let field = [4usize, 8, 12, 1, 2][rng.below(5)];
            let v = rng.next() as u8;
            a[x.start + field] = if rng.below(2) == 0 { a[x.start + field].wrapping_add(1) } else { v };
            "edit-block-field"
        }
        12 => {
            // Edit an E record or an F record field.
            let ends: Vec<Rec> = recs.iter().copied().filter(|r| matches!(r.kind, b'E' | b'F')).collect();
            let Some(x) = pick(rng, &ends) else { return "none" };
            let at = x.start + 1 + rng.below(x.len - 5);
            a[at] = a[at].wrapping_add(1 + rng.below(255) as u8);
            "edit-file-record"
        }
        _ => {
            // Random bytes inserted somewhere.
            let at = rng.below(a.len());
            let n = 1 + rng.below(64);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            a.splice(at..at, bytes);
            "insert-garbage"
        }
    }
}

/// What the readers made of one archive.
#[derive(Debug)]
pub struct Outcome {
    pub verify: Result<Files, Kind>,
    pub source: Result<Files, Kind>,
    pub piped: Result<Files, Kind>,
    pub inspect: Result<(), Kind>,
    pub unpack: Option<Result<Files, Kind>>,
}

#[derive(Default)]
struct Collect(BTreeMap<u32, (String, Vec<u8>)>);

impl SeqSink for Collect {
    fn begin(&mut self, id: u32, name: &str, _: FileKind) -> criuz::Result<()> {
        self.0.insert(id, (name.to_string(), Vec::new()));
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

/// Runs every reader on `bytes`.
pub fn run_readers(bytes: &[u8], unpack: bool) -> Outcome {
    let opts = Options { threads: 2, ..Options::default() };
    let kind = |e: criuz::Error| e.kind();
    let verify = {
        let mut c = Collect::default();
        read_sequential(std::io::Cursor::new(bytes.to_vec()), &opts, &mut c)
            .map(|_| c.0.into_values().collect::<Files>())
            .map_err(kind)
    };
    let source = Archive::from_store(Box::new(bytes.to_vec()), "fuzz".into()).and_then(|a| read_all(&a)).map_err(kind);
    let piped = Archive::from_reader(bytes, 1 << 30, "pipe").and_then(|a| read_all(&a)).map_err(kind);
    let inspect = criuz::offline::inspect(bytes).map(drop).map_err(kind);
    let unpack = unpack.then(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let dest = dir.path().join("out");
        let r = criuz::offline::unpack(
            std::io::Cursor::new(bytes.to_vec()),
            &dest,
            false,
            &opts,
            criuz::progress::Progress::hidden(),
        );
        match r {
            Ok(_) => {
                let mut files = Files::new();
                for e in std::fs::read_dir(&dest).expect("unpacked dir").flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    files.insert(name, std::fs::read(e.path()).expect("unpacked file"));
                }
                Ok(files)
            }
            Err(e) => {
                let left = std::fs::read_dir(&dest).map(|d| d.count()).unwrap_or(0);
                assert_eq!(left, 0, "a failed unpack left files behind");
                Err(e.kind())
            }
        }
    });
    Outcome { verify, source, piped, inspect, unpack }
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
    if let Some(u) = &o.unpack {
        if !same(u, &o.verify) {
            return Err(format!("unpack and verify disagree: {:?} vs {:?}", brief(u), brief(&o.verify)));
        }
    }
    if o.verify.is_ok() && o.inspect.is_err() {
        return Err("inspect rejects what verify accepts".into());
    }
    for r in [&o.verify, &o.source, &o.piped] {
        if let Err(k) = r {
            if *k != Kind::Archive {
                return Err(format!("a damaged archive gave a {k:?} error, not an archive error"));
            }
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

/// Seed archives made in memory: CRIU-like images in several block sizes
/// and codecs, with zero pages, raw and compressed blocks, empty files.
pub fn synthetic_seeds() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(7);
    let mut pages = Vec::new();
    for p in 0..40 {
        match p % 4 {
            0 => pages.extend_from_slice(&[0u8; 4096]),
            1 => pages.extend((0..4096).map(|_| rng.next() as u8)),
            _ => pages.extend((0..4096).map(|i| b"criuz page text "[(i + p) % 16])),
        }
    }
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("inventory.img", b"inventory".repeat(3)),
        ("pagemap-1.img", (0..700u32).flat_map(|i| i.to_le_bytes()).collect()),
        ("pages-1.img", pages.clone()),
        ("pages-2.img", pages[..3 * 4096 + 100].to_vec()),
        ("empty.img", Vec::new()),
    ];
    let mut seeds = Vec::new();
    for (block, codec) in [(4096, Codec::Lz4), (8192, Codec::Zstd), (16384, Codec::None), (65536, Codec::Lz4)] {
        let opts = Options {
            codec: CodecConfig::new(codec, None).expect("codec"),
            block_size: block,
            threads: 1,
            ..Options::default()
        };
        let buf = Arc::new(Mutex::new(Vec::new()));
        let packer = Packer::start(SharedVec(buf.clone()), &opts).expect("packer");
        for (name, data) in &files {
            let mut sink = packer.begin_file(name).expect("begin");
            sink.write(data).expect("write");
            sink.finish().expect("finish");
        }
        packer.finish().expect("pack");
        let bytes = buf.lock().unwrap().clone();
        seeds.push(bytes);
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
