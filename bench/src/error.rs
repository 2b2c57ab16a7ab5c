//! The bench's errors: its own failures, and the library's passed through.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bench step failed or a restored workload did not check out.
    #[error("{0}")]
    Invalid(String),
    #[error("{}: {err}", path.display())]
    File { path: PathBuf, err: io::Error },
    #[error("{0}")]
    Criu(String),
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Lib(#[from] criuz::Error),
}

impl Error {
    pub fn file(path: impl Into<PathBuf>, err: io::Error) -> Self {
        Error::File { path: path.into(), err }
    }
}
