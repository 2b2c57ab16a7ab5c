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
//! [`RecordStore`](super::RecordStore): a read waits only for the chunks it needs, so a restore
//! opens the archive from its index and CRIU reads while the rest arrives
//! (`archive::open` with `Proof::BehindIfArriving`). Memory: the chunks in flight.
//!
//! Trade-off: a chunk a reader asks for is fetched when one of the GETs in
//! flight ends (up to one chunk's time late), not at once; cancelling a GET
//! mid-body would waste what it had fetched.

use crate::error::{Error, Result};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, MultipartUpload, ObjectStoreExt, PutPayload, RetryConfig};
use std::collections::VecDeque;
use std::io::{self, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
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

    /// An error about this object, on one line. A bucket that is not there
    /// is a wrong name, as a missing directory is for a file (exit 2), not
    /// a failure a retry could mend.
    fn error(&self, doing: &str, e: object_store::Error) -> Error {
        let said = one_line(&e);
        let text = format!("{self}: {doing}: {said}");
        if said.starts_with("NoSuchBucket") {
            Error::Usage(text)
        } else {
            Error::Remote(text)
        }
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
    store: Arc<AmazonS3>,
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
        Ok(Upload { url, store, state: Arc::new(Mutex::new(state)), committed: false })
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
        drop(s);
        if let Err(e) = sweep::abort_others(&self.store, &url) {
            crate::say!("criuz: {url}: written; the incomplete uploads of earlier writers were not aborted: {e}");
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

mod download;
mod sweep;
pub use download::{read_head, Download, DownloadReader};

#[cfg(test)]
mod tests;
