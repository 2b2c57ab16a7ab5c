//! criuz: small, fast, safe CRIU checkpoints with stock CRIU.
//!
//! Data flows one way: `format` (bytes on disk) <- `codec` (one block) <-
//! `engine` (parallel, ordered, bounded) <- `archive` (files to archive and
//! back) <- `ops` (directories, inspect, verify) and `stream` (CRIU's
//! image-streaming protocol) <- the CLI.

pub mod archive;
pub mod bench;
pub mod checkpoint;
pub mod codec;
pub mod criu;
pub mod engine;
pub mod error;
pub mod format;
pub mod images;
pub mod ops;
pub mod output;
pub mod progress;
pub mod stream;

pub use error::{Error, Result};
