//! The reading side of [`super`]: a [`Download`] fetches an object in
//! parallel ranged GETs into a private temporary file and is a
//! [`RecordStore`] whose reads wait only for the chunks they need.

use super::{client, one_line, runtime, ObjectUrl, CHUNK, IN_FLIGHT};
use crate::error::{Error, Result};
use crate::io::RecordStore;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use object_store::aws::AmazonS3;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tokio::task::JoinHandle;

/// An object being fetched into a private temporary file; see the module
/// docs.
pub struct Download {
    size: u64,
    file: File,
    progress: Arc<Fetched>,
}

struct Fetched {
    state: Mutex<FetchState>,
    changed: Condvar,
    cancelled: AtomicBool,
}

/// Which chunks (`CHUNK` bytes each, the last shorter) are where.
pub(super) struct FetchState {
    /// Asked for (or fetched).
    pub(super) started: Vec<bool>,
    /// In the file.
    pub(super) done: Vec<bool>,
    /// Chunks a reader waits for that are not yet asked for, oldest first.
    pub(super) wanted: VecDeque<usize>,
    /// The first chunk from which to look for the next in order.
    pub(super) next: usize,
    pub(super) failed: Option<String>,
}

impl FetchState {
    /// The chunk to ask for next: the last (the trailer and index, which an
    /// archive is opened from), then what readers wait for, then in order.
    pub(super) fn pick(&mut self) -> Option<usize> {
        let last = self.started.len().checked_sub(1)?;
        let chosen = if !self.started[last] {
            Some(last)
        } else if let Some(c) = std::iter::from_fn(|| self.wanted.pop_front()).find(|&c| !self.started[c]) {
            Some(c)
        } else {
            while self.next < self.started.len() && self.started[self.next] {
                self.next += 1;
            }
            (self.next < self.started.len()).then_some(self.next)
        };
        if let Some(c) = chosen {
            self.started[c] = true;
        }
        chosen
    }
}

/// Takes the room for `size` bytes of `file` at once, not chunk by chunk
/// as they arrive: what is written beside a download while it runs (a
/// placed restore's images, in the same `$TMPDIR`) is then counted against
/// what is really left (`session::restore` checks that room), and cannot
/// leave the download short half-way. A file system that cannot reserve
/// room (no `fallocate`) is left to the writes.
fn reserve(file: &File, size: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let Ok(len) = libc::off_t::try_from(size) else { return Ok(()) };
    if len == 0 {
        return Ok(());
    }
    // SAFETY: fallocate on a descriptor we own; mode 0 allocates the range
    // and extends the file to `len` bytes, which the chunks then overwrite.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(());
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
        e => Err(e),
    }
}

impl Download {
    /// Finds the object and starts fetching it.
    pub fn start(url: &ObjectUrl) -> Result<Download> {
        let store = client(url)?;
        let path = url.path();
        let meta = runtime().block_on(store.head(&path)).map_err(|e| match e {
            object_store::Error::NotFound { .. } => missing(url, &store),
            e => url.error("looking up the object", e),
        })?;
        let dir = crate::io::temp_dir()?;
        let (size, etag) = (meta.size, meta.e_tag);
        if let Some(free) = crate::io::free_bytes(&dir).filter(|&free| free < size) {
            let why = format!("no room for {url} ({size} bytes, {free} free); set TMPDIR to a larger file system");
            return Err(Error::file(&dir, io::Error::new(io::ErrorKind::StorageFull, why)));
        }
        let file = tempfile::tempfile_in(&dir).map_err(|e| Error::file(&dir, e))?;
        reserve(&file, size).map_err(|e| {
            let why = format!("no room for {url} ({size} bytes): {e}; set TMPDIR to a larger file system");
            Error::file(&dir, io::Error::new(e.kind(), why))
        })?;
        let chunks = size.div_ceil(CHUNK) as usize;
        let progress = Arc::new(Fetched {
            state: Mutex::new(FetchState {
                started: vec![false; chunks],
                done: vec![false; chunks],
                wanted: VecDeque::new(),
                next: 0,
                failed: None,
            }),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
        });
        let fetcher = Fetcher { store, path, etag, size, file: file.try_clone().map_err(Error::Io)? };
        let p = progress.clone();
        std::thread::Builder::new()
            .name("criuz-s3-get".into())
            .spawn(move || fetcher.run(&p))
            .map_err(|e| Error::thread_not_started("download", e))?;
        Ok(Download { size, file, progress })
    }

    /// Reads the object front to back.
    pub fn reader(self) -> DownloadReader {
        DownloadReader { download: self, pos: 0 }
    }

    /// Waits until bytes `start..end` (not empty) are in the file, asking
    /// for the chunks they lie in first if they are not yet on their way.
    fn wait_for(&self, start: u64, end: u64) -> io::Result<()> {
        let chunks = (start / CHUNK) as usize..=((end - 1) / CHUNK) as usize;
        let mut s = self.progress.state.lock().unwrap_or_else(|p| p.into_inner());
        for c in chunks.clone() {
            if !s.started[c] && !s.wanted.contains(&c) {
                s.wanted.push_back(c);
            }
        }
        loop {
            if chunks.clone().all(|c| s.done[c]) {
                return Ok(());
            }
            if let Some(e) = &s.failed {
                return Err(io::Error::other(e.clone()));
            }
            s = self.progress.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        self.progress.cancelled.store(true, Ordering::Release);
    }
}

impl RecordStore for Download {
    fn size(&self) -> u64 {
        self.size
    }

