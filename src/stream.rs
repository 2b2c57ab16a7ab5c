//! CRIU's image-streaming protocol (`criu dump --stream` / `criu restore
//! --stream`, CRIU >= 3.15; see criu/img-streamer.c).
//!
//! CRIU connects to `streamer-capture.sock` (dump) or `streamer-serve.sock`
//! (restore) in the images directory and, for every image file it opens, sends
//! a length-prefixed `img_streamer_request_entry` (u32 native-endian length,
//! then the protobuf). On restore we answer with `img_streamer_reply_entry`
//! (does the file exist?). Then CRIU passes one end of a fresh pipe with
//! SCM_RIGHTS (plus one dummy byte) and reads or writes the file through it.
//! CRIU may hold several files open at once, so every file gets its own
//! thread; the socket closing means no more files will be opened.
//!
//! Capture feeds each pipe into the [`Packer`]. Serve answers from an
//! [`ArchiveSource`]: a seekable archive through its index (any file, any
//! order, any number of times, bounded memory) or an archive read from a pipe,
//! whose compressed records are buffered up to a cap.

use crate::archive::{IndexedArchive, Packer};
use crate::codec::Decoder;
use crate::engine;
use crate::error::{Error, Result};
use crate::format::{
    decode_block_header, decode_block_record, max_block_header_len, BlockCodec, BlockHeader, FileEntry, FileKind,
    Record, SeqReader, PAGE_SIZE,
};
use crate::images::{self, ZeroPlan};
use prost::Message;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub const CAPTURE_SOCKET: &str = "streamer-capture.sock";
pub const SERVE_SOCKET: &str = "streamer-serve.sock";

/// Pipe buffer we ask for: fewer wake-ups than the default 64 KiB. 1 MiB is
/// the unprivileged maximum by default (/proc/sys/fs/pipe-max-size).
const PIPE_SIZE: i32 = 1 << 20;

/// Our own minimal copies of CRIU's images/img-streamer.proto messages.
#[derive(Clone, PartialEq, Message)]
struct ImgStreamerRequestEntry {
    #[prost(string, required, tag = "1")]
    filename: String,
}

#[derive(Clone, PartialEq, Message)]
struct ImgStreamerReplyEntry {
    #[prost(bool, required, tag = "1")]
    exists: bool,
}

/// A listening streamer socket, created 0600 and removed on drop.
pub struct Listener {
    sock: UnixListener,
    path: PathBuf,
}

