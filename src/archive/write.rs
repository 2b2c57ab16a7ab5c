//! The archive writer: files written concurrently (CRIU streams several at
//! once) are cut into blocks, encoded on the worker pool and written in
//! submission order by one writer thread.
//!
//! Completion is explicit. [`Packer::finish`] writes the index and trailer;
//! [`Packer::abort`], an error, or dropping the packer writes neither, so a
//! reader (of a file, of a pipe, later of an upload) sees a truncated archive
//! and rejects it. The output sink decides what else to undo (a file's
//! temporary name is removed).

use super::dedup::DedupIndex;
use super::held::{HeldPipe, Spliced};
use super::slab::{Carver, SlabBuf};
use super::{Options, PackStats};
use crate::archive::records::ArchiveWriter;
use crate::codec::{EncodedBlock, Encoder, PageBuf};
use crate::engine::{self, Submitter};
use crate::error::{Error, Result};
use crate::format::{
    BlockHeader, EntryMeta, FileKind, Header, Index, KeyRecord, FLAG_IDS, FLAG_PARENT, FLAG_PLANES, FLAG_SEALED,
    FLAG_TABLE, FLAG_TREE,
};
use crate::progress::Meter;
use crate::seal::{keyring, ChainKey};
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

mod jobs;

use jobs::{cause, encode_job, write_results, BlockData, Failure, FileStart, PackJob};

/// Builds an archive from files written concurrently.
pub struct Packer {
    submitter: Option<Submitter<PackJob>>,
    /// Keeps the workers back while CRIU writes ([`Options::absorb_first`]).
    hold: Arc<engine::Hold>,
    meter: Arc<Meter>,
    aborted: Arc<AtomicBool>,
    failure: Failure,
    writer: Option<JoinHandle<Result<(PackStats, Index)>>>,
    /// The next file's key, which is also its file id: held while its Begin
    /// is submitted, so keys are submitted in order.
    next_key: Mutex<u64>,
    block_size: usize,
}

