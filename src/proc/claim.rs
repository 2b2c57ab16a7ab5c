//! One checkpoint of a process tree at a time. Two dumps of one tree
//! racing each other both failed: the second CRIU dumped the tree the
//! first had left stopped, and each criuz then saw the tree run (resumed
//! by the other) while its archive was written, so neither kept a
//! checkpoint. A dump therefore claims its tree's root pid before CRIU
//! runs: an `flock`ed file `dump-PID.lock` in criuz's runtime directory
//! (beside the memory grants, `budget`), holding the claimant's pid for
//! the message a second criuz gives. The kernel drops the lock of a criuz
//! that dies; the file is removed by its holder (or by an interruption),
//! and a claimant that locked a file someone removed meanwhile tries again.

use super::budget;
use crate::error::{Error, Result};
use crate::io::leftover;
use crate::io::unfinished::Unfinished;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Names of claim files.
const PREFIX: &str = "dump-";

/// Takes the lock on `file`. A criuz sweeping abandoned claims holds a
/// file's lock for an instant before it removes it: a lock still held a
/// tenth of a second later is a dump's.
fn locked(file: &File) -> bool {
    for _ in 0..20 {
        // SAFETY: flock on a descriptor we own; released when `file` closes.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    false
}

/// A tree claimed for one dump; let go when dropped.
#[derive(Debug)]
pub struct Claim {
    held: Option<(File, PathBuf, Unfinished)>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked, so no claimant locks a file that is
        // about to go (it would find it gone and try again).
        if let Some((_, path, _)) = self.held.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Claims tree `pid` for a dump, or says which criuz holds it. Best effort
/// where criuz has no runtime directory: no claim, no refusal.
pub fn claim_tree(pid: i32) -> Result<Claim> {
    claim_in(&budget::runtime_dir(), pid)
}

fn claim_in(dir: &Path, pid: i32) -> Result<Claim> {
    let unclaimed = Claim { held: None };
    let made = {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
    };
    if made.is_err() {
        return Ok(unclaimed);
    }
    // What killed criuzes left: files nobody holds.
    leftover::remove_abandoned(dir, PREFIX);
    let path = dir.join(format!("{PREFIX}{pid}.lock"));
    for _ in 0..100 {
        let opened = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
        let Ok(mut file) = opened else { return Ok(unclaimed) };
        if !locked(&file) {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let by = holder.trim().parse::<i32>().map(|h| format!(" (criuz pid {h})")).unwrap_or_default();
            return Err(Error::Criu(format!("process {pid} is being checkpointed by another criuz{by}")));
        }
        // Locked: still the file at `path`, or one its holder removed?
        let same = match (file.metadata(), std::fs::metadata(&path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if !same {
            continue;
        }
        // Registered only once it is ours: an interruption removes it then,
        // never another criuz's. (Interrupted before, it is left unlocked,
        // which claims nothing.)
        let Ok(((), unfinished)) = Unfinished::made(|| Ok::<_, std::io::Error>(((), path.clone()))) else {
            return Ok(unclaimed);
        };
        let mine = std::process::id().to_string();
        let written = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| file.write_all(mine.as_bytes()));
        if written.is_err() {
            return Ok(unclaimed);
        }
        return Ok(Claim { held: Some((file, path, unfinished)) });
    }
    Ok(unclaimed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_is_claimed_by_one_dump_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let first = claim_in(dir.path(), 4242).unwrap();
        assert!(first.held.is_some());
        // flock locks belong to the open file: a second open in this
        // process is refused as another criuz would be.
        let err = claim_in(dir.path(), 4242).unwrap_err().to_string();
        let me = std::process::id();
        assert_eq!(err, format!("process 4242 is being checkpointed by another criuz (criuz pid {me})"));
        assert!(claim_in(dir.path(), 4243).unwrap().held.is_some(), "another tree is free");
        drop(first);
        assert!(!dir.path().join("dump-4242.lock").exists(), "the claim's file goes with it");
        assert!(claim_in(dir.path(), 4242).unwrap().held.is_some(), "free again");
        // A claim a killed criuz left (its file, unlocked) claims nothing,
        // and the next claimant sweeps it.
        std::fs::write(dir.path().join("dump-77.lock"), "1").unwrap();
        assert!(claim_in(dir.path(), 78).unwrap().held.is_some());
        assert!(!dir.path().join("dump-77.lock").exists(), "an abandoned claim is swept");
        assert!(claim_in(dir.path(), 77).unwrap().held.is_some());
    }
}
