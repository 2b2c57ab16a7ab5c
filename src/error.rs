//! Library errors. Every variant renders as one line; [`Error::Context`] puts
//! the file or stage in front of its cause instead of re-formatting it, so a
//! user sees `criuz: FILE: offset N: what`. Errors are typed all the way
//! across threads (no strings), and each has a [`Kind`] that decides the exit
//! status, so callers and tests match on the kind, not on text.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The archive bytes are not what the format says they must be
    /// (damaged, truncated, crafted, or not a criuz archive at all). It
    /// prints `why` itself, so `why` is not also a `source` (that would
    /// print it twice).
    #[error("offset {offset}: {why}")]
    Corrupt { offset: u64, why: Damage },
    /// A well-formed archive using a feature this build does not implement.
    #[error("offset {offset}: unsupported: {what}")]
    Unsupported { offset: u64, what: String },
    /// An I/O error on a named file. The message already includes the cause,
    /// so it is not chained as a `source` too (that would print it twice).
    #[error("{}: {err}", path.display())]
    File { path: PathBuf, err: io::Error },
    #[error(transparent)]
    Io(io::Error),
    /// A whole archive is not the one expected (a parent that is not one).
    #[error("{0}")]
    Mismatch(String),
    /// An encrypted archive that none of the keys given opens: foreign to
    /// them, as much a reason to stop as a damaged archive.
    #[error("{0}")]
    Locked(String),
    /// An encrypted archive and no key of its kind given: the command lacks
    /// an option (a usage error, so that no one takes a good archive for a
    /// damaged one and discards it).
    #[error("{0}")]
    KeyNeeded(String),
    /// Something needed (a parent archive) is not where it was looked for.
    #[error("{0}")]
    NotFound(String),
    /// The output exists and `--force` was not given.
    #[error("{}: already exists (use --force to replace it)", .0.display())]
    Exists(PathBuf),
    /// A bad argument or a request that cannot be carried out as asked.
    #[error("{0}")]
    Usage(String),
    /// CRIU spoke the streamer protocol in a way we do not understand.
    #[error("CRIU stream protocol: {0}")]
    Protocol(String),
    /// An object store refused or failed a request (the URL leads the text).
    #[error("{0}")]
    Remote(String),
    /// CRIU failed, could not be run, or left the job incomplete.
    #[error("{0}")]
    Criu(String),
    /// CRIU (or what runs it) could not be run or talked to: what we were
    /// doing, and the I/O error (kept, but printed rather than chained as a
    /// `source`, like [`Error::File`]).
    #[error("{what}: {err}")]
    CriuIo { what: String, err: io::Error },
    /// A pipeline stage stopped because another stage failed first.
    #[error("cancelled")]
    Cancelled,
    /// `inner`, with what we were doing (a file name, a stage) in front. It
    /// prints its cause itself, so the cause is not also a `source` (that
    /// would print it twice).
    #[error("{context}: {inner}")]
    Context { context: String, inner: Box<Error> },
}

/// Why archive bytes are corrupt ([`Error::Corrupt`]): a payload that does
/// not decode, a sealed part that does not open, or a rule of the format
/// broken, said in words.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Damage {
    #[error("{0}")]
    Format(String),
    #[error(transparent)]
    Codec(#[from] DecodeError),
    #[error(transparent)]
    Seal(#[from] SealError),
}

impl From<String> for Damage {
    fn from(what: String) -> Self {
        Damage::Format(what)
    }
}

impl From<&str> for Damage {
    fn from(what: &str) -> Self {
        Damage::Format(what.to_string())
    }
}

/// What kind of failure an error is; decides the exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The operation failed (CRIU, I/O, protocol): exit 1.
    Failed,
    /// The command was used wrongly: exit 2.
    Usage,
    /// The archive is damaged, foreign or unsupported: exit 3.
    Archive,
}

impl Kind {
    pub fn exit_code(self) -> i32 {
        match self {
            Kind::Failed => 1,
            Kind::Usage => 2,
            Kind::Archive => 3,
        }
    }
}

/// An I/O error on a file a `Write` was given for, carried through the
/// `io::Error` that the `Write` trait allows (it has no room for a path), so
/// that "No space left on device" says on which output it happened. It
/// becomes [`Error::File`] again on conversion.
#[derive(Debug)]
pub struct WriteError {
    pub path: PathBuf,
    pub err: io::Error,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.err)
    }
}

impl std::error::Error for WriteError {}

impl WriteError {
    /// `err`, naming `path` unless it names a file already.
    pub fn wrap(path: &std::path::Path, err: io::Error) -> io::Error {
        if err.get_ref().is_some_and(|inner| inner.is::<WriteError>()) {
            return err;
        }
        io::Error::new(err.kind(), WriteError { path: path.to_path_buf(), err })
    }
}