impl Packer {
    /// Starts writing an archive to `out`. With `dedup` (an incremental
    /// archive) or `opts.ids`, page images carry page ids and pages already
    /// stored in the parents or earlier in this archive become references.
    pub fn start<W: Write + Send + 'static>(out: W, opts: &Options, dedup: Option<Arc<DedupIndex>>) -> Result<Self> {
        Self::start_metered(out, opts, dedup, Meter::new())
    }

    /// [`start`](Self::start), counting into `meter` the bytes taken in and
    /// the bytes written, and when [`capture_done`](Self::capture_done) came.
    pub fn start_metered<W: Write + Send + 'static>(
        out: W,
        opts: &Options,
        dedup: Option<Arc<DedupIndex>>,
        meter: Arc<Meter>,
    ) -> Result<Self> {
        opts.validate()?;
        let codec = opts.codec;
        let chain_key = chain_key_for(opts, dedup.as_deref())?;
        let dedup = dedup
            .or_else(|| opts.ids.then(|| Arc::new(DedupIndex::keyed(Vec::new(), HashMap::new(), chain_key.clone()))));
        let mut header = Header::new(opts.block_size);
        // The block table lets a reader start from the index (a restore from
        // an object store starts before the object has arrived); it costs
        // about 60 bytes per block, a fortieth of a percent at 256 KiB.
        header.flags |= FLAG_TABLE;
        if opts.tree {
            header.flags |= FLAG_TREE;
        }
        if codec.may_use_planes() {
            header.flags |= FLAG_PLANES;
        }
        let chain = dedup.as_ref().map(|d| d.chain.clone()).unwrap_or_default();
        if dedup.is_some() {
            header.flags |= FLAG_IDS;
        }
        if let Some(parent) = chain.first() {
            header.flags |= FLAG_PARENT;
            header.parent_id = parent.archive_id;
        }
        // The key is derived from the finished header, which it binds.
        let sealing = match (&chain_key, &opts.seal) {
            (Some(ck), Some(recipients)) => {
                header.flags |= FLAG_SEALED;
                let record = KeyRecord { key_id: ck.id(), wrapped: recipients.wrap(ck)? };
                // This process may read back what it wrote (a recompress).
                keyring::remember(ck);
                Some((Arc::new(ck.archive(&header)), record))
            }
            _ => None,
        };
        let block_key = sealing.as_ref().map(|(k, _)| k.clone());
        let hold = if opts.absorb_first {
            engine::Hold::with_free(engine::free_while_capturing(opts.threads))
        } else {
            engine::Hold::released()
        };
        let backlog = hold.clone();
        // Results wait for the writer only up to the default budget: past
        // that, what CRIU has written waits as input, which held pages
        // make free (on 16 cores the codec outruns the disk on memory that
        // does not compress).
        let (submitter, collector) = engine::start_held(
            opts.threads,
            opts.window(),
            engine::results_ahead(opts.block_size, opts.threads),
            hold.clone(),
            move || (Encoder::new(codec), PageBuf::new()),
            move |(enc, taken): &mut (Encoder, PageBuf), job: PackJob| {
                encode_job(job, enc, taken, &backlog, dedup.as_deref(), block_key.as_deref())
            },
        );
        let aborted = Arc::new(AtomicBool::new(false));
        let stop = aborted.clone();
        let stored = meter.clone();
        let failure = Arc::new(OnceLock::new());
        let failed = failure.clone();
        let writer = std::thread::Builder::new()
            .name("criuz-writer".into())
            .spawn(move || -> Result<(PackStats, Index)> {
                let mut collector = collector;
                let w = ArchiveWriter::sealed(out, &header, &chain, sealing);
                let written = w.and_then(|w| write_results(w, &mut collector, &stop, &stored));
                // Set before the collector goes, so a submitter refused
                // from then on finds the cause (see `Failure`).
                if let Err(e) = &written {
                    let _ = failed.set(e.duplicate());
                }
                drop(collector);
                written
            })
            .map_err(|e| Error::thread_not_started("archive's writer", e))?;
        Ok(Packer {
            submitter: Some(submitter),
            hold,
            meter,
            aborted,
            failure,
            writer: Some(writer),
            next_key: Mutex::new(0),
            block_size: opts.block_size,
        })
    }

    /// Starts a file of CRIU's (its kind from its name); write its bytes in
    /// order through the returned sink.
    pub fn begin_file(&self, name: &str) -> Result<FileSink> {
        self.begin_entry(name, FileKind::for_name(name), None)
    }

    /// [`begin_file`](Self::begin_file) for a page image whose pages stay
    /// unwritten until the archive is finished (a stopped tree's private
    /// memory): [`FileSink::read_from`] holds its blocks by reference
    /// instead of copying them (see `held`).
    pub fn begin_file_held(&self, name: &str) -> Result<FileSink> {
        let mut sink = self.begin_file(name)?;
        sink.hold = sink.page_aware;
        Ok(sink)
    }

    /// Starts an entry of a tree archive ([`Options::tree`]) with its mode
    /// and mtime: a file, a directory (write nothing) or a link (write its
    /// target).
    pub fn begin_entry(&self, name: &str, kind: FileKind, meta: Option<EntryMeta>) -> Result<FileSink> {
        let sub = self.submitter.as_ref().expect("packer running").clone();
        let mut next = self.next_key.lock().unwrap();
        let key = *next;
        sub.submit(PackJob::Begin(FileStart { key, name: name.to_string(), kind, meta }))
            .map_err(|e| cause(&self.failure, e))?;
        *next += 1;
        drop(next);
        Ok(FileSink {
            sub,
            failure: self.failure.clone(),
            key,
            page_aware: kind == FileKind::Pages,
            carver: Carver::new(self.block_size),
            meter: self.meter.clone(),
            buf: SlabBuf::empty(),
            blocks: 0,
            hold: false,
            held: None,
        })
    }

    /// CRIU has written everything: compress the absorbed backlog with every
    /// worker, at the codec asked for.
    pub fn capture_done(&self) {
        self.meter.criu_done();
        self.hold.release();
    }

    /// Waits until every block submitted so far has gone to the output
    /// (handed to it, not synced): a commit point for a sender that drops
    /// its copy once told so. Fails with the writer's error if it has
    /// stopped.
    pub fn wait_written(&self) -> Result<()> {
        let m = &self.meter;
        while m.stored.load(Ordering::Relaxed) < m.taken.load(Ordering::Relaxed) {
            if self.writer.as_ref().is_none_or(|w| w.is_finished()) {
                return Err(cause(&self.failure, Error::Cancelled));
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        Ok(())
    }

    /// Waits for every file to be written; returns the stats and index. Fails
    /// if the writer failed (its error, not a generic one).
    pub fn finish(mut self) -> Result<(PackStats, Index)> {
        drop(self.submitter.take());
        self.writer.take().expect("writer").join().map_err(|_| Error::Cancelled)?
    }

    /// Stops after a failure elsewhere without writing the index or trailer,
    /// and returns the writer's own error if the failure started there.
    pub fn abort(mut self) -> Option<Error> {
        self.stop()
    }

    fn stop(&mut self) -> Option<Error> {
        self.aborted.store(true, Ordering::Relaxed);
        drop(self.submitter.take());
        match self.writer.take()?.join() {
            Ok(Err(e)) if !e.is_cancelled() => Some(e),
            _ => None,
        }
    }
}

impl Drop for Packer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Writes one file's bytes into a [`Packer`], cutting them into blocks.
pub struct FileSink {
    sub: Submitter<PackJob>,
    failure: Failure,
    key: u64,
    page_aware: bool,
    /// Where the block buffers come from (see `slab` for why not the heap).
    carver: Carver,
    meter: Arc<Meter>,
    buf: SlabBuf,
    /// Blocks submitted so far (the next block's index in its file).
    blocks: u32,
    /// Blocks are held by reference where they can be.
    hold: bool,
    /// The block being held.
    held: Option<HeldPipe>,
}

impl FileSink {
    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            if self.buf.capacity() == 0 {
                self.buf = self.carver.carve();
            }
            let n = self.buf.extend(data);
            data = &data[n..];
            if self.buf.len() == self.buf.capacity() {
                self.flush_block()?;
            }
        }
        Ok(())
    }

    /// Reads once from `fd` straight into the current block (no copy, no
    /// zero-filling); returns the bytes read, 0 at end of input.
    pub fn read_from(&mut self, fd: &impl std::os::fd::AsRawFd) -> std::io::Result<usize> {
        if self.hold && self.buf.is_empty() {
            if let Some(n) = self.hold_from(fd.as_raw_fd())? {
                return Ok(n);
            }
        }
        self.read_up_to(fd, usize::MAX)
    }

    /// Splices from `fd` into the block being held; `None` where this block
    /// must be copied instead: no pipe could be had (then no later block
    /// tries), or its slots ran out (what it held is copied out first).
    fn hold_from(&mut self, fd: std::os::fd::RawFd) -> std::io::Result<Option<usize>> {
        let block = self.carver.block();
        if self.held.is_none() {
            self.held = HeldPipe::new(block);
            if self.held.is_none() {
                self.hold = false;
                return Ok(None);
            }
        }
        let pipe = self.held.as_mut().expect("a held block");
        match pipe.splice_from(fd, block - pipe.len())? {
            Spliced::Bytes(n) => {
                if pipe.len() == block {
                    self.flush_held().map_err(|e| std::io::Error::other(e.to_string()))?;
                }
                Ok(Some(n))
            }
            Spliced::Full => {
                // What it holds goes into the block's buffer, which the
                // copying path then fills on.
                let pipe = self.held.take().expect("a held block");
                // (Nothing held yet and still no room: never try again.)
                self.hold &= !pipe.is_empty();
                self.buf = self.carver.carve();
                pipe.read_into(&mut self.buf)?;
                Ok(None)
            }
        }
    }

    fn flush_held(&mut self) -> Result<()> {
        let Some(mut pipe) = self.held.take() else { return Ok(()) };
        if pipe.is_empty() {
            return Ok(());
        }
        pipe.seal();
        self.submit_block(pipe.len(), BlockData::Held(pipe))
    }

    /// Submits the file's next block, of `len` bytes.
    fn submit_block(&mut self, len: usize, data: BlockData) -> Result<()> {
        self.meter.taken.fetch_add(len as u64, Ordering::Relaxed);
        let block = self.blocks;
        self.blocks += 1;
        self.submit(PackJob::Block { key: self.key, data, page_aware: self.page_aware, block })
    }

    /// As [`read_from`](Self::read_from), reading at most `limit` bytes
    /// (a message's body, not what follows it).
    pub fn read_up_to(&mut self, fd: &impl std::os::fd::AsRawFd, limit: usize) -> std::io::Result<usize> {
        if self.buf.capacity() == 0 {
            self.buf = self.carver.carve();
        }
        let (spare, room) = self.buf.spare();
        let room = room.min(limit);
        let n = loop {
            // SAFETY: read(2) writes at most `room` bytes at `spare`, the
            // buffer's unfilled capacity.
            let n = unsafe { libc::read(fd.as_raw_fd(), spare.cast(), room) };
            if n >= 0 {
                break n as usize;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        // SAFETY: the kernel initialised `n <= room` bytes at `spare`.
        unsafe { self.buf.filled(n) };
        if self.buf.len() == self.buf.capacity() {
            self.flush_block().map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(n)
    }

    /// Adds a block another writer encoded (its unsealed header, data
    /// check in the clear, and payload), as the file's next block. Only at
    /// a block boundary (nothing written since the last full block), and
    /// not in an archive with page ids (a block's ids come from its data).
    pub fn write_encoded(&mut self, header: BlockHeader, payload: Vec<u8>) -> Result<()> {
        if !self.buf.is_empty() || self.held.as_ref().is_some_and(|p| !p.is_empty()) || header.sealed {
            return Err(Error::Usage("an encoded block between block boundaries, or still sealed".into()));
        }
        self.meter.taken.fetch_add(u64::from(header.raw_len), Ordering::Relaxed);
        let block = self.blocks;
        self.blocks += 1;
        // An opened sealed block carries no payload check; this archive's does.
        let header = BlockHeader { payload_check: xxhash_rust::xxh3::xxh3_64(&payload) as u32, ..header };
        let encoded = EncodedBlock { header, payload, ids: None };
        self.submit(PackJob::Encoded { key: self.key, encoded, block })
    }

    pub fn pending_len(&self) -> usize {
        self.buf.len() + self.held.as_ref().map_or(0, HeldPipe::len)
    }

    fn flush_block(&mut self) -> Result<()> {
        let data = std::mem::replace(&mut self.buf, SlabBuf::empty());
        self.submit_block(data.len(), BlockData::Copied(data))
    }

    pub fn finish(mut self) -> Result<()> {
        self.flush_held()?;
        if !self.buf.is_empty() {
            self.flush_block()?;
        }
        self.submit(PackJob::End { key: self.key })
    }

    fn submit(&self, job: PackJob) -> Result<()> {
        self.sub.submit(job).map_err(|e| cause(&self.failure, e))
    }
}

/// The chain key of a new archive: none unless it is to be encrypted; its
/// parent's when it has an encrypted parent (their page ids must match),
/// else a fresh one. A child is encrypted exactly when its parent is.
fn chain_key_for(opts: &Options, dedup: Option<&DedupIndex>) -> Result<Option<ChainKey>> {
    let has_parent = dedup.is_some_and(|d| !d.chain.is_empty());
    let parent_key = dedup.and_then(|d| d.chain_key.clone());
    match (&opts.seal, parent_key) {
        (None, Some(_)) => Err(Error::Usage(
            "the parent is encrypted, so its child must be: give --recipient, --recipients-file or --passphrase-file"
                .into(),
        )),
        (Some(_), None) if has_parent => Err(Error::Usage(
            "the parent is not encrypted; an encrypted child of it could not share its page ids (encrypt a full dump first)"
                .into(),
        )),
        (Some(_), Some(k)) => Ok(Some(k)),
        (Some(_), None) => ChainKey::random().map(Some),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::{read_sequential, EntryStart, SeqSink};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    #[derive(Default)]
    struct Files(HashMap<u32, (String, Vec<u8>)>);

    impl SeqSink for Files {
        fn begin(&mut self, entry: &EntryStart) -> Result<()> {
            self.0.insert(entry.file_id, (entry.name.to_string(), Vec::new()));
            Ok(())
        }
        fn data(&mut self, file_id: u32, data: &[u8]) -> Result<()> {
            self.0.get_mut(&file_id).expect("begun").1.extend_from_slice(data);
            Ok(())
        }
        fn end(&mut self, _: u32, _: u64) -> Result<()> {
            Ok(())
        }
    }

    /// A held page image comes back byte for byte: blocks held whole,
    /// blocks whose pipe ran out of slots part held and part copied (the
    /// small pieces below are vmspliced, a slot each, never merged), and a
    /// last block held part full.
    #[test]
    fn held_blocks_keep_their_bytes_and_order_when_some_must_be_copied() {
        let block = 64 << 10;
        let opts = Options { block_size: block, ..Options::default() };
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let packer = Packer::start(tmp.reopen().unwrap(), &opts, None).unwrap();
        let mut sink = packer.begin_file_held("pages-1.img").unwrap();
        assert!(sink.hold);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        // Whole pages, then 200 pieces of 100 bytes, then whole pages again
        // and a last part block.
        let mut pieces: Vec<Vec<u8>> = (0..20).map(|_| (0..4096).map(|_| next()).collect()).collect();
        pieces.extend((0..200).map(|_| (0..100).map(|_| next()).collect::<Vec<u8>>()));
        pieces.extend((0..37).map(|_| (0..4096).map(|_| next()).collect::<Vec<u8>>()));
        let sent: Vec<u8> = pieces.concat();
        let pieces = Arc::new(pieces);
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both were just created and are ours alone.
        let (w, r) = unsafe { (OwnedFd::from_raw_fd(fds[1]), OwnedFd::from_raw_fd(fds[0])) };
        let writer = {
            let pieces = pieces.clone();
            std::thread::spawn(move || {
                for p in pieces.iter() {
                    let mut at = 0;
                    while at < p.len() {
                        let iov =
                            libc::iovec { iov_base: p[at..].as_ptr() as *mut libc::c_void, iov_len: p.len() - at };
                        // SAFETY: the pipe references `p`, which `pieces`
                        // keeps alive and unchanged until the test's end.
                        let n = unsafe { libc::vmsplice(w.as_raw_fd(), &iov, 1, 0) };
                        assert!(n > 0, "vmsplice: {}", std::io::Error::last_os_error());
                        at += n as usize;
                    }
                }
            })
        };
        while sink.read_from(&r).unwrap() > 0 {}
        writer.join().unwrap();
        let blocks = sink.blocks;
        sink.finish().unwrap();
        packer.finish().unwrap();
        let mut files = Files::default();
        read_sequential(std::fs::File::open(tmp.path()).unwrap(), &Options::default(), &mut files).unwrap();
        let (name, got) = files.0.values().next().unwrap();
        assert_eq!(name, "pages-1.img");
        assert_eq!(got.len(), sent.len());
        assert!(*got == sent, "the bytes came back otherwise");
        // Three whole blocks before `finish`, which adds the part one.
        assert_eq!(blocks as usize, sent.len() / block);
        drop(pieces);
    }

    /// A disk that fills under the writer: what is submitted afterwards
    /// (a file written once CRIU's pages are in) fails with the writer's
    /// own error, not with "cancelled", and `abort` returns it too.
    #[test]
    fn a_file_begun_after_the_writer_failed_gets_its_error() {
        struct Full(usize);
        impl Write for Full {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                if self.0 < buf.len() {
                    return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
                }
                self.0 -= buf.len();
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let opts = Options { block_size: 64 << 10, ..Options::default() };
        let packer = Packer::start(Full(100 << 10), &opts, None).unwrap();
        let mut sink = packer.begin_file("pages-1.img").unwrap();
        // The writer fails on one of these blocks; whether this sink sees it
        // depends on timing, so only what comes after is asserted.
        let _ = sink.write(&crate::archive::noise(1 << 20)).and_then(|()| sink.finish());
        packer.capture_done();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while packer.failure.get().is_none() {
            assert!(std::time::Instant::now() < deadline, "the writer never failed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let refused = packer.begin_file("stats-dump").and_then(|mut s| {
            s.write(b"stats")?;
            s.finish()
        });
        let e = refused.expect_err("a stopped writer refuses");
        assert!(!e.is_cancelled(), "{e}");
        assert!(e.to_string().contains("No space left on device"), "{e}");
        let first = packer.abort().expect("the writer's error");
        assert!(first.to_string().contains("No space left on device"), "{first}");
    }
}
