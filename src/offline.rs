//! Offline commands: pack a CRIU images directory, unpack an archive into
//! one, verify every checksum, and inspect what an archive holds.

use crate::archive::check::{Checked, CheckedRecords};
use crate::archive::records::StreamInput;
use crate::archive::{read_sequential, Options, PackStats, Packer, SeqSink};
use crate::error::{Error, IoContext, Result};
use crate::format::{check_entry_name, BlockCodec, FileKind};
use crate::io::sync_parent;
use crate::progress::Progress;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// (name, size) of each regular file of an images directory.
pub type ImageFiles = Vec<(String, u64)>;

/// Regular files of a CRIU images directory, sorted; other entries are skipped
/// (returned so the caller can say so).
pub fn image_files(dir: &Path) -> Result<(ImageFiles, Vec<String>)> {
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let meta = e.metadata().at(e.path())?;
        if meta.is_file() && check_entry_name(&name).is_ok() {
            files.push((name, meta.len()));
        } else {
            skipped.push(name);
        }
    }
    files.sort();
    skipped.sort();
    Ok((files, skipped))
}

/// Packs every regular file of `dir` into an archive written to `out`.
pub fn pack_dir<W: Write + Send + 'static>(
    dir: &Path,
    out: W,
    opts: &Options,
    progress: &mut Progress,
) -> Result<PackStats> {
    let (files, _) = image_files(dir)?;
    let packer = Packer::start(out, opts)?;
    let mut done = 0u64;
    let fed = (|| -> Result<()> {
        for (name, _) in &files {
            let path = dir.join(name);
            let f = File::open(&path).at(&path)?;
            let mut sink = packer.begin_file(name)?;
            loop {
                let n = sink.read_from(&f).at(&path)?;
                if n == 0 {
                    break;
                }
                done += n as u64;
                progress.set(done);
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

/// Writes decoded files into a private staging directory inside the target;
/// they are moved into place only once the whole archive has checked out.
struct DirSink {
    target: PathBuf,
    staging: PathBuf,
    force: bool,
    open: Vec<Option<(String, BufWriter<File>)>>,
    done: Vec<String>,
    bytes: u64,
    progress: Progress,
}

impl DirSink {
    fn existing(&self, name: &str) -> bool {
        self.target.join(name).symlink_metadata().is_ok()
    }
}

impl SeqSink for DirSink {
    fn begin(&mut self, file_id: u32, name: &str, _kind: FileKind) -> Result<()> {
        // The checked records already refuse such names; a path is built from
        // this one, so the rule is applied here once more.
        check_entry_name(name).map_err(|why| Error::corrupt(0, format!("refusing archive entry {name:?}: {why}")))?;
        if !self.force && self.existing(name) {
            return Err(Error::Exists(self.target.join(name)));
        }
        let path = self.staging.join(name);
        let f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).at(&path)?;
        let idx = file_id as usize;
        if self.open.len() <= idx {
            self.open.resize_with(idx + 1, || None);
        }
        self.open[idx] = Some((name.to_string(), BufWriter::with_capacity(1 << 20, f)));
        Ok(())
    }

    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()> {
        let (name, w) = self.open[file_id as usize].as_mut().expect("file begun");
        w.write_all(data).at(self.staging.join(&*name))?;
        self.bytes += data.len() as u64;
        self.progress.set(self.bytes);
        Ok(())
    }

    fn end(&mut self, file_id: u32, _raw_size: u64) -> Result<()> {
        let (name, w) = self.open[file_id as usize].take().expect("file begun");
        let path = self.staging.join(&name);
        let f = w.into_inner().map_err(|e| Error::file(&path, e.into_error()))?;
        f.sync_all().at(&path)?;
        self.done.push(name);
        Ok(())
    }
}

pub struct UnpackStats {
    pub files: usize,
    pub bytes: u64,
}

/// Unpacks an archive into `dir` (created if missing). Nothing appears in
/// `dir` unless the whole archive checks out.
pub fn unpack<R: Read + Send + 'static>(
    inp: R,
    dir: &Path,
    force: bool,
    opts: &Options,
    progress: Progress,
) -> Result<UnpackStats> {
    std::fs::create_dir_all(dir).at(dir)?;
    let staging = dir.join(format!(".criuz-unpack-{}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&staging).at(&staging)?;
    let mut sink = DirSink {
        target: dir.to_path_buf(),
        staging: staging.clone(),
        force,
        open: Vec::new(),
        done: Vec::new(),
        bytes: 0,
        progress,
    };
    let result = read_sequential(inp, opts, &mut sink).and_then(|_| {
        for name in &sink.done {
            if !force && sink.existing(name) {
                return Err(Error::Exists(dir.join(name)));
            }
            std::fs::rename(staging.join(name), dir.join(name)).at(dir.join(name))?;
        }
        sync_parent(&dir.join("x"));
        Ok(UnpackStats { files: sink.done.len(), bytes: sink.bytes })
    });
    sink.progress.finish();
    drop(sink.open);
    let _ = std::fs::remove_dir_all(&staging);
    result
}

struct CountSink {
    files: usize,
    bytes: u64,
    progress: Progress,
}

impl SeqSink for CountSink {
    fn begin(&mut self, _: u32, _: &str, _: FileKind) -> Result<()> {
        self.files += 1;
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

/// Decodes everything and checks every checksum; returns (files, raw bytes).
pub fn verify<R: Read + Send + 'static>(inp: R, opts: &Options, progress: Progress) -> Result<(usize, u64)> {
    let mut sink = CountSink { files: 0, bytes: 0, progress };
    read_sequential(inp, opts, &mut sink)?;
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
    pub blocks_raw: u64,
    pub blocks_lz4: u64,
    pub blocks_zstd: u64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct InspectReport {
    pub version: u16,
    pub block_size: u32,
    pub archive_id: String,
    pub archive_bytes: u64,
    pub files: Vec<FileReport>,
    pub total: FileReport,
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
    let mut r = CheckedRecords::new(StreamInput(inp), true)?;
    let mut rep = InspectReport {
        version: crate::format::VERSION,
        block_size: r.header().block_size,
        archive_id: r.header().archive_id.iter().map(|b| format!("{b:02x}")).collect(),
        ..Default::default()
    };
    let mut start = r.offset();
    while let Some((_, rec)) = r.next_record()? {
        let len = r.offset() - start;
        match rec {
            Checked::FileBegin { name, kind, .. } => {
                let kind = match kind {
                    FileKind::Pages => "pages",
                    FileKind::Plain => "plain",
                };
                rep.files.push(FileReport { name, kind: kind.into(), stored_bytes: len, ..Default::default() });
            }
            Checked::Block { header, .. } => {
                let f = &mut rep.files[header.file_id as usize];
                f.raw_bytes += u64::from(header.raw_len);
                f.stored_bytes += len;
                if !header.zero_bitmap.is_empty() {
                    f.pages += header.pages() as u64;
                    f.zero_pages += header.zero_pages() as u64;
                }
                match header.codec {
                    BlockCodec::Raw => f.blocks_raw += 1,
                    BlockCodec::Lz4 => f.blocks_lz4 += 1,
                    BlockCodec::Zstd => f.blocks_zstd += 1,
                }
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
        t.blocks_raw += f.blocks_raw;
        t.blocks_lz4 += f.blocks_lz4;
        t.blocks_zstd += f.blocks_zstd;
    }
    t.stored_bytes = rep.archive_bytes;
    t.ratio = ratio(t.stored_bytes, t.raw_bytes);
    rep.total = t;
    Ok(rep)
}