/// A read of archive bytes that met the archive's end before the size its
/// reader had taken: the file was truncated under the reader. Carried
/// through the `io::Error` a store reads with, as [`WriteError`] is; it
/// becomes damage at `offset` ([`Error::Corrupt`], exit 3) on conversion,
/// where it read as a bare "failed to fill whole buffer", exit 1.
#[derive(Debug)]
pub struct TruncatedUnderReader {
    pub offset: u64,
}

impl TruncatedUnderReader {
    const WHY: &'static str = "archive was truncated after it was opened";

    /// `err`, a read at `offset` that met the end of the bytes (a short
    /// read), as this; any other error as it is.
    pub fn wrap(err: io::Error, offset: u64) -> io::Error {
        if err.kind() != io::ErrorKind::UnexpectedEof || err.get_ref().is_some_and(|inner| inner.is::<Self>()) {
            return err;
        }
        io::Error::new(io::ErrorKind::UnexpectedEof, TruncatedUnderReader { offset })
    }
}

impl std::fmt::Display for TruncatedUnderReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "offset {}: {}", self.offset, Self::WHY)
    }
}

impl std::error::Error for TruncatedUnderReader {}

impl From<io::Error> for Error {
    fn from(err: io::Error) -> Self {
        let err = match err.downcast::<WriteError>() {
            Ok(named) => return Error::File { path: named.path, err: named.err },
            Err(err) => err,
        };
        match err.downcast::<TruncatedUnderReader>() {
            Ok(t) => Error::corrupt(t.offset, TruncatedUnderReader::WHY),
            Err(err) => Error::Io(err),
        }
    }
}

impl Error {
    /// Archive bytes at `offset` that are not as they must be, and why: a
    /// message, or a typed cause ([`Damage`]).
    pub fn corrupt(offset: u64, why: impl Into<Damage>) -> Self {
        Error::Corrupt { offset, why: why.into() }
    }

    pub fn unsupported(offset: u64, what: impl Into<String>) -> Self {
        Error::Unsupported { offset, what: what.into() }
    }

    pub fn file(path: impl Into<PathBuf>, err: io::Error) -> Self {
        Error::File { path: path.into(), err }
    }

    /// A thread (named by what it does) that the system would not start:
    /// a cgroup's pids limit, most likely.
    pub fn thread_not_started(what: &str, err: io::Error) -> Self {
        Error::Io(err).context(format!("cannot start the {what} thread"))
    }

    /// Wraps the error with what we were doing; the kind is the cause's.
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context { context: context.into(), inner: Box::new(self) }
    }

    /// Wraps the error with the archive it came from (`label`), unless it
    /// names a file of its own: a sink's output that exists already or
    /// could not be written is not the archive's fault, and "ARCHIVE: DIR/x:
    /// already exists" read as if the archive were.
    pub fn from_archive(self, label: impl Into<String>) -> Self {
        match self.root() {
            Error::File { .. } | Error::Exists(_) => self,
            _ => self.context(label),
        }
    }

    /// The innermost error behind any contexts.
    pub fn root(&self) -> &Error {
        match self {
            Error::Context { inner, .. } => inner.root(),
            e => e,
        }
    }

    /// The OS error number behind the error, where an I/O error is its
    /// root.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self.root() {
            Error::File { err, .. } | Error::Io(err) | Error::CriuIo { err, .. } => err.raw_os_error(),
            _ => None,
        }
    }

    pub fn kind(&self) -> Kind {
        match self.root() {
            Error::Corrupt { .. } | Error::Unsupported { .. } | Error::Mismatch(_) | Error::Locked(_) => Kind::Archive,
            Error::Usage(_) | Error::Exists(_) | Error::KeyNeeded(_) => Kind::Usage,
            _ => Kind::Failed,
        }
    }

    /// A copy with the same kind and text, for a failure several readers
    /// must each report (an I/O cause keeps its kind and message).
    pub fn duplicate(&self) -> Error {
        match self {
            Error::Corrupt { offset, why } => Error::Corrupt { offset: *offset, why: why.clone() },
            Error::Unsupported { offset, what } => Error::Unsupported { offset: *offset, what: what.clone() },
            Error::File { path, err } => {
                Error::File { path: path.clone(), err: io::Error::new(err.kind(), err.to_string()) }
            }
            Error::Io(err) => Error::Io(io::Error::new(err.kind(), err.to_string())),
            Error::Mismatch(s) => Error::Mismatch(s.clone()),
            Error::NotFound(s) => Error::NotFound(s.clone()),
            Error::Locked(s) => Error::Locked(s.clone()),
            Error::KeyNeeded(s) => Error::KeyNeeded(s.clone()),
            Error::Exists(p) => Error::Exists(p.clone()),
            Error::Usage(s) => Error::Usage(s.clone()),
            Error::Protocol(s) => Error::Protocol(s.clone()),
            Error::Remote(s) => Error::Remote(s.clone()),
            Error::Criu(s) => Error::Criu(s.clone()),
            Error::CriuIo { what, err } => {
                Error::CriuIo { what: what.clone(), err: io::Error::new(err.kind(), err.to_string()) }
            }
            Error::Cancelled => Error::Cancelled,
            Error::Context { context, inner } => {
                Error::Context { context: context.clone(), inner: Box::new(inner.duplicate()) }
            }
        }
    }

    /// True when this is only a consequence of another failure.
    pub fn is_cancelled(&self) -> bool {
        matches!(self.root(), Error::Cancelled)
    }
}

