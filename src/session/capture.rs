//! Capture: receives CRIU's images over the streamer protocol and writes them
//! into a [`Packer`], one thread per open image pipe (CRIU writes several at
//! once). Whether the result is a complete checkpoint (CRIU exited 0 and
//! `inventory.img` arrived) is decided by the caller, which alone can finish
//! or abort the packer.

use crate::archive::Packer;
use crate::criu::streamer::{grow_pipe, read_request, recv_fd, Listener};
use crate::error::{Error, Result};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// What a capture received.
#[derive(Debug, Default, Clone)]
pub struct CaptureReport {
    pub files: Vec<String>,
}

/// Receives CRIU's images on `listener` and writes them into `packer` until
/// CRIU closes the connection. Returns `None` if `stop` was set before CRIU
/// connected.
pub fn capture(listener: &Listener, packer: &Packer, stop: &AtomicBool) -> Result<Option<CaptureReport>> {
    let Some(mut sock) = listener.accept(stop)? else { return Ok(None) };
    let mut report = CaptureReport::default();
    let failed: Arc<Mutex<Option<Error>>> = Arc::new(Mutex::new(None));
    let mut readers = Vec::new();
    let result = (|| -> Result<()> {
        while let Some(name) = read_request(&mut sock)? {
            let fd = recv_fd(&sock)?;
            grow_pipe(&fd);
            let mut sink = packer.begin_file(&name)?;
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
    result?;
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(e);
    }
    Ok(Some(report))
}
