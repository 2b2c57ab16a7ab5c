//! Archives in S3 and S3-compatible object stores (`s3://bucket/key`).
//!
//! The client is `object_store` on a small private tokio runtime: it did
//! multipart upload and ranged GET against moto and SeaweedFS, where
//! aws-sdk-s3 and rust-s3 failed on moto's multipart-complete reply.
//! Endpoint, credentials and region come from the standard `AWS_*`
//! variables; requests are path-style, so any S3-compatible server works.
//!
//! Writing: an archive is append-only, so it goes up as a multipart upload
//! while it is written: each part is sent as soon as it fills, a few in
//! flight, so memory stays bounded (parts in flight + the one filling). The
//! upload is completed only by [`Upload::commit`]; anything else (an error,
//! a drop) aborts it, and an aborted multipart upload leaves no object.
//!
//! Reading: a [`Download`] learns the object's size and ETag, then fetches
//! it in parallel 8 MiB ranged GETs (each pinned to that ETag, so an object
//! replaced meanwhile fails instead of mixing two archives) into a private
//! unnamed temporary file: the last chunk first (trailer and index), then
//! the chunks readers wait for, then the rest in order. It is a
//! [`RecordStore`]: a read waits only for the chunks it needs, so a restore
//! opens the archive from its index and CRIU reads while the rest arrives
//! (`archive::source::Archive::open_indexed`). Memory: the chunks in flight.
//!
//! Trade-off: a chunk a reader asks for is fetched when one of the GETs in
//! flight ends (up to one chunk's time late), not at once; cancelling a GET
//! mid-body would waste what it had fetched.

use super::RecordStore;
use crate::error::{Error, Result};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, GetOptions, GetRange, MultipartUpload, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;
use tokio::task::JoinHandle;

const SCHEME: &str = "s3://";

/// Parts and ranges in flight at once: enough to keep a link busy, few
/// enough to bound memory (4 x the part size).
const IN_FLIGHT: usize = 4;

/// The first parts' size; larger parts later (see [`part_size`]).
const FIRST_PART: usize = 8 << 20;

/// Ranged GETs are this large.
const CHUNK: u64 = 8 << 20;

/// `bucket` and `key` of an `s3://bucket/key` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectUrl {
    pub bucket: String,
    pub key: String,
}

impl std::fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.bucket, self.key)
    }
}

/// True if `spec` names an object (`s3://...`).
pub fn is_url(spec: &Path) -> bool {
    spec.to_str().is_some_and(|s| s.starts_with(SCHEME))
}

impl ObjectUrl {
    /// Parses `s3://bucket/key`; a missing bucket or key is a usage error.
    pub fn parse(spec: &Path) -> Result<ObjectUrl> {
        let bad = |what: &str| Error::Usage(format!("{}: {what} (expected s3://BUCKET/KEY)", spec.display()));
        let rest = spec.to_str().and_then(|s| s.strip_prefix(SCHEME)).ok_or_else(|| bad("not an s3:// URL"))?;
        let (bucket, key) = rest.split_once('/').ok_or_else(|| bad("no key"))?;
        if bucket.is_empty() {
            return Err(bad("no bucket"));
        }
        if key.is_empty() || key.ends_with('/') || key.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
            return Err(bad("the key must be a non-empty name without empty, '.' or '..' parts"));
        }
        Ok(ObjectUrl { bucket: bucket.to_string(), key: key.to_string() })
    }

    fn path(&self) -> ObjectPath {
        ObjectPath::from(self.key.as_str())
    }

    /// An error about this object, on one line.
    fn error(&self, doing: &str, e: object_store::Error) -> Error {
        Error::Remote(format!("{self}: {doing}: {}", one_line(&e)))
    }
}