/// Attach a path to an I/O result.
pub trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::file(path, e))
    }
}

/// Attach what we were doing to a library result.
pub trait ResultContext<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> ResultContext<T> for Result<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| e.context(context()))
    }
}

/// Why a block's payload is not what its header says. It says what is
/// wrong; the caller adds where (`Error::corrupt`, which takes it as is).
#[derive(Clone, Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("a dedup block must be resolved by its archive first")]
    Unresolved,
    #[error("raw block holds {got} bytes, expected {expect}")]
    RawLength { got: usize, expect: usize },
    #[error("LZ4 block does not decompress")]
    Lz4,
    #[error("LZ4 block decompresses to {got} bytes, expected {expect}")]
    Lz4Length { got: usize, expect: usize },
    /// zstd's own error, printed as part of this one (so not also chained
    /// as its `source`: `{:#}` would print it twice).
    #[error("zstd block does not decompress: {0}")]
    Zstd(std::sync::Arc<std::io::Error>),
    #[error("zstd block decompresses to {got} bytes, expected {expect}")]
    ZstdLength { got: usize, expect: usize },
    #[error("byte-planes block: {0}")]
    Planes(&'static str),
    #[error("block data checksum mismatch")]
    DataCheck,
}

/// Why a sealed part of an archive does not open. It says what is wrong;
/// the caller adds where (`Error::corrupt`, which takes it as is).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("block is not sealed as an encrypted archive's blocks are")]
    NotSealed,
    #[error("block does not open with the archive's key (damaged, moved or from another archive)")]
    Block,
    #[error("file name does not open with the archive's key")]
    Name,
    #[error("index does not open with the archive's key")]
    Index,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_looks_through_contexts() {
        let e = Error::corrupt(7, "bad").context("a.czr").context("serving pages-1.img");
        assert_eq!(e.kind(), Kind::Archive);
        assert_eq!(e.to_string(), "serving pages-1.img: a.czr: offset 7: bad");
        assert_eq!(Error::Usage("x".into()).kind().exit_code(), 2);
        assert_eq!(Error::Criu("x".into()).kind().exit_code(), 1);
        // An encrypted archive without a key is the command's fault, not the
        // archive's; with keys none of which opens it, the archive is foreign.
        assert_eq!(Error::KeyNeeded("x".into()).context("a.czr").kind().exit_code(), 2);
        assert_eq!(Error::Locked("x".into()).context("a.czr").kind().exit_code(), 3);
        let e = Error::CriuIo { what: "cannot run criu".into(), err: io::Error::from(io::ErrorKind::NotFound) };
        assert_eq!(e.kind().exit_code(), 1);
        assert_eq!(e.to_string(), format!("cannot run criu: {}", io::Error::from(io::ErrorKind::NotFound)));
    }

    #[test]
    fn a_write_error_keeps_its_file_and_its_errno() {
        let path = std::path::Path::new("/out/a.czr");
        let wrapped = WriteError::wrap(path, io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(wrapped.kind(), io::ErrorKind::StorageFull);
        // Wrapped once only, however many writers it passes through.
        let twice = WriteError::wrap(std::path::Path::new("/elsewhere"), wrapped);
        let e = Error::from(twice).context("packing d");
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(e.to_string().starts_with("packing d: /out/a.czr: "), "{e}");
        assert_eq!(e.kind(), Kind::Failed);
        assert!(matches!(Error::from(io::Error::other("x")), Error::Io(_)));
    }

    #[test]
    fn typed_damage_reads_as_its_message() {
        let e = Error::corrupt(5, DecodeError::RawLength { got: 1, expect: 2 }).context("a.czr");
        assert_eq!(e.to_string(), "a.czr: offset 5: raw block holds 1 bytes, expected 2");
        assert_eq!(e.duplicate().to_string(), e.to_string());
        assert_eq!(e.kind(), Kind::Archive);
        assert!(matches!(e.root(), Error::Corrupt { why: Damage::Codec(DecodeError::RawLength { .. }), .. }));
        let e = Error::corrupt(9, SealError::Name);
        assert_eq!(e.to_string(), "offset 9: file name does not open with the archive's key");
        assert!(std::error::Error::source(&e).is_none(), "the cause would print twice under {{:#}}");
    }
}