    fn arriving(&self) -> bool {
        true
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.size);
        let end = end.ok_or(io::ErrorKind::UnexpectedEof)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.wait_for(offset, end)?;
        FileExt::read_exact_at(&self.file, buf, offset)
    }
}

/// The first `len` bytes of an object, by one ranged GET.
pub fn read_head(url: &ObjectUrl, len: usize) -> Result<Vec<u8>> {
    let store = client(url)?;
    let got = runtime().block_on(store.get_range(&url.path(), 0..len as u64));
    let bytes = got.map_err(|e| url.error("reading its header", e))?;
    if bytes.len() != len {
        return Err(Error::corrupt(0, format!("{url}: shorter than an archive header")));
    }
    Ok(bytes.to_vec())
}

/// A HEAD's 404 does not say whether the bucket or the key is missing; a
/// listing of the key does. Either is a name that is wrong, as a local
/// input that is not there is (exit 2); a parent an archive names and
/// that is missing is found missing before this (exit 1).
fn missing(url: &ObjectUrl, store: &AmazonS3) -> Error {
    match runtime().block_on(store.list_with_delimiter(Some(&url.path()))) {
        Err(e) if e.to_string().contains("NoSuchBucket") => Error::Usage(format!("{url}: no such bucket")),
        _ => Error::Usage(format!("{url}: no such object")),
    }
}

/// The fetching side of a [`Download`].
struct Fetcher {
    store: Arc<AmazonS3>,
    path: ObjectPath,
    etag: Option<String>,
    size: u64,
    file: File,
}

impl Fetcher {
    fn run(self, progress: &Fetched) {
        let result = self.fetch_all(progress);
        let mut s = progress.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = result {
            s.failed = Some(e);
        }
        progress.changed.notify_all();
    }

    /// Keeps `IN_FLIGHT` ranged GETs going, each chunk as [`FetchState::pick`]
    /// chooses it; each streams its body into the file as it arrives (no
    /// chunk-sized buffers: memory stays a few network reads).
    fn fetch_all(&self, progress: &Fetched) -> std::result::Result<(), String> {
        let mut running = FuturesUnordered::new();
        loop {
            if progress.cancelled.load(Ordering::Acquire) {
                running.iter().for_each(|h: &JoinHandle<_>| h.abort());
                return Err("cancelled".into());
            }
            while running.len() < IN_FLIGHT {
                let Some(c) = progress.state.lock().unwrap_or_else(|p| p.into_inner()).pick() else { break };
                running.push(runtime().spawn(self.get(c as u64 * CHUNK)));
            }
            let Some(done) = runtime().block_on(running.next()) else { return Ok(()) };
            let (at, got) = done.map_err(|e| format!("reading the object: {e}"))??;
            let want = (self.size - at).min(CHUNK);
            if got != want {
                return Err(format!("offset {at}: the server sent {got} bytes for {want}"));
            }
            let mut s = progress.state.lock().unwrap_or_else(|p| p.into_inner());
            s.done[(at / CHUNK) as usize] = true;
            progress.changed.notify_all();
        }
    }

    /// Fetches the chunk at `at` into the file; returns `at` and the bytes
    /// written.
    fn get(&self, at: u64) -> impl std::future::Future<Output = std::result::Result<(u64, u64), String>> {
        let range = at..(at + CHUNK).min(self.size);
        let options = GetOptions {
            if_match: self.etag.clone(),
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let (store, path, file) = (self.store.clone(), self.path.clone(), self.file.try_clone());
        async move {
            let file = file.map_err(|e| format!("the temporary copy: {e}"))?;
            let got = store.get_opts(&path, options).await.map_err(|e| fetch_error(at, e))?;
            let mut body = got.into_stream();
            let (mut end, limit) = (at, range.end);
            while let Some(piece) = body.next().await {
                let piece = piece.map_err(|e| fetch_error(at, e))?;
                // Never past the range: a server that sends more must not
                // overwrite ranges that other reads have proven.
                if end + piece.len() as u64 > limit {
                    return Err(format!("offset {at}: the server sent more than the {} bytes asked for", limit - at));
                }
                file.write_all_at(&piece, end).map_err(|e| format!("writing the temporary copy: {e}"))?;
                end += piece.len() as u64;
            }
            Ok((at, end - at))
        }
    }
}

fn fetch_error(at: u64, e: object_store::Error) -> String {
    match e {
        object_store::Error::Precondition { .. } => "the object changed while it was read".into(),
        e => format!("reading offset {at}: {}", one_line(&e)),
    }
}

/// A [`Download`] read front to back.
pub struct DownloadReader {
    download: Download,
    pos: u64,
}

impl Read for DownloadReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.download.size - self.pos;
        let n = (buf.len() as u64).min(left).min(CHUNK) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.download.read_exact_at(&mut buf[..n], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}