impl Listener {
    pub fn bind(dir: &Path, name: &str) -> Result<Self> {
        let path = dir.join(name);
        // The umask makes the socket private from the moment it exists.
        // SAFETY: umask only swaps the process file-mode mask.
        let old = unsafe { libc::umask(0o177) };
        let sock = UnixListener::bind(&path);
        // SAFETY: restoring the previous mask.
        unsafe { libc::umask(old) };
        let sock = sock.map_err(|e| Error::file(&path, e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| Error::file(&path, e))?;
        sock.set_nonblocking(true)?;
        Ok(Listener { sock, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for CRIU to connect; `None` if `stop` is set first.
    pub fn accept(&self, stop: &AtomicBool) -> Result<Option<UnixStream>> {
        loop {
            match self.sock.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    return Ok(Some(s));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Error::file(&self.path, e)),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reads one request; `None` when CRIU has closed the connection.
fn read_request(sock: &mut UnixStream) -> Result<Option<String>> {
    let mut len = [0u8; 4];
    let got = crate::format::read_full(sock, &mut len)?;
    if got == 0 {
        return Ok(None);
    }
    if got < 4 {
        return Err(Error::Protocol("connection closed inside a request".into()));
    }
    let len = u32::from_ne_bytes(len) as usize;
    if len > 64 << 10 {
        return Err(Error::Protocol(format!("request of {len} bytes is not a file request")));
    }
    let mut buf = vec![0u8; len];
    if crate::format::read_full(sock, &mut buf)? < len {
        return Err(Error::Protocol("connection closed inside a request".into()));
    }
    let req = ImgStreamerRequestEntry::decode(&buf[..]).map_err(|e| Error::Protocol(format!("bad request: {e}")))?;
    Ok(Some(req.filename))
}

fn send_reply(sock: &mut UnixStream, exists: bool) -> Result<()> {
    let body = ImgStreamerReplyEntry { exists }.encode_to_vec();
    let mut msg = (body.len() as u32).to_ne_bytes().to_vec();
    msg.extend_from_slice(&body);
    sock.write_all(&msg)?;
    Ok(())
}

/// Receives the pipe end CRIU passes (one dummy byte carries it).
fn recv_fd(sock: &UnixStream) -> Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(RawFd);
    let msg = nix::sys::socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(|e| Error::Protocol(format!("receiving the pipe from CRIU: {e}")))?;
    if msg.bytes == 0 {
        return Err(Error::Protocol("connection closed before CRIU passed the pipe".into()));
    }
    for c in msg.cmsgs().map_err(|e| Error::Protocol(format!("bad control message: {e}")))? {
        if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel just installed this descriptor for us.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                for &extra in &fds[1..] {
                    // SAFETY: likewise; we did not ask for them.
                    drop(unsafe { OwnedFd::from_raw_fd(extra) });
                }
                return Ok(owned);
            }
        }
    }
    Err(Error::Protocol("CRIU sent no pipe with its request".into()))
}

fn grow_pipe(fd: &OwnedFd) {
    // SAFETY: fcntl on a descriptor we own; failure just keeps the default size.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
}

/// What a capture received.
#[derive(Debug, Default, Clone)]
pub struct CaptureReport {
    pub files: Vec<String>,
}

/// Receives CRIU's images on `listener` and writes them into `packer` until
/// CRIU closes the connection. Returns `None` if `stop` was set before CRIU
/// connected.
pub fn capture(listener: &Listener, packer: &Packer, stop: &AtomicBool) -> Result<Option<CaptureReport>> {
    let Some(mut sock) = listener.accept(stop)? else { return Ok(None) };
    let mut report = CaptureReport::default();
    let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
    let mut readers = Vec::new();
    let result = (|| -> Result<()> {
        while let Some(name) = read_request(&mut sock)? {
            let fd = recv_fd(&sock)?;
            grow_pipe(&fd);
            let mut sink = packer.begin_file(&name)?;
            report.files.push(name.clone());
            let failed = failed.clone();
            readers.push(std::thread::spawn(move || {
                let r = (|| -> Result<()> {
                    while sink.read_from(&fd).map_err(|e| Error::Protocol(format!("reading {name} from CRIU: {e}")))?
                        > 0
                    {}
                    sink.finish()
                })();
                if let Err(e) = r {
                    failed.lock().unwrap().get_or_insert(e);
                }
            }));
        }
        Ok(())
    })();
    for r in readers {
        let _ = r.join();
    }
    result?;
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(e);
    }
    Ok(Some(report))
}

/// Where served files come from.
pub trait ArchiveSource: Send + Sync {
    /// The file's blocks, or `None` if the archive has no such file. May wait
    /// for a streamed archive to reach the file.
    fn open(&self, name: &str) -> Result<Option<Arc<dyn FileBlocks>>>;
}

/// One stored block: its record bytes, where it is in the archive, and the
/// position of its first byte in the file.
#[derive(Clone)]
pub struct StoredBlock {
    pub record: Vec<u8>,
    pub offset: u64,
    pub raw_pos: u64,
}

/// The blocks of one file, fetched by position (possibly waiting for them).
pub trait FileBlocks: Send + Sync {
    fn kind(&self) -> FileKind;
    /// Block `i`, or `None` past the end.
    fn block(&self, i: usize) -> Result<Option<StoredBlock>>;
    /// Only the header of block `i` and its first byte's position (cheap).
    fn header(&self, i: usize) -> Result<Option<(BlockHeader, u64)>> {
        let Some(b) = self.block(i)? else { return Ok(None) };
        Ok(Some((decode_block_header(&b.record, b.offset)?.0, b.raw_pos)))
    }
}

impl ArchiveSource for Arc<IndexedArchive> {
    fn open(&self, name: &str) -> Result<Option<Arc<dyn FileBlocks>>> {
        Ok(self.index.find(name).cloned().map(|entry| {
            let mut pos = 0;
            let raw_pos = entry
                .blocks
                .iter()
                .map(|b| {
                    let p = pos;
                    pos += u64::from(b.raw_len);
                    p
                })
                .collect();
            Arc::new(IndexedFile { arc: self.clone(), entry, raw_pos }) as _
        }))
    }
}

struct IndexedFile {
    arc: Arc<IndexedArchive>,
    entry: FileEntry,
    raw_pos: Vec<u64>,
}

impl FileBlocks for IndexedFile {
    fn kind(&self) -> FileKind {
        self.entry.kind
    }
    fn block(&self, i: usize) -> Result<Option<StoredBlock>> {
        let Some(b) = self.entry.blocks.get(i) else { return Ok(None) };
        Ok(Some(StoredBlock { record: self.arc.read_record(b)?, offset: b.offset, raw_pos: self.raw_pos[i] }))
    }
    fn header(&self, i: usize) -> Result<Option<(BlockHeader, u64)>> {
        let Some(b) = self.entry.blocks.get(i) else { return Ok(None) };
        let len = max_block_header_len(b.raw_len).min(b.record_len as usize);
        let prefix = self.arc.read_at(b.offset, len)?;
        Ok(Some((decode_block_header(&prefix, b.offset)?.0, self.raw_pos[i])))
    }
}

/// An archive arriving through a pipe: records are kept (compressed) as they
/// arrive, up to `cap` bytes, so files can be served in any order.
pub struct PipeSource {
    state: Arc<(Mutex<PipeState>, Condvar)>,
}

#[derive(Default)]
struct PipeState {
    files: HashMap<String, Arc<PipeFile>>,
    by_id: Vec<Arc<PipeFile>>,
    done: bool,
    error: Option<String>,
    buffered: u64,
}

struct PipeFile {
    kind: FileKind,
    /// Blocks so far, whether the file has ended, and its size so far.
    blocks: Mutex<(Vec<StoredBlock>, bool, u64)>,
    state: std::sync::Weak<(Mutex<PipeState>, Condvar)>,
}

impl PipeSource {
    pub fn start<R: Read + Send + 'static>(inp: R, cap: u64, label: String) -> Result<Self> {
        let mut reader = SeqReader::new(inp)?;
        let state: Arc<(Mutex<PipeState>, Condvar)> = Arc::default();
        let st = state.clone();
        std::thread::spawn(move || {
            let r = (|| -> Result<()> {
                while let Some(rec) = reader.next_record()? {
                    let (lock, cv) = &*st;
                    let mut s = lock.lock().unwrap();
                    match rec {
                        Record::FileBegin { name, kind, .. } => {
                            let f = Arc::new(PipeFile {
                                kind,
                                blocks: Mutex::new((Vec::new(), false, 0)),
                                state: Arc::downgrade(&st),
                            });
                            s.files.insert(name, f.clone());
                            s.by_id.push(f);
                        }
                        Record::Block { header, payload, offset, .. } => {
                            s.buffered += payload.len() as u64;
                            if s.buffered > cap {
                                return Err(Error::Invalid(format!(
                                    "{label}: more than {cap} bytes of the archive arrived before CRIU asked for them \
                                     (raise --pipe-buffer, or serve from a file)"
                                )));
                            }
                            let f = s.by_id.get(header.file_id as usize).ok_or_else(|| {
                                Error::corrupt(offset, format!("block for unknown file {}", header.file_id))
                            })?;
                            let record = crate::format::encode_block_record(&header, &payload);
                            let mut b = f.blocks.lock().unwrap();
                            let raw_pos = b.2;
                            b.2 += u64::from(header.raw_len);
                            b.0.push(StoredBlock { record, offset, raw_pos });
                        }
                        Record::FileEnd { file_id, offset, .. } => {
                            let f = s
                                .by_id
                                .get(file_id as usize)
                                .ok_or_else(|| Error::corrupt(offset, format!("end of unknown file {file_id}")))?;
                            f.blocks.lock().unwrap().1 = true;
                        }
                        Record::Index { .. } => {}
                    }
                    cv.notify_all();
                }
                Ok(())
            })();
            let (lock, cv) = &*st;
            let mut s = lock.lock().unwrap();
            s.done = true;
            if let Err(e) = r {
                s.error = Some(format!("{label}: {e}"));
            }
            cv.notify_all();
        });
        Ok(PipeSource { state })
    }
}

impl ArchiveSource for PipeSource {
    fn open(&self, name: &str) -> Result<Option<Arc<dyn FileBlocks>>> {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        loop {
            if let Some(f) = s.files.get(name) {
                return Ok(Some(f.clone() as Arc<dyn FileBlocks>));
            }
            if let Some(e) = &s.error {
                return Err(Error::Invalid(e.clone()));
            }
            if s.done {
                return Ok(None);
            }
            s = cv.wait(s).unwrap();
        }
    }
}

impl FileBlocks for PipeFile {
    fn kind(&self) -> FileKind {
        self.kind
    }
    fn block(&self, i: usize) -> Result<Option<StoredBlock>> {
        let Some(state) = self.state.upgrade() else { return Ok(None) };
        let (lock, cv) = &*state;
        let mut s = lock.lock().unwrap();
        loop {
            {
                let b = self.blocks.lock().unwrap();
                if let Some(r) = b.0.get(i) {
                    return Ok(Some(r.clone()));
                }
                if b.1 {
                    return Ok(None);
                }
            }
            if let Some(e) = &s.error {
                return Err(Error::Invalid(e.clone()));
            }
            if s.done {
                return Err(Error::Invalid("archive ended inside a file".into()));
            }
            s = cv.wait(s).unwrap();
        }
    }
}

/// What to serve: a seekable archive through its index, or `-` for an
/// archive arriving on standard input (buffered up to `pipe_cap` bytes).
/// Returns it with the block size to plan read-ahead for.
pub fn open_source(input: &Path, pipe_cap: u64, default_block: usize) -> Result<(Arc<dyn ArchiveSource>, usize)> {
    if input == Path::new("-") {
        let stdin = std::io::BufReader::with_capacity(1 << 20, std::io::stdin());
        return Ok((Arc::new(PipeSource::start(stdin, pipe_cap, "stdin".into())?), default_block));
    }
    let arc = IndexedArchive::open(input).map_err(|e| match e {
        Error::File { .. } => e,
        other => Error::Invalid(format!("{}: {other}", input.display())),
    })?;
    let block_size = arc.header.block_size as usize;
    Ok((Arc::new(Arc::new(arc)), block_size))
}

/// Settings for serving.
#[derive(Clone, Copy, Debug)]
pub struct ServeOptions {
    pub threads: usize,
    /// Decoded bytes each file may prefetch ahead of CRIU.
    pub prefetch_bytes: usize,
    pub block_size: usize,
    /// Leave zero pages of private anonymous memory out of what CRIU reads
    /// (see [`crate::images`]).
    pub skip_zero_pages: bool,
}

#[derive(Debug, Default)]
pub struct ServeReport {
    pub served: Vec<String>,
    pub missing: Vec<String>,
    pub bytes: u64,
    pub zero_pages_skipped: u64,
}

/// Answers CRIU's requests from `source` until CRIU closes the connection.
/// Returns `None` if `stop` was set before CRIU connected. A damaged block
/// fails the whole serve: the connection is shut so CRIU aborts the restore.
pub fn serve(
    listener: &Listener,
    source: Arc<dyn ArchiveSource>,
    opts: ServeOptions,
    stop: &AtomicBool,
) -> Result<Option<ServeReport>> {
    let Some(mut sock) = listener.accept(stop)? else { return Ok(None) };
    let mut report = ServeReport::default();
    let mut plans: HashMap<u32, Arc<ZeroPlan>> = HashMap::new();
    let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    let result = (|| -> Result<()> {
        while let Some(name) = read_request(&mut sock)? {
            if let Some(e) = failed.lock().unwrap().take() {
                return Err(e);
            }
            let Some(file) = source.open(&name)? else {
                send_reply(&mut sock, false)?;
                report.missing.push(name);
                continue;
            };
            // Metadata is decoded and checked whole before CRIU sees a byte: a
            // protobuf image cut short could otherwise parse as a shorter, valid
            // one. Page images stream; CRIU reads them by exact length, so a
            // pipe closed early on a bad block makes it fail.
            let mut whole = match file.kind() {
                FileKind::Plain => Some(decode_whole(&*file)?),
                FileKind::Pages => None,
            };
            let mut plan = None;
            if opts.skip_zero_pages {
                if let (Some(pid), Some(pagemap)) = (images::process_pagemap_pid(&name), whole.as_ref()) {
                    if let Some(p) = zero_plan(&*source, pid, pagemap)? {
                        whole = Some(p.pagemap.clone());
                        plans.insert(p.pages_id, Arc::new(p));
                    }
                }
                if let Some(id) = images::pages_image_id(&name) {
                    plan = plans.get(&id).cloned();
                    if let Some(p) = &plan {
                        report.zero_pages_skipped += p.skipped_pages;
                    }
                }
            }
            send_reply(&mut sock, true)?;
            let fd = recv_fd(&sock)?;
            grow_pipe(&fd);
            report.served.push(name.clone());
            let (failed, bytes) = (failed.clone(), bytes.clone());
            let shutdown = sock.try_clone()?;
            writers.push(std::thread::spawn(move || {
                let mut pipe = std::fs::File::from(fd);
                let r = match whole {
                    Some(data) => write_pipe(&mut pipe, &data).map(|_| data.len() as u64),
                    None => stream_pages(file, pipe, opts, plan),
                };
                match r {
                    Ok(n) => {
                        bytes.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let _ = shutdown.shutdown(std::net::Shutdown::Both);
                        failed.lock().unwrap().get_or_insert(Error::Invalid(format!("serving {name}: {e}")));
                    }
                }
            }));
        }
        Ok(())
    })();
    for w in writers {
        let _ = w.join();
    }
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(e);
    }
    result?;
    report.bytes = bytes.load(Ordering::Relaxed);
    Ok(Some(report))
}

