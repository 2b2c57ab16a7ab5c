//! Follow: packs a dump that writes into a directory while it writes. When
//! CRIU cannot stream (runc and podman drive it through RPC), it writes its
//! images into a private directory (tmpfs); the page images, nearly all of
//! a checkpoint, are followed as they grow (CRIU only appends to them) and
//! compressed meanwhile, so little is left to pack once the dump exits. The
//! rest of the directory is packed after it (`tree::feed_dir`).
//!
//! Followed files are read to their end at every pass; once the dump has
//! exited (`done`) one more pass reads what it wrote last. A page image's
//! entry begins while CRIU still writes it, so it records the mode it had
//! then and the time following began, not its final mtime. The directory
//! itself is left alone: should writing the archive fail after the dump
//! killed the tree, the images are still there to be kept.

use crate::archive::{FileSink, Packer};
use crate::error::{IoContext, Result};
use crate::format::FileKind;
use crate::tree::meta_of;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long an idle pass waits before looking again.
const IDLE: Duration = Duration::from_millis(2);

struct Followed {
    name: String,
    file: File,
    sink: FileSink,
}

/// Follows `pages-*.img` in `dir` into `packer` until `done` is set and a
/// last pass found nothing new; returns the names of the files followed.
pub fn follow_pages(dir: &Path, packer: &Packer, done: &AtomicBool) -> Result<Vec<String>> {
    let mut open: Vec<Followed> = Vec::new();
    loop {
        // Read before the pass: a pass that starts after the dump exited
        // sees everything it wrote.
        let last = done.load(Ordering::Acquire);
        let mut moved = 0usize;
        for e in std::fs::read_dir(dir).at(dir)? {
            let e = e.at(dir)?;
            let Some(name) = e.file_name().to_str().map(str::to_owned) else { continue };
            if FileKind::for_name(&name) != FileKind::Pages || open.iter().any(|f| f.name == name) {
                continue;
            }
            let path = e.path();
            let file = File::open(&path).at(&path)?;
            let meta = meta_of(&file.metadata().at(&path)?);
            let sink = packer.begin_entry(&name, FileKind::Pages, Some(meta))?;
            open.push(Followed { name, file, sink });
        }
        for f in &mut open {
            loop {
                // Blocks are cut at fixed offsets whatever each read returns.
                let n = f.sink.read_from(&f.file).at(dir.join(&f.name))?;
                if n == 0 {
                    break;
                }
                moved += n;
            }
        }
        if last {
            let names = open.iter().map(|f| f.name.clone()).collect();
            for f in open {
                f.sink.finish()?;
            }
            return Ok(names);
        }
        if moved == 0 {
            std::thread::sleep(IDLE);
        }
    }
}