/// The object store's error, cause chain included, on one line. S3's own
/// error codes (NoSuchBucket, AccessDenied, ...) are in the chain, so they
/// are kept; repeated text is not.
fn one_line(e: &object_store::Error) -> String {
    if let Some(said) = s3_error(&e.to_string()) {
        return said;
    }
    if matches!(e, object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }) {
        return "access denied (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)".into();
    }
    // Each error in the chain, unless an earlier one already says it. A
    // failed request reads "Error performing PUT <url> in 1.2s, after 3
    // retries, ... - <cause>": only the cause and the retries matter.
    let flat = |e: &dyn std::error::Error| e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
    let mut parts: Vec<String> = Vec::new();
    let mut retries = None;
    let mut cur: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = cur {
        let mut text = flat(err);
        if let Some((head, cause)) = text.rsplit_once(" - ") {
            retries = retries.or(head.split(", ").find(|p| p.starts_with("after ")).map(str::to_string));
            text = cause.to_string();
        }
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = err.source();
    }
    let mut line = parts.join(": ");
    if let Some(r) = retries {
        line = format!("{line} ({r})");
    }
    if line.len() > 400 {
        format!("{}...", line.chars().take(400).collect::<String>())
    } else {
        line
    }
}

/// What S3 itself said in an error reply (`<Code>` and `<Message>`), if the
/// error carries one: that is what a user can act on.
fn s3_error(text: &str) -> Option<String> {
    let field = |tag: &str| {
        let start = text.find(&format!("<{tag}>"))? + tag.len() + 2;
        let len = text[start..].find(&format!("</{tag}>"))?;
        Some(text[start..start + len].trim().to_string())
    };
    let code = field("Code")?;
    Some(match field("Message") {
        Some(m) if !m.is_empty() => format!("{code}: {m}"),
        _ => code,
    })
}

/// The private runtime the client runs on: two workers are plenty for a
/// few requests in flight, and leave the cores to the codec and CRIU.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("criuz-s3")
            .enable_all()
            .build()
            .expect("a tokio runtime (threads and an epoll descriptor)")
    })
}

/// A client for `bucket` from the `AWS_*` variables, one per bucket for the
/// process (a restore of a chain in one bucket opens every archive of it
/// with one connection pool). A dead server must fail within seconds, not
/// minutes: few retries, short timeouts.
fn client(url: &ObjectUrl) -> Result<Arc<AmazonS3>> {
    static CLIENTS: Mutex<Vec<(String, Arc<AmazonS3>)>> = Mutex::new(Vec::new());
    let mut clients = CLIENTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = clients.iter().find(|(bucket, _)| *bucket == url.bucket) {
        return Ok(c.clone());
    }
    let c = new_client(url)?;
    clients.push((url.bucket.clone(), c.clone()));
    Ok(c)
}

fn new_client(url: &ObjectUrl) -> Result<Arc<AmazonS3>> {
    let endpoint = std::env::var("AWS_ENDPOINT_URL_S3").or_else(|_| std::env::var("AWS_ENDPOINT_URL")).ok();
    let mut b = AmazonS3Builder::from_env().with_bucket_name(&url.bucket).with_retry(RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: 3,
        retry_timeout: Duration::from_secs(30),
    });
    if let Some(e) = &endpoint {
        b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
    }
    if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none() {
        b = b.with_region("us-east-1");
    }
    b.build().map(Arc::new).map_err(|e| url.error("cannot set up the S3 client", e))
}

/// The size of part `n` (from 0): 8 MiB for the first thousand, doubling
/// every thousand after, so S3's 10,000 parts cover any archive (8 TiB by
/// part 8,000) while small archives keep small parts.
fn part_size(n: usize) -> usize {
    FIRST_PART << (n / 1000).min(9)
}

/// A multipart upload being written; completed only by [`Upload::commit`].
pub struct Upload {
    url: ObjectUrl,
    state: Arc<Mutex<UploadState>>,
    committed: bool,
}

struct UploadState {
    url: ObjectUrl,
    upload: Box<dyn MultipartUpload>,
    filling: Vec<u8>,
    parts: usize,
    in_flight: VecDeque<JoinHandle<object_store::Result<()>>>,
    failed: Option<String>,
}