fn decode_whole(file: &dyn FileBlocks) -> Result<Vec<u8>> {
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    let mut block = Vec::new();
    let mut i = 0;
    while let Some(b) = file.block(i)? {
        let (header, payload) = decode_block_record(&b.record, b.offset)?;
        dec.decode(&header, payload, &mut block).map_err(|e| Error::corrupt(b.offset, e))?;
        out.extend_from_slice(&block);
        i += 1;
    }
    Ok(out)
}

/// Writes to CRIU's pipe. CRIU closing its end early is its own business.
fn write_pipe(pipe: &mut std::fs::File, data: &[u8]) -> Result<bool> {
    match pipe.write_all(data) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Bytes to send: a range of a buffer (a whole decoded block, or the payload
/// of a raw block still inside its record, which saves a copy).
struct Chunk {
    buf: Vec<u8>,
    range: std::ops::Range<usize>,
}

impl Chunk {
    fn whole(buf: Vec<u8>) -> Self {
        Chunk { range: 0..buf.len(), buf }
    }
}

/// Hands buffers to CRIU's pipe with vmsplice: the pipe references our pages
/// instead of copying them, which halves the memory traffic of a restore and
/// keeps the pipe's lock held only briefly (with plain writes, CRIU's reads
/// spun on that lock while we copied). The pipe reads our memory later, so a
/// buffer is kept until the reader has consumed past it (bytes handed over
/// minus FIONREAD), and `finish` waits for the pipe to drain.
struct SplicePipe {
    pipe: std::fs::File,
    handed: u64,
    in_flight: std::collections::VecDeque<(u64, Vec<u8>)>,
    closed: bool,
}

impl SplicePipe {
    fn new(pipe: std::fs::File) -> Self {
        SplicePipe { pipe, handed: 0, in_flight: Default::default(), closed: false }
    }

    fn unread(&self) -> std::io::Result<u64> {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer we pass.
        if unsafe { libc::ioctl(self.pipe.as_raw_fd(), libc::FIONREAD, &mut n) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n.max(0) as u64)
    }

    fn release_consumed(&mut self) -> std::io::Result<()> {
        let consumed = self.handed - self.unread()?;
        while self.in_flight.front().is_some_and(|(end, _)| *end <= consumed) {
            self.in_flight.pop_front();
        }
        Ok(())
    }

    /// Returns false once CRIU has closed its end (it wants no more).
    fn send(&mut self, chunk: Chunk) -> Result<bool> {
        if self.closed {
            return Ok(false);
        }
        let bytes = &chunk.buf[chunk.range.clone()];
        let mut off = 0;
        while off < bytes.len() {
            let iov = libc::iovec { iov_base: bytes[off..].as_ptr() as *mut libc::c_void, iov_len: bytes.len() - off };
            // SAFETY: the iovec points into `buf`, which we keep (in_flight)
            // unchanged until the reader has consumed it.
            let n = unsafe { libc::vmsplice(self.pipe.as_raw_fd(), &iov, 1, 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EPIPE) => {
                        self.closed = true;
                        return Ok(false);
                    }
                    _ => return Err(e.into()),
                }
            }
            off += n as usize;
        }
        self.handed += bytes.len() as u64;
        self.in_flight.push_back((self.handed, chunk.buf));
        self.release_consumed()?;
        Ok(true)
    }

    /// Waits until CRIU has read everything (or closed the pipe), so no
    /// buffer is freed while the pipe still refers to it.
    fn finish(mut self) -> Result<()> {
        while !self.closed && !self.in_flight.is_empty() {
            let mut pfd = libc::pollfd { fd: self.pipe.as_raw_fd(), events: 0, revents: 0 };
            // SAFETY: one pollfd of ours; a 1 ms timeout paces the loop.
            unsafe { libc::poll(&mut pfd, 1, 1) };
            if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                // The reader is gone: the pipe dropped its references.
                self.closed = true;
                break;
            }
            self.release_consumed()?;
        }
        Ok(())
    }
}

