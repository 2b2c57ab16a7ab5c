//! Archive writing and reading on top of the format, codec and engine.
//!
//! [`Packer`] takes any number of concurrently written files (CRIU streams
//! several at once), cuts them into blocks, encodes the blocks on the worker
//! pool and writes records in submission order from one writer thread.
//! [`read_sequential`] decodes a whole archive (from a pipe or a file) on the
//! pool and hands every file's bytes, in order, to a [`SeqSink`].
//! [`IndexedArchive`] opens a seekable archive by its index for random access.

use crate::codec::{CodecConfig, Decoder, EncodedBlock, Encoder};
use crate::engine::{self, Submitter};
use crate::error::{Error, Result};
use crate::format::{
    decode_block_record, decode_index_record, decode_trailer, ArchiveWriter, BlockCodec, BlockHeader, BlockRef,
    FileEntry, FileKind, Header, Index, Record, SeqReader, HEADER_LEN, MAX_BLOCK, MIN_BLOCK, PAGE_SIZE, TRAILER_LEN,
};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub const DEFAULT_BLOCK_SIZE: usize = 256 << 10;

/// Settings shared by everything that writes or reads archives.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub codec: CodecConfig,
    pub block_size: usize,
    pub threads: usize,
    /// Bytes of block data allowed in flight in the engine.
    pub memory_budget: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            codec: CodecConfig::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            threads: engine::default_threads(),
            memory_budget: engine::DEFAULT_MEMORY_BUDGET,
        }
    }
}

impl Options {
    pub fn validate(&self) -> Result<()> {
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&self.block_size) || self.block_size % PAGE_SIZE != 0 {
            return Err(Error::Invalid(format!(
                "block size must be a multiple of 4K between 4K and 4M, got {}",
                self.block_size
            )));
        }
        if self.threads == 0 {
            return Err(Error::Invalid("thread count must be at least 1".into()));
        }
        Ok(())
    }

    fn window(&self) -> usize {
        engine::window_for(self.memory_budget, self.block_size, self.threads)
    }
}

/// What went into an archive.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PackStats {
    pub files: u64,
    pub raw_bytes: u64,
    pub archive_bytes: u64,
    pub zero_pages: u64,
    pub blocks: u64,
    pub blocks_raw: u64,
    pub blocks_lz4: u64,
    pub blocks_zstd: u64,
}

impl PackStats {
    fn add_block(&mut self, h: &BlockHeader) {
        self.blocks += 1;
        self.raw_bytes += u64::from(h.raw_len);
        self.zero_pages += h.zero_pages() as u64;
        match h.codec {
            BlockCodec::Raw => self.blocks_raw += 1,
            BlockCodec::Lz4 => self.blocks_lz4 += 1,
            BlockCodec::Zstd => self.blocks_zstd += 1,
        }
    }
}

enum PackJob {
    Begin { key: u64, name: String, kind: FileKind },
    Block { key: u64, data: Vec<u8>, page_aware: bool },
    End { key: u64 },
}

enum PackResult {
    Begin { key: u64, name: String, kind: FileKind },
    Block { key: u64, block: EncodedBlock },
    End { key: u64 },
}

/// Builds an archive from files written concurrently.
pub struct Packer {
    submitter: Option<Submitter<PackJob>>,
    writer: Option<JoinHandle<Result<(PackStats, Index)>>>,
    next_key: AtomicU64,
    block_size: usize,
}