impl UploadState {
    /// Sends the part being filled; waits while too many are in flight.
    fn send(&mut self) -> std::result::Result<(), String> {
        let next = Vec::with_capacity(part_size(self.parts + 1));
        let part = std::mem::replace(&mut self.filling, next);
        self.parts += 1;
        let put = self.upload.put_part(PutPayload::from(part));
        self.in_flight.push_back(runtime().spawn(put));
        while self.in_flight.len() > IN_FLIGHT {
            self.wait_oldest()?;
        }
        Ok(())
    }

    fn wait_oldest(&mut self) -> std::result::Result<(), String> {
        let Some(h) = self.in_flight.pop_front() else { return Ok(()) };
        match runtime().block_on(h) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{}: uploading part: {}", self.url, one_line(&e))),
            Err(e) => Err(format!("{}: uploading part: {e}", self.url)),
        }
    }
}

impl Upload {
    /// Starts a multipart upload to `url`; an existing object is refused
    /// unless `force`.
    pub fn start(url: ObjectUrl, force: bool) -> Result<Upload> {
        let store = client(&url)?;
        let path = url.path();
        if !force {
            match runtime().block_on(store.head(&path)) {
                Ok(_) => return Err(Error::Exists(url.to_string().into())),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(url.error("checking for an existing object", e)),
            }
        }
        let upload = runtime().block_on(store.put_multipart(&path)).map_err(|e| url.error("starting the upload", e))?;
        let state = UploadState {
            url: url.clone(),
            upload,
            filling: Vec::with_capacity(part_size(0)),
            parts: 0,
            in_flight: VecDeque::new(),
            failed: None,
        };
        Ok(Upload { url, state: Arc::new(Mutex::new(state)), committed: false })
    }

    /// The archive's bytes go here; parts leave as they fill.
    pub fn writer(&self) -> UploadWriter {
        UploadWriter { state: self.state.clone() }
    }

    /// Sends the last part, waits for every part and completes the upload:
    /// only now does the object appear.
    pub fn commit(mut self) -> Result<()> {
        let url = self.url.clone();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let sent = match s.failed.take() {
            Some(e) => Err(e),
            None => s.send().and_then(|()| {
                while !s.in_flight.is_empty() {
                    s.wait_oldest()?;
                }
                Ok(())
            }),
        };
        if let Err(e) = sent {
            let _ = runtime().block_on(s.upload.abort());
            self.committed = true;
            return Err(Error::Remote(format!("{e} (upload aborted, no object written)")));
        }
        let done = runtime().block_on(s.upload.complete());
        self.committed = true;
        if let Err(e) = done {
            let _ = runtime().block_on(s.upload.abort());
            return Err(url.error("completing the upload (aborted, no object written)", e));
        }
        Ok(())
    }
}

impl Drop for Upload {
    /// Uncommitted: the upload is aborted, so no object and no stored parts
    /// are left behind.
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for h in s.in_flight.drain(..) {
            h.abort();
        }
        let _ = runtime().block_on(s.upload.abort());
    }
}

/// Writes into an [`Upload`]'s parts.
pub struct UploadWriter {
    state: Arc<Mutex<UploadState>>,
}

