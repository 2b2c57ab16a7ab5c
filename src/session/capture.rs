//! Capture: receives CRIU's images over the streamer protocol and writes them
//! into a [`Packer`], one thread per open image pipe (CRIU writes several at
//! once). [`settle`] holds the rule for a complete stream (`inventory.img`,
//! which CRIU writes last, arrived) and aborts the packer otherwise, so an
//! incomplete dump publishes nothing; `criuz dump` also requires CRIU's exit
//! status 0 first, which a standalone `criuz capture` cannot see.

use crate::archive::Packer;
use crate::criu::scm;
use crate::criu::streamer::{grow_pipe, read_request, Listener};
use crate::error::{Error, Result};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

/// What a capture received.
#[derive(Debug, Default, Clone)]
pub struct CaptureReport {
    pub files: Vec<String>,
}

/// How a capture takes in the tree's pages.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Pages {
    /// Copied as they arrive.
    Copied,
    /// A process's own pages held by reference until the archive is
    /// finished (see `archive::held`): only for a tree that stays stopped
    /// until then, which the caller checks before it commits.
    HeldWhileStopped,
}

/// Receives CRIU's images on `listener` and writes them into `packer` until
/// CRIU closes the connection. Returns `None` if `stop` was set before CRIU
/// connected. `ends`, where given, gets a handle on the connection: shut
/// down for reading, it ends the capture as CRIU's closing would (for a
/// CRIU that waits at its post-dump hook, every image written).
pub fn capture(
    listener: &Listener,
    packer: &Packer,
    stop: &AtomicBool,
    pages: Pages,
    ends: Option<&OnceLock<UnixStream>>,
) -> Result<Option<CaptureReport>> {
    let Some(mut sock) = listener.accept(stop)? else { return Ok(None) };
    if let Some(ends) = ends {
        let _ = ends.set(sock.try_clone()?);
    }
    let mut report = CaptureReport::default();
    let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
    let mut readers = Vec::new();
    let result = (|| -> Result<()> {
        // CRIU opens a pages image right after the pagemap that names it.
        let mut after_private_pagemap = false;
        while let Some(name) = read_request(&mut sock)? {
            let fd = scm::recv_fd(&sock, "the pipe")?;
            grow_pipe(&fd);
            let held = pages == Pages::HeldWhileStopped && after_private_pagemap && name.starts_with("pages-");
            after_private_pagemap = is_private_pagemap(&name);
            let mut sink = if held { packer.begin_file_held(&name)? } else { packer.begin_file(&name)? };
            report.files.push(name.clone());
            let failed = failed.clone();
            readers.push(std::thread::spawn(move || {
                let r = (|| -> Result<()> {
                    while sink.read_from(&fd).map_err(|e| Error::Protocol(format!("reading {name} from CRIU: {e}")))?
                        > 0
                    {}
                    sink.finish()
                })();
                if let Err(e) = r {
                    failed.lock().unwrap().get_or_insert(e);
                }
            }));
        }
        Ok(())
    })();
    for r in readers {
        let _ = r.join();
    }
    packer.capture_done();
    result?;
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(e);
    }
    Ok(Some(report))
}

/// A process's own pagemap (`pagemap-<pid>.img`), not one of shared memory
/// (`pagemap-shmem-<id>.img`), whose pages other processes may still write.
fn is_private_pagemap(name: &str) -> bool {
    name.strip_prefix("pagemap-")
        .and_then(|rest| rest.strip_suffix(".img"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

/// Applies the completeness rule to a capture's outcome. Complete: the packer
/// is handed back to be finished. Otherwise it is aborted (nothing is
/// published) and the error says why; an error of the writer itself wins
/// over the capture's, since it is the cause.
pub fn settle(packer: Packer, captured: Result<Option<CaptureReport>>) -> Result<(Packer, CaptureReport)> {
    let failure = match captured {
        Ok(Some(r)) if r.files.iter().any(|f| f == "inventory.img") => return Ok((packer, r)),
        Ok(Some(_)) => Error::Criu("the dump stream has no inventory.img: CRIU did not finish".into()),
        Ok(None) => Error::Criu("CRIU never connected to the capture socket".into()),
        Err(e) => e,
    };
    Err(packer.abort().unwrap_or(failure))
}