impl Packer {
    pub fn start<W: Write + Send + 'static>(out: W, opts: &Options) -> Result<Self> {
        opts.validate()?;
        let codec = opts.codec;
        let (submitter, collector) = engine::start(
            opts.threads,
            opts.window(),
            move || Encoder::new(codec),
            |enc: &mut Encoder, job: PackJob| match job {
                PackJob::Begin { key, name, kind } => PackResult::Begin { key, name, kind },
                PackJob::Block { key, data, page_aware } => {
                    PackResult::Block { key, block: enc.encode(0, &data, page_aware) }
                }
                PackJob::End { key } => PackResult::End { key },
            },
        );
        let header = Header::new(opts.block_size);
        let writer = std::thread::Builder::new()
            .name("criuz-writer".into())
            .spawn(move || -> Result<(PackStats, Index)> {
                let mut w = ArchiveWriter::new(out, &header)?;
                let mut ids: HashMap<u64, u32> = HashMap::new();
                let mut stats = PackStats::default();
                for r in collector {
                    match r {
                        PackResult::Begin { key, name, kind } => {
                            ids.insert(key, w.begin_file(&name, kind)?);
                            stats.files += 1;
                        }
                        PackResult::Block { key, mut block } => {
                            block.header.file_id = ids[&key];
                            w.write_block(&block.header, &block.payload)?;
                            stats.add_block(&block.header);
                        }
                        PackResult::End { key } => w.end_file(ids.remove(&key).expect("file begun"))?,
                    }
                }
                let (mut out, index, len) = w.finish()?;
                out.flush()?;
                stats.archive_bytes = len;
                Ok((stats, index))
            })
            .expect("spawn writer thread");
        Ok(Packer {
            submitter: Some(submitter),
            writer: Some(writer),
            next_key: AtomicU64::new(0),
            block_size: opts.block_size,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Starts a file; write its bytes in order through the returned sink.
    pub fn begin_file(&self, name: &str) -> Result<FileSink> {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let kind = FileKind::for_name(name);
        let sub = self.submitter.as_ref().expect("packer running").clone();
        sub.submit(PackJob::Begin { key, name: name.to_string(), kind })?;
        Ok(FileSink { sub, key, page_aware: kind == FileKind::Pages, block_size: self.block_size, buf: Vec::new() })
    }

    /// Waits for every file to be written; returns the stats and index. Fails
    /// if the writer failed (its error, not a generic one).
    pub fn finish(mut self) -> Result<(PackStats, Index)> {
        drop(self.submitter.take());
        self.writer.take().expect("writer").join().map_err(|_| Error::Cancelled)?
    }

    /// Stops after a failure elsewhere and returns the writer's own error, if
    /// the failure started there.
    pub fn abort(mut self) -> Option<Error> {
        drop(self.submitter.take());
        match self.writer.take()?.join() {
            Ok(Err(e)) => Some(e),
            _ => None,
        }
    }
}

/// Writes one file's bytes into a [`Packer`], cutting them into blocks.
pub struct FileSink {
    sub: Submitter<PackJob>,
    key: u64,
    page_aware: bool,
    block_size: usize,
    buf: Vec<u8>,
}

impl FileSink {
    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(self.block_size);
            }
            let n = (self.block_size - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == self.block_size {
                self.flush_block()?;
            }
        }
        Ok(())
    }

