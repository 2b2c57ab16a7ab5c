//! `criuz restore`: eagerly through CRIU's stream (`checkpoint::restore`),
//! eagerly with criuz placing the memory itself (`lazy::restore_placed`:
//! the tree held stopped until every page is in), or lazily with criuz as
//! CRIU's lazy-pages daemon (`lazy::restore_lazy`), as the options ask.
//! One call for the command line, one report.

use crate::archive::Options;
use crate::criu::Criu;
use crate::error::Result;
use crate::session::checkpoint::{self, RestoreReport};
use crate::session::criu_run::RestoreOptions;
use crate::session::lazy::{self, LazyReport};

/// How a restore went.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(untagged)]
pub enum Restored {
    Eager(RestoreReport),
    Placed(LazyReport),
    Lazy(LazyReport),
}

/// How a tree's memory comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// Through CRIU's image stream, page by page.
    Stream,
    /// Placed by criuz (userfaultfd copies), the tree held stopped until
    /// every page is in and proven.
    Placed,
    /// The tree runs at once; its memory arrives on demand.
    Lazy,
}

impl Restored {
    /// CRIU's exit status: without `--restore-detached`, the restored tree's.
    pub fn criu_exit(&self) -> i32 {
        match self {
            Restored::Eager(r) => r.criu_exit,
            Restored::Placed(r) | Restored::Lazy(r) => r.criu_exit,
        }
    }
}

/// Restores the tree of `o.input` as `how` says; `archive.threads` decode
/// a streamed restore's blocks.
pub fn restore(o: &RestoreOptions, how: How, archive: &Options, criu: &Criu) -> Result<Restored> {
    match how {
        How::Stream => checkpoint::restore(o, archive, criu).map(Restored::Eager),
        How::Placed => lazy::restore_placed(o, criu).map(Restored::Placed),
        How::Lazy => lazy::restore_lazy(o, criu).map(Restored::Lazy),
    }
}
