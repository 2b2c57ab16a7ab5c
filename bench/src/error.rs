//! The bench's errors: its own failures, and the library's passed through.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bench step failed or a restored workload did not check out.
    #[error("{0}")]
    Invalid(String),
    /// The command line asks for what cannot be run (exit 2, as criuz's own
    /// usage errors).
    #[error("{0}")]
    Usage(String),
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
    /// The exit status for this error: 2 for a usage error, else 1.
    pub fn exit_code(&self) -> i32 {
        if matches!(self, Error::Usage(_)) {
            2
        } else {
            1
        }
    }

    pub fn file(path: impl Into<PathBuf>, err: io::Error) -> Self {
        Error::File { path: path.into(), err }
    }
}
