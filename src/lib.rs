//! criuz: small, fast, safe CRIU checkpoints with stock CRIU.
//!
//! Module map (lower layers first; a module imports only those above it in
//! its own row or earlier rows, and there is no import cycle):
//!
//! | layer | modules | what |
//! |---|---|---|
//! | layout | `format` | the byte layout, one file per record family; pure, no I/O |
//! | blocks | `planes`, `huffman`, `codec`, `seal`, `engine` | the byte-plane transform of 16-bit words; zstd frames of a plane Huffman-coded from the planes' sample; zero elision and LZ4/zstd per block; AEAD seals; the worker pool |
//! | storage | `io`, `spawn` | `io::Location` (where an archive is, parsed once), outputs published on commit, random-access stores (a local file read ahead), S3, what a killed criuz left, what an interrupted one removes; `spawn`: the programs criuz runs, started with the signal mask criuz was started with |
//! | archive | `archive` | writing (`write`, `dedup`); reading through one door, `archive::open`: `prove` → `fetch` → `resolve` → `block` (the `BlockSource` seam, every block through `check`) → `stored` (the opened archive); `ids` for page ids |
//! | CRIU | `criu` | everything CRIU speaks: streamer socket, page-server protocol, userfaultfd hand-over, images, stats |
//! | OS | `proc`, `cuda` | process trees through /proc, the forked guard, cgroup v2, socket tricks; knows no session. `cuda`: the CUDA driver's checkpoint calls (libcuda loaded at run time), a tree's GPU state suspended and resumed |
//! | work | `offline`, `tree`, `session` | pack/unpack/inspect/verify; directory trees and tar; sessions: one library call per command (dump, restore, lazy, capture/serve, containers) |
//!
//! Data flows one way. Dump: (`cuda` suspends the tree's GPU state) CRIU →
//! `criu::streamer` → `session::capture` →
//! `archive::write` (on the `engine`, blocks through the `codec`) → `io`
//! output. Restore: `io::Location` → `archive::open` (proven; every block
//! through `archive::check`) → `session::place` copies every page into the
//! held tree through userfaultfd, on every core (or, where placing does not
//! suit, `session::serve` → CRIU's pipe); lazily, `session::pager` copies
//! pages into the running process.
//! Containers: CRIU driven by runc or podman cannot stream, so
//! `session::container` follows the directory CRIU writes
//! (`session::follow`) or is its page server (`criu::page_server` →
//! `session::receive`), and restores through a directory without the zero
//! pages (`session::images_dir`). The command line (`src/bin/criuz`) only
//! turns flags into these modules' option types and prints.

// Tests start processes of their own; the rule (clippy.toml) is for the
// programs criuz runs.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
// The module docs are the design notes, read as built with
// `--document-private-items` (scripts/test.sh): they link the private items
// a design turns on, which resolve there.
#![allow(rustdoc::private_intra_doc_links)]

/// `eprintln!` that never panics. What criuz says on stderr is for a reader
/// that may be gone (a supervisor's log pipe closed, `2>&1 | head`): a dump
/// must not fail, nor a restore lose its tree, because nobody reads its
/// messages. The exit status still says how it ended.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

pub mod archive;
pub mod codec;
pub mod criu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod format;
pub mod huffman;
pub mod io;
pub mod offline;
pub mod planes;
pub mod proc;
pub mod progress;
pub mod seal;
pub mod session;
pub mod spawn;
pub mod threads;
pub mod tree;

pub use error::{Error, Kind, Result};