impl Write for UploadWriter {
    fn write(&mut self, mut buf: &[u8]) -> io::Result<usize> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &s.failed {
            return Err(io::Error::other(e.clone()));
        }
        let n = buf.len();
        while !buf.is_empty() {
            let room = part_size(s.parts) - s.filling.len();
            let take = room.min(buf.len());
            s.filling.extend_from_slice(&buf[..take]);
            buf = &buf[take..];
            if s.filling.len() == part_size(s.parts) {
                if let Err(e) = s.send() {
                    s.failed = Some(e.clone());
                    return Err(io::Error::other(e));
                }
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

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
struct FetchState {
    /// Asked for (or fetched).
    started: Vec<bool>,
    /// In the file.
    done: Vec<bool>,
    /// Chunks a reader waits for that are not yet asked for, oldest first.
    wanted: VecDeque<usize>,
    /// The first chunk from which to look for the next in order.
    next: usize,
    failed: Option<String>,
}

impl FetchState {
    /// The chunk to ask for next: the last (the trailer and index, which an
    /// archive is opened from), then what readers wait for, then in order.
    fn pick(&mut self) -> Option<usize> {
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

impl Download {
    /// Finds the object and starts fetching it.
    pub fn start(url: &ObjectUrl) -> Result<Download> {
        let store = client(url)?;
        let path = url.path();
        let meta = runtime().block_on(store.head(&path)).map_err(|e| match e {
            object_store::Error::NotFound { .. } => missing(url, &store),
            e => url.error("looking up the object", e),
        })?;
        let dir = std::env::temp_dir();
        let (size, etag) = (meta.size, meta.e_tag);
        if let Some(free) = free_bytes(&dir).filter(|&free| free < size) {
            let why = format!("no room for {url} ({size} bytes, {free} free); set TMPDIR to a larger file system");
            return Err(Error::file(&dir, io::Error::new(io::ErrorKind::StorageFull, why)));
        }
        let file = tempfile::tempfile_in(&dir).map_err(|e| Error::file(&dir, e))?;
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
        std::thread::Builder::new().name("criuz-s3-get".into()).spawn(move || fetcher.run(&p)).map_err(Error::Io)?;
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

/// Bytes free for an unprivileged file in `dir` (`None` if unknown): a
/// download that cannot fit fails before it starts, not when the disk fills.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is written by statvfs before
    // it is read, only when it returns 0.
    let st = unsafe {
        if libc::statvfs(path.as_ptr(), st.as_mut_ptr()) != 0 {
            return None;
        }
        st.assume_init()
    };
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
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
/// listing of the key does.
fn missing(url: &ObjectUrl, store: &AmazonS3) -> Error {
    match runtime().block_on(store.list_with_delimiter(Some(&url.path()))) {
        Err(e) if e.to_string().contains("NoSuchBucket") => Error::NotFound(format!("{url}: no such bucket")),
        _ => Error::NotFound(format!("{url}: no such object")),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = ObjectUrl::parse(Path::new("s3://b/dir/x.czr")).unwrap();
        assert_eq!((u.bucket.as_str(), u.key.as_str()), ("b", "dir/x.czr"));
        assert_eq!(u.to_string(), "s3://b/dir/x.czr");
        for bad in ["s3://b", "s3://b/", "s3:///k", "s3://b/a//c", "s3://b/../k", "s3://b/d/"] {
            assert!(ObjectUrl::parse(Path::new(bad)).is_err(), "{bad}");
        }
        assert!(is_url(Path::new("s3://b/k")) && !is_url(Path::new("./s3:/b/k")));
    }

    #[test]
    fn parts_cover_the_limit() {
        let total: u64 = (0..10_000).map(|n| part_size(n) as u64).sum();
        assert!(total > 4 << 40, "10,000 parts cover {total} bytes");
        assert!(part_size(9_999) <= 5 << 30, "S3's largest part is 5 GiB");
    }

    #[test]
    fn chunks_come_tail_first_then_as_wanted_then_in_order() {
        let mut s = FetchState {
            started: vec![false; 6],
            done: vec![false; 6],
            wanted: VecDeque::new(),
            next: 0,
            failed: None,
        };
        s.wanted.extend([3, 0]);
        let order: Vec<usize> = std::iter::from_fn(|| s.pick()).collect();
        assert_eq!(order, [5, 3, 0, 1, 2, 4]);
        let mut empty = FetchState { started: vec![], done: vec![], wanted: VecDeque::new(), next: 0, failed: None };
        assert_eq!(empty.pick(), None);
    }
}