/// Plans the zero-page rewrite for process `pid`: needs its mm image and the
/// block headers of the pages image its pagemap names.
fn zero_plan(source: &dyn ArchiveSource, pid: &str, pagemap: &[u8]) -> Result<Option<ZeroPlan>> {
    let Some(pages_id) = images::pagemap_pages_id(pagemap) else { return Ok(None) };
    let (Some(mm), Some(pages)) =
        (source.open(&format!("mm-{pid}.img"))?, source.open(&format!("pages-{pages_id}.img"))?)
    else {
        return Ok(None);
    };
    if pages.kind() != FileKind::Pages {
        return Ok(None);
    }
    let mm = decode_whole(&*mm)?;
    let mut zero: Vec<u64> = Vec::new();
    let mut i = 0;
    while let Some((h, raw_pos)) = pages.header(i)? {
        if raw_pos % PAGE_SIZE as u64 != 0 {
            return Ok(None);
        }
        let first = raw_pos / PAGE_SIZE as u64;
        for p in 0..h.pages() {
            if h.is_zero_page(p) {
                let page = first + p as u64;
                let w = (page / 64) as usize;
                if zero.len() <= w {
                    zero.resize(w + 1, 0);
                }
                zero[w] |= 1 << (page % 64);
            }
        }
        i += 1;
    }
    let is_zero = |p: u64| zero.get((p / 64) as usize).is_some_and(|w| w & (1 << (p % 64)) != 0);
    Ok(images::plan(&mm, pagemap, &is_zero))
}