    /// Reads once from `fd` straight into the current block (no copy, no
    /// zero-filling); returns the bytes read, 0 at end of input.
    pub fn read_from(&mut self, fd: &impl std::os::fd::AsRawFd) -> std::io::Result<usize> {
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(self.block_size);
        }
        let len = self.buf.len();
        let room = self.block_size - len;
        let n = loop {
            // SAFETY: read(2) writes at most `room` bytes into the spare
            // capacity after `len`, which the reserve above guarantees.
            let n = unsafe { libc::read(fd.as_raw_fd(), self.buf.as_mut_ptr().add(len).cast(), room) };
            if n >= 0 {
                break n as usize;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        // SAFETY: the kernel initialised `n` bytes after `len`.
        unsafe { self.buf.set_len(len + n) };
        if self.buf.len() == self.block_size {
            self.flush_block().map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(n)
    }

    pub fn pending_len(&self) -> usize {
        self.buf.len()
    }

    fn flush_block(&mut self) -> Result<()> {
        let data = std::mem::take(&mut self.buf);
        self.sub.submit(PackJob::Block { key: self.key, data, page_aware: self.page_aware })
    }

    pub fn finish(mut self) -> Result<()> {
        if !self.buf.is_empty() {
            self.flush_block()?;
        }
        self.sub.submit(PackJob::End { key: self.key })
    }
}

/// Receives a decoded archive in order.
pub trait SeqSink {
    fn begin(&mut self, file_id: u32, name: &str, kind: FileKind) -> Result<()>;
    fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()>;
    fn end(&mut self, file_id: u32, raw_size: u64) -> Result<()>;
}

enum ReadJob {
    Other(Record),
    Block { header: BlockHeader, payload: Vec<u8>, offset: u64, record_len: u64 },
}

enum ReadResult {
    Other(Record),
    Block { file_id: u32, offset: u64, record_len: u64, data_check: u64, data: std::result::Result<Vec<u8>, Error> },
}

/// Decodes a whole archive front to back on the worker pool, checking every
/// block, file and the index against what was read. Returns the index.
pub fn read_sequential<R: Read + Send + 'static>(inp: R, opts: &Options, sink: &mut dyn SeqSink) -> Result<Index> {
    let mut reader = SeqReader::new(inp)?;
    let block_size = (reader.header.block_size as usize).clamp(MIN_BLOCK, MAX_BLOCK);
    let window = engine::window_for(opts.memory_budget, block_size, opts.threads);
    let (sub, collector) =
        engine::start(opts.threads, window, Decoder::new, |dec: &mut Decoder, job: ReadJob| match job {
            ReadJob::Other(r) => ReadResult::Other(r),
            ReadJob::Block { header, payload, offset, record_len } => {
                let mut out = Vec::new();
                let data = dec.decode(&header, &payload, &mut out).map(|_| out).map_err(|e| Error::corrupt(offset, e));
                ReadResult::Block { file_id: header.file_id, offset, record_len, data_check: header.data_check, data }
            }
        });
    let producer = std::thread::spawn(move || -> Result<()> {
        while let Some(rec) = reader.next_record()? {
            let job = match rec {
                Record::Block { header, payload, offset, record_len } => {
                    ReadJob::Block { header, payload, offset, record_len }
                }
                other => ReadJob::Other(other),
            };
            sub.submit(job)?;
        }
        Ok(())
    });
    let consumed = consume_sequential(collector, sink);
    let produced = producer.join().map_err(|_| Error::Cancelled)?;
    match (produced, consumed) {
        (Err(Error::Cancelled), Err(e)) | (Ok(()), Err(e)) => Err(e),
        (Err(e), _) => Err(e),
        (Ok(()), Ok(Some(index))) => Ok(index),
        (Ok(()), Ok(None)) => Err(Error::Invalid("archive has no index".into())),
    }
}

struct SeenFile {
    name: String,
    kind: FileKind,
    raw_size: u64,
    check: xxhash_rust::xxh3::Xxh3,
    /// (record offset, raw length, record length) of each block, to compare with the index.
    blocks: Vec<(u64, u32, u64)>,
    record_offset: u64,
    ended: bool,
}

fn consume_sequential(collector: engine::Collector<ReadResult>, sink: &mut dyn SeqSink) -> Result<Option<Index>> {
    let mut files: Vec<SeenFile> = Vec::new();
    for r in collector {
        match r {
            ReadResult::Other(Record::FileBegin { file_id, name, kind, offset }) => {
                if file_id as usize != files.len() {
                    return Err(Error::corrupt(offset, format!("file id {file_id} out of sequence")));
                }
                sink.begin(file_id, &name, kind)?;
                files.push(SeenFile {
                    name,
                    kind,
                    raw_size: 0,
                    check: Default::default(),
                    blocks: Vec::new(),
                    record_offset: offset,
                    ended: false,
                });
            }
            ReadResult::Block { file_id, offset, record_len, data_check, data } => {
                let data = data?;
                let f = open_file(&mut files, file_id, offset)?;
                f.raw_size += data.len() as u64;
                f.check.update(&data_check.to_le_bytes());
                f.blocks.push((offset, data.len() as u32, record_len));
                sink.data(file_id, &data)?;
            }
            ReadResult::Other(Record::FileEnd { file_id, raw_size, file_check, offset }) => {
                let f = open_file(&mut files, file_id, offset)?;
                if f.raw_size != raw_size || f.check.digest() != file_check {
                    return Err(Error::corrupt(offset, format!("file {} does not match its end record", f.name)));
                }
                f.ended = true;
                sink.end(file_id, raw_size)?;
            }
            ReadResult::Other(Record::Index { index, offset }) => {
                check_index(&index, &files, offset)?;
                return Ok(Some(index));
            }
            ReadResult::Other(Record::Block { .. }) => unreachable!("blocks are decoded"),
        }
    }
    Ok(None)
}

fn open_file(files: &mut [SeenFile], file_id: u32, offset: u64) -> Result<&mut SeenFile> {
    match files.get_mut(file_id as usize) {
        Some(f) if !f.ended => Ok(f),
        _ => Err(Error::corrupt(offset, format!("record for unknown or ended file {file_id}"))),
    }
}

fn check_index(index: &Index, files: &[SeenFile], offset: u64) -> Result<()> {
    if index.files.len() != files.len() {
        return Err(Error::corrupt(offset, "index lists a different number of files than the archive holds"));
    }
    for (i, (e, f)) in index.files.iter().zip(files).enumerate() {
        let same = e.file_id as usize == i
            && e.name == f.name
            && e.kind == f.kind
            && e.raw_size == f.raw_size
            && e.file_check == f.check.digest()
            && e.record_offset == f.record_offset
            && f.ended
            && e.blocks.len() == f.blocks.len()
            && e.blocks.iter().zip(&f.blocks).all(|(b, s)| (b.offset, b.raw_len, u64::from(b.record_len)) == *s);
        if !same {
            return Err(Error::corrupt(offset, format!("index entry for {} does not match the archive", e.name)));
        }
    }
    Ok(())
}

/// A seekable archive opened through its index.
pub struct IndexedArchive {
    file: Arc<File>,
    path: PathBuf,
    pub header: Header,
    pub index: Index,
    pub len: u64,
}

impl IndexedArchive {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::file(path, e))?;
        Self::from_file(file, path)
    }

    pub fn from_file(file: File, path: &Path) -> Result<Self> {
        let len = file.metadata()?.len();
        let mut hb = [0u8; HEADER_LEN];
        if len < (HEADER_LEN + TRAILER_LEN) as u64 {
            let n = file.read_at(&mut hb, 0)?;
            if n >= 8 && hb[..8] != crate::format::MAGIC {
                return Err(Error::corrupt(0, "not a criuz archive (bad magic)"));
            }
            return Err(Error::corrupt(len, "truncated: archive is shorter than header and trailer"));
        }
        file.read_exact_at(&mut hb, 0)?;
        let header = Header::decode(&hb)?;
        let mut tb = [0u8; TRAILER_LEN];
        let tpos = len - TRAILER_LEN as u64;
        file.read_exact_at(&mut tb, tpos)?;
        let (ioff, ilen) = decode_trailer(&tb, tpos)?;
        if ioff < HEADER_LEN as u64 || ioff.checked_add(ilen) != Some(tpos) {
            return Err(Error::corrupt(tpos, "trailer points outside the archive"));
        }
        let mut rec = vec![0u8; ilen as usize];
        file.read_exact_at(&mut rec, ioff)?;
        let index = decode_index_record(&rec, ioff)?;
        for f in &index.files {
            for b in &f.blocks {
                if b.offset.checked_add(u64::from(b.record_len)).is_none_or(|end| end > ioff) {
                    return Err(Error::corrupt(ioff, format!("index entry for {} points outside the archive", f.name)));
                }
            }
        }
        Ok(IndexedArchive { file: Arc::new(file), path: path.to_path_buf(), header, index, len })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored bytes of one block record.
    pub fn read_record(&self, b: &BlockRef) -> Result<Vec<u8>> {
        self.read_at(b.offset, b.record_len as usize)
    }

    pub fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset).map_err(|e| Error::file(&self.path, e))?;
        Ok(buf)
    }

    /// A whole file, decoded and checked (for small files such as metadata).
    pub fn read_file(&self, entry: &FileEntry) -> Result<Vec<u8>> {
        let (mut dec, mut all, mut out) = (Decoder::new(), Vec::new(), Vec::new());
        for i in 0..entry.blocks.len() {
            self.read_block(entry, i, &mut dec, &mut out)?;
            all.extend_from_slice(&out);
        }
        Ok(all)
    }

    /// Reads and decodes one block into `out`.
    pub fn read_block(&self, entry: &FileEntry, i: usize, dec: &mut Decoder, out: &mut Vec<u8>) -> Result<()> {
        let b = entry.blocks[i];
        let rec = self.read_record(&b)?;
        let (header, payload) = decode_block_record(&rec, b.offset)?;
        if header.file_id != entry.file_id || header.raw_len != b.raw_len || header.raw_len > self.header.block_size {
            return Err(Error::corrupt(b.offset, format!("block does not belong to {} as the index says", entry.name)));
        }
        dec.decode(&header, payload, out).map_err(|e| Error::corrupt(b.offset, e))
    }

    /// Streams one file's decoded blocks, in order, decoding ahead on
    /// `threads` workers with at most `window` blocks in flight.
    pub fn stream_file(
        self: &Arc<Self>,
        entry: &FileEntry,
        threads: usize,
        window: usize,
    ) -> impl Iterator<Item = Result<Vec<u8>>> {
        let me = self.clone();
        let entry = Arc::new(entry.clone());
        let n = entry.blocks.len();
        let e2 = entry.clone();
        let (sub, collector) =
            engine::start(threads.min(n.max(1)), window, Decoder::new, move |dec: &mut Decoder, i: usize| {
                let mut out = Vec::new();
                me.read_block(&e2, i, dec, &mut out).map(|_| out)
            });
        std::thread::spawn(move || {
            for i in 0..n {
                if sub.submit(i).is_err() {
                    break;
                }
            }
        });
        collector
    }
}
