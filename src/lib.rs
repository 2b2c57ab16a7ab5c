//! criuz: small, fast, safe CRIU checkpoints with stock CRIU.
//!
//! Data flows one way. Dump: CRIU → `criu::streamer` → `session::capture` →
//! `archive::write` (on the `engine`, blocks through the `codec`) → `io`
//! sink. Restore: `io` source → `archive::source` (every block through
//! `archive::check`) → `session::serve` → CRIU. `format` is the byte layout
//! (pure, no I/O); `offline` packs, unpacks, inspects and verifies without
//! CRIU. A lower module never calls a higher one. `seal` encrypts archives:
//! the writer seals blocks on the engine's workers, and every reader opens
//! them where it checks them (`archive::check`, `archive::source`). `tree`
//! carries whole directory trees (and tar streams) in and out of tree
//! archives. Containers: CRIU driven by runc or podman cannot stream, so
//! `session::container` follows the directory CRIU writes
//! (`session::follow`) or is its page server (`criu::page_server` →
//! `session::receive`), and restores through a directory without the zero
//! pages (`session::images_dir`). `proc` is the OS machinery under the
//! sessions (/proc process trees, the forked guard, cgroup v2, socket
//! tricks); it imports no session.

pub mod archive;
pub mod codec;
pub mod criu;
pub mod engine;
pub mod error;
pub mod format;
pub mod io;
pub mod offline;
pub mod proc;
pub mod progress;
pub mod seal;
pub mod session;
pub mod tree;

pub use error::{Error, Kind, Result};
