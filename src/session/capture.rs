//! Capture: receives CRIU's images over the streamer protocol and writes them
//! into a [`Packer`], one thread per open image pipe (CRIU writes several at
//! once). [`settle`] holds the rule for a complete stream (`inventory.img`,
//! which CRIU writes last, arrived) and aborts the packer otherwise, so an
//! incomplete dump publishes nothing; `criuz dump` also requires CRIU's exit
//! status 0 first, which a standalone `criuz capture` cannot see.

use crate::archive::Packer;
use crate::criu::streamer::{grow_pipe, read_request, Listener};
use crate::criu::{images, scm};
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

/// What a capture received.
#[derive(Debug, Default, Clone)]
pub struct CaptureReport {
    pub files: Vec<String>,
    /// The shared memory objects (by inode) whose pages were held.
    pub held_shared: HashSet<u64>,
}

/// How a capture takes in the tree's pages.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Pages {
    /// Copied as they arrive.
    Copied,
    /// A process's own pages held by reference until the archive is
    /// finished (see `archive::held`), and those of the shared memory
    /// objects `shared` names (by inode, as CRIU names their pagemaps),
    /// which only the tree reaches (`proc::outside::survey`): only
    /// for a tree that stays stopped until then, which the caller checks
    /// before it commits, as it checks that those objects are still the
    /// tree's alone. Other shared memory, which processes outside the tree
    /// may write, is copied as it arrives.
    HeldWhileStopped { shared: HashSet<u64> },
}

impl Pages {
    pub fn holds(&self) -> bool {
        matches!(self, Pages::HeldWhileStopped { .. })
    }
}

/// Whose pages the pages image CRIU opens next holds: it opens one right
/// after the pagemap that names it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PagesOf {
    Process,
    Shared(u64),
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
    pages: &Pages,
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
        let mut after_pagemap = None;
        while let Some(name) = read_request(&mut sock)? {
            let fd = scm::recv_fd(&sock, "the pipe")?;
            grow_pipe(&fd);
            let held = match (pages, after_pagemap) {
                _ if !name.starts_with("pages-") => false,
                (Pages::HeldWhileStopped { .. }, Some(PagesOf::Process)) => true,
                (Pages::HeldWhileStopped { shared }, Some(PagesOf::Shared(inode))) if shared.contains(&inode) => {
                    report.held_shared.insert(inode);
                    true
                }
                _ => false,
            };
            after_pagemap = pages_named_by(&name);
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
    if result.is_err() {
        refuse_the_rest(&mut sock);
    }
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

/// After a failure (the archive could not be written), what CRIU still
/// sends is refused until it ends the connection: each pipe is closed as
/// it arrives, so CRIU writing into it fails. Left in this connection's
/// queue, its read end would keep it open and CRIU would wait on it for
/// good, and with it the readers of the pipes CRIU had opened before and
/// criuz waiting for CRIU: a dump onto a disk that filled while CRIU wrote
/// held shared memory hung so.
fn refuse_the_rest(sock: &mut UnixStream) {
    while let Ok(Some(_)) = read_request(sock) {
        if scm::recv_fd(sock, "the pipe").is_err() {
            break;
        }
    }
}

/// Whose pages a pagemap names: a process's own (`pagemap-<pid>.img`) or
/// a shared memory object's (`pagemap-shmem-<inode>.img`).
fn pages_named_by(name: &str) -> Option<PagesOf> {
    if let Some(inode) = images::shmem_pagemap_id(name) {
        return Some(PagesOf::Shared(inode));
    }
    name.strip_prefix("pagemap-")
        .and_then(|rest| rest.strip_suffix(".img"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        .then_some(PagesOf::Process)
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