/// Streams a page image, decoding ahead of CRIU on the worker pool. With a
/// plan, the zero pages it skips are left out.
fn stream_pages(
    file: Arc<dyn FileBlocks>,
    pipe: std::fs::File,
    opts: ServeOptions,
    plan: Option<Arc<ZeroPlan>>,
) -> Result<u64> {
    let window = (opts.prefetch_bytes / opts.block_size.max(PAGE_SIZE)).max(2 * opts.threads).max(2);
    let f2 = file.clone();
    let (sub, results) = engine::start(opts.threads, window, Decoder::new, move |dec: &mut Decoder, i: usize| {
        let Some(b) = f2.block(i)? else { return Ok(None) };
        let (header, payload) = decode_block_record(&b.record, b.offset)?;
        let first = b.raw_pos / PAGE_SIZE as u64;
        let omit = |p: usize| plan.as_ref().is_some_and(|pl| pl.is_skipped(first + p as u64));
        let zeros = header.zero_pages();
        let stored_is_output =
            zeros == 0 || (0..header.pages()).filter(|&p| header.is_zero_page(p) && omit(p)).count() == zeros;
        if stored_is_output && header.codec == BlockCodec::Raw {
            // The payload is the output: check it and hand the record over as is.
            dec.check_raw(&header, payload).map_err(|e| Error::corrupt(b.offset, e))?;
            let start = b.record.len() - payload.len();
            return Ok(Some(Chunk { range: start..b.record.len(), buf: b.record }));
        }
        let mut stored = Vec::new();
        dec.decode_stored(&header, payload, &mut stored).map_err(|e| Error::corrupt(b.offset, e))?;
        if stored_is_output {
            return Ok(Some(Chunk::whole(stored)));
        }
        let mut out = Vec::new();
        crate::codec::scatter(&header, &stored, &omit, &mut out);
        Ok(Some(Chunk::whole(out)))
    });
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    std::thread::spawn(move || {
        let mut i = 0;
        while !stop2.load(Ordering::Relaxed) && sub.submit(i).is_ok() {
            i += 1;
        }
    });
    let mut written = 0u64;
    let mut result = Ok(());
    let mut out = SplicePipe::new(pipe);
    for r in results {
        match r {
            Ok(Some(data)) => {
                let len = data.range.len() as u64;
                match out.send(data) {
                    Ok(true) => written += len,
                    Ok(false) => break,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            Ok(None) => break,
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let drained = out.finish();
    result.and(drained).map(|_| written)
}
