//! Library error type. Every variant renders as one line; the CLI prefixes the
//! file it was working on, so a user sees `criuz: FILE: offset N: what`.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The archive bytes are not what the format says they must be.
    #[error("offset {offset}: {what}")]
    Corrupt { offset: u64, what: String },
    /// A valid archive using a feature this build does not implement.
    #[error("offset {offset}: unsupported: {what}")]
    Unsupported { offset: u64, what: String },
    /// The message already includes the cause, so it is not chained as a
    /// `source` too (that would print it twice).
    #[error("{}: {err}", path.display())]
    File { path: PathBuf, err: io::Error },
    #[error(transparent)]
    Io(#[from] io::Error),
    /// Bad argument or refused operation (e.g. would overwrite a file).
    #[error("{0}")]
    Invalid(String),
    #[error("CRIU stream protocol: {0}")]
    Protocol(String),
    #[error("{0}")]
    Criu(String),
    /// A pipeline stage stopped because another stage failed first.
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    pub fn corrupt(offset: u64, what: impl Into<String>) -> Self {
        Error::Corrupt { offset, what: what.into() }
    }

    pub fn file(path: impl Into<PathBuf>, err: io::Error) -> Self {
        Error::File { path: path.into(), err }
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
