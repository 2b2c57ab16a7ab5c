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

use super::{budget, tree};
use crate::error::{Error, Result};
use crate::io::leftover;
use crate::io::unfinished::Unfinished;
use crate::proc::holder;
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
    // Only a directory of this user's own (see `budget::reserve`).
    if crate::io::private_dir(dir).is_err() {
        return Ok(unclaimed);
    }
    // What killed criuzes left: files nobody holds.
    leftover::remove_abandoned(dir, PREFIX);
    let path = dir.join(format!("{PREFIX}{pid}.lock"));
    for _ in 0..100 {
        // Opened (made, where it was not there), locked and registered with
        // no instant between in which an interruption could miss a file
        // this criuz made (the campaign's SIGINT found one, 1 trial in 320);
        // registered only once it is ours, so an interruption removes it
        // then, never another criuz's.
        let taken = Unfinished::made(|| {
            let opened = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
            let mut file = opened.map_err(|_| Take::Failed)?;
            if !locked(&file) {
                return Err(Take::Held(holder(&mut file)));
            }
            // Locked: still the file at `path`, or one its holder removed?
            match (file.metadata(), std::fs::metadata(&path)) {
                (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino() => Ok((file, path.clone())),
                _ => Err(Take::Removed),
            }
        });
        let (mut file, unfinished) = match taken {
            Ok(taken) => taken,
            Err(Take::Removed) => continue,
            Err(Take::Held(by)) => {
                return Err(Error::Criu(format!("process {pid} is being checkpointed by another criuz{by}")))
            }
            Err(Take::Failed) => return Ok(unclaimed),
        };
        let mine = std::process::id().to_string();
        let written = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| file.write_all(mine.as_bytes()));
        if written.is_err() {
            // Ours, locked: not left for the next sweep.
            let _ = std::fs::remove_file(&path);
            return Ok(unclaimed);
        }
        let claim = Claim { held: Some((file, path, unfinished)) };
        // Claimed first, looked at after: of two overlapping claims made at
        // once, each sees the other (both refused, neither dump spoilt).
        if let Some((other, by)) = overlapping(dir, pid) {
            return Err(Error::Criu(format!(
                "process {pid}'s tree overlaps that of process {other}, which another criuz{by} is checkpointing"
            )));
        }
        return Ok(claim);
    }
    Ok(unclaimed)
}

/// Why a claim file was not taken.
enum Take {
    /// Another criuz holds it (" (criuz pid N)", or nothing).
    Held(String),
    /// Its holder removed it meanwhile: try again.
    Removed,
    /// It cannot be opened: no claim, no refusal.
    Failed,
}

/// " (criuz pid N)", naming the claimant of an open claim file.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    text.trim().parse::<i32>().map(|h| format!(" (criuz pid {h})")).unwrap_or_default()
}

/// A held claim (other than `pid`'s own) on a process of `pid`'s tree or
/// on one of its ancestors, whose tree holds `pid`'s: CRIU would freeze
/// processes the other dump holds. Its pid and claimant.
fn overlapping(dir: &Path, pid: i32) -> Option<(i32, String)> {
    let mut related = tree::tree_pids(&[pid]);
    let mut at = pid;
    while let Some(parent) = holder::parent_of(at).filter(|&p| p > 1 && p != at) {
        related.push(parent);
        at = parent;
    }
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name();
        let Some(other) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)?.strip_suffix(".lock")?.parse().ok())
        else {
            continue;
        };
        if other == pid || !related.contains(&other) {
            continue;
        }
        let Ok(mut file) = File::open(entry.path()) else { continue };
        // SAFETY: flock on a descriptor we own; released when `file` closes.
        // Shared: a claimant's exclusive lock refuses it; taken, it claims nothing.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            continue;
        }
        return Some((other, holder(&mut file)));
    }
    None
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

    #[test]
    fn a_runtime_directory_open_to_others_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let open = base.path().join("criuz-1000");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        // Another user's link, where this user's claim would be.
        let victim = base.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, open.join("dump-4242.lock")).unwrap();
        let link = base.path().join("linked");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        for dir in [&open, &link] {
            assert!(claim_in(dir, 4242).unwrap().held.is_none(), "{}: no claim there", dir.display());
            let grant = crate::proc::budget::reserve_in(dir, 100, 60);
            assert_eq!(grant.bytes, 60, "{}: granted as if alone", dir.display());
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep", "a link was followed");
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 1, "nothing was made there");
    }

    #[test]
    fn a_tree_inside_or_around_one_being_dumped_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let kid = child.id() as i32;
        let mine = claim_in(dir.path(), me).unwrap();
        let err = claim_in(dir.path(), kid).unwrap_err().to_string();
        assert!(err.contains(&format!("process {kid}'s tree overlaps that of process {me}")), "{err}");
        assert!(!dir.path().join(format!("dump-{kid}.lock")).exists(), "a refused claim leaves nothing");
        drop(mine);
        let inner = claim_in(dir.path(), kid).unwrap();
        let err = claim_in(dir.path(), me).unwrap_err().to_string();
        assert!(err.contains(&format!("process {me}'s tree overlaps that of process {kid}")), "{err}");
        drop(inner);
        let _ = child.kill();
        let _ = child.wait();
    }
}
