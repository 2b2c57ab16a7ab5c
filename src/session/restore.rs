//! `criuz restore`: eagerly through CRIU's stream (`checkpoint::restore`)
//! or lazily with criuz as CRIU's lazy-pages daemon (`lazy::restore_lazy`),
//! as the options ask. One call for the command line, one report.

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
    Lazy(LazyReport),
}

impl Restored {
    /// CRIU's exit status: without `--restore-detached`, the restored tree's.
    pub fn criu_exit(&self) -> i32 {
        match self {
            Restored::Eager(r) => r.criu_exit,
            Restored::Lazy(r) => r.criu_exit,
        }
    }
}

/// Restores the tree of `o.input`, lazily with `lazy`; `archive.threads`
/// decode an eager restore's blocks.
pub fn restore(o: &RestoreOptions, lazy: bool, archive: &Options, criu: &Criu) -> Result<Restored> {
    if lazy {
        lazy::restore_lazy(o, criu).map(Restored::Lazy)
    } else {
        checkpoint::restore(o, archive, criu).map(Restored::Eager)
    }
}
